"""Tiny random policies shared by the rollout tests (fixed shapes, so compiled programs are reused)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import ModelConfig, init_params
from jaxspec.models.params import PAIR_AXIS, PAIRED, pair


def random_params(cfg: ModelConfig, seed: int, std: float):
    """Params with `init_params`' structure and dtypes: matrices normal(0, std), norm weights
    1 + normal(0, 0.1). Drawn with numpy so that no per-shape XLA program is compiled, leaf by leaf
    in key order with each paired leaf (`PAIRED`: gate_up, kv) drawn as its two projections, then
    stacked: the tests' policies are the ones their distributions and thresholds were chosen on,
    before the model paired them."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = path[-1].key
        values = (
            1 + 0.1 * rng.standard_normal(leaf.shape)
            if name.endswith("norm")
            else (std * rng.standard_normal(leaf.shape))
        )
        return jnp.asarray(values, leaf.dtype)

    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    for layer in shapes["layers"]:
        for leaf in PAIRED.keys() & layer.keys():
            both = layer.pop(leaf)
            half = jax.ShapeDtypeStruct(both.shape[:PAIR_AXIS] + both.shape[PAIR_AXIS + 1 :], both.dtype)
            layer |= dict.fromkeys(PAIRED[leaf], half)
    params = jax.tree_util.tree_map_with_path(draw, shapes)
    for layer in params["layers"]:
        for leaf, (first, second) in PAIRED.items():
            if first in layer:
                layer[leaf] = pair(layer.pop(first), layer.pop(second))
    return params


@pytest.fixture(scope="session")
def tiny_vocab_policy():
    """Vocabulary of 6 with eos id 5: small enough to enumerate every 3-token continuation.

    std 0.2 makes next-token distributions clearly non-uniform and far from one-hot.
    """
    cfg = ModelConfig(
        family="qwen3",
        vocab_size=6,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        eos_token_id=5,
    )
    return cfg, random_params(cfg, seed=1, std=0.2)


@pytest.fixture(scope="session")
def policy():
    """A Llama-style policy with vocabulary 61, a pad id, and no eos in its config."""
    cfg = ModelConfig(
        family="llama",
        vocab_size=61,
        hidden_size=48,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        max_position_embeddings=96,
        pad_token_id=7,
    )
    return cfg, random_params(cfg, seed=2, std=0.2)
