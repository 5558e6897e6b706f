"""Autoregressive rollouts on the slot engine (`generate(..., slots=S)`).

Greedy tokens equal the staged engine's for any slot count, with the rows of a prompt sharing
its prefix pages, and for the slot count slots="auto" picks from the free memory (stated once);
sampled rows are the same for any slot count and through preemptions (row r's token i is drawn
with a key of (r, i) alone); a pool too small for all rows at once completes
every row exactly; the sampled continuations follow the exact processed distribution (the
chi-square test of test_distribution.py, whose power is stated there).
"""

import logging

import jax
import numpy as np
import pytest

from jaxspec.models import Sharding, make_mesh, shard_params
from jaxspec.rollout import Sampling, continuous, generate, prefix_cache, slot_memory, slots
from jaxspec.rollout.prompts import group_prompts, row_limits, validate_prompts
from jaxspec.rollout.slot_layout import plan_layout
from tests.rollout.test_distribution import (
    NUCLEUS,
    T1,
    assert_exact_law,
    chi_square_pvalue,
    exact_continuations,
    slot_continuations,
)
from tests.rollout.test_engine import BATCH, GREEDY, MAX_NEW, PROMPTS, greedy_batch  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

SAMPLED = Sampling(temperature=1.0, top_p=0.95, max_new_tokens=MAX_NEW, eos_id=(3, 11))
ROWS = BATCH * 3  # 18 rows
SLOT_COUNTS = (1, 4, 7)
SMALL_POOL = dict(slots=5, kv_pages=14, page_size=4, decode_steps=4)  # 5 slots of up to 7 pages each


@pytest.mark.parametrize("count", [1, 3, 8])
def test_greedy_tokens_equal_the_staged_engine(policy, greedy_batch, count):  # noqa: F811
    cfg, params = policy
    out = generate(cfg, params, BATCH, jax.random.key(0), GREEDY, slots=count)
    np.testing.assert_array_equal(out.tokens, greedy_batch.tokens)
    np.testing.assert_array_equal(out.lengths, greedy_batch.lengths)
    np.testing.assert_allclose(out.logprobs, greedy_batch.logprobs, rtol=1e-5, atol=1e-5)
    assert out.stats["slots"] == min(count, len(BATCH)) and out.stats["preemptions"] == 0
    assert out.stats["generated_tokens"] == MAX_NEW * len(BATCH)


def test_greedy_through_preemptions_equals_the_staged_engine(policy, greedy_batch):  # noqa: F811
    cfg, params = policy
    out = generate(cfg, params, BATCH, jax.random.key(0), GREEDY, slots=3, kv_pages=8, page_size=4, decode_steps=2)
    assert out.stats["preemptions"] > 0 and out.stats["peak_kv_pages"] <= 8
    np.testing.assert_array_equal(out.tokens, greedy_batch.tokens)
    np.testing.assert_allclose(out.logprobs, greedy_batch.logprobs, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def sampled(policy):
    """{slot count or "small pool": RolloutOutput} of one key over ROWS."""
    cfg, params = policy
    runs = {n: generate(cfg, params, ROWS, jax.random.key(3), SAMPLED, slots=n) for n in SLOT_COUNTS}
    runs["small pool"] = generate(cfg, params, ROWS, jax.random.key(3), SAMPLED, **SMALL_POOL)
    return runs


def test_sampled_rows_do_not_depend_on_the_slot_count(sampled):
    first = sampled[SLOT_COUNTS[0]]
    lengths = np.asarray(first.lengths)
    assert len(set(lengths.tolist())) > 2, "rows should end at different lengths (eos)"
    for n in SLOT_COUNTS[1:]:
        np.testing.assert_array_equal(sampled[n].tokens, first.tokens)
        np.testing.assert_array_equal(sampled[n].lengths, first.lengths)
        np.testing.assert_allclose(sampled[n].logprobs, first.logprobs, rtol=1e-5, atol=1e-5)  # batched-matmul rounding


def test_the_staged_engine_draws_the_same_rows(policy, sampled):
    """slots=None (the staged dense engine) draws row r's token i with the same key as the slot
    engine, so in float32 one key gives the same rollouts on either engine."""
    cfg, params = policy
    staged = generate(cfg, params, ROWS, jax.random.key(3), SAMPLED)
    first = sampled[SLOT_COUNTS[0]]
    np.testing.assert_array_equal(staged.tokens, first.tokens)
    np.testing.assert_array_equal(staged.lengths, first.lengths)
    np.testing.assert_allclose(staged.logprobs, first.logprobs, rtol=1e-5, atol=1e-5)


def test_a_pool_too_small_for_all_rows_completes_every_row_exactly(sampled):
    small, free = sampled["small pool"], sampled[SLOT_COUNTS[-1]]
    assert small.stats["preemptions"] > 0
    assert small.stats["peak_kv_pages"] <= SMALL_POOL["kv_pages"]
    np.testing.assert_array_equal(small.tokens, free.tokens)
    np.testing.assert_array_equal(small.lengths, free.lengths)
    np.testing.assert_allclose(small.logprobs, free.logprobs, rtol=1e-5, atol=1e-5)


def test_slot_dependent_draws_would_be_caught(policy, sampled):
    """Negative control of the any-S test: drawing with the slot's index folded into the key
    changes the tokens between slot counts."""
    cfg, params = policy
    row_keys = slots.row_keys

    def by_slot(key, rows, index):
        return row_keys(key, rows, index + 1000 * jax.numpy.arange(rows.shape[0]))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slots, "row_keys", by_slot)  # the prefill's draws
        patch.setattr(continuous, "row_keys", by_slot)  # the decode steps' draws
        jax.clear_caches()
        try:
            runs = [generate(cfg, params, ROWS, jax.random.key(3), SAMPLED, slots=n) for n in (1, 4)]
        finally:
            jax.clear_caches()
    assert not np.array_equal(runs[0].tokens, runs[1].tokens)


