"""`jaxspec train` end to end on a tiny random policy: learning, the online head, dynamic sampling,
rollout sub-batches, reward shaping."""

import jax
import numpy as np
import pytest

from tests.rl.runs import read_metrics, train_cli, without_machine_keys, write_config

pytestmark = pytest.mark.slow


def test_the_default_compilation_cache_is_off_on_the_cpu(full_run):
    _, run_dir = full_run  # no train.compilation_cache in its config
    assert jax.default_backend() == "cpu" and not (run_dir / "xla_cache").exists()


def test_grpo_raises_reward_and_adapts_the_draft(full_run):
    _, run_dir = full_run
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(13))  # validation before training, then 12 steps
    steps = records[1:]
    first, last = steps[0]["reward_mean"], np.mean([r["reward_mean"] for r in steps[-3:]])
    assert last > max(0.5, 3 * first), [r["reward_mean"] for r in steps]
    # The random head learns online to predict the policy: acceptance and draft loss follow.
    acceptance = [r["acceptance_length"] for r in steps]
    assert acceptance[0] < 1.05 and acceptance[-1] > 1.2, acceptance
    assert steps[-1]["draft_loss"] < 0.7 * steps[0]["draft_loss"]
    for r in steps:
        assert r["updates"] <= 4 * r["step"]
        assert r["data_position"] == 4 * r["step"]
        assert len(r["acceptance_rate_per_position"]) == 2 and len(r["draft_top1_agreement"]) == 1
        assert r["accepted_tokens"] <= r["drafted_tokens"]
        assert 0 <= r["logprob_mismatch_max"] < 1e-4  # trainer and rollout compute the same p
        assert r["response_length_mean"] <= 8 and r["tokens_per_s"] > 0
        assert {"time_generation_s", "time_logprob_s", "time_train_s", "time_sync_s"} <= set(r)
    assert {"eval_accuracy", "eval_reward_mean"} <= set(records[0]) | set(records[6]) | set(records[12])
    assert "eval_accuracy" in records[6] and "eval_accuracy" not in records[5]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["12", "6"]
    assert (run_dir / "policy" / "model.safetensors").exists() and (run_dir / "policy" / "tokenizer.json").exists()
    assert (run_dir / "draft" / "model.safetensors").exists()
    assert not any("router_aux_loss" in r for r in records)  # a dense policy has no router


def test_moe_policy_trains_with_the_router_loss(tiny_moe_policy, tmp_path):
    """A mixture-of-experts policy: each step logs the router's load-balancing loss, and the loss
    holds it weighted by the policy's router_aux_loss_coef (loss.router_aux_coef null)."""
    config = write_config(tmp_path / "run.yaml", tiny_moe_policy[0], steps=2, eval_every=0, checkpoint_every=2)
    options = ["spec.method=none", "draft.online=false", "loss.kl_beta=0", "loss.ppo_epochs=1"]
    assert train_cli("--config", config, "--run-dir", tmp_path / "run", *options) == 0
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 1.5 < r["router_aux_loss"] <= 4.0  # top-2 of 4 experts: 2 when balanced, at most 4
        assert r["loss"] == pytest.approx(r["pg_loss"] + 0.05 * r["router_aux_loss"], rel=1e-5, abs=1e-6)


def test_rollouts_read_the_policy_and_the_draft_in_the_rollout_dtype(tiny_policy, tmp_path):
    """rollout.dtype bfloat16: "sync" casts the float32 master weights of both the policy and the
    head (a float32 head would draft at float32 speed); the head's vocabulary maps keep their types."""
    import jax.numpy as jnp

    from jaxspec.config_io import load_config
    from jaxspec.rl.config import GRPOConfig
    from jaxspec.rl.loop import GRPORun
    from jaxspec.rl.resources import check_inputs

    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=1)
    cfg = load_config(GRPOConfig, config, ["rollout.dtype=bfloat16", "draft.online=false"])
    run = GRPORun(cfg, tmp_path / "run", False, check_inputs(cfg))
    policy, spec = run.rollout_view()
    master = run.state["draft_params"]
    assert {x.dtype for x in jax.tree.leaves(policy)} == {jnp.dtype(jnp.bfloat16)}
    assert spec.draft[0] == run.draft_cfg
    for (path, got), want in zip(jax.tree.leaves_with_path(spec.draft[1]), jax.tree.leaves(master)):
        expected = jnp.bfloat16 if jnp.issubdtype(want.dtype, jnp.floating) else want.dtype
        assert got.dtype == expected, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(expected)))
    assert {x.dtype for x in jax.tree.leaves(master)} >= {jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)}


