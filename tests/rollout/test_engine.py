import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import extend, forward_hidden, init_cache
from jaxspec.rollout import Sampling, engine, generate, processed_logprobs
from jaxspec.rollout.memory import PREFILL_CHUNK
from tests.rollout.reference import full_forward, greedy_reference, padded

# Lengths 3, 7 and 20 (prompt buckets 16, 16 and 32); the batch repeats two of them.
PROMPTS = [[5, 9, 11], [2, 40, 33, 17, 8, 60, 1], [3] * 5 + list(range(10, 25))]
BATCH = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[0]]
MAX_NEW = 8
GREEDY = Sampling(temperature=0.0, max_new_tokens=MAX_NEW)
PAD = 7  # the policy fixture's pad_token_id


@pytest.fixture(scope="module")
def greedy_batch(policy):
    cfg, params = policy
    return generate(cfg, params, BATCH, jax.random.key(0), GREEDY)


@pytest.fixture(scope="module")
def greedy_ref(policy):
    cfg, params = policy
    return greedy_reference(cfg, params, PROMPTS, MAX_NEW)


def test_greedy_matches_full_forward_argmax(greedy_batch, greedy_ref):
    out = greedy_batch
    assert out.tokens.shape == (len(BATCH), MAX_NEW) and out.tokens.dtype == np.int32
    assert out.logprobs.dtype == np.float32 and out.lengths.dtype == np.int32
    for r, prompt in enumerate(BATCH):
        tokens, logprobs = greedy_ref[PROMPTS.index(prompt)]
        assert np.asarray(out.tokens[r]).tolist() == tokens
        np.testing.assert_allclose(out.logprobs[r], logprobs, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.lengths, MAX_NEW)  # no eos: exactly max_new_tokens
    assert out.stats["steps"] == MAX_NEW - 1
    assert out.stats["generated_tokens"] == MAX_NEW * len(BATCH)
    assert out.stats["acceptance_length"] == 1.0
    assert out.stats["acceptance_rate_per_position"].shape == (0,)


def test_mixed_length_batch_equals_one_by_one(policy, greedy_batch):
    cfg, params = policy
    for prompt in PROMPTS:
        single = generate(cfg, params, [prompt], jax.random.key(1), GREEDY)
        for r in (r for r, p in enumerate(BATCH) if p == prompt):
            np.testing.assert_array_equal(greedy_batch.tokens[r], single.tokens[0])
            np.testing.assert_allclose(greedy_batch.logprobs[r], single.logprobs[0], rtol=1e-5, atol=1e-6)


def test_cache_dtype_override(policy, greedy_batch):
    cfg, params = policy
    out = generate(cfg, params, BATCH, jax.random.key(0), GREEDY, cache_dtype="bfloat16")
    np.testing.assert_array_equal(out.tokens, greedy_batch.tokens)
    np.testing.assert_allclose(out.logprobs, greedy_batch.logprobs, atol=0.05)
    assert not np.array_equal(out.logprobs, greedy_batch.logprobs)  # the bfloat16 cache was used


def test_single_new_token(policy, greedy_ref):
    cfg, params = policy
    out = generate(cfg, params, [PROMPTS[0]], jax.random.key(0), Sampling(temperature=0.0, max_new_tokens=1))
    assert out.tokens.shape == (1, 1)
    assert int(out.tokens[0, 0]) == greedy_ref[0][0][0] and int(out.lengths[0]) == 1
    assert out.stats["steps"] == 0


