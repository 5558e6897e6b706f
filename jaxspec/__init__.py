"""jaxspec: RL post-training of language models in JAX with lossless speculative-decoding rollouts."""

from jaxspec import draft, models, rollout

__version__ = "0.1.0"
__all__ = ["draft", "models", "rollout"]