def test_a_pool_smaller_than_one_row_is_refused_with_its_sizes(policy):
    cfg, params = policy
    with pytest.raises(ValueError, match=r"kv_pages=6: .* 7 pages of 4 positions \(prompt 20 \+ max_new_tokens 8"):
        generate(cfg, params, BATCH, jax.random.key(0), GREEDY, slots=2, kv_pages=6, page_size=4)
    with pytest.raises(ValueError, match="slots must be an integer >= 1, got 0"):
        generate(cfg, params, BATCH, jax.random.key(0), GREEDY, slots=0)
    with pytest.raises(ValueError, match="decode_steps must be an integer >= 1, got 0"):
        generate(cfg, params, BATCH, jax.random.key(0), GREEDY, slots=2, decode_steps=0)


def test_the_schedule_runs_once_per_decode_steps_and_changes_no_token(policy, sampled):
    """decode_steps K: the loop schedules (admits, preempts, releases) once per K decode steps. The
    rows are those of every other K (rows that finish within an iteration stop there: a row that
    went on decoding after its eos would differ), through preemptions too, and the loop runs fewer
    iterations the larger K."""
    cfg, params = policy
    runs = {k: generate(cfg, params, ROWS, jax.random.key(3), SAMPLED, slots=4, decode_steps=k) for k in (1, 3)}
    runs[8] = sampled[4]  # the default
    for k, out in runs.items():
        np.testing.assert_array_equal(out.tokens, sampled[1].tokens)
        np.testing.assert_array_equal(out.lengths, sampled[1].lengths)
        assert out.stats["loop_iterations"] * k >= out.stats["steps"], (k, out.stats)
    assert runs[1].stats["loop_iterations"] > runs[3].stats["loop_iterations"] > runs[8].stats["loop_iterations"]
    # a pool of one row's longest sequence (7 pages): 8 steps ahead would be 9 pages for the longest
    # prompt, so a row is given no more than its longest sequence can use
    for pages, k in ((9, 3), (7, 8)):
        tight = generate(
            cfg, params, ROWS, jax.random.key(3), SAMPLED, slots=5, kv_pages=pages, page_size=4, decode_steps=k
        )
        assert tight.stats["preemptions"] > (0 if k == 3 else -1) and tight.stats["peak_kv_pages"] <= pages
        np.testing.assert_array_equal(tight.tokens, sampled[1].tokens)


def test_a_context_of_several_lanes_is_written_in_one_prefill_step(policy):
    """A 45-token prompt fills three prefill lanes of 16 tokens (`slot_layout.PREFILL_CHUNK`); on one
    slot all three are written in one step, each lane attending to the keys and values its
    slot's earlier lanes wrote in the same forward: the greedy tokens and log-probs are the staged
    engine's (a lane that missed its earlier lanes' positions would see a different context)."""
    cfg, params = policy
    prompt = [int(t) for t in np.random.default_rng(5).integers(12, cfg.vocab_size, 45)]
    staged = generate(cfg, params, [prompt], jax.random.key(0), GREEDY)
    out = generate(cfg, params, [prompt], jax.random.key(0), GREEDY, slots=1)
    assert out.stats["prefill_chunks"] == 1
    np.testing.assert_array_equal(out.tokens, staged.tokens)
    np.testing.assert_allclose(out.logprobs, staged.logprobs, rtol=1e-5, atol=1e-5)