def _first_new(tokens, start):
    """Index >= start of the first token not seen earlier in `tokens`."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def test_eos_stops_exactly(policy, greedy_ref):
    cfg, params = policy
    row0, row1 = greedy_ref[0][0], greedy_ref[1][0]
    eos_a = row0[_first_new(row0, 2)]
    eos_b = next(row1[k] for k in range(1, MAX_NEW) if row1[k] not in row1[:k] and row1[k] != eos_a)
    eos = (eos_a, eos_b)
    out = generate(cfg, params, BATCH, jax.random.key(0), Sampling(temperature=0.0, max_new_tokens=MAX_NEW, eos_id=eos))
    tokens, lengths, logprobs = map(np.asarray, (out.tokens, out.lengths, out.logprobs))
    for r, prompt in enumerate(BATCH):
        full, full_lp = greedy_ref[PROMPTS.index(prompt)]
        stop = next((k + 1 for k, t in enumerate(full) if t in eos), MAX_NEW)
        assert lengths[r] == stop
        assert tokens[r, :stop].tolist() == full[:stop]
        assert np.all(tokens[r, stop:] == PAD) and np.all(logprobs[r, stop:] == 0)
        np.testing.assert_allclose(logprobs[r, :stop], full_lp[:stop], rtol=1e-5, atol=1e-5)
    assert lengths[0] < MAX_NEW and lengths[1] < MAX_NEW
    assert out.stats["steps"] == lengths.max() - 1
    assert out.stats["generated_tokens"] == lengths.sum()


def test_logprobs_match_teacher_forced_recomputation(policy):
    cfg, params = policy
    sampling = Sampling(temperature=0.8, top_k=20, top_p=0.95, max_new_tokens=MAX_NEW, eos_id=tuple(range(0, 61, 6)))
    out = generate(cfg, params, BATCH, jax.random.key(3), sampling)
    tokens, lengths, logprobs = map(np.asarray, (out.tokens, out.lengths, out.logprobs))
    assert (lengths < MAX_NEW).any() and (lengths == MAX_NEW).any()
    assert len({tuple(tokens[r]) for r in (0, 3, 5)}) > 1, "copies of one prompt must be sampled independently"
    seqs = [prompt + tokens[r, : lengths[r]].tolist() for r, prompt in enumerate(BATCH)]
    recomputed = np.asarray(processed_logprobs(full_forward(cfg, params, padded(seqs, 20 + MAX_NEW)), sampling))
    for r, prompt in enumerate(BATCH):
        n, p = lengths[r], len(prompt)
        want = recomputed[r, np.arange(p - 1, p - 1 + n), tokens[r, :n]]
        np.testing.assert_allclose(logprobs[r, :n], want, rtol=1e-5, atol=1e-5)
        assert np.all(logprobs[r, n:] == 0) and np.all(tokens[r, n:] == PAD)
        assert np.isfinite(want).all()


def test_no_recompilation_within_buckets(policy):
    cfg, params = policy
    key = jax.random.key(0)

    def sizes():
        return engine.prefill_prompts._cache_size(), engine._decode._cache_size()

    generate(cfg, params, [[1, 2, 3], [4, 5], [6], [1, 2, 3]], key, GREEDY)  # 3 distinct -> bucket 4, length 16
    warm = sizes()
    generate(cfg, params, [[9] * 11, list(range(16)), [8, 8], [1, 2]], key, GREEDY)  # 4 distinct, lengths <= 16
    generate(cfg, params, [[30] * 16, [31], [32] * 9, [33] * 4], key, GREEDY)
    assert sizes() == warm
    generate(cfg, params, [[4] * 12] * 4, key, GREEDY)  # 1 distinct prompt: only the prefill compiles
    assert sizes() == (warm[0] + 1, warm[1])
    generate(cfg, params, [[4] * 17, [1], [2], [3]], key, GREEDY)  # length bucket 32: both compile
    assert sizes() == (warm[0] + 2, warm[1] + 1)


def test_prompt_width_pads_to_one_bucket_without_changing_samples(policy):
    """A caller that passes its longest prompt length gets one program for all its batches, and
    the same tokens and log-probs as without the extra padding."""
    cfg, params = policy
    key = jax.random.key(3)
    sampling = Sampling(temperature=1.0, max_new_tokens=MAX_NEW)
    short = generate(cfg, params, BATCH, key, sampling)
    padded_out = generate(cfg, params, BATCH, key, sampling, prompt_width=40)  # bucket 64 instead of 16
    np.testing.assert_array_equal(padded_out.tokens, short.tokens)
    np.testing.assert_allclose(padded_out.logprobs, short.logprobs, rtol=1e-5, atol=1e-6)
    warm = engine._decode._cache_size()
    generate(cfg, params, [[5] * 40, [6], [7]] * 2, key, sampling, prompt_width=40)  # a 40-token prompt: same bucket
    assert engine._decode._cache_size() == warm


def _distinct_prompts(count: int, seed: int) -> list[list[int]]:
    """`count` distinct prompts (the first token is the index) of 1 to 16 tokens (one length bucket)."""
    rng = np.random.default_rng(seed)
    return [[i] + rng.integers(0, 61, rng.integers(0, 16)).tolist() for i in range(count)]


def test_chunked_prefill_matches_one_pass_over_all_prompts(policy):
    cfg, params = policy
    prompts = _distinct_prompts(PREFILL_CHUNK + 8, seed=4)  # two chunks, the second completed with filler
    tokens, lengths = padded(prompts, 16), jnp.asarray([len(p) for p in prompts], jnp.int32)
    row_prompt = jnp.asarray(np.random.default_rng(5).integers(0, len(prompts), 50), jnp.int32)
    cache, logits, hidden = engine.prefill_prompts(
        cfg,
        params,
        tokens,
        lengths,
        row_prompt,
        max_len=24,
        cache_dtype=jnp.float32,
        sharding=None,
        hidden_layers=(1, 0),
    )

    num = len(prompts)
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (num, 16))
    _, _, want_cache = jax.jit(extend, static_argnums=0)(
        cfg, params, init_cache(cfg, num, 24), tokens, positions, jnp.zeros((num,), jnp.int32)
    )
    want_logits, want_hidden = jax.jit(forward_hidden, static_argnums=(0, 3))(cfg, params, tokens, (1, 0))
    last = np.asarray(lengths) - 1
    np.testing.assert_allclose(
        logits, np.asarray(want_logits)[np.asarray(row_prompt), last[row_prompt]], rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(hidden, want_hidden, rtol=1e-5, atol=1e-5)
    assert hidden.shape == (2, num, 16, cfg.hidden_size)
    for got, want in zip((*cache.k, *cache.v), (*want_cache.k, *want_cache.v)):
        assert got.shape == (50, 24, cfg.num_kv_heads, cfg.head_dim)
        np.testing.assert_allclose(got, np.asarray(want)[np.asarray(row_prompt)], rtol=1e-5, atol=1e-5)


def test_more_distinct_prompts_than_a_chunk_equal_two_halves(policy):
    cfg, params = policy
    distinct = _distinct_prompts(PREFILL_CHUNK + 8, seed=6)
    half = len(distinct) // 2
    # Each half repeats four of its own prompts: same shapes for both halves, fewer than a chunk.
    first, second = distinct[:half] + distinct[:4], distinct[half:] + distinct[half : half + 4]
    whole = generate(cfg, params, first + second, jax.random.key(0), GREEDY)
    parts = [generate(cfg, params, rows, jax.random.key(0), GREEDY) for rows in (first, second)]
    np.testing.assert_array_equal(whole.tokens, np.concatenate([p.tokens for p in parts]))
    np.testing.assert_allclose(whole.logprobs, np.concatenate([p.logprobs for p in parts]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([], {}, "prompts is empty"),
        ("hello", {}, "prompts must be"),
        ([[1, 2], []], {}, r"prompts\[1\] is empty"),
        ([[1, 61]], {}, r"prompts\[0\]\[1\] = 61 is outside the vocabulary"),
        ([[3], [-1]], {}, r"prompts\[1\]\[0\] = -1"),
        ([[1.5, 2.0]], {}, r"prompts\[0\] must hold integer"),
        ([[1] * 89], {}, r"prompts\[0\] has 89 tokens.*max_new_tokens=8.*max_position_embeddings=96"),
        ([[1]], dict(spec="eagle3"), "spec"),
        ([[1]], dict(sampling={"temperature": 1.0}), "sampling must be"),
        ([[1]], dict(sampling=Sampling(max_new_tokens=8, eos_id=61)), "eos_id 61"),
    ],
)
def test_bad_input_raises(policy, prompts, kwargs, match):
    cfg, params = policy
    kwargs = {"sampling": GREEDY, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(cfg, params, prompts, jax.random.key(0), **kwargs)
