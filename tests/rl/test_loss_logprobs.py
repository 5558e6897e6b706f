"""The trainer's side of `jaxspec.rl.loss`: the packed forward (`sequence_forward`), the response
log-probs and entropies through the LM head in chunks (`response_logprobs`) and the online head's
targets in chunks (`draft_targets`), against the rollout's log-probs and unchunked references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxspec.models import init_params
from jaxspec.models.blocks import logits_from_hidden
from jaxspec.models.config import ModelConfig
from jaxspec.rl.batch import pack_rows, training_rows
from jaxspec.rl.loss import response_logprobs, sequence_forward
from jaxspec.rollout import Sampling, generate
from jaxspec.rollout.sampling import processed_logprobs


def test_trainer_logprobs_match_the_rollout(tiny_policy):
    """One full-sequence forward reproduces the log-probs `generate` reports, for a filtered p."""
    _, cfg, params = tiny_policy
    sampling = Sampling(temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=10, eos_id=cfg.eos_token_id)
    prompts = [[1, 3, 50, 60, 4], [1, 3, 70, 4], [1, 3, 50, 60, 4]]
    out = generate(cfg, params, prompts, jax.random.PRNGKey(3), sampling=sampling)
    rows = training_rows(prompts, np.asarray(out.tokens), np.asarray(out.lengths), pad_id=0, width=48)
    packed = pack_rows(rows)
    assert packed.tokens.shape[0] == 1  # all three rollouts share one row
    hidden, _, _ = sequence_forward(cfg, params, packed.tokens, packed.segment_ids, head=False)
    logp, entropy = response_logprobs(cfg, params, hidden, packed.resp_index, packed.resp_tokens, sampling)
    valid = rows.resp_mask
    assert np.isfinite(np.asarray(logp)[valid]).all()
    np.testing.assert_allclose(np.asarray(logp)[valid], np.asarray(out.logprobs)[valid], atol=2e-6)
    assert (np.asarray(entropy)[valid] > 0).all()


def _head_case(tie: bool):
    """(cfg, params, packed rows of 6 random rollouts of up to 7 new tokens, resp_tokens [6, 7]: half the
    tokens the policy's most likely ones, so that top-k / top-p keep them, half random)."""
    cfg = ModelConfig(
        family="qwen3",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
    )
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    rng = np.random.default_rng(0)
    prompts = [[1, 3, 50, 60, 4], [1, 3, 70, 4], [1, 5, 4]] * 2
    rows = training_rows(prompts, rng.integers(5, 96, (6, 7)), rng.integers(1, 8, 6), pad_id=0)
    packed = pack_rows(rows)
    logits = sequence_forward(cfg, params, packed.tokens, packed.segment_ids)[0]
    likely = np.asarray(jnp.argmax(logits.reshape(-1, 96)[packed.resp_index], axis=-1))
    tokens = np.where(rng.random((6, 7)) < 0.5, likely, rng.integers(0, 96, (6, 7))).astype(np.int32)
    return cfg, params, packed, jnp.asarray(tokens)


def _unchunked_logprobs(cfg, params, hidden, resp_index, resp_tokens, sampling):
    """The reference: float32 logits [R, W, V] of every position, gathered to [S, N, V]."""
    logits = logits_from_hidden(cfg, params, hidden)
    logp_all = processed_logprobs(logits.reshape(-1, logits.shape[-1])[resp_index], sampling)
    logp = jnp.take_along_axis(logp_all, resp_tokens[:, :, None], axis=2)[:, :, 0]
    probs = jnp.where(jnp.isfinite(logp_all), jnp.exp(logp_all) * logp_all, 0.0)
    return logp, -probs.sum(-1)


SAMPLINGS = [
    Sampling(temperature=1.0),
    Sampling(temperature=0.7, top_k=5),
    Sampling(temperature=1.0, top_p=0.8),
    Sampling(temperature=0.9, top_k=20, top_p=0.9),
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "t0.7-topk", "topp", "topk-topp"])
def test_chunked_logprobs_equal_the_unchunked_head(sampling):
    """response_logprobs from the final hidden states, in chunks that divide S * N = 42 or leave a padded
    tail (and one chunk larger than all positions), equals log p and entropy from the logits of every
    position; the head=False forward is the logits' input."""
    cfg, params, packed, resp_tokens = _head_case(tie=False)
    hidden, _, _ = sequence_forward(cfg, params, packed.tokens, packed.segment_ids, head=False)
    np.testing.assert_array_equal(
        logits_from_hidden(cfg, params, hidden), sequence_forward(cfg, params, packed.tokens, packed.segment_ids)[0]
    )
    want_logp, want_entropy = _unchunked_logprobs(cfg, params, hidden, packed.resp_index, resp_tokens, sampling)
    assert np.isfinite(np.asarray(want_logp)).sum() >= 21
    if sampling.top_k or sampling.top_p < 1:
        assert np.isneginf(np.asarray(want_logp)).any()  # the filter excludes some of the random tokens
    for chunk in (1, 7, 16, 42, 1000):
        logp, entropy = response_logprobs(
            cfg, params, hidden, packed.resp_index, resp_tokens, sampling, chunk_size=chunk
        )
        assert logp.shape == entropy.shape == (6, 7)
        np.testing.assert_allclose(logp, want_logp, rtol=0, atol=1e-5, err_msg=f"chunk {chunk}")
        np.testing.assert_allclose(entropy, want_entropy, rtol=0, atol=1e-5, err_msg=f"chunk {chunk}")
    with pytest.raises(ValueError, match="chunk_size"):
        response_logprobs(cfg, params, hidden, packed.resp_index, resp_tokens, sampling, chunk_size=0)