def test_every_context_is_written_before_the_iterations_decode_steps(policy):
    """40 distinct 20-token prompts (2 lanes each, 80 lanes, 32 a prefill step) on 40 slots: the
    first iteration writes every context (3 prefill steps) before its decode steps, so all rows
    start together and the call takes MAX_NEW - 1 decode steps (each row emits its first token from
    its prefill and the others by decoding), where rows started as their prefill completes, one
    decode step per prefill step, would start the last rows two steps later. The tokens are the
    staged engine's."""
    cfg, params = policy
    rng = np.random.default_rng(6)
    prompts = [[int(t) for t in rng.integers(12, cfg.vocab_size, 20)] for _ in range(40)]
    out = generate(cfg, params, prompts, jax.random.key(0), GREEDY, slots=40)
    assert plan_layout(40, 40, 32, 20, MAX_NEW, 1).lanes == 32
    assert out.stats["prefill_chunks"] == 3 and out.stats["steps"] == MAX_NEW - 1
    np.testing.assert_array_equal(out.tokens, generate(cfg, params, prompts, jax.random.key(0), GREEDY).tokens)


@pytest.mark.parametrize("reported", [False, True], ids=["cpu-fallback", "reported-free-memory"])
def test_auto_slots_are_stated_once_and_give_the_explicit_tokens(policy, greedy_batch, reported, monkeypatch, caplog):  # noqa: F811
    """On the CPU (no free memory reported: 2 GiB per device assumed) every row gets a slot; with
    a device reporting room for the pages and buffers of 3 slots, 3. Two calls: one statement."""
    cfg, params = policy
    monkeypatch.setattr(slot_memory, "_chosen", {})
    count = len(BATCH)
    width = group_prompts(validate_prompts(cfg, BATCH, MAX_NEW), row_limits(None, len(BATCH), MAX_NEW)).tokens.shape[1]
    if reported:
        count = 3
        needed = slot_memory.slot_memory_bytes(
            cfg, plan_layout(len(BATCH), 3, width, width, MAX_NEW, 1), width, "float32"
        )
        free = int(needed / slot_memory.AUTO_MEMORY_FRACTION) + 1
        monkeypatch.setattr(slot_memory, "tightest_memory_stats", lambda _: {"bytes_limit": free, "bytes_in_use": 0})
    with caplog.at_level(logging.INFO, logger="jaxspec.rollout"):
        runs = [generate(cfg, params, BATCH, jax.random.key(0), GREEDY, slots="auto") for _ in range(2)]
    explicit = generate(cfg, params, BATCH, jax.random.key(0), GREEDY, slots=count)
    pages = count * plan_layout(len(BATCH), count, width, width, MAX_NEW, 1).pages_per_slot
    for out in runs:
        assert (out.stats["slots"], out.stats["kv_pages"], out.stats["preemptions"]) == (count, pages, 0)
        np.testing.assert_array_equal(out.tokens, explicit.tokens)
        np.testing.assert_array_equal(out.tokens, greedy_batch.tokens)
        np.testing.assert_allclose(out.logprobs, explicit.logprobs, rtol=1e-5, atol=1e-5)
    (statement,) = [r.getMessage() for r in caplog.records if r.name == "jaxspec.rollout"]
    assert statement.startswith(f"slots=auto: {count} slots over {len(BATCH)} rows, {pages} KV pages of 16 positions")
    assert "bytes per page per device" in statement and ("CPU fallback" in statement) != reported


def test_slots_that_do_not_fit_are_refused_naming_the_slots_and_auto(policy, monkeypatch):
    """An explicit slot count whose pools and buffers exceed the free memory a device reports is
    refused before the loop runs, naming the slots, the pool and slots='auto' as the way out."""
    cfg, params = policy
    monkeypatch.setattr(slot_memory, "tightest_memory_stats", lambda _: {"bytes_limit": 1000, "bytes_in_use": 0})
    with pytest.raises(ValueError, match=r"on slots=3 \(kv_pages=\d+\) needs \d+ bytes.*slots='auto' picks"):
        generate(cfg, params, BATCH, jax.random.key(0), GREEDY, slots=3)


