"""Cached drafting (`draft_extend`) against the uncached unrolled head (`ttt_forward`).

A drafting chain from context x_0..x_{t+1}, teacher-forced with the true next tokens, must
reproduce the training-time-test logits at position t of every unrolled step: this checks the
cache, the TTT attention pattern, the rope positions and the hidden-state recursion together.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.draft import (
    draft_extend,
    draft_logprobs_on_target_vocab,
    fuse,
    init_draft_cache,
    to_target_ids,
    ttt_forward,
)
from jaxspec.models import forward_hidden
from tests.models.hf_reference import random_tokens, rel_max_err

SEQ = 16
PREFILL = 12  # entries written by the first call (positions 0..11)
MAX_LEN = 24
STEPS = 4
TOL = 1e-5
ROWS_END = np.array([5, 9])  # row b's real context ends at entry ROWS_END[b] (token x_{t+1})

extend_jit = jax.jit(draft_extend, static_argnums=0)


@pytest.fixture(scope="module")
def reference(policy, head):
    """tokens [2, SEQ], fused features, and TTT (logits [STEPS, 2, SEQ, Vd], outputs)."""
    cfg, params = policy
    dcfg, dparams = head
    tokens = jnp.asarray(random_tokens(11, (2, SEQ), cfg.vocab_size))
    _, aux = jax.jit(forward_hidden, static_argnums=(0, 3))(cfg, params, tokens, dcfg.aux_layer_ids)
    fused = fuse(dcfg, dparams, aux)
    logits, outs = jax.jit(ttt_forward, static_argnums=(0, 5))(dcfg, dparams, params["embed"], fused, tokens, STEPS)
    return tokens, fused, logits, outs


def _prefill(policy, head, tokens, fused):
    """Entries j = 0..PREFILL-1 (token x_{j+1}, hidden f_j, position j) for both rows."""
    dcfg, dparams = head
    positions = jnp.broadcast_to(jnp.arange(PREFILL, dtype=jnp.int32), (2, PREFILL))
    return extend_jit(
        dcfg,
        dparams,
        policy[1]["embed"],
        init_draft_cache(dcfg, 2, MAX_LEN),
        tokens[:, 1 : PREFILL + 1],
        fused[:, :PREFILL],
        positions,
        jnp.zeros((2,), jnp.int32),
    )


def _rows(x, cols):
    """x[b, cols[b]] for each row b, keeping a length-1 time axis."""
    index = jnp.asarray(cols).reshape((-1, 1) + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


def test_teacher_forced_chain_reproduces_every_ttt_step(policy, head, reference):
    dcfg, dparams = head
    tokens, fused, ttt_logits, ttt_outs = reference
    logits, hidden, cache = _prefill(policy, head, tokens, fused)
    assert logits.dtype == jnp.float32 and logits.shape == (2, PREFILL, dcfg.draft_vocab_size)
    assert rel_max_err(logits, ttt_logits[0, :, :PREFILL]) < TOL
    assert rel_max_err(hidden, ttt_outs[0, :, :PREFILL]) < TOL

    # Rows keep entries 0..ROWS_END[b]; slots past that hold stale prefill entries, overwritten
    # or never attended to.
    hidden = _rows(hidden, ROWS_END)
    for step in range(1, STEPS):
        cache_len = jnp.asarray(ROWS_END + step, jnp.int32)
        step_tokens = _rows(tokens, ROWS_END + 1 + step)
        logits, hidden, cache = extend_jit(
            dcfg, dparams, policy[1]["embed"], cache, step_tokens, hidden, cache_len[:, None], cache_len
        )
        for b, t in enumerate(ROWS_END):
            assert rel_max_err(logits[b, 0], ttt_logits[step, b, t]) < TOL, (step, b)
            assert rel_max_err(hidden[b, 0], ttt_outs[step, b, t]) < TOL, (step, b)


def test_tree_block_with_masks_equals_separate_branches(policy, head, reference):
    """Two sibling drafts in one call (tree_mask = identity), then a grandchild under the second
    sibling with the first hidden by prefix_mask, equal drafting the second branch alone."""
    dcfg, dparams = head
    embed = policy[1]["embed"]
    tokens, fused, _, _ = reference
    _, hidden, cache = _prefill(policy, head, tokens, fused)
    parent_hidden = _rows(hidden, ROWS_END)  # [2, 1, H]
    base_len = jnp.asarray(ROWS_END + 1, jnp.int32)
    siblings = jnp.asarray([[3, 17], [29, 40]], jnp.int32)
    grandchild = jnp.asarray([[7], [51]], jnp.int32)

    pair_logits, pair_hidden, pair_cache = extend_jit(
        dcfg,
        dparams,
        embed,
        cache,
        siblings,
        jnp.repeat(parent_hidden, 2, axis=1),
        jnp.repeat(base_len[:, None], 2, axis=1),
        base_len,
        tree_mask=jnp.broadcast_to(jnp.eye(2, dtype=bool), (2, 2, 2)),
    )
    for i in range(2):
        alone_logits, alone_hidden, alone_cache = extend_jit(
            dcfg, dparams, embed, cache, siblings[:, i : i + 1], parent_hidden, base_len[:, None], base_len
        )
        assert rel_max_err(pair_logits[:, i : i + 1], alone_logits) < TOL
    # alone_* now hold the second branch drafted on its own.
    ref_logits, _, _ = extend_jit(
        dcfg, dparams, embed, alone_cache, grandchild, alone_hidden, base_len[:, None] + 1, base_len + 1
    )
    prefix_mask = jnp.broadcast_to(jnp.arange(MAX_LEN) != base_len[:, None], (1, 2, MAX_LEN)).transpose(1, 0, 2)
    tree_logits, _, _ = extend_jit(
        dcfg,
        dparams,
        embed,
        pair_cache,
        grandchild,
        pair_hidden[:, 1:],
        base_len[:, None] + 1,
        base_len + 2,
        prefix_mask=prefix_mask,
    )
    assert rel_max_err(tree_logits, ref_logits) < TOL
    # Without the prefix mask the first sibling leaks into the grandchild's attention.
    leaky, _, _ = extend_jit(
        dcfg, dparams, embed, pair_cache, grandchild, pair_hidden[:, 1:], base_len[:, None] + 1, base_len + 2
    )
    assert rel_max_err(leaky, ref_logits) > 1e-3


def test_draft_ids_map_to_policy_vocabulary(head):
    dcfg, dparams = head
    t2d = np.asarray(dparams["t2d"])
    kept = np.flatnonzero(t2d)
    assert len(kept) == dcfg.draft_vocab_size
    ids = jnp.asarray([[0, 5, dcfg.draft_vocab_size - 1]])
    np.testing.assert_array_equal(to_target_ids(dparams, ids), kept[np.asarray(ids)])

    logits = jax.random.normal(jax.random.key(0), (3, dcfg.draft_vocab_size)) * 3
    full = np.asarray(draft_logprobs_on_target_vocab(dparams, logits))
    assert full.shape == (3, dcfg.vocab_size)
    assert np.all(np.isneginf(full[:, ~t2d]))
    np.testing.assert_allclose(full[:, kept], jax.nn.log_softmax(logits, axis=-1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.exp(full).sum(-1), 1.0, rtol=1e-6)


def test_bad_inputs_name_the_dimension(policy, head):
    cfg, params = policy
    dcfg, dparams = head
    cache = init_draft_cache(dcfg, 1, 8)
    tokens, pos, lens = jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32)
    hidden = jnp.zeros((1, 2, cfg.hidden_size))
    with pytest.raises(ValueError, match="hidden_size"):
        draft_extend(dcfg, dparams, jnp.zeros((cfg.vocab_size, cfg.hidden_size + 8)), cache, tokens, hidden, pos, lens)
    with pytest.raises(ValueError, match="vocab_size"):
        draft_extend(dcfg, dparams, jnp.zeros((cfg.vocab_size + 1, cfg.hidden_size)), cache, tokens, hidden, pos, lens)
    with pytest.raises(ValueError, match="hidden_in"):
        draft_extend(dcfg, dparams, params["embed"], cache, tokens, hidden[:, :1], pos, lens)
    with pytest.raises(ValueError, match="aux"):
        fuse(dcfg, dparams, jnp.zeros((2, 1, 2, cfg.hidden_size)))
