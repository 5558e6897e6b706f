"""The compiled minibatch update's memory and layout: no logits of every packed position in XLA's
plan, the chunked scoring and update on a mesh equal one device's, the gradients laid out like the
params, the online draft's targets read in chunks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.draft import init_eagle3, split_buffers
from jaxspec.models import init_params
from jaxspec.rl.batch import PackedRows
from jaxspec.rl.config import GRPOLossConfig, OnlineDraftConfig, PolicyOptimConfig
from jaxspec.rl.loss import sequence_forward
from jaxspec.rl.online_draft import OnlineDraft, draft_optimizer
from jaxspec.rl.step import policy_optimizer, score_fn, update_fn
from jaxspec.rollout import Sampling
from tests.rl.test_step import _copy, _draft_case

pytestmark = pytest.mark.slow


def _abstract_minibatch(rows: int, width: int, seqs: int, new_tokens: int, seq_resp_mask: bool = False):
    """A PackedRows of shapes only (jax.ShapeDtypeStruct), to compile an update without data;
    with seq_resp_mask, the [rows, width] mask the online draft's loss reads."""
    shape = jax.ShapeDtypeStruct
    return PackedRows(
        tokens=shape((rows, width), jnp.int32),
        segment_ids=shape((rows, width), jnp.int32),
        resp_index=shape((seqs, new_tokens), jnp.int32),
        resp_tokens=shape((seqs, new_tokens), jnp.int32),
        advantages=shape((seqs,), jnp.float32),
        prox_logp=shape((seqs, new_tokens), jnp.float32),
        loss_mask=shape((seqs, new_tokens), bool),
        seq_resp_mask=shape((rows, width), bool) if seq_resp_mask else None,
    )


def _temporaries(update) -> int:
    """The largest temporaries of a compiled update's programs."""
    return max(program.memory_analysis().temp_size_in_bytes for program in update.programs().values())


def test_update_and_scoring_keep_no_logits_of_every_position():
    """The compiled update's and log-prob pass's temporaries (XLA's analysis on CPU, nothing runs)
    stay well below the float32 logits [R, W, V] of every packed position (64 MiB here), which the
    unchunked head kept several copies of (the logits, the gathered response logits, their
    log-softmax and in the update the gradient of each: 324 MiB of the update's temporaries and
    160 MiB of the pass's at this shape, against 26 and 5 MiB chunked)."""
    from jaxspec.models.config import ModelConfig

    cfg = ModelConfig(
        family="qwen3",
        vocab_size=4096,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=32,
        max_position_embeddings=256,
    )
    rows, width, seqs, new_tokens = 32, 128, 32, 96
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    optim = PolicyOptimConfig(learning_rate=1e-5)
    opt_state = jax.eval_shape(policy_optimizer(optim).init, params)
    mb = _abstract_minibatch(rows, width, seqs, new_tokens)
    sampling = Sampling(temperature=0.7, top_k=50, max_new_tokens=new_tokens)
    update = update_fn(cfg, sampling, GRPOLossConfig(), optim, "float32", True, None, logprob_chunk=64)
    temporaries = _temporaries(update.compile(params, opt_state, None, None, None, mb))
    logits_bytes = rows * width * cfg.vocab_size * 4
    assert temporaries < logits_bytes / 2, (temporaries, logits_bytes)
    score = score_fn(cfg, sampling, "float32", True, logprob_chunk=64)
    temporaries = score.lower(params, mb.tokens, mb.segment_ids, mb.resp_index, mb.resp_tokens).compile()
    assert temporaries.memory_analysis().temp_size_in_bytes < logits_bytes / 2


@pytest.mark.parametrize("mesh_shape", [(1, 2, 1), (2, 2, 2)], ids=["fsdp2", "data2-fsdp2-tensor2"])
def test_chunked_scoring_and_update_on_a_mesh_match_one_device(tiny_policy, mesh_shape):
    """The log-prob pass and the update with the head's chunks split over the mesh's batch axes (a
    chunk size the batch axes divide, S * N not a multiple of it) give the one-device results."""
    from jaxspec.models import Sharding, make_mesh, shard_params

    _, cfg, _ = tiny_policy
    params, sampling, batch = _draft_case(cfg)
    batch = batch.replace(seq_resp_mask=None)
    sharding = Sharding(make_mesh(*mesh_shape, devices=jax.devices()[: np.prod(mesh_shape)]))
    args = (batch.tokens, batch.segment_ids, batch.resp_index, batch.resp_tokens)
    assert batch.resp_index.size % 12
    want = score_fn(cfg, sampling, "float32", False, logprob_chunk=12)(params, *args)
    got = score_fn(cfg, sampling, "float32", False, sharding, logprob_chunk=12)(shard_params(sharding, params), *args)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    optim = PolicyOptimConfig(learning_rate=1e-3)
    updated = []
    for mesh in (None, sharding):
        p = _copy(params) if mesh is None else shard_params(mesh, params)
        update = update_fn(cfg, sampling, GRPOLossConfig(), optim, "float32", False, None, mesh, logprob_chunk=12)
        p, _, _, _, metrics = update(p, policy_optimizer(optim).init(p), None, None, None, batch)
        updated.append((jax.tree.map(np.asarray, p), [float(metrics[k]) for k in ("loss", "entropy", "grad_norm")]))
    (p1, metrics1), (p2, metrics2) = updated
    np.testing.assert_allclose(metrics2, metrics1, rtol=1e-5, atol=1e-6)
    # Adam's first step is ~lr * sign(gradient) (lr 1e-3): summation-order differences of a
    # gradient near Adam's eps change it by a fraction of lr, a gradient of the wrong sign by 2 lr;
    # the gradient's scale is checked by grad_norm above.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), p1, p2)


