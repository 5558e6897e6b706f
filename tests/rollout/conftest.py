"""Policies shared by the rollout tests (fixed shapes, so compiled programs are reused): tiny random
ones, and the embedded tiny math policy with its trained EAGLE-3 head on 12 rows, whose staged
greedy rollout is the reference the slot engine's tests compare against."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.assets import tiny_eagle3_path, tiny_policy_path
from jaxspec.draft import load_eagle3
from jaxspec.models import ModelConfig, init_params, load_hf
from jaxspec.models.params import PAIR_AXIS, PAIRED, pair
from jaxspec.rollout import Sampling, generate
from jaxspec.tasks import ChatTokenizer, generate_problems

TINY_MAX_NEW = 40  # max_new_tokens of the `tiny` fixture's Samplings


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


@pytest.fixture(scope="module")
def tiny():
    """(cfg, params, EAGLE-3 head, rows: 6 math prompts twice each, greedy Sampling, sampled Sampling)
    of the embedded tiny policy in float32, TINY_MAX_NEW tokens per row."""
    path = tiny_policy_path()
    cfg, params = load_hf(path, dtype="float32")
    tok = ChatTokenizer.from_file(path)
    prompts = [tok.encode_prompt(p["question"]) for p in generate_problems(6, seed=7, levels=[1, 2])]
    rows = [p for p in prompts for _ in range(2)]
    greedy = Sampling(temperature=0.0, max_new_tokens=TINY_MAX_NEW, eos_id=tok.eos_id)
    sampled = Sampling(temperature=1.0, max_new_tokens=TINY_MAX_NEW, eos_id=tok.eos_id)
    return cfg, params, load_eagle3(tiny_eagle3_path(), policy=cfg), rows, greedy, sampled


@pytest.fixture(scope="module")
def staged(tiny):
    """The staged engine's greedy autoregressive rollout of `tiny`'s rows (unbounded: a dense cache
    for every row)."""
    cfg, params, _, rows, greedy, _ = tiny
    return generate(cfg, params, rows, jax.random.key(0), greedy)


def assert_same_rollout(out, reference) -> None:
    """Equal tokens and lengths, log-probs within 1e-5."""
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    np.testing.assert_array_equal(out.lengths, reference.lengths)
    np.testing.assert_allclose(out.logprobs, reference.logprobs, rtol=1e-5, atol=1e-5)
