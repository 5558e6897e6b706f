"""The EAGLE-3 drafter's cached state: across verification steps with any accepted counts, its
first draft token equals the uncached head's prediction from the policy's own features."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.draft import fuse, init_eagle3, to_target_ids
from jaxspec.draft.loss import ttt_forward
from jaxspec.models.transformer import forward_hidden
from jaxspec.rollout import Sampling
from jaxspec.rollout.speculative.drafter import Prefill, Verified
from jaxspec.rollout.speculative.eagle3 import Eagle3Drafter

DEPTH = 3  # chunks of up to DEPTH + 1 entries
PROMPT_LENGTHS = [3, 7, 5]
TOTAL = 24

# Jitted, as in the decode loop, where the drafter always runs under jit: eager op-by-op dispatch
# of the head and the policy compiles every primitive at every shape and takes far longer.
forward_hidden = jax.jit(forward_hidden, static_argnums=(0, 3))
ttt_forward = jax.jit(ttt_forward, static_argnums=(0, 5))


def test_first_draft_matches_uncached_head_after_any_acceptance(policy):
    cfg, params = policy
    dcfg, head = init_eagle3(cfg, jax.random.key(5), std=0.3)
    rng = np.random.default_rng(0)
    seqs = jnp.asarray(rng.integers(0, cfg.vocab_size, (len(PROMPT_LENGTHS), TOTAL)), jnp.int32)
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
            dparams, Prefill(**arrays, max_len=TOTAL + 2 * DEPTH, cache_dtype=jnp.float32, sharding=None)
        )
    )
    state = init(dparams, prefill)
    propose, update = jax.jit(drafter.propose), jax.jit(drafter.update)
    all_rows = jnp.ones(len(rows), bool)

    root_index = lengths.copy()  # the root x_p sits at index p (= the policy's cache length)
    for accepted in ([0, 2, 3], [3, 0, 1], [1, 1, 0]):
        state, tree = propose(
            dparams, state, seqs[rows, root_index], jnp.asarray(root_index), all_rows, jax.random.key(0)
        )
        np.testing.assert_array_equal(np.asarray(tree.tokens[:, 1]), predicted[rows, root_index - 1])
        accepted = np.asarray(accepted)
        window = root_index[:, None] + np.arange(DEPTH + 1)  # [root, the next DEPTH tokens]
        state = update(
            dparams,
            state,
            Verified(
                committed=seqs[rows[:, None], window],
                next_root=seqs[rows, root_index + accepted + 1],
                num_accepted=jnp.asarray(accepted),
                cache_len=jnp.asarray(root_index),
                hidden=aux[:, rows[:, None], window],
                active=jnp.ones(len(rows), bool),
            ),
        )
        root_index = root_index + accepted + 1
    state, tree = propose(dparams, state, seqs[rows, root_index], jnp.asarray(root_index), all_rows, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(tree.tokens[:, 1]), predicted[rows, root_index - 1])