@pytest.mark.parametrize("online", [False, True], ids=["policy", "online-head"])
def test_the_gradients_leave_the_update_laid_out_like_the_params(tiny_policy, online):
    """The update's two programs meet at the gradients, which leave the first laid out like the
    params (fsdp-split here), as the second reads them; not as XLA would pick for an output (it
    replicated them, the whole float32 policy on every device)."""
    from jaxspec.models import Sharding, make_mesh, param_shardings, shard_params

    _, cfg, _ = tiny_policy
    params, sampling, batch = _draft_case(cfg)
    sharding = Sharding(make_mesh(1, 2, 1, devices=jax.devices()[:2]))
    params = shard_params(sharding, params)
    optim = PolicyOptimConfig(learning_rate=1e-3)
    draft, head = None, (None, None, None)
    if online:
        dcfg, dparams = init_eagle3(cfg, jax.random.PRNGKey(2), 40)
        weights, buffers = split_buffers(dparams)
        draft = OnlineDraft(dcfg=dcfg, train=OnlineDraftConfig(online=True, ttt_steps=1))
        head = (weights, buffers, draft_optimizer(draft.train).init(weights))
    else:
        batch = batch.replace(seq_resp_mask=None)
    update = update_fn(cfg, sampling, GRPOLossConfig(), optim, "float32", False, draft, sharding)
    compiled = update.compile(params, policy_optimizer(optim).init(params), *head, batch)
    grads = compiled.gradients.output_shardings[0]
    want = param_shardings(sharding, params)
    split = [g for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)) if w.spec != jax.sharding.PartitionSpec()]
    assert split, "the tiny policy has params that the fsdp rules split"
    assert all(g.is_equivalent_to(w, len(w.spec)) for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)))


def test_the_online_draft_loss_reads_the_policys_targets_in_chunks(tiny_policy):
    """The update's draft loss, with the head's targets built a few columns at a time (a chunk of 3
    positions), is eagle3_loss of the policy's logits of every position; and its compiled
    temporaries stay below the float32 logits [R, W, V] of every packed position, which the update
    built whole before (XLA's analysis on CPU, nothing runs)."""
    from jaxspec.draft import eagle3_loss, merge_buffers
    from jaxspec.models.blocks import logits_from_hidden
    from jaxspec.models.config import ModelConfig

    _, cfg, _ = tiny_policy
    params, sampling, batch = _draft_case(cfg)
    dcfg, dparams = init_eagle3(cfg, jax.random.PRNGKey(2), 40)
    weights, buffers = split_buffers(dparams)
    online = OnlineDraft(dcfg=dcfg, train=OnlineDraftConfig(online=True, learning_rate=1e-2, ttt_steps=2))
    optim = PolicyOptimConfig(learning_rate=1e-2)
    update = update_fn(cfg, sampling, GRPOLossConfig(), optim, "float32", False, online, logprob_chunk=3)
    *_, metrics = update(
        _copy(params),
        policy_optimizer(optim).init(params),
        _copy(weights),
        buffers,
        draft_optimizer(online.train).init(weights),
        batch,
    )
    final, hidden, _ = sequence_forward(
        cfg, params, batch.tokens, batch.segment_ids, tuple(dcfg.aux_layer_ids), head=False
    )
    want, _ = eagle3_loss(
        dcfg,
        merge_buffers(weights, buffers),
        params["embed"],
        hidden,
        logits_from_hidden(cfg, params, final),
        batch.tokens,
        batch.seq_resp_mask,
        num_steps=2,
        step_decay=online.train.step_decay,
        segment_ids=batch.segment_ids,
    )
    assert float(want) > 0
    np.testing.assert_allclose(float(metrics["draft_loss"]), float(want), rtol=1e-6)

    big = ModelConfig(
        family="qwen3",
        vocab_size=8192,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=1,
        num_kv_heads=1,
        head_dim=32,
        max_position_embeddings=256,
    )
    rows, width, seqs, new_tokens = 32, 128, 32, 96
    big_params = jax.eval_shape(lambda: init_params(big, jax.random.PRNGKey(0)))
    big_state = jax.eval_shape(policy_optimizer(optim).init, big_params)
    dcfg, dparams = init_eagle3(big, jax.random.PRNGKey(1), 256)
    weights, buffers = split_buffers(dparams)
    online = OnlineDraft(dcfg=dcfg, train=OnlineDraftConfig(online=True, ttt_steps=2))
    mb = _abstract_minibatch(rows, width, seqs, new_tokens, seq_resp_mask=True)

    def temporaries(draft, *args):
        update = update_fn(big, sampling, GRPOLossConfig(), optim, "float32", True, draft, logprob_chunk=64)
        return _temporaries(update.compile(big_params, big_state, *args))

    plain = temporaries(None, None, None, None, mb.replace(seq_resp_mask=None))
    with_draft = temporaries(online, weights, buffers, draft_optimizer(online.train).init(weights), mb)
    logits_bytes = rows * width * big.vocab_size * 4  # 128 MiB; the draft's share was 132 MiB, now 29
    assert with_draft - plain < logits_bytes / 3, (plain, with_draft, logits_bytes)
