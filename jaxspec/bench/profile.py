"""`jaxspec bench profile`: where the device time of a decode-loop iteration goes.

Generates the same prompts autoregressively and with each given speculative configuration,
once to compile and once under `jax.profiler.trace`. XLA dumps its optimized HLO, whose
metadata names the jax scope every fused kernel came from, so each traced kernel is charged to
a phase of the loop:

    autoregressive: forward (the one-token policy step), sample
    speculative:    propose (the drafter), verify_forward (the policy over the drafted nodes),
                    verify (the acceptance test), commit (moving a tree path's KV),
                    draft_update, and the loop's own bookkeeping
    both:           stage_move (rows moving into a smaller batch), prefill (its own program)

and, inside a phase, to a part: attention (scores over the KV cache), kv_write, lm_head, or
layers (the other matmuls and norms). Reported in device milliseconds per loop iteration,
against the autoregressive decode step of the same run, with the kernels launched per iteration
by phase and by jax op_name: at small batches a decode step is a few hundred kernels of a few
microseconds each, so the launch count, not the bytes read, sets its time.

With `--model CONFIG` instead of `--policy`, the loops run on random weights of that shape
(`jaxspec bench decode`'s workload: random prompts of `--prompt` tokens, no eos) and EAGLE-3
chains on a random head, which accepts next to nothing: what a step costs against the AR step,
not what it gains. The AR step's parts are set against the bytes they must read, as rates and
fractions of the copy bandwidth measured inside one compiled loop in the same run: the weights
against the kernels of the "layers" and "lm_head" parts (`weights_tb_s`: the GEMMs and the
elementwise kernels between them), the filled KV against "attention" (`attention_tb_s`: the
kernel and its wrapper). `kernels_by_op_name` splits them further.

The dump flags must reach XLA before its backend starts, so this command sets XLA_FLAGS itself
and refuses to run in a process that has already used JAX. On GPU it also turns XLA's command
buffers (CUDA graphs) off: a graph is traced as one event, which hides the kernels inside it.
Kernel times are unchanged by that; the loop's wall time may grow by the launches.
"""

from __future__ import annotations

import argparse
import collections
import re
import tempfile
from pathlib import Path

from jaxspec.bench.kernel_trace import Kernel, kernel_times, op_scopes, set_dump_flags
from jaxspec.bench.spec_configs import add_stage_depths

PHASES = ("propose", "verify_forward", "verify", "commit", "draft_update", "forward", "sample", "stage_move")
PARTS = ("attention", "kv_write", "lm_head")
LOOP_MODULES = {"jit__decode": "ar", "jit_speculative_decode": "spec", "jit_prefill_prompts": "prefill"}
LOOP_MODULE_RE = ".*(_decode|prefill).*"  # the HLO dump of the loop programs (and their siblings)
TOP_KERNELS = 25
TOP_OP_NAMES = 60
_STAGE = re.compile(r"(?:^|/)stage(\d+)/while/")


def classify(op_name: str) -> tuple[str, str]:
    """(phase, part) of a kernel from its jax op_name (scopes separated by '/'); kernels XLA
    created without one (layout copies, converts) are "unattributed"."""
    if not op_name:
        return "unattributed", "layers"
    parts = op_name.split("/")
    phase = next((p for p in parts if p in PHASES), "bookkeeping")
    part = next((p for p in parts if p in PARTS), "layers")
    return phase, part


def phase_part(kernel: Kernel) -> tuple[str, str]:
    phase, part = classify(kernel.op_name)
    return ("prefill" if kernel.program == "prefill" else phase), part


def by_op_name(kernels: list[Kernel], steps: int) -> list[dict]:
    """Kernels grouped by jax op_name (one name per source line: a layer's kernel appears once
    per layer), most launches per loop iteration first."""
    groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for k in kernels:
        name = re.sub(r"^jit\([^)]*\)/(stage\d+/)?while/body/", "", k.op_name)
        groups[name][0] += k.ns
        groups[name][1] += k.launches
    return [
        {"op_name": name, "launches": n / steps, "ms": t / 1e6 / steps}
        for name, (t, n) in sorted(groups.items(), key=lambda kv: (-kv[1][1], -kv[1][0]))
    ]


