"""Adaptive draft depth: a loop whose drafts are never accepted falls back to autoregressive
iterations (counted) and still samples exactly; one whose drafts are always accepted keeps its
depth. (Exactness of the mixed loop at T = 1 and under nucleus sampling: the chi-square tests of
`test_lossless.py`, cases "adaptive".)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.rollout import Sampling, Spec, generate
from jaxspec.rollout.speculative.adaptive import (
    AdaptiveDepth,
    DepthState,
    candidate_depths,
    choose,
    cost_points,
    observe,
)
from jaxspec.rollout.speculative.stats import Counts

pytestmark = pytest.mark.slow

K = 3
MAX_NEW = 40


def settings(**changes) -> AdaptiveDepth:
    base = dict(
        tree_width=1,
        tree_budget=None,
        verify_token_cost=0.1,
        draft_token_cost=0.0,
        decay=0.5,
        probe_interval=8,
        probe_max=8,
    )
    base |= changes
    return AdaptiveDepth(**base | {"verify_token_cost": cost_points(base["verify_token_cost"])})


def test_candidate_depths():
    assert candidate_depths(1) == (0, 1)
    assert candidate_depths(3) == (0, 1, 2, 3)
    assert candidate_depths(7) == (0, 1, 2, 4, 7)


def measured(state: DepthState, rates) -> DepthState:
    """`state` with every depth tested at `rates` (float [K])."""
    return state._replace(rates=jnp.asarray(rates, jnp.float32), tested=jnp.ones((K,), bool))


def test_the_choice_weighs_expected_tokens_against_cost():
    depths = candidate_depths(K)
    state = DepthState.start(K, settings())
    assert int(choose(settings(), state, depths, 8)) == 3  # 4 tokens for 1.3 steps
    useless = measured(state, [0.0] * K)
    assert int(choose(settings(), useless, depths, 8)) == 0
    # 1 + 0.5 + 0.25 tokens: depth 1 (1.5 / 1.4) beats depth 2 (1.75 / 1.8) at a verify cost of 0.4.
    half = measured(state, [0.5] * K)
    assert int(choose(settings(verify_token_cost=0.4), half, depths, 8)) == 1
    assert int(choose(settings(verify_token_cost=0.0), half, depths, 8)) == 3
    # Free drafting of a useless draft is no better than none: ties go to the autoregressive step.
    assert int(choose(settings(verify_token_cost=0.0), useless, depths, 8)) == 0
    probing = useless._replace(since_draft=jnp.asarray(7, jnp.int32))
    assert int(choose(settings(), probing, depths, 8)) == 1


def test_a_first_test_sets_a_rate_and_untested_depths_take_the_nearest_above():
    """The rates `choose` weighs, and how `observe` moves them: a depth's first test replaces the
    start's 1, later ones move it by the decay (0.5); an untested depth takes the rate of the
    nearest tested depth above it."""
    state = DepthState.start(K, settings())
    np.testing.assert_array_equal(state.expected_rates(), [1.0, 1.0, 1.0])
    before = Counts.zeros(K)
    # 8 rows reach depth 1, 2 of them accept it and reach depth 2, none accepts that.
    after = before._replace(reached=jnp.asarray([8, 2, 0]), accepted_at=jnp.asarray([2, 0, 0]))
    state = observe(settings(), state, before, after, jnp.asarray(True))
    np.testing.assert_array_equal(state.tested, [True, True, False])
    np.testing.assert_allclose(state.expected_rates(), [0.25, 0.0, 0.0])  # a prior of 1 would give 0.625, 0.5, 1
    later = after._replace(
        reached=after.reached + jnp.asarray([4, 0, 0]), accepted_at=after.accepted_at + jnp.asarray([4, 0, 0])
    )
    state = observe(settings(), state, after, later, jnp.asarray(True))
    np.testing.assert_allclose(state.expected_rates(), [0.625, 0.0, 0.0])  # 0.5 * 0.25 + 0.5 * 1
    untested_second = state._replace(tested=jnp.asarray([True, False, True]), rates=jnp.asarray([0.5, 0.9, 0.8]))
    np.testing.assert_allclose(untested_second.expected_rates(), [0.5, 0.5, 0.8])


def test_the_verify_cost_follows_the_rows_a_step_runs():
    """verify_token_cost pairs: linear between the points, flat beyond; the same acceptance drafts
    deep in a small batch and not at all in a large one."""
    by_rows = settings(verify_token_cost=((8, 0.0), (64, 0.4), (512, 2.0)))
    costs = [float(by_rows.verify_cost(rows)) for rows in (1, 8, 36, 64, 288, 512, 4096)]
    np.testing.assert_allclose(costs, [0.0, 0.0, 0.2, 0.4, 1.2, 2.0, 2.0], rtol=1e-6)
    assert float(by_rows.cost(3, jnp.asarray(36, jnp.int32))) == pytest.approx(1.6)
    depths = candidate_depths(K)
    half = measured(DepthState.start(K, by_rows), [0.5] * K)
    # E(d) = 1, 1.5, 1.75, 1.875 against C(d) = 1 + d v(rows): depth 3 at v = 0, 1 at v = 0.4, 0 at v = 2
    assert [int(choose(by_rows, half, depths, rows)) for rows in (1, 64, 512)] == [3, 1, 0]


def test_the_verify_cost_is_numpys_interpolation_without_a_loop():
    """Against np.interp at every row count from 0 to 600 over uneven points (a repeated row count
    among them), and one point alone; the lowered cost has no loop (the rollout loop evaluates it
    every iteration)."""
    points = ((1, 0.05), (8, 0.0), (64, 0.4), (64, 0.7), (96, 0.7), (512, 2.0))
    by_rows = settings(verify_token_cost=points)
    rows = jnp.arange(601, dtype=jnp.int32)
    got = jax.vmap(by_rows.verify_cost)(rows)
    want = np.interp(np.arange(601), [r for r, _ in points], [c for _, c in points])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert "while" not in jax.jit(by_rows.verify_cost).lower(jnp.int32(36)).as_text()
    assert float(settings(verify_token_cost=((1, 0.3),)).verify_cost(jnp.int32(900))) == pytest.approx(0.3)


@pytest.fixture(scope="module")
def greedy_runs(policy):
    cfg, params = policy
    prompts = [[5, 9, 11], [2, 40, 33, 17, 8, 60, 1], [3] * 5 + list(range(10, 25))]
    sampling = Sampling(temperature=0.0, max_new_tokens=MAX_NEW)
    # The policy with its logits negated drafts its least likely token: never accepted at T = 0.
    contrary = dict(params, lm_head=-params["lm_head"])
    adaptive = dict(adaptive=True, verify_token_cost=0.1, adaptive_decay=0.5, adaptive_probe=8)
    runs = {"ar": generate(cfg, params, prompts, jax.random.key(0), sampling)}
    for name, draft in (("never", contrary), ("always", params)):
        spec = Spec("draft_model", (cfg, draft), num_draft_tokens=K, **adaptive)
        runs[name] = generate(cfg, params, prompts, jax.random.key(1), sampling, spec=spec)
    # A drafter whose proposals leave its state as it was: its autoregressive iterations skip them.
    spec = Spec("suffix", num_draft_tokens=K, tree_width=2, **adaptive)
    runs["suffix"] = generate(cfg, params, prompts + prompts, jax.random.key(1), sampling, spec=spec)
    runs["ar-twice"] = generate(cfg, params, prompts + prompts, jax.random.key(0), sampling)
    return runs


def test_a_draft_never_accepted_falls_back_to_autoregressive_steps(greedy_runs):
    out, ar = greedy_runs["never"], greedy_runs["ar"]
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    np.testing.assert_allclose(out.logprobs, ar.logprobs, rtol=1e-5, atol=1e-5)
    stats = out.stats
    assert stats["accepted_tokens"] == 0
    steps, depths = stats["steps"], stats["depth_steps"]
    assert sum(depths) == steps and stats["fallback_steps"] == depths[0]
    # The first step (every depth untested: rate 1) drafts 3 levels; its rate a_1 = 0 stands for
    # a_2 and a_3 too (untested), so autoregressive steps follow at once, with depth-1 probes
    # (which fail): after 7 of them, then after 15 (each failed probe doubles the run,
    # adaptive_probe_max 128). A prior of 1 halving per failed step would keep depth 3 for 4 steps.
    assert depths == [7 + 15 + (steps - 1 - 7 - 1 - 15 - 1), 2, 0, 1], stats
    assert steps == MAX_NEW - 1  # one token per step


def test_an_adaptive_suffix_loop_equals_autoregressive_decoding(greedy_runs):
    out, ar = greedy_runs["suffix"], greedy_runs["ar-twice"]
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    np.testing.assert_allclose(out.logprobs, ar.logprobs, rtol=1e-5, atol=1e-5)
    assert sum(out.stats["depth_steps"]) == out.stats["steps"]


def test_a_draft_always_accepted_keeps_its_depth(greedy_runs):
    out, ar = greedy_runs["always"], greedy_runs["ar"]
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    stats = out.stats
    assert stats["depth_steps"] == [0, 0, 0, stats["steps"]] and stats["fallback_steps"] == 0
    assert stats["acceptance_length"] == K + 1


PROMPTS = [[5, 9, 11], [2, 40, 33, 17, 8, 60, 1], [3] * 5 + list(range(10, 25))]


def accepted_draft(policy, **settings) -> Spec:
    """Adaptive chains of depth K drafted by the policy itself (always accepted at T = 0), decay 0.5."""
    cfg, params = policy
    return Spec("draft_model", (cfg, params), num_draft_tokens=K, adaptive=True, adaptive_decay=0.5, **settings)


@pytest.mark.parametrize("slots", [None, 3], ids=["staged", "slots"])
def test_the_depth_follows_the_rows_that_decode(policy, slots):
    """A draft that is always accepted, verification free for one row and dear for three
    (verify_token_cost [[1, 0], [2, 10]]): one row drafts its full depth at every step; three
    rows, on either engine, run autoregressive steps, but for a probe every `adaptive_probe`
    (adaptive_probe_max = adaptive_probe: the run before a probe does not grow)."""
    cfg, params = policy
    sampling = Sampling(temperature=0.0, max_new_tokens=MAX_NEW)
    spec = accepted_draft(policy, verify_token_cost=[[1, 0.0], [2, 10.0]], adaptive_probe=8, adaptive_probe_max=8)
    prompts = PROMPTS
    engine = {} if slots is None else {"slots": slots}
    alone = generate(cfg, params, prompts[:1], jax.random.key(1), sampling, spec=spec, **engine).stats
    assert alone["depth_steps"] == [0, 0, 0, alone["steps"]], alone
    three = generate(cfg, params, prompts, jax.random.key(1), sampling, spec=spec, **engine).stats
    depths = three["depth_steps"]
    assert depths[2:] == [0, 0] and three["fallback_steps"] == depths[0] > 0, three
    assert depths[1] == pytest.approx(depths[0] / 7, abs=1), three  # a depth-1 probe after 7 AR steps


def probe_runs(tokens: int, first: int, longest: int) -> tuple[list[int], int]:
    """(the runs of autoregressive iterations, the probes) that emit `tokens` tokens when drafting
    never pays but every probe's draft is accepted (an autoregressive iteration emits one token, a
    probe two): runs of interval - 1 iterations each ended by a probe, the interval doubling from
    `first` up to `longest` (the rule `adaptive.observe` implements), cut where the tokens run out."""
    runs, probes, emitted, interval = [], 0, 0, first
    while True:
        runs.append(min(interval - 1, tokens - emitted))
        emitted += runs[-1]
        if emitted >= tokens:
            return runs, probes
        probes, emitted = probes + 1, emitted + 2
        if emitted >= tokens:
            return runs, probes
        interval = min(2 * interval, longest)


def probe_schedule(tokens: int, first: int, longest: int) -> tuple[int, int]:
    """(autoregressive iterations, probes) of `probe_runs`."""
    runs, probes = probe_runs(tokens, first, longest)
    return sum(runs), probes


@pytest.mark.parametrize("slots", [None, 3], ids=["staged", "slots"])
def test_probes_back_off_while_drafting_does_not_pay(policy, slots):
    """Three rows with a draft always accepted but dear to verify (as above): each probe succeeds
    yet leaves autoregressive steps the better choice, so the run before the next probe doubles,
    from adaptive_probe 2 to adaptive_probe_max 8: 1, 3, 7, 7, ... autoregressive steps."""
    cfg, params = policy
    sampling = Sampling(temperature=0.0, max_new_tokens=MAX_NEW)
    spec = accepted_draft(policy, verify_token_cost=10.0, adaptive_probe=2, adaptive_probe_max=8)
    prompts = PROMPTS
    engine = {} if slots is None else {"slots": slots}
    stats = generate(cfg, params, prompts, jax.random.key(1), sampling, spec=spec, **engine).stats
    depths = stats["depth_steps"]
    assert depths[2:] == [0, 0], stats
    # The first token comes from the prefill; the loop emits the other MAX_NEW - 1.
    assert (depths[0], depths[1]) == probe_schedule(MAX_NEW - 1, 2, 8) == (29, 5), stats
    # Runs one iteration too long would give (30, 5); without the doubling (13, 13); without the cap (31, 4).
    assert probe_schedule(MAX_NEW - 1, 2, 2) == (13, 13) and probe_schedule(MAX_NEW - 1, 2, 64) == (31, 4)


def test_slot_iterations_short_of_the_probe_decode_without_choosing(policy):
    """As above on 3 slots, with loop iterations of K = 3 decode steps: an iteration that begins
    with the choice at depth 0 and at least K steps before the probe runs its steps as
    autoregressive steps without choosing (fallback_rounds), and the depths are those chosen step
    by step (K divides none of the probe intervals 2, 4, 8, so iterations that ignored the probe
    would delay some). A run of r autoregressive steps holds at least (r - K + 1) // K whole
    iterations; every counted iteration but the last holds K of the steps."""
    cfg, params = policy
    sampling = Sampling(temperature=0.0, max_new_tokens=MAX_NEW)
    spec = accepted_draft(policy, verify_token_cost=10.0, adaptive_probe=2, adaptive_probe_max=8)
    stats = generate(cfg, params, PROMPTS, jax.random.key(1), sampling, spec=spec, slots=3, decode_steps=3).stats
    runs, probes = probe_runs(MAX_NEW - 1, 2, 8)
    assert runs == [1, 3, 7, 7, 7, 4] and probes == 5
    assert (stats["depth_steps"][0], stats["depth_steps"][1]) == (sum(runs), probes), stats
    whole = sum(max(0, (r - 2) // 3) for r in runs)  # 3 (an engine that chooses at every step: 0)
    assert whole <= stats["fallback_rounds"] <= (sum(runs) - 1) // 3 + 1, stats


@pytest.fixture(scope="module")
def tiny_policy_and_head():
    """The embedded tiny policy, its trained EAGLE-3 head (top-1 agreement 0.82) and 16 of its
    level-1 word problems as prompts (greedy answers of 16 to 31 tokens)."""
    from tokenizers import Tokenizer

    from jaxspec.assets import tiny_eagle3_path, tiny_policy_path
    from jaxspec.draft import load_eagle3
    from jaxspec.models.checkpoint import load_hf
    from jaxspec.tasks.generator import generate_problems
    from jaxspec.tasks.tokenizer import format_prompt

    cfg, params = load_hf(tiny_policy_path())
    tokenizer = Tokenizer.from_file(str(tiny_policy_path() / "tokenizer.json"))
    problems = generate_problems(16, seed=3, levels=[1], kinds=["word"])
    prompts = [tokenizer.encode(format_prompt(p["question"])).ids for p in problems]
    return cfg, params, load_eagle3(tiny_eagle3_path(), policy=cfg), prompts


@pytest.mark.parametrize("slots", [None, 6, 16], ids=["staged", "slots", "narrowing slots"])
def test_an_eagle3_head_queues_autoregressive_iterations(tiny_policy_and_head, slots):
    """An adaptive EAGLE-3 loop runs no head in its autoregressive iterations: the head queues them
    (`Eagle3Drafter.defer`) and runs them at the next probe (after 16 of them: more than one piece
    of 16 entries, the least `queue_piece` gives). Its drafts, so the loop's acceptance, choices
    and statistics, equal those of the same loop with a head that runs at every iteration; its
    tokens equal autoregressive decoding. 6 slots start rows in slots that other rows left; 16
    slots step 8 of them once at most 8 decode (`slot_width`), the queue appended at full width."""
    from jaxspec.rollout.speculative import eagle3
    from jaxspec.rollout.speculative.eagle3 import MIN_QUEUE_PIECE, Eagle3Drafter

    cfg, params, head, prompts = tiny_policy_and_head
    sampling = Sampling(temperature=0.0, max_new_tokens=40)
    # A verified node costs 0.8 steps: depth 3 at first, then autoregressive iterations and probes.
    spec = Spec(
        "eagle3",
        head,
        num_draft_tokens=K,
        adaptive=True,
        verify_token_cost=0.8,
        adaptive_probe=17,
        adaptive_probe_max=17,
    )
    engine = {} if slots is None else {"slots": slots}
    with pytest.MonkeyPatch.context() as patch:  # the drafter `generate` makes, in pieces of 16
        patch.setattr(eagle3, "Eagle3Drafter", lambda **fields: Eagle3Drafter(**fields | {"piece": MIN_QUEUE_PIECE}))
        queued = generate(cfg, params, prompts, jax.random.key(1), sampling, spec=spec, **engine)
    with pytest.MonkeyPatch.context() as patch:  # the drafter `generate` makes, without a backlog
        patch.setattr(eagle3, "Eagle3Drafter", lambda **fields: Eagle3Drafter(**fields | {"backlog": 0}))
        stepped = generate(cfg, params, prompts, jax.random.key(1), sampling, spec=spec, **engine)
    ar = generate(cfg, params, prompts, jax.random.key(0), sampling)
    np.testing.assert_array_equal(queued.tokens, ar.tokens)
    depths = queued.stats["depth_steps"]
    assert depths[0] >= 17 - 1 >= MIN_QUEUE_PIECE and depths[1] > 0 and queued.stats["accepted_tokens"] > 0, (
        queued.stats
    )
    for name in ("depth_steps", "fallback_steps", "accepted_tokens", "drafted_tokens", "steps"):
        assert queued.stats[name] == stepped.stats[name], (name, queued.stats, stepped.stats)
    if slots == 16:
        assert queued.stats["step_widths"] == [16, 8] and queued.stats["width_steps"][1] > 0, queued.stats
