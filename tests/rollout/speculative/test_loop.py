"""The speculative loop: greedy speculation equals greedy autoregressive decoding token for token
(eos inside an accepted run, max_new_tokens mid-run), statistics, compile reuse, bad input."""

import jax
import numpy as np
import pytest

from jaxspec.draft import init_eagle3
from jaxspec.models import ModelConfig, init_params
from jaxspec.rollout import Sampling, Spec, generate
from jaxspec.rollout.speculative import loop
from tests.rollout.reference import greedy_reference

# Lengths 3, 7 and 20 (prompt buckets 16, 16 and 32); the batch repeats two of them.
PROMPTS = [[5, 9, 11], [2, 40, 33, 17, 8, 60, 1], [3] * 5 + list(range(10, 25))]
BATCH = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[1]]
MAX_NEW = 24  # with k = 3 a full-acceptance run covers outputs 1-4, 5-8, ..., 21-24: the last one is cut
K = 3
PAD = 7  # the policy fixture's pad_token_id


@pytest.fixture(scope="module")
def eos_and_reference(policy):
    """An eos id that first appears in the middle of row 0's greedy output, not at the end of a
    k + 1 token run, and the greedy continuations (full forwards, no cache) of every prompt."""
    cfg, params = policy
    reference = greedy_reference(cfg, params, PROMPTS, MAX_NEW)
    tokens = reference[0][0]
    eos = next(
        tokens[i] for i in range(6, MAX_NEW - 4) if tokens[i] not in tokens[:i] and (i - 1) % (K + 1) not in (K,)
    )
    return eos, reference


@pytest.fixture(scope="module")
def greedy_sampling(eos_and_reference):
    return Sampling(temperature=0.0, max_new_tokens=MAX_NEW, eos_id=eos_and_reference[0])


@pytest.fixture(scope="module")
def autoregressive(policy, greedy_sampling):
    cfg, params = policy
    return generate(cfg, params, BATCH, jax.random.key(0), greedy_sampling)


def specs(policy):
    cfg, params = policy
    head = init_eagle3(cfg, jax.random.key(5), std=0.3)
    return {
        # A draft identical to the policy: every greedy draft is accepted.
        "draft_model-self-chain": Spec("draft_model", (cfg, params), num_draft_tokens=K),
        "eagle3-chain": Spec("eagle3", head, num_draft_tokens=K),
        "ngram-tree": Spec("ngram", num_draft_tokens=K, tree_width=2),
        # Rows 0 and 3, 1 and 4 carry one prompt: a group each, drafting from each other.
        "suffix-tree": Spec("suffix", num_draft_tokens=K, tree_width=2),
    }


@pytest.fixture(scope="module")
def speculative(policy, greedy_sampling):
    cfg, params = policy
    return {
        name: generate(cfg, params, BATCH, jax.random.key(1), greedy_sampling, spec=spec)
        for name, spec in specs(policy).items()
    }


@pytest.mark.parametrize("name", ["draft_model-self-chain", "eagle3-chain", "ngram-tree", "suffix-tree"])
def test_greedy_speculation_equals_greedy_autoregressive(speculative, autoregressive, eos_and_reference, name):
    eos, reference = eos_and_reference
    out = speculative[name]
    np.testing.assert_array_equal(out.tokens, autoregressive.tokens)
    np.testing.assert_array_equal(out.lengths, autoregressive.lengths)
    np.testing.assert_allclose(out.logprobs, autoregressive.logprobs, rtol=1e-5, atol=1e-5)
    # Against the cache-free reference too: rows stop right after the eos, padded after it.
    lengths = np.asarray(out.lengths)
    for r, prompt in enumerate(BATCH):
        full = reference[PROMPTS.index(prompt)][0]
        stop = full.index(eos) + 1 if eos in full else MAX_NEW
        assert lengths[r] == stop and np.asarray(out.tokens[r, :stop]).tolist() == full[:stop]
        assert np.all(np.asarray(out.tokens[r, stop:]) == PAD) and np.all(np.asarray(out.logprobs[r, stop:]) == 0)
    assert lengths[0] < MAX_NEW and lengths.max() == MAX_NEW, "both an eos stop and the max_new_tokens cut"
    stats = out.stats
    assert stats["generated_tokens"] == lengths.sum() and 1 <= stats["steps"] < MAX_NEW
    rates = stats["acceptance_rate_per_position"]  # NaN at depths never tested (none accepted above)
    if name.endswith("chain"):  # every step drafts K nodes, each but the last with one child
        row_steps = stats["drafted_tokens"] / K
        assert stats["acceptance_length"] == pytest.approx(1 + stats["accepted_tokens"] / row_steps)
        # the steps that test depth i + 1 are those that accepted depth i: tokens per step telescope
        assert stats["acceptance_length"] == pytest.approx(1 + np.sum(np.cumprod(np.nan_to_num(rates))), rel=1e-5)
    assert stats["accepted_tokens"] <= stats["drafted_tokens"]


def test_a_draft_identical_to_the_policy_accepts_everything(speculative):
    stats = speculative["draft_model-self-chain"].stats
    assert stats["acceptance_length"] == K + 1
    np.testing.assert_array_equal(stats["acceptance_rate_per_position"], np.ones(K, np.float32))
    # Rows emit K + 1 tokens per step: 1 + 6 * 4 >= 24 tokens after 6 steps.
    assert stats["steps"] == 6 and stats["drafted_tokens"] == stats["accepted_tokens"]


