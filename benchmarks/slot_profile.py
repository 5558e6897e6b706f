"""The slot engine's decode step against the staged engine's, on random weights, with each one's kernels.

    python3 benchmarks/slot_profile.py WORK_DIR [--model JSON] [--rows 256] [--new 512] [--slots 256]
        [--kv-pages N] [--decode-steps K ...] [--spec K [--adaptive [--no-fixed] [--probe FIRST MAX]]]
        [--engines staged slots] [--staged-calls N] [--temperature T] [--lengths CONFIG] [--warmup-new N]
        [--mesh D F T] [--trace] [--copies]

Random weights of --model (default `configs/models/small-policy.json`; bf16, normal(0, 0.02): the
next token is near uniform, so each row ends at the eos with probability ~1/vocab per token and
lengths are geometric, capped at --new), --rows rows in groups of 8 that share a prompt of 60 random
tokens (a GRPO group; fewer rows: one group), T=1 (--temperature 0: greedy, so that a speculative
run emits the AR run's tokens, ends each row where it does and the two runs' times compare equal
work; at T=1 the rows' lengths are a draw of their own in each run, and at 64 rows the token counts
of two draws differ by several percent). --lengths CONFIG stops each row at a length drawn from the
workload's law instead: the response length in tokens of one of the first --rows problems of a
pretraining config's data (e.g. configs/pretrain_long.yaml, under its BPE;
`jaxspec.data_cli.response_lengths`), capped at --new, passed as `row_max_new_tokens` (random
weights reach their eos only by chance). --staged-calls N runs the staged engine's rows as N calls
of rows / N, one after another, in the memory of rows / N dense rows (a GRPO step's
`rollout.sub_batch`), and gives the slot engine those rows' bytes as its pool unless --kv-pages:
ceil((60 + --new) / 16) pages of 16 positions each, a prompt and its longest answer per dense row
(the staged cache pads the prompt further). --mesh D F T runs on a data x fsdp x tensor mesh of the
devices (the rows over data x fsdp, the KV heads over tensor). Both engines generate the same
prompts with the same key (compiled and warmed up first: by a whole call, or with --warmup-new N by
one whose rows stop after at most N tokens, row i of R after ceil((i + 1) N / R) so that the
occupancy falls through every step width and stage, which compiles the same programs and runs
their branches; the compilations
during the timed call are counted, and any make the run an error row, as does a branch it runs that
the warm-up did not, a draft depth or a step width, whose first execution loads its kernels), the
slot engine once per --decode-steps (decode steps between two rounds of scheduling; default: the
engine's); printed per run: generation time, decode steps, ms per decode step, the KV bytes its decode
steps read (`kv_read_gb`: the same for both engines on the same rows, a floor on their time at the
card's read rate, `kv_read_bytes`) and the steps at each
batch width (`stage_rows` / `stage_steps`: the staged loop's stages, the slot loop's step widths)
and the devices' peak memory so far. With --spec K both engines also run EAGLE-3 chains of depth K
drafted by a random head of the policy's shape (its drafts are rejected, so rows emit one token per
step as in the AR runs and the per-step figures compare a speculative step's cost with a decode
step's at the same occupancy); --adaptive adds the same chains at adaptive depth (`spec.adaptive`:
they fall back to autoregressive iterations, so their steps against the AR steps give speculation's
floor; --no-fixed leaves the fixed-depth chains out, which saves their compilation; --probe FIRST
MAX sets its probe runs). --engines picks the engines (default both). With --trace a third call runs
under `jax.profiler` and the kernels of the loop programs are charged from the trace
(`jaxspec.bench.kernel_trace`): total kernel time and launches per iteration (their difference from
the wall time is the device's idle time), the 22 longest kernels, the time by jax scope and, for a
speculative step, by its phase (`PHASES`: the named scopes of `jaxspec.rollout.speculative.step`),
the 40 longest kernels outside the policy's forward (the loop's bookkeeping, sampling, the drafter),
and the device's idle time between the loop's kernels with the 30 longest gaps by the pair of
kernels around them (`idle_gaps`, on a GPU: where the host holds the loop up). --trace turns XLA's
command buffers (CUDA graphs) off for the whole run, timings included. --copies lists the copies of
256 KiB or more inside each loop program's loops and branches, read from XLA's optimized HLO
(`jaxspec.bench.hlo_copies`: a KV cache copied there is copied at every iteration that reaches it),
each with the op_name of the `cond`, `switch` or loop that runs it (its jax scope path). WORK_DIR
gets slot_profile.json, rewritten after each run; the HLO dump and the traces (hundreds of MB) are
deleted once charged unless --keep-traces. XLA_FLAGS set outside reach every run."""