def by_stage(kernels: list[Kernel], stage_rows: list[int], stage_steps: list[int]) -> list[dict]:
    """Device ms and kernels per loop iteration in each stage of the loop (`jaxspec.rollout.stages`
    names its loops stage0, stage1, ...); a stage that ran no iteration reports zeros."""
    ns, launches = collections.defaultdict(float), collections.defaultdict(int)
    for k in kernels:
        m = _STAGE.search(k.op_name)
        if m:
            ns[int(m.group(1))] += k.ns
            launches[int(m.group(1))] += k.launches
    return [
        {
            "rows": rows,
            "iterations": steps,
            "ms": ns[i] / 1e6,
            "ms_per_iteration": ns[i] / 1e6 / steps if steps else 0.0,
            "kernels_per_iteration": launches[i] / steps if steps else 0.0,
        }
        for i, (rows, steps) in enumerate(zip(stage_rows, stage_steps))
    ]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="jaxspec bench profile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--policy", help="HF folder of the policy (with tokenizer.json)")
    source.add_argument("--model", help="model config JSON: random weights of its shape (chains on a random head)")
    p.add_argument("--prompt", type=int, default=960, help="--model: prompt tokens per row")
    p.add_argument("--copy-bytes", type=int, default=2 << 30, help="--model: array size of the copy-bandwidth baseline")
    p.add_argument("--draft", default=None, help="EAGLE-3 head (public layout); without it only n-gram runs")
    p.add_argument("--batch", type=int, default=64, help="rollouts (rows) per batch")
    p.add_argument(
        "--samples",
        type=int,
        default=1,
        help="rollouts per prompt (GRPO's group size): batch / samples distinct prompts",
    )
    p.add_argument("--new", type=int, default=256, help="max_new_tokens (a short run keeps the trace small)")
    p.add_argument("--k", type=int, nargs="*", default=[3], help="EAGLE-3 chain depths (none: AR and n-gram only)")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="--model: the random head's draft vocabulary (default min(V, 32000))",
    )
    add_stage_depths(p)
    p.add_argument("--levels", type=int, nargs="+", default=[6, 7])
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--trace-dir", default=None, help="keep the traces and HLO dumps here (default: a temp dir)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    work = Path(args.trace_dir or tempfile.mkdtemp(prefix="jaxspec-profile-"))
    set_dump_flags(work / "hlo", LOOP_MODULE_RE, "bench profile")
    return _profile(args, work)


def _workload(args):
    """(cfg, params, prompts, sampling, [(label, Spec or None)]) of the policy or the random model."""
    import jax
    import jax.numpy as jnp

    from jaxspec.bench.decode import random_prompts
    from jaxspec.bench.spec import bench_prompts
    from jaxspec.bench.spec_configs import stage_configurations
    from jaxspec.draft import init_eagle3, load_eagle3
    from jaxspec.models import ModelConfig, init_params, load_hf
    from jaxspec.rollout import Sampling, Spec
    from jaxspec.tasks import ChatTokenizer

    if args.model:  # random weights: the costs of the steps, not what they accept
        cfg = ModelConfig.from_json(args.model)
        params = init_params(cfg, jax.random.key(0), jnp.dtype(args.dtype))
        prompts = random_prompts(cfg, args.batch, args.prompt).tolist()
        head = init_eagle3(cfg, jax.random.key(1), args.draft_vocab, dtype=jnp.dtype(args.dtype)) if args.k else None
        configs = [("ar", None)] + [
            (f"eagle3 chain k={k}, random head", Spec(method="eagle3", draft=head, num_draft_tokens=k)) for k in args.k
        ]
        return cfg, params, prompts, Sampling(temperature=1.0, max_new_tokens=args.new, eos_id=()), configs
    cfg, params = load_hf(args.policy, dtype=args.dtype)
    tok = ChatTokenizer.from_file(args.policy)
    head = load_eagle3(args.draft, dtype=args.dtype, policy=cfg) if args.draft else None
    sampling = Sampling(temperature=1.0, max_new_tokens=args.new, eos_id=tok.eos_id)
    prompts = bench_prompts(tok, args.batch, args.samples, args.seed, args.levels)
    configs = [("ar", None)]
    configs += [(f"eagle3 chain k={k}", Spec(method="eagle3", draft=head, num_draft_tokens=k)) for k in args.k if head]
    configs += [(label, Spec(draft=head, **kwargs)) for label, kwargs in stage_configurations(args) if head]
    configs.append(("ngram chain k=3", Spec(method="ngram", num_draft_tokens=3)))
    return cfg, params, prompts, sampling, configs


def roofline_parts(cfg, row: dict, batch: int, prompt: int, new: int, copy_rate: float) -> dict:
    """The AR step's weights and KV bytes (as `jaxspec bench decode` counts them, dtype bf16)
    against the device time of the parts that read them (weights: "layers" and "lm_head", KV:
    "attention"), as rates in TB/s and fractions of `copy_rate` (bytes per second)."""
    from jaxspec.bench.decode import kv_read_bytes, weight_read_bytes
    from jaxspec.bench.timing import add_fraction

    parts = row["parts_ms"]
    weights, kv = weight_read_bytes(cfg, 2, batch), kv_read_bytes(cfg, batch, prompt, new, 2)
    matmul_ms = parts.get("layers", 0.0) + parts.get("lm_head", 0.0)
    weights_rate = weights / (matmul_ms / 1e3) if matmul_ms else None  # bytes per second
    kv_rate = kv / (parts["attention"] / 1e3) if parts.get("attention") else None
    out = {
        "weights_gb": weights / 1e9,
        "kv_gb": kv / 1e9,
        "copy_tb_s": copy_rate / 1e12,
        "copy_bound_ms": (weights + kv) / copy_rate * 1e3,
        "weights_tb_s": weights_rate and weights_rate / 1e12,
        "attention_tb_s": kv_rate and kv_rate / 1e12,
    }
    add_fraction(
        out,
        "step_frac",
        (weights + kv) / (row["step_ms"] / 1e3),
        copy_rate,
        "profiled AR step: bytes per step / device time vs the in-loop copy",
    )
    add_fraction(
        out,
        "weights_frac",
        weights_rate,
        copy_rate,
        "layers and LM head: weight bytes / device time vs the in-loop copy",
    )
    add_fraction(
        out, "attention_frac", kv_rate, copy_rate, "attention: filled KV bytes / device time vs the in-loop copy"
    )
    return out


