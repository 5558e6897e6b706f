"""`jaxspec bench grpo-step`: time and peak memory of each phase of one GRPO step on a mesh.

The policy is an HF folder (`--policy`) or random weights in the shape of `--model` (an HF
config.json, as `bench decode`); the EAGLE-3 head is `--draft` (a public-layout folder) or a random
one (`init_eagle3`). The policy's float32 master copy is sharded over the mesh
(`--mesh data,fsdp,tensor`) by the model's rules, as `jaxspec train` holds it; rollouts read its
`--rollout-dtype` cast, sharded like it or, with `--gather-weights` (rollout.gather_weights), gathered
over the batch axes once before the phase (whole on every device but for the tensor split; made
per phase, freed before the next). AdamW's first moment is `--state-dtype` (optim.state_dtype). The
phases run the library's own functions, next to the whole training state (the policy, AdamW's
moments, the head and, with update_draft, its optimizer state), which is made before the first
phase and kept through all of them, as `jaxspec train` holds it:

  generate_ar / generate_spec  `jaxspec.rollout.generate` (autoregressive; EAGLE-3 chain with k =
      `--k`) of `--batch` random prompts of `--prompt` tokens, `--new` tokens each (temperature 1,
      no eos: every row decodes `--new` tokens), `--sub-batch` rows per call so the KV cache fits.
  logprobs  `jaxspec.rl.step.score_fn` over the rollouts packed (`jaxspec.rl.batch.pack_rows`) in
      `--minibatches` chunks. Without generate_ar in --phases it reads random tokens of the same
      shape instead (every row `--new` tokens long, as generate_ar's rollouts are), so the training
      phases can be measured without generating.
  update / update_draft  `jaxspec.rl.step.update_fn` over the same minibatches, without and with
      the online EAGLE-3 loss, each continuing from the optimizer state before it.
  checkpoint  `jaxspec.run.Checkpointer` (orbax) of the training state (the policy and its optimizer
      state; the head and its optimizer state with update_draft) to a temporary folder.
The log-prob and update times include packing each minibatch on the host, as the training loop does.

Each phase runs once untimed first (compilation), then is timed over the whole batch. Memory is
`peak_bytes_in_use` of every local device after the phase: the peak since the process started
(a high-water mark, so the first phase that needs more raises it), and `bytes_in_use` when the
phase starts (in_use_gb_before: what it runs next to, also on a phase that runs out of memory) with
the largest free block of the allocator's pool then (largest_free_gb_before: what one allocation
can get; less than the free memory when the pool is fragmented; None under `cuda_async`);
None where the device reports no statistics (CPU). The log-prob and update programs are compiled
ahead of their first call, so each row also gives XLA's memory plan per device (xla_plan_gb:
arguments, outputs, outputs aliased to donated arguments, temporaries; for an update, of each of its
programs: `gradients`, `optimizer_step` and, with the draft, `draft_step`), also when the call then runs
out of memory.

PROJECTION (computed, not measured): the speculative generation at acceptance length tau costs
(new / tau) verification steps at the measured cost of one (the generate_spec time / its steps,
which holds the k draft steps and the verification forward), against the measured autoregressive
decode; the projected GRPO step adds the measured log-prob pass and update with the draft loss.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.timing import (
    device_description,
    gigabytes,
    largest_free_block,
    memory_stat,
    out_of_memory,
    print_table,
    write_results,
)
from jaxspec.draft import init_eagle3, load_eagle3
from jaxspec.models import ModelConfig, cache_bytes, init_params, load_hf, save_hf
from jaxspec.models.sharding import shard_params
from jaxspec.rl.batch import pack_rows, training_rows
from jaxspec.rl.config import GRPOLossConfig, OnlineDraftConfig, PolicyOptimConfig
from jaxspec.rl.loss import loss_denominator
from jaxspec.rl.online_draft import OnlineDraft, OnlineDraftState
from jaxspec.rl.step import policy_optimizer, score_fn, update_fn
from jaxspec.rollout import Sampling, Spec, generate
from jaxspec.run import Checkpointer
from jaxspec.run.placement import MeshConfig, Placement, cast_floats, check_devices, rollout_policy

PROJECTED_ACCEPTANCE = (2.5, 3.0, 3.3)  # measured on `small` (~2.9) and the EAGLE-3 paper's range
PHASES = ("generate_ar", "generate_spec", "logprobs", "update", "update_draft", "checkpoint")
# the phase whose results a phase reads: their log-probs, an optimizer state
NEEDS = {"update": ("logprobs",), "update_draft": ("logprobs",), "checkpoint": ("update", "update_draft")}


def check_phases(phases: list[str]) -> None:
    """ValueError naming a phase in --phases without a phase it reads (NEEDS: one of them)."""
    for phase in phases:
        if phase in NEEDS and not set(NEEDS[phase]) & set(phases):
            raise ValueError(f"--phases: {phase} reads the results of {' or '.join(NEEDS[phase])}; add it")


def mesh_config(text: str) -> MeshConfig:
    try:
        data, fsdp, tensor = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--mesh {text!r}: expected three integers data,fsdp,tensor, e.g. 1,2,1") from None
    return MeshConfig(data, fsdp, tensor)


def write_random_policy(model_json: str, folder: Path, dtype: str = "bfloat16", seed: int = 0) -> None:
    """An HF folder (config.json + safetensors) of random weights in the shape of `model_json`."""
    cfg = ModelConfig.from_json(model_json)
    save_hf(cfg, init_params(cfg, jax.random.key(seed), jnp.dtype(dtype)), folder, dtype=dtype)


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


def projection(phases: dict, new: int, taus: list[float]) -> list[dict]:
    """Projected speculative generation and GRPO step at acceptance lengths `taus` (see module doc)."""
    ar, spec = phases["generate_ar"], phases["generate_spec"]
    rest = phases["logprobs"]["seconds"] + phases["update_draft"]["seconds"]
    ar_step = ar["seconds"] + rest
    rows = []
    for tau in taus:
        generation = phases["sub_batches"] * (new / tau) * spec["ms_per_loop_step"] / 1e3
        rows.append(
            {
                "projection": f"tau={tau}",
                "generate_s": generation,
                "step_s": generation + rest,
                "ar_step_s": ar_step,
                "speedup": ar_step / (generation + rest),
                "generation_speedup": ar["seconds"] / generation,
            }
        )
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxspec bench grpo-step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--policy", help="HF folder of the policy (default: random weights of --model)")
    source.add_argument("--model", default="configs/models/qwen3-8b.json")
    p.add_argument("--draft", help="EAGLE-3 folder in the public layout (default: a random head)")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--mesh", default="1,1,1", help="data,fsdp,tensor")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--sub-batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--minibatches", type=int, default=8)
    p.add_argument(
        "--ttt-steps",
        type=int,
        default=OnlineDraftConfig.ttt_steps,
        help="unrolled steps of the online draft loss (draft.ttt_steps)",
    )
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--rollout-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--gather-weights",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="rollouts read the policy gathered over the batch axes (rollout.gather_weights)",
    )
    p.add_argument(
        "--state-dtype",
        choices=["float32", "bfloat16"],
        default=PolicyOptimConfig.state_dtype,
        help="dtype of AdamW's first moment (optim.state_dtype)",
    )
    p.add_argument("--acceptance", type=float, default=None, help="a measured acceptance length to project too")
    p.add_argument(
        "--write-policy",
        metavar="DIR",
        help="only write random bfloat16 weights in the shape of --model as an HF folder, then exit",
    )
    p.add_argument(
        "--phases",
        nargs="+",
        choices=PHASES,
        default=list(PHASES),
        help="the phases to run, in the usual order (default: all)",
    )
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.write_policy:
        write_random_policy(args.model, Path(args.write_policy))
        print(f"random {args.model} policy written to {args.write_policy}")
        return 0
    check_phases(args.phases)
    for name in ("sub_batch", "minibatches"):
        if args.batch % getattr(args, name):
            raise ValueError(
                f"--batch {args.batch} is not a multiple of --{name.replace('_', '-')} {getattr(args, name)}"
            )

    bench = Bench(args)
    cfg = bench.cfg
    print(
        f"{device_description()}: {len(jax.local_devices())} local devices, mesh {args.mesh}; policy "
        f"{cfg.num_params() / 1e9:.2f}B params; {args.batch} rollouts of {args.prompt} + {args.new} tokens in "
        f"sub-batches of {args.sub_batch}; rollout weights {'gathered' if args.gather_weights else 'sharded'}, "
        f"AdamW mu in {args.state_dtype}"
    )
    phases: dict = {"sub_batches": args.batch // args.sub_batch}
    rows = []
    for name, run in (
        ("generate_ar", lambda: bench.generation(spec=False)),
        ("generate_spec", lambda: bench.generation(spec=True)),
        ("logprobs", bench.logprobs),
        ("update", lambda: bench.update(False)),
        ("update_draft", lambda: bench.update(True)),
        ("checkpoint", bench.checkpoint),
    ):
        if name not in args.phases:
            continue
        before = {
            "in_use_gb_before": gigabytes(memory_stat("bytes_in_use")),  # what the phase starts next to
            "largest_free_gb_before": gigabytes(largest_free_block()),
        }
        try:
            phases[name] = run()
        except jax.errors.JaxRuntimeError as err:
            # a phase that does not fit ends the benchmark; what ran before it is still reported
            rows.append(
                {"phase": name, **before, "xla_plan_gb": bench.xla_plans.get(name), "error": out_of_memory(err)}
            )
            print(f"{name}: {rows[-1]['error']}")
            break
        row = {
            "phase": name,
            **phases[name],
            **before,
            "peak_gb_per_device": gigabytes(memory_stat("peak_bytes_in_use")),
            "xla_plan_gb": bench.xla_plans.get(name),
        }
        rows.append(row)
        print_table([row], list(row))
    kv = cache_bytes(cfg, args.sub_batch, args.prompt + args.new, jnp.dtype(args.rollout_dtype))
    taus = list(PROJECTED_ACCEPTANCE) + ([args.acceptance] if args.acceptance else [])
    measured = all(name in phases for name in ("generate_ar", "generate_spec", "logprobs", "update_draft"))
    projected = projection(phases, args.new, taus) if measured else []
    print(
        f"\nKV cache per sub-batch of {args.sub_batch} rows x {args.prompt + args.new} slots: {kv / 1e9:.2f} GB "
        f"(all devices together)"
    )
    print_table(
        rows,
        [
            "phase",
            "seconds",
            "first_call_s",
            "acceptance_length",
            "ms_per_loop_step",
            "in_use_gb_before",
            "largest_free_gb_before",
            "peak_gb_per_device",
            "xla_plan_gb",
            "error",
        ],
    )
    if projected:
        print("\nPROJECTION (computed from the measured costs above, not measured):")
        print_table(projected, ["projection", "generate_s", "step_s", "ar_step_s", "speedup", "generation_speedup"])
    write_results(
        args.out,
        "grpo_step",
        rows + projected,
        {
            "model": args.policy or args.model,
            "mesh": args.mesh,
            "batch": args.batch,
            "sub_batch": args.sub_batch,
            "prompt": args.prompt,
            "new": args.new,
            "k": args.k,
            "gather_weights": args.gather_weights,
            "state_dtype": args.state_dtype,
            "kv_cache_bytes_per_sub_batch": kv,
            "params": cfg.num_params(),
            "projection": "generate = sub_batches * (new / tau) * measured ms per speculative step",
        },
    )
    return 0
