"""The EAGLE-3 drafter's cached state: across verification steps with any accepted counts, its
first draft token equals the uncached head's prediction from the policy's own features, and a
chain's later levels, drafted one node a level, equal the head run over the whole chain."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.draft import draft_extend, fuse, init_eagle3, to_target_ids
from jaxspec.draft.loss import ttt_forward
from jaxspec.models.transformer import forward_hidden
from jaxspec.rollout import Sampling
from jaxspec.rollout.speculative.drafter import Prefill, Verified
from jaxspec.rollout.speculative.eagle3 import MIN_QUEUE_PIECE, Eagle3Drafter, queue_piece

DEPTH = 3  # chunks of up to DEPTH + 1 entries
PROMPT_LENGTHS = [3, 7, 5]
TOTAL = 24

# Jitted, as in the decode loop, where the drafter always runs under jit: eager op-by-op dispatch
# of the head and the policy compiles every primitive at every shape and takes far longer.
forward_hidden = jax.jit(forward_hidden, static_argnums=(0, 3))
ttt_forward = jax.jit(ttt_forward, static_argnums=(0, 5))


def _setup(policy, total: int, backlog: int = 0, piece: int | None = None):
    """A random head over the policy, three prompts of a random sequence [3, total], the head's
    uncached guesses of x_{t+2} at every t, the drafter, its params and its jitted started state."""
    cfg, params = policy
    dcfg, head = init_eagle3(cfg, jax.random.key(5), std=0.3)
    rng = np.random.default_rng(0)
    seqs = jnp.asarray(rng.integers(0, cfg.vocab_size, (len(PROMPT_LENGTHS), total)), jnp.int32)
    _, aux = forward_hidden(cfg, params, seqs, dcfg.aux_layer_ids)  # [3, B, T, H]
    fused = fuse(dcfg, head, aux)
    logits, _ = ttt_forward(dcfg, head, params["embed"], fused, seqs, num_steps=1)
    predicted = np.asarray(to_target_ids(head, jnp.argmax(logits[0], axis=-1)))  # [B, T]: guesses x_{t+2}

    drafter = Eagle3Drafter(
        dcfg=dcfg,
        sampling=Sampling(temperature=0.0, max_new_tokens=16),
        depth=DEPTH,
        width=1,
        num_nodes=DEPTH,
        stochastic=False,
        backlog=backlog,
        piece=piece,
    )
    dparams = {"head": head, "embed": params["embed"]}
    lengths = np.asarray(PROMPT_LENGTHS)
    prompt_width = 8
    prompts = jnp.where(jnp.arange(prompt_width)[None] < lengths[:, None], seqs[:, :prompt_width], 0)
    _, prompt_aux = forward_hidden(cfg, params, prompts, dcfg.aux_layer_ids)
    rows = np.arange(len(lengths))
    prefill = dict(
        prompt_tokens=prompts,
        prompt_lengths=jnp.asarray(lengths),
        row_prompt=jnp.asarray(rows),
        row_lengths=jnp.asarray(lengths),
        first_token=seqs[rows, lengths],
        policy_hidden=prompt_aux,
    )
    init = jax.jit(
        lambda dparams, arrays: drafter.init(
            dparams, Prefill(**arrays, max_len=total + 2 * DEPTH, cache_dtype=jnp.float32, sharding=None)
        )
    )
    return seqs, aux, predicted, drafter, dparams, init(dparams, prefill)


def _verified(seqs, aux, root_index, accepted) -> Verified:
    """The outcome of a step at root_index [3] that accepted `accepted` [3] of the true tokens."""
    rows = np.arange(len(root_index))
    window = root_index[:, None] + np.arange(DEPTH + 1)  # [root, the next DEPTH tokens]
    return Verified(
        committed=seqs[rows[:, None], window],
        next_root=seqs[rows, root_index + accepted + 1],
        num_accepted=jnp.asarray(accepted),
        cache_len=jnp.asarray(root_index),
        hidden=aux[:, rows[:, None], window],
        active=jnp.ones(len(rows), bool),
    )


def test_first_draft_matches_uncached_head_after_any_acceptance(policy):
    seqs, aux, predicted, drafter, dparams, state = _setup(policy, TOTAL)
    propose, update = jax.jit(drafter.propose), jax.jit(drafter.update)
    rows = np.arange(len(PROMPT_LENGTHS))
    all_rows = jnp.ones(len(rows), bool)

    root_index = np.asarray(PROMPT_LENGTHS)  # the root x_p sits at index p (= the policy's cache length)
    for accepted in ([0, 2, 3], [3, 0, 1], [1, 1, 0]):
        state, tree = propose(
            dparams, state, seqs[rows, root_index], jnp.asarray(root_index), all_rows, jax.random.key(0)
        )
        np.testing.assert_array_equal(np.asarray(tree.tokens[:, 1]), predicted[rows, root_index - 1])
        accepted = np.asarray(accepted)
        state = update(dparams, state, _verified(seqs, aux, root_index, accepted))
        root_index = root_index + accepted + 1
    state, tree = propose(dparams, state, seqs[rows, root_index], jnp.asarray(root_index), all_rows, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(tree.tokens[:, 1]), predicted[rows, root_index - 1])


def _chain_rerun(drafter, dparams, state, root, root_index) -> np.ndarray:
    """A chain drafted by running the head over the whole chain so far at every level (the root with
    its features, each node with its parent's output; the cache holding the entries before the
    root's): its DEPTH drafted policy ids [B, DEPTH], the reference for drafting one node a level."""
    head, embed = dparams["head"], dparams["embed"]
    head_len = jnp.asarray(root_index) - 1
    every_row = jnp.ones(len(root_index), bool)
    logits, out, root_hidden, cache = drafter._pending_pass(head, embed, state.cache, state, head_len, every_row)
    tokens = []
    for level in range(DEPTH):
        tokens.append(to_target_ids(head, jnp.argmax(logits[:, -1], axis=-1)))
        if level + 1 == DEPTH:
            break
        chain = jnp.stack([root, *tokens], axis=1)  # [B, level + 2]
        hidden = jnp.concatenate([root_hidden, out], axis=1)  # the root's features, then each parent's output
        positions = head_len[:, None] + jnp.arange(level + 2)
        logits, out, _ = draft_extend(drafter.dcfg, head, embed, cache, chain, hidden, positions, head_len)
    return np.asarray(jnp.stack(tokens, axis=1))


def test_a_chain_drafts_one_node_a_level_as_the_head_over_the_whole_chain(policy):
    """Each level after the first runs its newest node alone, over the entries the levels before
    wrote: the same drafts as running the head over the whole chain again at every level."""
    seqs, aux, _, drafter, dparams, state = _setup(policy, TOTAL)
    propose, update = jax.jit(drafter.propose), jax.jit(drafter.update)
    rows = np.arange(len(PROMPT_LENGTHS))
    root_index = np.asarray(PROMPT_LENGTHS)
    for accepted in ([0, 2, 3], [3, 0, 1], None):
        root = seqs[rows, root_index]
        want = _chain_rerun(drafter, dparams, state, root, root_index)
        state, tree = propose(dparams, state, root, jnp.asarray(root_index), jnp.ones(3, bool), jax.random.key(0))
        np.testing.assert_array_equal(np.asarray(tree.tokens[:, 1:]), want)
        if accepted is not None:
            state = update(dparams, state, _verified(seqs, aux, root_index, np.asarray(accepted)))
            root_index = root_index + np.asarray(accepted) + 1


@pytest.mark.parametrize("piece", [MIN_QUEUE_PIECE, None], ids=["pieces_of_16", "one_pass"])
def test_a_deferred_run_drafts_as_a_head_run_at_every_step(policy, piece):
    """An adaptive loop's autoregressive iterations: a head with a backlog queues them (`defer`) and
    runs them at its next proposal in pieces; its drafts then equal those of a head that ran a
    depth-1 proposal at every iteration, and its first token the uncached head's guess. The rows
    queue 15 to 18 entries: in pieces of 16 their last entries fall in the first and second piece;
    by default (`queue_piece`) the whole chunk runs in one pass."""
    total, deferred = 40, 14
    seqs, aux, predicted, queued, dparams, queued_state = _setup(policy, total, backlog=deferred + 2, piece=piece)
    _, _, _, stepped, _, stepped_state = _setup(policy, total)
    size = piece or queue_piece(queued.dcfg)
    assert queued.chunk > size if piece else queued.chunk <= size
    rows = np.arange(len(PROMPT_LENGTHS))
    all_rows = jnp.ones(len(rows), bool)
    one_level = dataclasses.replace(stepped, depth=1, num_nodes=1)
    propose = {d: jax.jit(d.propose) for d in (queued, stepped, one_level)}
    update, defer = jax.jit(stepped.update), jax.jit(queued.defer)

    root_index = np.asarray(PROMPT_LENGTHS)
    accepted = np.asarray([0, 3, 1])
    states = {}
    for name, drafter, state in (("queued", queued, queued_state), ("stepped", stepped, stepped_state)):
        index = root_index
        state, _ = propose[drafter](dparams, state, seqs[rows, index], jnp.asarray(index), all_rows, jax.random.key(0))
        state = jax.jit(drafter.update)(dparams, state, _verified(seqs, aux, index, accepted))
        index = index + accepted + 1
        for _ in range(deferred):  # autoregressive iterations: the root verified alone
            if name == "stepped":
                state, _ = propose[one_level](
                    dparams, state, seqs[rows, index], jnp.asarray(index), all_rows, jax.random.key(1)
                )
                state = update(dparams, state, _verified(seqs, aux, index, np.zeros(3, int)))
            else:
                state = defer(dparams, state, _verified(seqs, aux, index, np.zeros(3, int)))
            index = index + 1
        states[name] = (state, index)
    np.testing.assert_array_equal(np.asarray(states["queued"][0].count), accepted + 1 + deferred)
    trees = {}
    for name, drafter in (("queued", queued), ("stepped", stepped)):
        state, index = states[name]
        _, trees[name] = propose[drafter](
            dparams, state, seqs[rows, index], jnp.asarray(index), all_rows, jax.random.key(2)
        )
    index = states["queued"][1]
    np.testing.assert_array_equal(np.asarray(trees["queued"].tokens[:, 1]), predicted[rows, index - 1])
    np.testing.assert_array_equal(np.asarray(trees["queued"].tokens), np.asarray(trees["stepped"].tokens))


def test_a_backlog_runs_in_pieces_as_large_as_the_attention_kernel_takes(policy):
    """Entries x query heads per kv head fill one program of the cache-attention kernel (128 query
    rows): `small`'s head (16 query heads, 8 kv heads) runs 64 entries a pass, a Qwen3-8B-shaped
    one (32, 8) 32, and a head with many query heads per kv head at least 16."""
    dcfg, _ = init_eagle3(policy[0], jax.random.key(5))
    shaped = {(16, 8): 64, (32, 8): 32, (8, 8): 128, (32, 2): 16, (64, 1): 16}
    for (heads, kv_heads), entries in shaped.items():
        assert queue_piece(dataclasses.replace(dcfg, num_heads=heads, num_kv_heads=kv_heads)) == entries