def _profile(args, work: Path) -> int:
    import jax

    from jaxspec.bench.timing import ceilings, copy_bytes_per_second, print_table, write_results
    from jaxspec.rollout import generate

    cfg, params, prompts, sampling, configs = _workload(args)
    outputs = []
    for i, (_, spec) in enumerate(configs):
        run = lambda: generate(cfg, params, prompts, jax.random.key(0), sampling, spec=spec)  # noqa: E731
        jax.block_until_ready(run().tokens)  # compile
        with jax.profiler.trace(str(work / f"trace{i}")):
            out = run()
            jax.block_until_ready(out.tokens)
        outputs.append(out)

    scopes = op_scopes(work / "hlo")  # every program has been compiled (and dumped) by now
    rows, ar_step_ms = [], None
    for i, ((label, spec), out) in enumerate(zip(configs, outputs)):
        steps = max(int(out.stats["steps"]), 1)
        program = "spec" if spec is not None else "ar"
        kernels = kernel_times(work / f"trace{i}", scopes, LOOP_MODULES)
        loop_kernels = [k for k in kernels if k.program == program]
        loop, launches = collections.defaultdict(float), collections.defaultdict(int)
        for k in loop_kernels:
            phase, part = phase_part(k)
            loop[(phase, part)] += k.ns
            launches[phase] += k.launches
        total_ms = sum(loop.values()) / 1e6 / steps
        top = [{"ms": k.ns / 1e6 / steps, "op": k.op, "op_name": k.op_name} for k in loop_kernels][:TOP_KERNELS]
        ar_step_ms = total_ms if spec is None else ar_step_ms
        row = {
            "config": label,
            "batch": args.batch,
            "steps": steps,
            "acceptance_length": float(out.stats["acceptance_length"]),
            "step_ms": total_ms,
            "step_over_ar": total_ms / ar_step_ms,
            "prefill_ms": sum(k.ns for k in kernels if k.program == "prefill") / 1e6,
            "kernels_per_step": sum(launches.values()) / steps,
            "phase_kernels_per_step": {ph: n / steps for ph, n in sorted(launches.items())},
            "phases_ms": _by(loop, 0, steps),
            "parts_ms": _by(loop, 1, steps),
            "phase_parts_ms": {f"{ph}/{pa}": ns / 1e6 / steps for (ph, pa), ns in sorted(loop.items())},
            "top_kernels": top,
            "kernels_by_op_name": by_op_name(loop_kernels, steps)[:TOP_OP_NAMES],
            "stages": by_stage(loop_kernels, out.stats["stage_rows"], out.stats["stage_steps"]),
        }
        rows.append(row)
        print(
            f"\n{label}: {total_ms:.3f} device ms per iteration ({row['step_over_ar']:.2f}x the AR step), "
            f"{row['kernels_per_step']:.0f} kernels per iteration, {steps} iterations, "
            f"acceptance {row['acceptance_length']:.2f}"
        )
        print_table(
            [{"phase/part": k, "ms": v, "share": v / total_ms} for k, v in row["phase_parts_ms"].items()],
            ["phase/part", "ms", "share"],
        )
        print_table(row["stages"], ["rows", "iterations", "ms", "ms_per_iteration", "kernels_per_iteration"])
        for k in top[:8]:
            print(f"  {k['ms']:8.4f} ms  {k['op']:<32} {k['op_name'][-90:]}")
        print("  most launched (per iteration):")
        for g in row["kernels_by_op_name"][:10]:
            print(f"  {g['launches']:6.1f} x {g['ms']:8.4f} ms  {g['op_name'][-90:]}")
    baseline = {
        "policy": args.policy,
        "model": args.model,
        "draft": args.draft,
        "max_new_tokens": args.new,
        "samples_per_prompt": args.samples,
        "unit": "device ms per loop iteration",
        "baseline": "the autoregressive decode step of the same run",
    }
    if args.model:
        copy_rate = copy_bytes_per_second(args.copy_bytes)
        baseline.update(ceilings(copy_rate=copy_rate), prompt_tokens=args.prompt)
        rows[0]["roofline"] = roofline_parts(cfg, rows[0], args.batch, args.prompt, args.new, copy_rate)
        print_table([rows[0]["roofline"]], list(rows[0]["roofline"]))
    else:
        baseline["levels"] = args.levels
    print()
    print_table(rows, ["config", "step_ms", "step_over_ar", "kernels_per_step", "acceptance_length", "steps"])
    write_results(args.out, "profile", rows, baseline)
    return 0


def _by(loop: dict[tuple[str, str], float], index: int, steps: int) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for key, ns in loop.items():
        out[key[index]] += ns / 1e6 / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