def policy_copies(params) -> float:
    """Bytes of the live arrays split over devices and shaped like the policy's float32 matrices, in
    units of the policy's (0 on one device)."""

    def split(x):
        return x.dtype == np.float32 and x.ndim > 1 and not x.sharding.is_fully_replicated

    shaped = {x.shape for x in jax.tree.leaves(params) if split(x)}
    size = sum(x.nbytes for x in jax.tree.leaves(params) if x.shape in shaped and split(x))
    return sum(x.nbytes for x in jax.live_arrays() if x.shape in shaped and split(x)) / max(size, 1)


@pytest.fixture
def update_calls(monkeypatch):
    """Every minibatch update of the training loop, as a dict: with_draft (the online head's update),
    has_head (head arguments given), policy_steps (as the loop asked), has_tokens (the packed
    minibatch holds loss tokens), unfinished_params (policy arrays the device was still computing
    when the update was called)."""
    import jaxspec.rl.loop as loop

    calls, update_fn = [], loop.update_fn

    def counting_update_fn(*args):
        fn, with_draft = update_fn(*args), args[6] is not None  # (..., remat, draft, sharding)

        def update(*inputs, **options):
            calls.append(
                {
                    "with_draft": with_draft,
                    "has_head": inputs[2] is not None,
                    "policy_steps": options.get("policy_steps", True),
                    "has_tokens": bool(np.asarray(inputs[5].loss_mask).any()),
                    "unfinished_params": sum(not x.is_ready() for x in jax.tree.leaves(inputs[0])),
                    "policy_copies": policy_copies(inputs[0]),
                }
            )
            return fn(*inputs, **options)

        return update

    monkeypatch.setattr(loop, "update_fn", counting_update_fn)
    return calls


def test_the_head_trains_on_every_nth_minibatch(tiny_policy, tmp_path, update_calls):
    """draft.train_every=2 with 2 minibatches x 2 epochs: the head's update runs on minibatches 0 and 2
    of each step, the policy-only update on the others (unless they hold no loss tokens)."""
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=2, eval_every=0, checkpoint_every=2)
    assert train_cli("--config", config, "--run-dir", tmp_path / "run", "draft.train_every=2") == 0
    assert all(c["with_draft"] == c["has_head"] for c in update_calls)
    assert sum(c["with_draft"] for c in update_calls) == 4 and len(update_calls) <= 8, update_calls
    records = read_metrics(tmp_path / "run")
    assert all(r["draft_loss"] > 0 and len(r["draft_top1_agreement"]) == 1 for r in records)


def test_the_policy_steps_only_on_minibatches_with_loss_tokens(tiny_policy, tmp_path, update_calls):
    """A reward every rollout scores 0 with loss.filter_groups: no group is informative, so no
    minibatch holds loss tokens. The head still trains on its minibatches, the policy never steps
    (the loop says so to the update), and no update is counted."""
    config = write_config(
        tmp_path / "run.yaml", tiny_policy[0], reward="zero", steps=2, eval_every=0, checkpoint_every=2
    )
    assert (
        train_cli("--config", config, "--run-dir", tmp_path / "run", "draft.train_every=2", "loss.filter_groups=true")
        == 0
    )
    assert update_calls and all(
        c["with_draft"] and not c["has_tokens"] and not c["policy_steps"] for c in update_calls
    ), update_calls
    records = read_metrics(tmp_path / "run")
    assert [r["updates"] for r in records] == [0, 0]
    assert all(r["draft_loss"] > 0 for r in records)


def test_dapo_dynamic_sampling_refills_the_batch(tiny_policy, tmp_path):
    """filter_groups_max_rounds 4 with a reward most groups score all 0: a step generates further
    batches of prompts until its 4 groups are informative (or 4 rounds ran), the data position
    advances by every prompt generated, and the batch keeps its size. The run also uses top-k
    sampling from bf16 rollouts with recomputed log-probs, TIS, dual-clip and Dr.GRPO's
    normaliser: every loss metric is finite and the dropped-token count is reported."""
    config = write_config(
        tmp_path / "run.yaml", tiny_policy[0], reward="rare_hash", steps=3, eval_every=0, checkpoint_every=3
    )
    options = [
        "spec.method=none",
        "draft.online=false",
        "loss.filter_groups_max_rounds=4",
        "rollout.top_k=8",
        "rollout.dtype=bfloat16",
        "loss.tis_cap=2.0",
        "loss.aggregation=seq-mean-token-sum-norm",
    ]
    assert train_cli("--config", config, "--run-dir", tmp_path / "run", *options) == 0
    records = read_metrics(tmp_path / "run")
    position = 0
    for r in records:
        position += 4 * r["generation_rounds"]
        assert r["data_position"] == position
        if r["generation_rounds"] < 4:
            assert r["groups_zero_variance"] == 0
        for key in (
            "loss",
            "pg_loss",
            "kl",
            "grad_norm",
            "behaviour_weight_mean",
            "dual_clip_frac",
            "nonfinite_tokens",
        ):
            assert np.isfinite(r[key]), (key, r)
    assert any(r["generation_rounds"] > 1 for r in records), records


