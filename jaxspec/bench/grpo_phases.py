"""The phases `jaxspec bench grpo-step` times, run by the library's own functions next to the whole
training state (`Bench`), and XLA's memory plan of a compiled phase (`memory_plan`).

The phases, their inputs and what each measures: `jaxspec.bench.grpo_step`'s module doc.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.draft import init_eagle3, load_eagle3
from jaxspec.models import ModelConfig, init_params, load_hf
from jaxspec.models.sharding import shard_params
from jaxspec.rl.batch import pack_rows, training_rows
from jaxspec.rl.config import GRPOLossConfig, OnlineDraftConfig, PolicyOptimConfig
from jaxspec.rl.loss import loss_denominator
from jaxspec.rl.online_draft import OnlineDraft, OnlineDraftState
from jaxspec.rl.step import policy_optimizer, score_fn, update_fn
from jaxspec.rollout import Sampling, Spec, generate
from jaxspec.run import Checkpointer
from jaxspec.run.placement import MeshConfig, Placement, cast_floats, check_devices, rollout_policy


def mesh_config(text: str) -> MeshConfig:
    try:
        data, fsdp, tensor = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--mesh {text!r}: expected three integers data,fsdp,tensor, e.g. 1,2,1") from None
    return MeshConfig(data, fsdp, tensor)


def compile_once(jitted, *args):
    """(`jitted` compiled for `args`, its `memory_plan`). Every later call must have the shapes and
    layouts of `args` (the phases keep them)."""
    exe = jitted.lower(*args).compile()
    return exe, memory_plan(exe)


def memory_plan(exe) -> dict | None:
    """XLA's memory plan of one device of a compiled program, in GB: the arguments, the outputs,
    the part of the outputs that reuses donated arguments, and the temporaries (one allocation)."""
    stats = exe.memory_analysis()
    fields = (("arguments", "argument"), ("outputs", "output"), ("aliased", "alias"), ("temporaries", "temp"))
    return (
        None
        if stats is None
        else {name: round(getattr(stats, f"{field}_size_in_bytes") / 1e9, 6) for name, field in fields}
    )


def _timed(fn, *args):
    """(result, seconds) of fn(*args), waiting for every output array."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


