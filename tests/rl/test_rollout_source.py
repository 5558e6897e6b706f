"""The rollout seam: a GRPO run takes its rollouts from one `RolloutSource`, whichever it is, and
hands it the weights after each update and its entries to checkpoint (`jaxspec.rl.rollout_source`)."""

import dataclasses

import numpy as np

from jaxspec.config_io import load_config
from jaxspec.rl import driver
from jaxspec.rl.config import GRPOConfig
from jaxspec.rl.loop import rollout_source
from jaxspec.rl.rollout_source import RolloutSource
from tests.rl.runs import LIGHT, read_metrics, write_config


class _StandIn(RolloutSource):
    """The colocated source's rollouts rescored (1 for the first sample of each group, 0 for the
    others), its calls recorded, and one checkpoint entry: how many weight updates it took."""

    def __init__(self, setup, calls: list):
        self.inner, self.calls = rollout_source(setup), calls
        self.group, self.placement, self.updates = setup.rollout.samples_per_prompt, setup.placement, 0

    def initial_entries(self, state):
        return self.checkpoint_entries()

    def start(self, state, step, position, resumed):
        self.updates = int(state["stand_in_updates"])
        self.calls.append(("start", step, position, resumed, self.updates))

    def next_batch(self, state, step, position, timer):
        self.calls.append(("next_batch", step, position))
        batch = self.inner.next_batch(state, step, position, timer)
        scores = (np.arange(len(batch.rollouts.scores)) % self.group == 0).astype(np.float64)
        return batch._replace(rollouts=dataclasses.replace(batch.rollouts, scores=scores, rewards=scores))

    def update_weights(self, state, step, timer):
        self.updates += 1
        self.calls.append(("update_weights", step))
        return {}

    def checkpoint_entries(self):
        return self.placement.state({"stand_in_updates": np.int32(self.updates)})

    def close(self):
        self.calls.append(("close",))


def test_a_stand_in_source_feeds_the_steps_and_its_entries_are_checkpointed(tiny_policy, tmp_path):
    """Two steps on a stand-in source, resumed for a third: each step trains on the rollouts the
    source returned (one correct sample per group of 8: reward_mean 1/8, every group informative),
    the source is told each update's step and closed at the end, and the entry it adds to the
    state comes back from the checkpoint on resume."""
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=2, eval_every=0, checkpoint_every=1)
    calls = []

    def stand_in(setup):
        return _StandIn(setup, calls)

    cfg = load_config(GRPOConfig, config, LIGHT)
    result = driver.train(cfg, tmp_path / "run", make_rollouts=stand_in)
    assert not result["preempted"]
    assert calls == [
        ("start", 0, 0, False, 0),
        ("next_batch", 0, 0),
        ("update_weights", 1),
        ("next_batch", 1, 4),
        ("update_weights", 2),
        ("close",),
    ]
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["reward_mean"] == r["accuracy"] == 1 / 8 and r["groups_zero_variance"] == 0.0, r
        assert not {"staleness", "rollout_version", "sync_bytes"} & set(r)

    calls.clear()
    resumed = load_config(GRPOConfig, config, [*LIGHT, "train.steps=3"])
    driver.train(resumed, tmp_path / "run", resume=True, make_rollouts=stand_in)
    assert calls == [("start", 2, 8, True, 2), ("next_batch", 2, 8), ("update_weights", 3), ("close",)]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]


def test_the_checkpointed_state_keeps_the_layout_runs_were_saved_in(tiny_policy, tmp_path):
    """The training state that checkpoints hold, as `jaxspec.rl.checkpointing` lists it (what a run
    saved by an earlier jaxspec restores into): the trainer's entries, and in async mode one
    rollout copy per batch in flight (max_staleness 2) laid out like the policy and the draft, with
    their versions."""
    import jax

    from jaxspec.rl.loop import GRPORun
    from jaxspec.rl.resources import check_inputs

    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=2, eval_every=0, checkpoint_every=2)
    trainer = {"params", "opt_state", "step", "position", "updates", "key", "draft_params", "draft_opt_state"}
    trainer |= {"ref_params"}
    for mode, extra in (("colocated", []), ("async", ["mesh.rollout_devices=1", "rollout.max_staleness=2"])):
        cfg = load_config(GRPOConfig, config, [f"rollout.mode={mode}", *extra])
        run = GRPORun(cfg, tmp_path / mode, False, check_inputs(cfg))
        state = run.state
        run.rollouts.close()
        if mode == "colocated":
            assert set(state) == trainer
            continue
        assert set(state) == trainer | {"rollout", "rollout_version"}
        assert state["rollout_version"].dtype == np.int32 and state["rollout_version"].shape == (2,)
        assert sorted(state["rollout"]) == ["0", "1"]
        for slot in state["rollout"].values():
            assert sorted(slot) == ["draft", "policy"]
            for name, master in (("policy", state["params"]), ("draft", state["draft_params"])):
                assert jax.tree.structure(slot[name]) == jax.tree.structure(master)
                assert [x.shape for x in jax.tree.leaves(slot[name])] == [x.shape for x in jax.tree.leaves(master)]
