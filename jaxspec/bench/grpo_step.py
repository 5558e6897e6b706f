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
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxspec.bench.grpo_phases import Bench
from jaxspec.bench.timing import (
    device_description,
    gigabytes,
    largest_free_block,
    memory_stat,
    out_of_memory,
    print_table,
    write_results,
)
from jaxspec.models import ModelConfig, cache_bytes, init_params, save_hf
from jaxspec.rl.config import OnlineDraftConfig, PolicyOptimConfig

PROJECTED_ACCEPTANCE = (2.5, 3.0, 3.3)  # measured on `small` (~2.9) and the EAGLE-3 paper's range
PHASES = ("generate_ar", "generate_spec", "logprobs", "update", "update_draft", "checkpoint")
# the phase whose results a phase reads: their log-probs, an optimizer state
NEEDS = {"update": ("logprobs",), "update_draft": ("logprobs",), "checkpoint": ("update", "update_draft")}


def check_phases(phases: list[str]) -> None:
    """ValueError naming a phase in --phases without a phase it reads (NEEDS: one of them)."""
    for phase in phases:
        if phase in NEEDS and not set(NEEDS[phase]) & set(phases):
            raise ValueError(f"--phases: {phase} reads the results of {' or '.join(NEEDS[phase])}; add it")


def write_random_policy(model_json: str, folder: Path, dtype: str = "bfloat16", seed: int = 0) -> None:
    """An HF folder (config.json + safetensors) of random weights in the shape of `model_json`."""
    cfg = ModelConfig.from_json(model_json)
    save_hf(cfg, init_params(cfg, jax.random.key(seed), jnp.dtype(dtype)), folder, dtype=dtype)


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
