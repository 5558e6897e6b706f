"""Speculative rollouts sample exactly the policy's processed distribution.

Every 3-token continuation of a prompt over a 6-token vocabulary is enumerated with its exact
probability (teacher-forced forwards, numpy processed distribution); the sampled continuations
must pass a chi-square goodness-of-fit test, and every reported log-prob must equal the
trainer's recomputation. Drafts are weak (random draft model and head, n-gram continuations of a
prompt whose tokens are followed by varying tokens), so rejections, residual samples, bonus
tokens and max_new_tokens truncation all occur.

Every method x {chain, tree} x {greedy, stochastic drafts} x {T=1, T=0.7 with top_p=0.9} runs
(the n-gram and suffix drafters have no draft distribution, so they draft greedily only; so do hybrid
trees, the EAGLE-3 head's branches merged with suffix branches): 28 cases, each its
own compiled decode loop (every one differs in a static argument: method, tree shape, draft
sampling or `Sampling`); the exact distribution and the trainer's log-probs are computed once per
setting.

Power: `test_lossless_power.py` (the strong-draft tests that detect small biases).

Vocabulary tiles. Verification draws residual and bonus samples tile by tile (`jaxspec.kernels.tree_race`:
a race between tiles, then between the winning tile's tokens); a policy's vocabulary spans many
tiles (Qwen's 151936 tokens: 75), the tiny policy's 6 tokens one. The rollouts here therefore
verify with tiles of RACE_TEST_TILE = 2 tokens (3 tiles; `race_tiles`), where an error in the race
between tiles or in the token race's seed shows (with greedy drafts; sampled drafts race over the
whole vocabulary in the reference): the 28 cases' flat distributions reveal a token race seeded
like the tile race (a token whose tile lost the race is then rarely drawn), the strong drafts'
peaked ones a tile race that counts the drafted tokens' mass.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import kernels
from jaxspec.draft import init_eagle3
from jaxspec.kernels.tree_verify_reference import verify_reference
from jaxspec.models import ModelConfig
from jaxspec.rollout import Sampling, Spec, processed_logprobs
from tests.rollout.conftest import random_params
from tests.rollout.reference import continuation_probs, full_forward, padded
from tests.rollout.test_distribution import chi_square_pvalue, staged_continuations

pytestmark = pytest.mark.slow

PROMPT = (2, 1, 3, 1, 4, 2, 3, 2, 1)
MAX_NEW = 3
# One batch: fewer than half the rows end within 3 tokens, so a staged loop would never leave its
# first stage; the tests turn staging off rather than compile loops that do not run (staged loops
# are tested in tests/rollout/test_stages.py, and at T = 1 by the strong-draft tests below).
NUM_SAMPLES = 6144
EOS = 5
RACE_TEST_TILE = 2  # verification's vocabulary tiles (`race_tiles`): 3 over the 6 tokens

T1 = dict(temperature=1.0, top_k=0, top_p=1.0)
NUCLEUS = dict(temperature=0.7, top_k=0, top_p=0.9)
SHAPES = {
    "chain": dict(num_draft_tokens=2, tree_width=1),
    "tree": dict(num_draft_tokens=2, tree_width=2, tree_budget=3),
}
SETTINGS = (T1, NUCLEUS)
CASES = [
    (method, shape, drafts, setting)
    for method in ("draft_model", "eagle3", "ngram", "suffix", "hybrid")
    for shape in SHAPES
    for drafts in (("greedy",) if method in ("ngram", "suffix", "hybrid") else ("greedy", "stochastic"))
    for setting in SETTINGS
]


def case_id(case) -> str:
    method, shape, drafts, setting = case
    return f"{method}-{shape}-{drafts}-T{setting['temperature']}-p{setting['top_p']}"


@pytest.fixture(scope="module", autouse=True)
def race_tiles():
    """Every rollout of this module verifies over vocabulary tiles of RACE_TEST_TILE tokens (tree
    verification on the CPU is the jnp reference); yields the list of the tiles each verification
    was traced with. Jit caches are cleared on entry and exit, so every loop of the module is traced
    with the tiles and none of other modules is."""
    traced = []

    def verify(*args, **kwargs):
        traced.append(RACE_TEST_TILE)
        return verify_reference(*args, tile=RACE_TEST_TILE, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "verify_reference", verify)
        jax.clear_caches()
        try:
            yield traced
        finally:
            jax.clear_caches()


@pytest.fixture(scope="module")
def drafts(tiny_vocab_policy):
    """Weak drafts for the tiny policy: a 1-layer random model and a random EAGLE-3 head whose
    reduced vocabulary (4 of 6 tokens) leaves out the eos and token 0."""
    cfg, _ = tiny_vocab_policy
    draft_cfg = ModelConfig(
        family="qwen3",
        vocab_size=6,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=64,
    )
    head = init_eagle3(cfg, jax.random.key(11), draft_vocab_size=4, token_counts=np.array([0, 9, 9, 9, 9, 1]), std=0.3)
    return {
        "draft_model": (draft_cfg, random_params(draft_cfg, seed=3, std=0.5)),
        "eagle3": head,
        "ngram": None,
        "suffix": None,
        "hybrid": head,
    }


@pytest.fixture(scope="module")
def teacher_forced(tiny_vocab_policy):
    """Policy logits [36, len(PROMPT) + 2, V] over PROMPT + every 2-token extension, by row (a, b)."""
    cfg, params = tiny_vocab_policy
    pairs = list(itertools.product(range(cfg.vocab_size), repeat=2))
    logits = np.asarray(full_forward(cfg, params, padded([PROMPT + pair for pair in pairs], len(PROMPT) + 2)))
    return logits, {pair: i for i, pair in enumerate(pairs)}


def exact_continuations(teacher_forced, setting) -> dict[tuple[int, ...], float]:
    """Probability of every continuation of PROMPT (MAX_NEW tokens or up to the first eos)."""
    logits, row = teacher_forced
    return continuation_probs(logits, row, len(PROMPT), EOS, setting)


@pytest.fixture(scope="module")
def reference(teacher_forced):
    """reference(setting) -> (exact continuation probabilities, the trainer's log-probs
    processed_logprobs [36, len(PROMPT) + 2, V] of the teacher-forced logits); cached per setting."""
    cache = {}

    def get(setting):
        key = tuple(sorted(setting.items()))
        if key not in cache:
            recomputed = processed_logprobs(jnp.asarray(teacher_forced[0]), Sampling(max_new_tokens=MAX_NEW, **setting))
            cache[key] = exact_continuations(teacher_forced, setting), np.asarray(recomputed)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def sampled(tiny_vocab_policy, drafts, race_tiles):
    """sampled(case) -> (continuations, RolloutOutput) of one speculative generate call over
    NUM_SAMPLES copies of PROMPT; cached per case."""
    cfg, params = tiny_vocab_policy
    cache = {}

    def run(case):
        key = case_id(case)
        if key not in cache:
            method, shape, draft_sampling, setting = case
            # Suffix drafts come from groups of 8 rows (of NUM_SAMPLES copies of PROMPT); hybrid trees
            # merge them with the EAGLE-3 head's.
            group = dict(suffix_group_rows=8) if method in ("suffix", "hybrid") else {}
            hybrid = dict(suffix_branches=True) if method == "hybrid" else {}
            spec = Spec(
                "eagle3" if method == "hybrid" else method,
                drafts[method],
                draft_sampling=draft_sampling,
                ngram_sizes=(2, 1),
                **group,
                **hybrid,
                **SHAPES[shape],
            )
            traced = len(race_tiles)
            # all the rows in one stage: see NUM_SAMPLES
            cache[key] = staged_continuations(cfg, params, setting, spec, PROMPT, NUM_SAMPLES, MAX_NEW)
            assert len(race_tiles) > traced, "each case's loop is traced, its verification over the race tiles"
        return cache[key]

    return run


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_speculative_samples_follow_exact_distribution(tiny_vocab_policy, teacher_forced, reference, sampled, case):
    cfg, _ = tiny_vocab_policy
    probs, recomputed = reference(case[3])
    seqs, out = sampled(case)
    tokens, lengths, logprobs = map(np.asarray, (out.tokens, out.lengths, out.logprobs))
    assert all(probs[s] > 0 for s in seqs), "sampled a continuation the processed distribution excludes"
    assert sum(len(s) < MAX_NEW for s in seqs) > 100, "eos-terminated continuations should be exercised"
    assert chi_square_pvalue(seqs, probs) > 1e-3

    # Log-probs are the trainer's recomputation: processed_logprobs of the teacher-forced logits,
    # read for every row at the teacher-forced row of its first two tokens (0 past its end).
    _, row = teacher_forced
    row_of = np.zeros((cfg.vocab_size, cfg.vocab_size), np.int64)
    for (a, b), r in row.items():
        row_of[a, b] = r
    valid = np.arange(MAX_NEW)[None, :] < lengths[:, None]
    prefix = np.where(valid[:, :2], tokens[:, :2], 0)
    r = row_of[prefix[:, 0], prefix[:, 1]]
    want = recomputed[r[:, None], len(PROMPT) - 1 + np.arange(MAX_NEW)[None, :], tokens]
    np.testing.assert_allclose(logprobs[valid], want[valid], rtol=1e-5, atol=1e-5)
    past = ~valid
    assert np.all(logprobs[past] == 0) and np.all(tokens[past] == (cfg.pad_token_id or 0))

    # Weak drafts: both acceptances and rejections happen.
    stats = out.stats
    assert 0 < stats["accepted_tokens"] < stats["drafted_tokens"]
    assert 1.0 < stats["acceptance_length"] < 1 + SHAPES[case[1]]["num_draft_tokens"]
    assert stats["acceptance_rate_per_position"].shape == (SHAPES[case[1]]["num_draft_tokens"],)


@pytest.mark.parametrize("setting", SETTINGS, ids=["T1", "nucleus"])
def test_adaptive_loops_sample_exactly(tiny_vocab_policy, drafts, reference, setting):
    """An adaptive loop (`spec.adaptive`) mixes drafting and autoregressive iterations: the weak
    EAGLE-3 head's sampled tree (2 deep, 3 nodes) is drafted first (rates start at 1: 3 tokens for
    1 + 3 * 0.6 steps), then its measured acceptance does not pay at a verify cost of 0.6 per node
    (decay 0: the last iteration's rate alone), so each row's last token, where it needs one, comes
    from an autoregressive iteration. The rollouts follow the exact law."""
    cfg, params = tiny_vocab_policy
    probs, _ = reference(setting)
    spec = Spec(
        "eagle3",
        drafts["eagle3"],
        draft_sampling="stochastic",
        **SHAPES["tree"],
        adaptive=True,
        verify_token_cost=0.6,
        adaptive_decay=0.0,
    )
    seqs, out = staged_continuations(cfg, params, setting, spec, PROMPT, NUM_SAMPLES, MAX_NEW, seed=8)
    assert out.stats["depth_steps"] == [1, 0, 1] and out.stats["fallback_steps"] == 1, out.stats
    assert 0 < out.stats["accepted_tokens"] < out.stats["drafted_tokens"]
    assert chi_square_pvalue(seqs, probs) > 1e-3


def test_chi_square_rejects_a_wrong_distribution(reference, sampled):
    """Negative control: the same samples against the exact distribution at another temperature."""
    seqs, _ = sampled(("draft_model", "tree", "stochastic", T1))
    wrong, _ = reference(dict(temperature=0.85, top_k=0, top_p=1.0))
    assert chi_square_pvalue(seqs, wrong) < 1e-6