import argparse
import collections
import itertools
import json
import os
import shutil
import time
import types
from pathlib import Path

import numpy as np

from jaxspec.bench.hlo_copies import callers, loop_copies
from jaxspec.bench.kernel_trace import idle_gaps, kernel_times, op_scopes, set_dump_flags

PHASES = ("propose", "verify_forward", "verify", "draft_update", "commit")  # speculative_step's scopes
FORWARD_SCOPES = {"forward", "verify_forward"}  # the policy forward's scope in the AR and speculative steps
PROMPT_TOKENS = 60  # each group's random prompt


def kv_read_bytes(lengths, prompt_tokens: int, bytes_per_position: int) -> int:
    """The KV bytes the decode steps of rows of `lengths` emitted tokens read: the step that writes a
    row's token i (i >= 1; the first comes from the prefill) attends over its prompt_tokens + i
    positions, whatever the engine, so both engines' runs of the same rows read the same bytes (a
    floor on their time at the card's read rate)."""
    emitted = np.asarray(lengths, np.int64)
    steps = np.maximum(emitted - 1, 0)
    return int(((steps * prompt_tokens + steps * (steps + 1) // 2) * bytes_per_position).sum())


def warmup_lengths(limits: list[int], most: int) -> list[int]:
    """The warm-up call's row limits: row i of R stops after at most ceil((i + 1) most / R) tokens (a
    ladder: the occupancy falls through every step width and stage, whose first runs load their
    kernels, as the timed call's does) and never past its own limit."""
    rows = len(limits)
    return [min(limit, -(-(i + 1) * most // rows)) for i, limit in enumerate(limits)]


def phase_of(op_name: str) -> str:
    """The speculative step's phase a kernel ran in (its innermost `PHASES` scope), else its
    first four scopes (e.g. the slot loop's scheduling)."""
    parts = op_name.split("/")
    for part in reversed(parts):
        if part in PHASES:
            return part
    return "/".join(parts[:4])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work", type=Path)
    p.add_argument("--model", default="configs/models/small-policy.json", help="the policy's shape (a config.json)")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--kv-pages", type=int, default=None, help="the slot engine's page pool (default: no preemption)")
    p.add_argument("--decode-steps", type=int, nargs="+", default=[None], help="the slot engine's, one run each")
    p.add_argument("--spec", type=int, default=None, metavar="K", help="also EAGLE-3 chains of depth K (random head)")
    p.add_argument("--adaptive", action="store_true", help="with --spec: also the chains at adaptive depth")
    p.add_argument("--no-fixed", action="store_true", help="with --adaptive: not the chains at fixed depth")
    p.add_argument(
        "--probe",
        type=int,
        nargs=2,
        default=None,
        metavar=("FIRST", "MAX"),
        help="with --adaptive: spec.adaptive_probe and adaptive_probe_max (default: Spec's)",
    )
    p.add_argument("--engines", nargs="+", choices=["staged", "slots"], default=["staged", "slots"])
    p.add_argument("--staged-calls", type=int, default=1, metavar="N", help="the staged engine's rows in N calls")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lengths", default=None, metavar="CONFIG", help="rows stop at lengths of this config's workload")
    p.add_argument(
        "--warmup-new",
        type=int,
        default=None,
        metavar="N",
        help="the warm-up's row i of R stops after at most ceil((i + 1) N / R) tokens (default: the timed call's)",
    )
    p.add_argument("--mesh", type=int, nargs=3, default=None, metavar=("DATA", "FSDP", "TENSOR"))
    p.add_argument("--trace", action="store_true")
    p.add_argument("--keep-traces", action="store_true", help="keep the HLO dump and the traces in WORK_DIR")
    p.add_argument("--copies", action="store_true", help="list the copies (>= 256 KiB) inside the loop programs")
    args = p.parse_args()
    if args.adaptive and not args.spec:
        p.error("--adaptive needs --spec K")
    if args.no_fixed and not args.adaptive:
        p.error("--no-fixed needs --adaptive")
    if args.probe and not args.adaptive:
        p.error("--probe needs --adaptive")
    group = min(8, args.rows)  # rows of one prompt
    if args.rows % group:
        p.error(f"--rows must be below 8 or a multiple of 8, got {args.rows}")
    if args.staged_calls < 1 or args.rows % (group * args.staged_calls):
        p.error(f"--rows ({args.rows}) must split into --staged-calls ({args.staged_calls}) calls of groups of 8")
    if args.warmup_new is not None and not 1 <= args.warmup_new <= args.new:
        p.error(f"--warmup-new must be in [1, --new={args.new}], got {args.warmup_new}")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.trace:  # (turns XLA's command buffers off, so that each kernel is traced under its own name)
        set_dump_flags(args.work / "hlo", ".*(_decode|_loop|prefill).*", "slot_profile")
    elif args.copies:
        dump = f"--xla_dump_to={args.work / 'hlo'} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*(_decode|_loop).*"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {dump}".strip()
    import jax
    import jax.numpy as jnp

    from jaxspec.draft import init_eagle3
    from jaxspec.models import ModelConfig, Sharding, make_mesh, shard_params
    from jaxspec.models.kv_cache import cache_bytes
    from jaxspec.models.params import init_params
    from jaxspec.rl.metrics import PhaseTimer
    from jaxspec.rollout import Sampling, Spec, generate
    from jaxspec.rollout.page_pool import pages_for
    from jaxspec.rollout.slot_layout import DEFAULT_PAGE_SIZE

    cfg = ModelConfig.from_json(args.model)
    params = init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
    kv_position_bytes = cache_bytes(cfg, 1, 1, params["embed"].dtype)  # generate's cache is in the params' dtype
    sharding = None if args.mesh is None else Sharding(make_mesh(*args.mesh))
    if sharding is not None:
        params = shard_params(sharding, params)
    rng = np.random.default_rng(0)
    distinct = [[int(t) for t in rng.integers(3, cfg.vocab_size, PROMPT_TOKENS)] for _ in range(args.rows // group)]
    prompts = [prompt for prompt in distinct for _ in range(group)]
    sampling = Sampling(temperature=args.temperature, max_new_tokens=args.new, eos_id=cfg.eos_token_id)
    limits = None if args.lengths is None else workload_lengths(args.lengths, args.rows, args.new)
    if limits is not None:
        print(f"row limits from {args.lengths}: median {int(np.median(limits))}, max {max(limits)}, sum {sum(limits)}")
    warmup_limits = (
        None if args.warmup_new is None else warmup_lengths(limits or [args.new] * args.rows, args.warmup_new)
    )
    kv_pages = args.kv_pages
    if kv_pages is None and args.staged_calls > 1:
        kv_pages = args.rows // args.staged_calls * pages_for(PROMPT_TOKENS + args.new, DEFAULT_PAGE_SIZE)
        print(f"slot pool: {kv_pages} pages of {DEFAULT_PAGE_SIZE} positions (the staged calls' rows)")
    result = {}
    engines = [("staged", None, None)] if "staged" in args.engines else []
    if "slots" in args.engines:
        engines += [(f"slots K={k or 'default'}", args.slots, k) for k in args.decode_steps]
    specs = [("", None)]
    if args.spec:
        head = init_eagle3(cfg, jax.random.key(2), dtype=jnp.bfloat16)
        if not args.no_fixed:
            specs.append((f" eagle3 k={args.spec}", Spec("eagle3", head, num_draft_tokens=args.spec)))
        if args.adaptive:
            probes = {} if args.probe is None else dict(adaptive_probe=args.probe[0], adaptive_probe_max=args.probe[1])
            adaptive = Spec("eagle3", head, num_draft_tokens=args.spec, adaptive=True, **probes)
            specs.append((f" eagle3 k={args.spec} adaptive", adaptive))
    for (engine, slots, decode_steps), (method, spec) in itertools.product(engines, specs):
        label = engine + method

        def run(row_limits=limits):
            calls = 1 if slots else args.staged_calls
            size = args.rows // calls
            outs = [
                generate(
                    cfg,
                    params,
                    prompts[i * size : (i + 1) * size],
                    jax.random.fold_in(jax.random.key(1), i) if calls > 1 else jax.random.key(1),
                    sampling,
                    spec=spec,
                    slots=slots,
                    decode_steps=decode_steps,
                    kv_pages=kv_pages if slots else None,
                    sharding=sharding,
                    row_max_new_tokens=None if row_limits is None else row_limits[i * size : (i + 1) * size],
                )
                for i in range(calls)
            ]
            return one_after_another(jax.block_until_ready(outs))

        warm = run(warmup_limits or limits)  # the rows' limits are data: a shorter warm-up compiles the same programs
        timer = PhaseTimer()
        start = time.perf_counter()
        out = run()
        seconds = time.perf_counter() - start
        loaded = timer.record()
        compiles = loaded["compiles"] + loaded["compiles_cached"]  # a persistent-cache read takes time too
        steps = int(out.stats["steps"])
        row = result[label] = {
            "seconds": seconds,
            "steps": steps,
            "step_ms": 1e3 * seconds / steps,
            "tokens": int(np.asarray(out.lengths).sum()),
            "kv_read_gb": kv_read_bytes(out.lengths, PROMPT_TOKENS, kv_position_bytes) / 1e9,
            # a slot loop's step widths (a speculative one's `stage_rows` are its occupancy sizes)
            "stage_rows": list(out.stats.get("step_widths", out.stats["stage_rows"])),
            "stage_steps": [int(n) for n in out.stats.get("width_steps", out.stats["stage_steps"])],
            "depth_steps": None if spec is None else [int(n) for n in out.stats["depth_steps"]],
            "preemptions": int(out.stats.get("preemptions", 0)),
            "prefill_chunks": None if slots is None else int(out.stats["prefill_chunks"]),
            "loop_iterations": None if slots is None else int(out.stats["loop_iterations"]),
            "peak_kv_pages": None if slots is None else int(out.stats["peak_kv_pages"]),
            "peak_gib_per_device": peak_gib(jax.local_devices()),
            "compiles": compiles,
        }
        errors = [f"{compiles} compilations (or cache reads) during the timed call"] if compiles else []
        errors += [f"{kind} that the warm-up never ran" for kind in first_runs(warm.stats, out.stats)]
        if errors:
            row["error"] = "; ".join(errors) + ": its time is not the engine's"
        print(
            f"== {label}: {seconds:.2f} s, {steps} decode steps, {row['step_ms']:.3f} ms each, {row['tokens']} tokens, "
            f"{row['kv_read_gb']:.0f} GB of KV read, "
            f"widths {row['stage_rows']} steps {row['stage_steps']} depths {row['depth_steps']}, "
            f"preemptions {row['preemptions']}, prefill chunks {row['prefill_chunks']}, "
            f"loop iterations {row['loop_iterations']}, peak KV pages {row['peak_kv_pages']}, "
            f"peak GiB per device so far {row['peak_gib_per_device']}, compilations {compiles}",
            flush=True,
        )
        (args.work / "slot_profile.json").write_text(json.dumps(result, indent=1))
        if not args.trace:
            continue
        trace = args.work / f"trace_{label.replace(' ', '_')}"
        with jax.profiler.trace(str(trace)):
            run()
        modules = {"jit__decode": label, "jit__loop": label, "jit_speculative_decode": label}
        modules["jit_prefill_prompts"] = f"{label}-prefill"
        scopes = op_scopes(args.work / "hlo")
        kernels = kernel_times(trace, scopes, modules)
        gaps = [g for g in idle_gaps(trace, scopes, modules) if g.program == label]  # the loop's, not the prefill's
        if not args.keep_traces:
            shutil.rmtree(trace)
        by_scope = collections.defaultdict(float)
        by_phase = collections.defaultdict(lambda: [0.0, 0])
        for k in kernels:
            by_scope["/".join(k.op_name.split("/")[:4])] += k.ns
            by_phase[phase_of(k.op_name)][0] += k.ns
            by_phase[phase_of(k.op_name)][1] += k.launches
        launches = sum(k.launches for k in kernels)
        loop = [k for k in kernels if k.program == label]  # not the prefill's
        outside = [k for k in loop if not FORWARD_SCOPES & set(k.op_name.split("/"))]
        row |= {
            "kernel_ms": sum(k.ns for k in kernels) / 1e6,
            "launches_per_step": launches / steps,
            "top": [(k.op, k.op_name, k.ns / 1e6, k.launches) for k in kernels[:22]],
            "scopes": sorted(((ms / 1e6, name) for name, ms in by_scope.items()), reverse=True)[:12],
            "phases_ms_per_step": {name: ns / 1e6 / steps for name, (ns, _) in by_phase.items()},
            "phases_launches_per_step": {name: n / steps for name, (_, n) in by_phase.items()},
            "outside_forward": [(k.op, k.op_name, k.ns / 1e6, k.launches) for k in outside[:40]],
            "idle_ms": sum(g.ns for g in gaps) / 1e6,
            "idle_gaps": [(g.before, g.before_name, g.after, g.after_name, g.ns / 1e6, g.count) for g in gaps[:30]],
        }
        print(f"   kernels {row['kernel_ms']:.0f} ms, {row['launches_per_step']:.0f} launches per iteration")
        for op, name, ms, n in row["top"]:
            print(f"  {ms:9.2f} ms {n:7d}  {op[:28]:28s} {name[-90:]}")
        for ms, name in row["scopes"]:
            print(f"  scope {ms:9.2f} ms  {name}")
        for name, ms in sorted(row["phases_ms_per_step"].items(), key=lambda item: -item[1])[:12]:
            launches = row["phases_launches_per_step"][name]
            print(f"  phase {ms:7.3f} ms/step {launches:6.1f} launches/step  {name}", flush=True)
        for op, name, ms, n in row["outside_forward"]:
            print(
                f"  outside the forward {1e3 * ms / steps:6.2f} us/step {n / steps:5.2f} per step  {op[:28]:28s} {name}"
            )
        print(f"  idle between the loop's kernels {1e3 * row['idle_ms'] / steps:.1f} us/step; the longest:")
        for before, before_name, after, after_name, ms, n in row["idle_gaps"]:
            share = f"{1e3 * ms / steps:7.2f} us/step {n / steps:5.2f} per step"
            print(f"  idle {share}  after {before[:24]:24s} {before_name[-70:]}")
            print(f"  {'':{len(share) + 7}s}before {after[:24]:24s} {after_name[-70:]}")
        (args.work / "slot_profile.json").write_text(json.dumps(result, indent=1))
    if args.copies:
        result["copies"] = copies_in_loops(args.work / "hlo")
        (args.work / "slot_profile.json").write_text(json.dumps(result, indent=1))
    if (args.trace or args.copies) and not args.keep_traces:
        shutil.rmtree(args.work / "hlo", ignore_errors=True)


def one_after_another(outs: list):
    """The staged calls' outputs as one: their rows' lengths in order, their decode steps (and
    those of each stage and draft depth) summed; one call's output as it is."""
    if len(outs) == 1:
        return outs[0]
    stats = dict(outs[0].stats)
    for name in ("steps", "stage_steps", "depth_steps"):
        if name in stats:
            stats[name] = sum(np.asarray(out.stats[name]) for out in outs)
    return types.SimpleNamespace(lengths=np.concatenate([np.asarray(out.lengths) for out in outs]), stats=stats)


def first_runs(warm: dict, timed: dict) -> list[str]:
    """The branches of a loop that the timed call ran and the warm-up did not, as "draft depths
    [1, 2]" / "step widths [8]" (from each call's `depth_steps` and `width_steps` stats). A branch's
    first execution loads its kernels (on an H200, a ~70 ms first probe at batch 1, lease KK), which
    would land in the timed call's time."""
    found = []
    for name, counts, labels in (("draft depths", "depth_steps", None), ("step widths", "width_steps", "step_widths")):
        if counts not in timed:
            continue
        ran = [int(n) for n in np.asarray(timed[counts])]
        before = [int(n) for n in np.asarray(warm[counts])]
        keys = list(range(len(ran))) if labels is None else [int(w) for w in timed[labels]]
        missed = [key for key, now, then in zip(keys, ran, before, strict=True) if now and not then]
        if missed:
            found.append(f"{name} {missed}")
    return found


def workload_lengths(config: str, rows: int, cap: int) -> list[int]:
    """Response lengths in tokens (solution + eos) of the first `rows` problems of a pretraining
    config's data, under its tokenizer, each capped at `cap`: one draw of the workload's length law
    per row."""
    from jaxspec.config_io import load_config
    from jaxspec.data_cli import response_lengths
    from jaxspec.pretrain.config import PretrainConfig
    from jaxspec.tasks import generate_problems

    data = load_config(PretrainConfig, config, []).data
    problems = generate_problems(rows, data.seed, data.levels, data.kinds, tally=data.tally)
    return [min(n, cap) for n in response_lengths(data, problems)[0]]


def peak_gib(devices) -> list[float] | None:
    """Each device's peak memory in use so far (GiB), or None where the backend reports none."""
    stats = [d.memory_stats() for d in devices]
    if any(s is None or "peak_bytes_in_use" not in s for s in stats):
        return None
    return [round(s["peak_bytes_in_use"] / 2**30, 2) for s in stats]


def copies_in_loops(dump_dir: Path) -> dict[str, list]:
    """{loop program's HLO file: [computation, copies, MiB, caller]}: the copies of 256 KiB or more
    inside its loops and branches (`jaxspec.bench.hlo_copies`; the programs in the order they
    compiled), with the op_name of the branch or loop that runs each computation (`callers`)."""
    found = {}
    for path in sorted(dump_dir.glob("module_*after_optimizations.txt")):
        if not any(name in path.name for name in ("_decode", "_loop")):
            continue
        hlo = path.read_text()
        by_computation = collections.defaultdict(lambda: [0, 0.0])
        for copy in loop_copies(hlo):
            if copy.bytes >= 2**18:
                by_computation[copy.computation][0] += 1
                by_computation[copy.computation][1] += copy.bytes / 2**20
        caller = callers(hlo)
        found[path.name] = [[name, n, mib, caller.get(name, "")] for name, (n, mib) in by_computation.items()]
        print(f"== copies in {path.name}: {sum(n for _, n, _, _ in found[path.name])}", flush=True)
        for name, n, mib, called_by in found[path.name]:
            print(f"  {n:4d} copies, {mib:9.1f} MiB  {name}  {called_by}")
    return found


if __name__ == "__main__":
    main()