def test_rollout_sub_batches_bound_each_generate_call(tiny_policy, tmp_path, monkeypatch):
    """rollout.sub_batch 16 of a step's 32 rollouts: two generate calls of 16 prompts each (whole
    groups, keys folded per call), and the record's acceptance statistics are the two calls'
    counts combined."""
    import jaxspec.rl.evaluate as evaluate
    import jaxspec.rl.rollout_source as rollout_source

    calls, generate = [], rollout_source.generate

    def recording_generate(cfg, params, prompts, key, **kwargs):
        out = generate(cfg, params, prompts, key, **kwargs)
        calls.append((len(prompts), prompts, out.stats))
        return out

    monkeypatch.setattr(rollout_source, "generate", recording_generate)
    monkeypatch.setattr(evaluate, "generate", recording_generate)
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=1, eval_every=0, checkpoint_every=1)
    assert train_cli("--config", config, "--run-dir", tmp_path / "run", "rollout.sub_batch=16") == 0
    assert [n for n, _, _ in calls] == [16, 16]
    for _, prompts, _ in calls:  # 2 groups of 8 equal prompts per call
        assert all(prompts[i] == prompts[i - i % 8] for i in range(16))
    (record,) = read_metrics(tmp_path / "run")
    parts = [stats for _, _, stats in calls]
    rows = sum(p["verified_row_steps"] for p in parts)
    accepted = sum(p["accepted_tokens"] for p in parts)
    assert record["accepted_tokens"] == accepted
    assert record["acceptance_length"] == pytest.approx((accepted + rows) / rows)
    assert record["decode_steps"] == sum(p["steps"] for p in parts)


@pytest.mark.parametrize(
    "spec",
    [[], ["spec.suffix_branches=true", "spec.suffix_history=2", "spec.adaptive=true"]],
    ids=["eagle3", "hybrid-adaptive"],
)
def test_rollout_slots_run_the_step_on_the_slot_engine(tiny_policy, tmp_path, monkeypatch, spec):
    """rollout.slots 8: the step's EAGLE-3 rollouts (plain, or hybrid trees with the prompts'
    earlier answers at an adaptive depth) stream through 8 decode slots over a paged KV cache
    (`generate(..., slots=8)`), and the step trains on them."""
    import jaxspec.rl.rollout_source as rollout_source

    calls, generate = [], rollout_source.generate

    def recording_generate(cfg, params, prompts, key, **kwargs):
        out = generate(cfg, params, prompts, key, **kwargs)
        calls.append((kwargs["slots"], out.stats))
        return out

    monkeypatch.setattr(rollout_source, "generate", recording_generate)
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=1, eval_every=0, checkpoint_every=1)
    assert train_cli("--config", config, "--run-dir", tmp_path / "run", "rollout.slots=8", *spec) == 0
    assert [(n, stats["slots"], stats["kv_pages"] > 0) for n, stats in calls] == [(8, 8, True)]
    (record,) = read_metrics(tmp_path / "run")
    assert record["decode_steps"] == calls[0][1]["steps"] and np.isfinite(record["loss"])


def test_soft_overlong_penalty_shapes_the_rewards(tiny_policy, tmp_path):
    """overlong_buffer = max_new_tokens: every response of L tokens loses L / 8 before the
    advantages; reward_mean stays the reward function's."""
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=1, eval_every=0, checkpoint_every=1)
    options = ["spec.method=none", "draft.online=false", "loss.overlong_buffer=8", "loss.overlong_penalty=1.0"]
    assert train_cli("--config", config, "--run-dir", tmp_path / "run", *options) == 0
    (record,) = read_metrics(tmp_path / "run")
    assert record["shaped_reward_mean"] == pytest.approx(record["reward_mean"] - record["response_length_mean"] / 8)


