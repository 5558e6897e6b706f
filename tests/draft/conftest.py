"""A tiny random policy and a random EAGLE-3 head for it, shared by the draft tests."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.draft import DraftConfig, build_vocab_maps, init_eagle3
from jaxspec.models import ModelConfig
from tests.models.hf_reference import random_params

DRAFT_VOCAB = 40


def random_head(cfg: ModelConfig, seed: int, draft_vocab_size: int = DRAFT_VOCAB):
    """(dcfg, dparams) with every weight redrawn: norms 1 + 0.3 n, matrices unit-scale for unit
    inputs, and a reduced vocabulary picked from random token counts (so d2t is not all zeros)."""
    rng = np.random.default_rng(seed)
    dcfg = DraftConfig.for_policy(cfg, draft_vocab_size)
    d2t, t2d = build_vocab_maps(rng.integers(0, 1000, cfg.vocab_size), draft_vocab_size)
    shapes = jax.eval_shape(lambda: init_eagle3(cfg, jax.random.key(0), draft_vocab_size)[1])

    def draw(path, leaf):  # numpy draws: no per-shape XLA compilation
        name = path[-1].key
        if name in ("d2t", "t2d"):
            return jnp.asarray(d2t if name == "d2t" else t2d)
        x = rng.standard_normal(leaf.shape)
        if name.endswith("norm"):
            x = 1.0 + 0.3 * x
        elif name == "o":  # [Nq, D, H]
            x = x / math.sqrt(leaf.shape[0] * leaf.shape[1])
        else:  # [in, ...]
            x = x / math.sqrt(leaf.shape[0])
        return jnp.asarray(x, jnp.float32)

    return dcfg, jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.fixture(scope="session")
def policy():
    """Qwen3, 4 layers (aux layers (1, 1, 0)), grouped-query attention, vocabulary 61."""
    cfg = ModelConfig(
        family="qwen3",
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        rope_theta=500.0,
    )
    return cfg, random_params(cfg, jax.random.key(3))


@pytest.fixture(scope="session")
def head(policy):
    return random_head(policy[0], seed=5)