@pytest.mark.parametrize("tie", [False, True], ids=["lm_head", "tied"])
def test_chunked_logprobs_have_the_unchunked_gradient(tie):
    """The gradient w.r.t. every param (through the head and the forward) of a weighted sum of the
    chunked log-probs equals the unchunked one's; the entropy carries no gradient."""
    cfg, params, packed, resp_tokens = _head_case(tie)
    sampling = SAMPLINGS[-1]
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(6, 7)), jnp.float32)

    def objective(logprobs):
        def f(p):
            hidden, _, _ = sequence_forward(cfg, p, packed.tokens, packed.segment_ids, head=False)
            logp, entropy = logprobs(p, hidden)
            return jnp.sum(jnp.where(jnp.isfinite(logp), logp, 0.0) * weights) + entropy.sum()

        return jax.jit(jax.grad(f))(params)

    def unchunked(p, hidden):  # the entropy is not differentiated: a constant in the reference
        logp, entropy = _unchunked_logprobs(cfg, p, hidden, packed.resp_index, resp_tokens, sampling)
        return logp, jax.lax.stop_gradient(entropy)

    want = objective(unchunked)
    for chunk in (16, 42):
        got = objective(
            functools.partial(
                response_logprobs,
                cfg,
                resp_index=packed.resp_index,
                resp_tokens=resp_tokens,
                sampling=sampling,
                chunk_size=chunk,
            )
        )
        assert float(optax.tree.norm(want)) > 0
        jax.tree.map(assert_close_in_float32, got, want)


def assert_close_in_float32(got: jax.Array, want: jax.Array) -> None:
    """Equal up to float32 sums taken in another order: an element's rounding error scales with the
    largest terms of its leaf, not with the element (the tied embedding's gradient, its head's and its
    input's parts summed: elements near 0.02-0.14 differed by 2.8e-6 on JAX 0.12.1, 1.3e-6 of the
    leaf's largest, 2.1), so the absolute tolerance is 1e-5 of the leaf's largest magnitude; a gradient
    that misses or adds a token's part differs by that part's size."""
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_the_trainer_forward_runs_large_expert_calls_through_the_kernels_on_gpus(tiny_moe_policy, monkeypatch):
    """sequence_forward asks for moe_impl auto: on a GPU (faked, with a stand-in for jax_triton) a
    packed batch of 4 x 8192 tokens (4 experts x top-2: 262144 experts x rows) takes the
    grouped-matmul kernels, forward and gradient; on this CPU it keeps ragged_dot."""
    pytest.importorskip("triton", reason="the grouped-matmul kernels need triton (the test extra has it)")
    from jaxspec.models import moe
    from tests.kernels.fake_jax_triton import install, kernels_in

    cfg, params = tiny_moe_policy[1], tiny_moe_policy[2]
    tokens = jax.ShapeDtypeStruct((4, 8192), jnp.int32)

    def jaxpr() -> str:
        def loss(p, t):
            return sequence_forward(cfg, p, t, jnp.ones_like(t), head=False)[0].astype(jnp.float32).sum()

        return str(jax.make_jaxpr(jax.grad(loss))(params, tokens))

    assert kernels_in(jaxpr()) == set()
    monkeypatch.setattr(moe, "on_gpu", lambda: True)
    monkeypatch.setattr(moe, "_kernels_import", lambda: True)
    install(monkeypatch)
    assert kernels_in(jaxpr()) == {"_grouped_matmul", "_grouped_transposed_matmul"}  # forward / dX, and dW