def test_auto_slots_refuse_a_page_pool_and_unknown_words(policy):
    cfg, params = policy
    with pytest.raises(ValueError, match="kv_pages=20: slots='auto' chooses the page pool"):
        generate(cfg, params, BATCH, jax.random.key(0), GREEDY, slots="auto", kv_pages=20)
    with pytest.raises(ValueError, match="slots must be None, 'auto' or an integer >= 1, got 'many'"):
        generate(cfg, params, BATCH, jax.random.key(0), GREEDY, slots="many")


GROUPS = [p for p in PROMPTS for _ in range(4)]  # GRPO-like: 3 prompts, 4 rows each


@pytest.fixture(scope="module")
def staged_groups(policy):
    cfg, params = policy
    return generate(cfg, params, GROUPS, jax.random.key(0), GREEDY)


@pytest.mark.parametrize(("count", "kv_pages", "decode_steps"), [(3, None, None), (12, None, None), (4, 10, 4)])
def test_rows_of_a_prompt_share_its_prefix_pages(policy, staged_groups, count, kv_pages, decode_steps):
    """Pages of 4 positions: prompt lengths 3, 7 and 20 share 0, 1 and 4 pages, so the 3 later rows
    of each group take 0 + 3 x 1 + 3 x 4 = 15 pages from the prefix cache, also when all 12 rows are
    admitted at once (the later ones wait for the first to write the prefix) and through
    preemptions in a pool of 10 pages; the tokens are the staged engine's."""
    cfg, params = policy
    out = generate(
        cfg,
        params,
        GROUPS,
        jax.random.key(0),
        GREEDY,
        slots=count,
        kv_pages=kv_pages,
        page_size=4,
        decode_steps=decode_steps,
    )
    assert out.stats["prefix_pages_shared"] == 15, out.stats
    assert (out.stats["preemptions"] > 0) == (kv_pages is not None)
    np.testing.assert_array_equal(out.tokens, staged_groups.tokens)
    np.testing.assert_allclose(out.logprobs, staged_groups.logprobs, rtol=1e-5, atol=1e-5)


def test_a_wrong_shared_prefix_would_be_caught(policy, staged_groups):
    """Negative control of the prefix-sharing test: rows attached to the pages cached for the next
    prompt (none where it has none) produce other tokens."""
    cfg, params = policy
    attach = prefix_cache.attach

    def wrong_prompt(state, layout, prompts):
        shifted = state.prefix._replace(pages=jax.numpy.roll(state.prefix.pages, -1, axis=0))
        return attach(state._replace(prefix=shifted), layout, prompts)._replace(prefix=state.prefix)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefix_cache, "attach", wrong_prompt)
        jax.clear_caches()
        try:
            out = generate(cfg, params, GROUPS, jax.random.key(0), GREEDY, slots=3, page_size=4)
        finally:
            jax.clear_caches()
    assert not np.array_equal(out.tokens, staged_groups.tokens)


def test_a_mesh_gives_the_same_rollout(policy, greedy_batch):  # noqa: F811
    """Params sharded over a (data, fsdp, tensor) mesh, as the trainer passes them: the same tokens."""
    cfg, params = policy
    sharding = Sharding(make_mesh(data=2, fsdp=2, tensor=2))
    out = generate(cfg, shard_params(sharding, params), BATCH, jax.random.key(0), GREEDY, sharding=sharding, slots=4)
    np.testing.assert_array_equal(out.tokens, greedy_batch.tokens)
    np.testing.assert_allclose(out.logprobs, greedy_batch.logprobs, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def slot_draws(tiny_vocab_policy):
    """{setting name: (continuations, RolloutOutput)} of `slot_continuations`."""
    cfg, params = tiny_vocab_policy
    return {name: slot_continuations(cfg, params, setting) for name, setting in (("T1", T1), ("nucleus", NUCLEUS))}


@pytest.mark.parametrize("name", ["T1", "nucleus"])
def test_slot_samples_follow_the_exact_distribution(tiny_vocab_policy, slot_draws, name):
    cfg, params = tiny_vocab_policy
    setting = {"T1": T1, "nucleus": NUCLEUS}[name]
    probs = exact_continuations(cfg, params, setting)
    seqs, run = slot_draws[name]
    assert sum(len(s) < 3 for s in seqs) > 100, "eos-terminated continuations should be exercised"
    assert_exact_law(seqs, run.logprobs, probs)


def test_slot_chi_square_rejects_a_wrong_temperature(tiny_vocab_policy, slot_draws):
    cfg, params = tiny_vocab_policy
    wrong = exact_continuations(cfg, params, dict(T1, temperature=0.7))
    assert chi_square_pvalue(slot_draws["T1"][0], wrong) < 1e-6