class Bench:
    """The phases of one GRPO step (`jaxspec.bench.grpo_step`'s module doc), each a method that
    returns its row's measurements, next to the whole training state made here from the command's
    parsed arguments."""

    def __init__(self, args):
        self.args = args
        mesh = mesh_config(args.mesh)
        check_devices(mesh)
        self.placement = Placement(mesh)
        self.sharding = self.placement.sharding
        if args.policy:
            self.cfg, params = load_hf(args.policy, dtype="float32", sharding=self.sharding)
        else:
            self.cfg = ModelConfig.from_json(args.model)
            # drawn on the host, so no device holds the whole float32 policy before it is sharded
            with jax.default_device(jax.local_devices(backend="cpu")[0]):
                params = init_params(self.cfg, jax.random.key(0), jnp.float32)
            params = params if self.sharding is None else shard_params(self.sharding, params)
        self.params = self.placement.state(params)
        if args.draft:
            self.dcfg, dparams = load_eagle3(args.draft, policy=self.cfg)
        else:
            self.dcfg, dparams = init_eagle3(self.cfg, jax.random.key(1), min(args.draft_vocab, self.cfg.vocab_size))
        self.dparams = self.placement.state(dparams)
        # The rest of the training state, made up front and kept through every phase as `jaxspec
        # train` holds it: AdamW's moments (scalars replicated) and, for update_draft, the online
        # head's optimizer state. So each phase runs next to what it runs next to in training, and
        # the update allocates on the layout the training loop leaves (its state made first).
        self.optim = PolicyOptimConfig(state_dtype=args.state_dtype)
        self.opt_state = self.placement.state(policy_optimizer(self.optim).init(self.params))
        self.online = OnlineDraft(self.dcfg, OnlineDraftConfig(online=True, ttt_steps=args.ttt_steps))
        self.head = None
        if "update_draft" in args.phases:
            head = OnlineDraftState.init(self.online, self.dparams)
            self.head = head.with_update(head.weights, self.placement.state(head.opt_state))
        self.sampling = Sampling(temperature=1.0, max_new_tokens=args.new, eos_id=())
        rng = np.random.default_rng(0)
        self.prompts = rng.integers(0, self.cfg.vocab_size, (args.batch, args.prompt)).tolist()
        self.loss = GRPOLossConfig()
        self.rows: dict | None = None
        self.xla_plans: dict[str, dict | None] = {}  # phase -> compile_once's memory plan

    def rollout_params(self):
        """(policy, head params) as the rollout reads them: cast to --rollout-dtype; the policy
        gathered over the batch axes with --gather-weights (as `GRPORun.rollout_weights`)."""
        dtype = jnp.dtype(self.args.rollout_dtype)
        return (
            rollout_policy(self.params, dtype, self.sharding, self.args.gather_weights),
            cast_floats(self.dparams, dtype),
        )

    def generation(self, spec: bool) -> dict:
        """Every sub-batch once; the first also once before (compilation)."""
        a = self.args
        params, dparams = self.rollout_params()
        spec_cfg = Spec(method="eagle3", draft=(self.dcfg, dparams), num_draft_tokens=a.k) if spec else None

        def run(i):
            rows = self.prompts[i * a.sub_batch : (i + 1) * a.sub_batch]
            return generate(
                self.cfg,
                params,
                rows,
                jax.random.key(i),
                self.sampling,
                spec_cfg,
                sharding=self.sharding,
                prompt_width=a.prompt,
            )

        _, compile_s = _timed(lambda: run(0).tokens)
        seconds, steps, accepted, outs = 0.0, 0, [], []
        for i in range(a.batch // a.sub_batch):
            start = time.perf_counter()
            out = run(i)
            jax.block_until_ready(out.tokens)
            seconds += time.perf_counter() - start
            steps += out.stats["steps"]
            accepted.append(out.stats["acceptance_length"])
            outs.append((np.asarray(out.tokens), np.asarray(out.lengths)))
        if not spec:
            tokens, lengths = (np.concatenate(x) for x in zip(*outs))
            self.rows = training_rows(self.prompts, tokens, lengths, pad_id=0)
        return {
            "seconds": seconds,
            "first_call_s": compile_s,
            "loop_steps": steps,
            "ms_per_loop_step": 1e3 * seconds / max(steps, 1),
            "acceptance_length": float(np.mean(accepted)),
        }

    def random_rollouts(self) -> None:
        """Rows of random response tokens, each `--new` long: what generate_ar leaves (no eos)."""
        a = self.args
        tokens = np.random.default_rng(2).integers(0, self.cfg.vocab_size, (a.batch, a.new))
        self.rows = training_rows(self.prompts, tokens, np.full(a.batch, a.new), pad_id=0)

    def minibatches(self, with_draft: bool = False):
        if self.rows is None:
            self.random_rollouts()
        a, rows = self.args, self.rows
        per = a.batch // a.minibatches
        for i in range(a.minibatches):
            mb = rows.take(np.arange(i * per, (i + 1) * per))
            yield mb if with_draft else mb.replace(seq_resp_mask=None)

    def logprobs(self) -> dict:
        a = self.args
        score = score_fn(self.cfg, self.sampling, a.compute_dtype, a.remat, self.sharding)

        def args(mb):
            packed = self.placement.rows(pack_rows(mb.response_rows(), self.placement.row_shards))
            return self.params, packed.tokens, packed.segment_ids, packed.resp_index, packed.resp_tokens

        def first(mb):
            nonlocal score
            call = args(mb)
            score, self.xla_plans["logprobs"] = compile_once(score, *call)
            return score(*call)

        run = lambda mb: score(*args(mb))  # noqa: E731
        _, compile_s = _timed(first, next(self.minibatches()))
        seconds, old = 0.0, []
        for mb in self.minibatches():
            out, s = _timed(run, mb)
            seconds += s
            old.append(np.asarray(out))
        rng = np.random.default_rng(1)
        denominator = loss_denominator(self.rows.resp_mask, self.loss.aggregation, a.minibatches)
        self.rows = self.rows.replace(
            prox_logp=np.concatenate(old),
            loss_mask=self.rows.resp_mask,
            advantages=rng.standard_normal(a.batch).astype(np.float32),
            loss_denominator=np.full(a.batch, denominator, np.float32),
        )
        return {"seconds": seconds, "first_call_s": compile_s}

    def update(self, with_draft: bool) -> dict:
        """Every minibatch once (the first also once before: compilation), from the optimizer state
        the previous update phase left."""
        a = self.args
        draft = self.online if with_draft else None
        update = update_fn(
            self.cfg, self.sampling, self.loss, self.optim, a.compute_dtype, a.remat, draft, self.sharding
        )
        opt_state, self.opt_state = self.opt_state, None  # donated: only the phase holds it
        weights, buffers, d_opt = self.head.update_args() if with_draft else (None, None, None)
        phase = "update_draft" if with_draft else "update"

        def run(mb, compile_first=False):
            nonlocal opt_state, weights, d_opt, update
            packed = self.placement.rows(pack_rows(mb, self.placement.row_shards))
            before = (self.params, opt_state, weights, d_opt)
            if compile_first:  # the plan is known before the first call can run out of memory
                update = update.compile(*before[:3], buffers, d_opt, packed)
                self.xla_plans[phase] = {name: memory_plan(program) for name, program in update.programs().items()}
            *after, metrics = update(
                self.params, opt_state, weights, buffers, d_opt, packed, policy_steps=bool(mb.loss_mask.any())
            )
            # on the input layout, as the training loop keeps it: every call runs the one compilation
            self.params, opt_state, weights, d_opt = self.placement.pin(tuple(after), before)
            return metrics

        _, compile_s = _timed(run, next(self.minibatches(with_draft)), True)
        seconds = sum(_timed(run, mb)[1] for mb in self.minibatches(with_draft))
        if with_draft:
            self.head = self.head.with_update(weights, d_opt)
            self.dparams = self.head.params
        self.opt_state = opt_state
        return {"seconds": seconds, "first_call_s": compile_s}

    def checkpoint(self) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            checkpointer = Checkpointer(Path(tmp) / "checkpoints", keep=1)
            start = time.perf_counter()
            head = self.head.checkpoint_entries() if self.head is not None else {}
            checkpointer.save({"params": self.params, "opt_state": self.opt_state, **head, "step": jnp.int32(1)})
            checkpointer.close()
            return {"seconds": time.perf_counter() - start, "first_call_s": None}