@pytest.mark.parametrize("head", [False, True])
def test_remat_saves_no_compute_dtype_copy_of_the_weights(head, capsys):
    """The trainer's bf16 forward over float32 master weights casts each layer's weights inside its
    rematerialised layer function, so the backward pass keeps the master weights (arguments, alive
    anyway) and no bf16 copy of the layers (2 bytes per parameter per device: 8.2 GB for Qwen3-8B
    over fsdp=2). A cast of the whole tree before the forward saved every layer's bf16 weights.
    (head=True, pretraining's path, keeps the bf16 LM head for the logits' backward; the trainer's
    head=False applies it in rematerialised chunks, `response_logprobs`.) The outputs are those of
    the forward on the cast weights, bit for bit."""
    import re

    from jax.ad_checkpoint import print_saved_residuals

    cfg = ModelConfig(
        family="qwen3",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    params = init_params(cfg, jax.random.key(0), jnp.float32)
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, cfg.vocab_size)
    segments = jnp.ones((2, 32), jnp.int32).at[1, 20:].set(2)

    def loss(p):
        out, _, _ = sequence_forward(cfg, p, tokens, segments, (), jnp.bfloat16, True, None, head=head)
        return out.astype(jnp.float32).sum()

    weight_shapes = {"bf16[" + ",".join(map(str, x.shape)) + "]" for x in jax.tree.leaves(params["layers"])}
    capsys.readouterr()
    print_saved_residuals(loss, params)  # one line per residual: "bf16[64,128] output of ..."
    saved = [line for line in capsys.readouterr().out.splitlines() if "from the argument" not in line]
    copies = [line for line in saved if re.match(r"\S+", line)[0] in weight_shapes]
    assert not copies, f"bf16 weight copies saved for the backward pass: {copies}"
    assert any(line.startswith("bf16[2,32,64]") for line in saved), "the activations were not found among them"

    cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    ours = sequence_forward(cfg, params, tokens, segments, (1,), jnp.bfloat16, True, None, head=head)
    reference = sequence_forward(cfg, cast, tokens, segments, (1,), jnp.bfloat16, True, None, head=head)
    for a, b in zip(ours[:2], reference[:2]):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("mesh_shape", [None, (1, 2, 1), (2, 2, 2)], ids=["one-device", "fsdp2", "data2-fsdp2-tensor2"])
def test_draft_targets_in_chunks_equal_the_targets_of_every_position(mesh_shape):
    """The online head's targets built a few columns of the packed rows at a time (chunks that
    divide the width, leave a padded tail, or exceed it) equal `eagle3_targets` of the logits of
    every position: the draft-vocabulary softmax and the argmax over the whole vocabulary, which
    here often falls outside the draft vocabulary (40 of the 96 tokens, the most frequent of random
    counts)."""
    from jaxspec.draft import eagle3_targets, init_eagle3
    from jaxspec.models import Sharding, make_mesh, shard_params
    from jaxspec.rl.loss import draft_targets

    cfg, params, packed, _ = _head_case(tie=False)
    counts = np.random.default_rng(3).integers(0, 1000, cfg.vocab_size)
    _, dparams = init_eagle3(cfg, jax.random.PRNGKey(1), 40, counts)
    hidden, _, _ = sequence_forward(cfg, params, packed.tokens, packed.segment_ids, head=False)
    want = eagle3_targets(dparams, logits_from_hidden(cfg, params, hidden))
    in_vocab = np.asarray(dparams["t2d"])[np.asarray(want.top)]
    assert in_vocab.any() and not in_vocab.all()
    sharding = None
    if mesh_shape is not None:
        sharding = Sharding(make_mesh(*mesh_shape, devices=jax.devices()[: np.prod(mesh_shape)]))
        params = shard_params(sharding, params)
    rows, width = packed.tokens.shape
    assert width % 3  # 3 columns a chunk leave a padded tail
    for chunk in (rows, rows * 3, rows * width, 10_000):
        fn = jax.jit(lambda p, h, d: draft_targets(cfg, p, h, d, chunk_size=chunk, sharding=sharding))
        got = fn(params, hidden, dparams)
        assert got.soft.shape == (rows, width, 40) and got.top.shape == (rows, width)
        np.testing.assert_allclose(got.soft, want.soft, rtol=0, atol=1e-6, err_msg=f"chunk {chunk}")
        np.testing.assert_array_equal(got.top, want.top, err_msg=f"chunk {chunk}")
    with pytest.raises(ValueError, match="chunk_size"):
        draft_targets(cfg, params, hidden, dparams, chunk_size=0)
