"""jaxspec: RL post-training of language models in JAX with lossless speculative-decoding rollouts."""

from jaxspec import models, rollout

__version__ = "0.1.0"
__all__ = ["models", "rollout"]