def test_weak_drafts_are_rejected_often(speculative):
    stats = speculative["eagle3-chain"].stats
    assert stats["accepted_tokens"] < stats["drafted_tokens"] / 2
    assert stats["steps"] > MAX_NEW // (K + 1)


def test_no_recompilation_within_buckets(policy, greedy_sampling, speculative):
    cfg, params = policy
    spec = specs(policy)["ngram-tree"]
    compiled = loop.speculative_decode._cache_size()
    generate(
        cfg,
        params,
        [[1, 2, 3, 1, 2], [9] * 30, [4, 4], [6], [1, 2, 3, 1, 2]],
        jax.random.key(2),
        greedy_sampling,
        spec=spec,
    )  # same batch size, prompt bucket and distinct-prompt bucket
    assert loop.speculative_decode._cache_size() == compiled


def _spec_error(policy, spec_kwargs):
    cfg, params = policy
    spec = Spec(**spec_kwargs)
    generate(cfg, params, [[1, 2]], jax.random.key(0), Sampling(max_new_tokens=4), spec=spec)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="medusa"), "Spec.method"),
        (dict(method="ngram", draft_sampling="top_p"), "Spec.draft_sampling"),
        (dict(method="ngram", draft_sampling="stochastic"), "draft_sampling must be 'greedy' for method='ngram'"),
        (dict(method="ngram", num_draft_tokens=0), "Spec.num_draft_tokens"),
        (dict(method="ngram", tree_width=0), "Spec.tree_width"),
        (
            dict(method="ngram", tree_width=3, tree_budget=2),
            "Spec.tree_budget must be None or >= Spec.tree_width=3, got 2",
        ),
        (dict(method="ngram", ngram_sizes=(2, 0)), "Spec.ngram_sizes"),
        (
            dict(method="ngram", num_draft_tokens=3, stage_draft_tokens=(3, 4)),
            r"Spec.stage_draft_tokens must be None or a non-empty list of depths in 1..Spec.num_draft_tokens=3, "
            r"got \[3, 4\]",
        ),
        (dict(method="ngram", stage_draft_tokens=()), "Spec.stage_draft_tokens"),
        (dict(method="ngram", draft=(1, 2)), "Spec.draft must be None"),
        (dict(method="draft_model"), r"Spec.draft must be a \(config, params\) pair"),
        (dict(method="draft_model", draft=("cfg", {})), "Spec.draft\\[0\\] must be a jaxspec.models.ModelConfig"),
    ],
)
def test_bad_spec_raises(policy, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _spec_error(policy, kwargs)


def test_draft_that_does_not_fit_the_policy_raises(policy):
    cfg, params = policy
    small = ModelConfig(
        family="llama",
        vocab_size=60,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=96,
    )
    small_params = jax.eval_shape(lambda: init_params(small, jax.random.key(0)))
    with pytest.raises(ValueError, match="vocab_size 60 differs from the policy's 61"):
        _spec_error(policy, dict(method="draft_model", draft=(small, small_params)))
    other = ModelConfig(
        family="llama",
        vocab_size=61,
        hidden_size=40,
        intermediate_size=32,
        num_layers=4,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=96,
    )
    head = init_eagle3(other, jax.random.key(0))
    with pytest.raises(ValueError, match="EAGLE-3 head does not fit the policy: hidden_size"):
        _spec_error(policy, dict(method="eagle3", draft=head))
    with pytest.raises(ValueError, match="Spec.tree_width=5 exceeds the draft vocabulary \\(4 tokens\\)"):
        _spec_error(
            policy, dict(method="eagle3", draft=init_eagle3(cfg, jax.random.key(0), draft_vocab_size=4), tree_width=5)
        )
    with pytest.raises(ValueError, match="spec must be a jaxspec.rollout.Spec"):
        generate(cfg, params, [[1, 2]], jax.random.key(0), Sampling(max_new_tokens=4), spec="ngram")


def test_stochastic_drafts_through_the_verification_kernel_are_token_identical(policy, greedy_sampling, monkeypatch):
    """Sampled EAGLE-3 trees at T=1 give the same rollout with the stochastic-draft kernel in
    Triton's interpreter (JAXSPEC_TREE_VERIFY_IMPL=triton-interpret) as with the jnp reference,
    from the same key."""
    import dataclasses

    import jaxspec.kernels.tree_stochastic_triton as stochastic

    cfg, params = policy
    head = init_eagle3(cfg, jax.random.key(5), std=0.3)
    sampling = dataclasses.replace(greedy_sampling, temperature=1.0)
    specs = [Spec("eagle3", head, num_draft_tokens=K, tree_width=2, draft_sampling="stochastic")]
    traced = []
    kernel = stochastic.verify_stochastic_triton
    monkeypatch.setattr(stochastic, "verify_stochastic_triton", lambda *a, **kw: traced.append(1) or kernel(*a, **kw))
    results = {}
    for impl in ("reference", "triton-interpret"):
        monkeypatch.setenv("JAXSPEC_TREE_VERIFY_IMPL", impl)
        jax.clear_caches()  # the rollout's programs read the variable when traced
        results[impl] = [generate(cfg, params, BATCH, jax.random.key(2), sampling, spec=spec) for spec in specs]
    jax.clear_caches()  # later tests trace their rollouts afresh, with the variable unset
    assert len(traced) == len(specs)  # traced once per spec, in the kernel's rollouts only
    for want, got in zip(results["reference"], results["triton-interpret"], strict=True):
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.lengths, want.lengths)
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-6)
        assert float(got.stats["acceptance_length"]) == float(want.stats["acceptance_length"]) > 1.0