def test_gathered_rollout_weights_repeat_the_sharded_run(tiny_policy, tmp_path, monkeypatch):
    """rollout.gather_weights on a fsdp=2 x tensor=2 mesh: the rollouts and validation read a bf16
    copy whole over fsdp (split over tensor; their Sharding says the weights are gathered), made at
    "sync" and gone before the update, and the step's metrics (rewards, acceptance, losses,
    validation) are those of the fsdp-sharded copy."""
    import jax.numpy as jnp

    import jaxspec.rl.evaluate as evaluate
    import jaxspec.rl.loop as loop
    import jaxspec.rl.rollout_source as rollout_source

    generate, optimize = rollout_source.generate, loop.GRPORun._optimize
    read_fsdp_sharded, told_gathered, copies_in_update = [], [], []

    def recording_generate(cfg, params, *args, **kwargs):
        read_fsdp_sharded.append("fsdp" in tuple(params["embed"].sharding.spec))
        told_gathered.append(kwargs["sharding"].gathered_weights)
        return generate(cfg, params, *args, **kwargs)

    def recording_optimize(run, batch):
        embed = run.state["params"]["embed"]
        copies_in_update.append(sum(x.shape == embed.shape and x.dtype == jnp.bfloat16 for x in jax.live_arrays()))
        return optimize(run, batch)

    monkeypatch.setattr(rollout_source, "generate", recording_generate)
    monkeypatch.setattr(evaluate, "generate", recording_generate)
    monkeypatch.setattr(loop.GRPORun, "_optimize", recording_optimize)
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=1, eval_every=1, checkpoint_every=1)
    options = ["mesh.fsdp=2", "mesh.tensor=2", "rollout.dtype=bfloat16"]
    for gather in ("false", "true"):
        assert (
            train_cli("--config", config, "--run-dir", tmp_path / gather, *options, f"rollout.gather_weights={gather}")
            == 0
        )
    # embed [vocab, embed] is split over fsdp in the master weights, not in the copy; validation
    # at steps 0 and 1 and the rollouts of step 1 each read it
    assert read_fsdp_sharded == [True] * 3 + [False] * 3
    assert told_gathered == [False] * 3 + [True] * 3  # the rollouts' Sharding says so (projection kernels)
    assert copies_in_update == [0, 0]
    sharded, gathered = (without_machine_keys(read_metrics(tmp_path / gather)) for gather in ("false", "true"))
    assert [r["step"] for r in gathered] == [0, 1] and [set(r) for r in gathered] == [set(r) for r in sharded]
    for want, got in zip(sharded, gathered):
        for key in want:  # null (an unreached draft position) reads as nan on both sides
            np.testing.assert_allclose(
                np.asarray(got[key], float), np.asarray(want[key], float), rtol=1e-5, atol=1e-6, err_msg=key
            )


def test_one_update_runs_at_a_time_and_the_run_holds_its_arrays_in_its_state(tiny_policy, tmp_path, update_calls):
    """Each minibatch update is dispatched only once the one before it is done (one update's float32
    gradients live at a time), and after start-up
    the run keeps no device array outside its state (it kept the initial head, 1.6 GB on an 8B policy)."""
    import jaxspec.rl.loop as loop
    from jaxspec.config_io import load_config
    from jaxspec.rl.config import GRPOConfig
    from jaxspec.rl.resources import check_inputs

    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=1, eval_every=0, checkpoint_every=1)
    cfg = load_config(GRPOConfig, config, ["loss.minibatches=4", "loss.filter_groups=false"])
    earlier = jax.live_arrays()  # the fixtures' (held here, so no new array takes their ids)
    run = loop.GRPORun(cfg, tmp_path / "run", False, check_inputs(cfg))
    kept = {id(x) for x in [*earlier, *jax.tree.leaves(run.state)]}
    outside = [(x.shape, x.dtype) for x in jax.live_arrays() if id(x) not in kept and x.size > 1]
    assert not outside, outside
    run.run_step()
    waiting = [c["unfinished_params"] for c in update_calls]
    assert len(waiting) == 4 * cfg.loss.ppo_epochs and not any(waiting), waiting


def test_updates_on_a_mesh_hold_one_policy_and_its_moments(tiny_policy, tmp_path, update_calls):
    """On an fsdp mesh the optimizer step returns the state sharded as P('fsdp',) where it came in as
    P('fsdp', None): the loop keeps it on the input's sharding without a copy, and nothing holds the
    step's outputs beside it (a copy held beside them ran Qwen3-8B on 2 x 80 GB out of memory)."""
    config = write_config(tmp_path / "run.yaml", tiny_policy[0], steps=1, eval_every=0, checkpoint_every=1)
    assert (
        train_cli(
            "--config",
            config,
            "--run-dir",
            tmp_path / "run",
            "loss.minibatches=4",
            "loss.filter_groups=false",
            "mesh.fsdp=2",
        )
        == 0
    )
    copies = [c["policy_copies"] for c in update_calls]
    assert len(copies) > 1 and copies[0] > 0, copies
    assert max(copies) == pytest.approx(copies[0]), copies  # as many as the first update, before any pin
