"""The online head's state: split for the update, merged back into the checkpoint's entries, and
the schedule of the updates it trains on."""

import jax
import numpy as np

from jaxspec.draft import init_eagle3, split_buffers
from jaxspec.rl.config import OnlineDraftConfig
from jaxspec.rl.online_draft import OnlineDraft, OnlineDraftState, draft_optimizer


def test_state_round_trips_through_the_checkpoint_entries(tiny_policy):
    _, cfg, _ = tiny_policy
    dcfg, params = init_eagle3(cfg, jax.random.PRNGKey(2))
    draft = OnlineDraft(dcfg=dcfg, train=OnlineDraftConfig(online=True, ttt_steps=1))
    head = OnlineDraftState.init(draft, params)
    weights, buffers = split_buffers(params)
    assert jax.tree.structure(head.weights) == jax.tree.structure(weights) and buffers
    expected_opt = draft_optimizer(draft.train).init(weights)
    assert jax.tree.structure(head.opt_state) == jax.tree.structure(expected_opt)
    # The checkpoint keeps the merged params (the layout of a frozen head) next to the optimizer state.
    entries = head.checkpoint_entries()
    assert set(entries) == {"draft_params", "draft_opt_state"}
    assert jax.tree.structure(entries["draft_params"]) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, entries["draft_params"], params)
    # An update's new weights reach the checkpoint; the frozen buffers stay as they are.
    moved = head.with_update(jax.tree.map(lambda x: x + 1, head.weights), head.opt_state)
    restored = OnlineDraftState.from_checkpoint(moved.checkpoint_entries())
    jax.tree.map(np.testing.assert_array_equal, restored.weights, jax.tree.map(lambda x: x + 1, weights))
    jax.tree.map(np.testing.assert_array_equal, restored.buffers, buffers)
    assert restored.update_args()[1] is restored.buffers


def test_the_head_trains_on_every_nth_update():
    every_other = OnlineDraft(dcfg=None, train=OnlineDraftConfig(online=True, train_every=2))
    assert [every_other.trains_on(i) for i in range(5)] == [True, False, True, False, True]
    assert every_other.skips_updates
    always = OnlineDraft(dcfg=None, train=OnlineDraftConfig(online=True))
    assert all(always.trains_on(i) for i in range(4)) and not always.skips_updates
