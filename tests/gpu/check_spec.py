"""GPU check of speculative verification: the Triton kernels (through jax-triton) against the jnp
reference, on the GPU.

    pytest -m gpu tests/gpu/test_spec.py                         # the check, as tests
    python3 -m tests.gpu.check_spec [--out FILE.json] [--jobs 6]  # every row printed; exit 0 when all agree
    python3 -m tests.gpu.check_spec --deadline 500                # compare what finished in 500 s (exit 3 if cut)
    python3 -m tests.gpu.check_spec --kernels /c --only coupled   # the coupled draws' cases alone

Run it on a GPU after every change to jaxspec/kernels/ or the rollout loop: Triton's interpreter on the
CPU runs the kernels' arithmetic in numpy and cannot see a fault of the compiled program.

kernel: `verify_triton` compiled against `verify_reference` on the same random trees and key, for
chains of 1 to 15 drafts and random trees of up to 16 nodes, greedy and T=1, a vocabulary of one
race tile and of many; and `verify_stochastic_triton` (stochastic drafts, tree "chain/q" or
"random/q") the same way, at T=1 and 0.7, vocabularies of 512 and 151936 tokens: the accepted path,
its length and the next token must be equal (float rounding can flip a decision that lands on a
boundary: at most `MAX_FLIPPED` of the rows), the log-probs within `LOGPROB_TOL`, and every result
must be consistent (num_accepted equals the path's accepted nodes). Coupled draws (one key per
node, tree "chain/c" or "random/c", T=1) take the same comparison (`tests.gpu.check_spec_kernels`).
rollout: every method (EAGLE-3 chains k = 1..7, trees, stochastic drafts, adaptive depth; a draft
model; n-gram) on the staged engine, and EAGLE-3 and draft-model runs on the slot engine (8 slots), on the
embedded tiny policy and head, 16 level-1/2 problems, 64 new tokens, greedy and T=1; each
run once with JAXSPEC_TREE_VERIFY_IMPL=reference and once with triton, in `--jobs` child processes each (the
choice is made when the rollout loop is traced), started before the kernel check and compiling beside
it. Greedy tokens must be equal; acceptance length
and acceptance per position within `RATE_TOL` at T=1 (same key and noise: equal unless a boundary
decision flipped), exactly at T=0. coupled: the coupled EAGLE-3 runs (`Sampling.coupled`: chains and
trees, staged and on slots) against the coupled autoregressive run, at least `COUPLED_SHARE` of
their rows with its tokens (`coupled_rows`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# The kernel check and each rollout process allocate what they use: JAX's default of taking 75% of
# the GPU at start-up would leave a rollout process nothing beside its parent.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tests.gpu.check_spec_kernels import kernel_cases, kernel_checks  # noqa: E402

RATE_TOL = 0.02
NEW_TOKENS = 64
ROLLOUT_ROWS = 16
SLOTS = 8  # slot-engine cases: half the rows at once
COUPLED_AR = "autoregressive coupled"  # the coupled runs' reference
COUPLED_SHARE = 0.75  # of the rows of a coupled run with the autoregressive tokens (`coupled_rows`)
ROOT = Path(__file__).resolve().parents[2]


def rollout_configs() -> list[tuple[str, dict]]:
    """(label, Spec kwargs) of every method and shape the rollout check runs."""
    runs = [(f"eagle3 chain k={k}", {"method": "eagle3", "num_draft_tokens": k}) for k in range(1, 8)]
    runs += [
        ("eagle3 tree w=2 d=3", {"method": "eagle3", "num_draft_tokens": 3, "tree_width": 2}),
        ("eagle3 tree w=3 d=4 n=8", {"method": "eagle3", "num_draft_tokens": 4, "tree_width": 3, "tree_budget": 8}),
    ]
    runs += [
        (f"eagle3 stochastic k={k}", {"method": "eagle3", "num_draft_tokens": k, "draft_sampling": "stochastic"})
        for k in (1, 3)
    ]
    runs += [(f"draft_model chain k={k}", {"method": "draft_model", "num_draft_tokens": k}) for k in (1, 2, 4)]
    runs += [(f"ngram chain k={k}", {"method": "ngram", "num_draft_tokens": k}) for k in (1, 3)]
    # Adaptive depth: as the cost model has it, and with verification so dear that the loop runs
    # autoregressive iterations (the head's queue) between probes that back off.
    adaptive = [
        ("eagle3 chain k=3 adaptive", {"method": "eagle3", "num_draft_tokens": 3, "adaptive": True}),
        (
            "eagle3 chain k=3 adaptive fallback",
            {"method": "eagle3", "num_draft_tokens": 3, "adaptive": True, "verify_token_cost": 1.0},
        ),
    ]
    runs += adaptive
    slot_runs = [  # the slot engine verifies all its slots in one call, with one key per row
        ("eagle3 chain k=3", {"method": "eagle3", "num_draft_tokens": 3}),
        ("eagle3 tree w=2 d=3", {"method": "eagle3", "num_draft_tokens": 3, "tree_width": 2}),
        ("eagle3 stochastic k=3", {"method": "eagle3", "num_draft_tokens": 3, "draft_sampling": "stochastic"}),
        ("draft_model chain k=2", {"method": "draft_model", "num_draft_tokens": 2}),
        *adaptive,
    ]
    runs += [(f"{label} slots={SLOTS}", {**kwargs, "slots": SLOTS}) for label, kwargs in slot_runs]
    coupled = [  # Sampling.coupled: each speculative run's tokens are the autoregressive run's (`coupled_rows`)
        (COUPLED_AR, {"method": "none", "coupled": True}),
        ("eagle3 chain k=3 coupled", {"method": "eagle3", "num_draft_tokens": 3, "coupled": True}),
        ("eagle3 tree w=2 d=3 coupled", {"method": "eagle3", "num_draft_tokens": 3, "tree_width": 2, "coupled": True}),
        (
            f"eagle3 chain k=3 coupled slots={SLOTS}",
            {"method": "eagle3", "num_draft_tokens": 3, "coupled": True, "slots": SLOTS},
        ),
    ]
    return runs + coupled


def rollout_cases() -> list[tuple[float, str, dict]]:
    """(temperature, label, Spec kwargs) of every rollout the check runs, in report order."""
    return [
        (temperature, label, kwargs)
        for temperature in (0.0, 1.0)
        for label, kwargs in rollout_configs()
        if not (temperature == 0 and kwargs.get("draft_sampling") == "stochastic")
    ]


def rollout_runs(shard: int, shards: int, only: str = "", emit=None) -> list[dict]:
    """Cases shard, shard + shards, ... of the rollout_cases() whose label contains `only`, under the
    implementation the environment selects, each row tagged with its case index; `emit(row)` is
    called as each case finishes."""
    from jaxspec.assets import tiny_policy_path
    from jaxspec.draft import load_eagle3
    from jaxspec.models import load_hf
    from jaxspec.rollout import Sampling, Spec, generate
    from jaxspec.tasks import ChatTokenizer, generate_problems

    path = tiny_policy_path()
    cfg, params = load_hf(path, dtype="float32")
    tok = ChatTokenizer.from_file(path)
    drafts = {"eagle3": load_eagle3(path.parent / "tiny-eagle3", policy=cfg), "draft_model": (cfg, params)}
    problems = generate_problems(ROLLOUT_ROWS, seed=7, levels=[1, 2])
    prompts = [tok.encode_prompt(p["question"]) for p in problems]
    rows = []
    cases = [(i, case) for i, case in enumerate(rollout_cases()) if only in case[1]]
    for position, (index, (temperature, label, kwargs)) in enumerate(cases):
        if position % shards != shard:
            continue
        kwargs = dict(kwargs)
        coupled = kwargs.pop("coupled", False)
        sampling = Sampling(temperature=temperature, max_new_tokens=NEW_TOKENS, eos_id=tok.eos_id, coupled=coupled)
        engine = {"slots": kwargs.pop("slots")} if "slots" in kwargs else {}
        spec = None if kwargs["method"] == "none" else Spec(draft=drafts.get(kwargs["method"]), **kwargs)
        out = generate(cfg, params, prompts, jax.random.key(3), sampling, spec=spec, **engine)
        rows.append(
            {
                "index": index,
                "config": label,
                "temperature": temperature,
                "coupled": coupled,
                "acceptance_length": float(out.stats["acceptance_length"]),
                "acceptance_per_position": np.asarray(out.stats["acceptance_rate_per_position"]).tolist(),
                "tokens": np.asarray(out.tokens).tolist(),
                "lengths": np.asarray(out.lengths).tolist(),
            }
        )
        if emit is not None:
            emit(rows[-1])
    return rows


def compare_rollouts(reference: list[dict], kernel: list[dict]) -> list[dict]:
    rows = []
    for ref, got in zip(reference, kernel, strict=True):
        exact = ref["temperature"] == 0
        tol = 0.0 if exact else RATE_TOL
        rate_ref = np.nan_to_num(np.asarray(ref["acceptance_per_position"], float), nan=-1.0)
        rate_got = np.nan_to_num(np.asarray(got["acceptance_per_position"], float), nan=-1.0)
        rate_diff = float(np.abs(rate_ref - rate_got).max()) if rate_ref.size else 0.0
        length_diff = abs(ref["acceptance_length"] - got["acceptance_length"])
        tokens_equal = ref["tokens"] == got["tokens"] and ref["lengths"] == got["lengths"]
        ok = rate_diff <= tol and length_diff <= tol and (tokens_equal or not exact)
        rows.append(
            {
                "check": "rollout",
                "config": ref["config"],
                "temperature": ref["temperature"],
                "acceptance_reference": ref["acceptance_length"],
                "acceptance_kernel": got["acceptance_length"],
                "rate_diff": rate_diff,
                "tokens_equal": tokens_equal,
                "ok": ok,
            }
        )
    return rows


def coupled_rows(runs: list[dict]) -> list[dict]:
    """The coupled speculative runs of one implementation against its coupled autoregressive run at
    the same temperature: the share of rows with the autoregressive tokens. In float32 on the CPU it
    is 1 (tests/rollout/speculative/test_coupled.py); on a GPU XLA's float32 matmuls may round the
    verification forward's logits and the decode step's differently (TF32), enough to break a
    near-tie, after which a row departs, so at least COUPLED_SHARE of the rows must agree (the
    default draws leave almost none)."""
    ar = {r["temperature"]: r for r in runs if r["config"] == COUPLED_AR}
    rows = []
    for r in runs:
        if not r.get("coupled") or r["config"] == COUPLED_AR or r["temperature"] not in ar:
            continue
        want = ar[r["temperature"]]
        same = [a == b for a, b in zip(r["tokens"], want["tokens"], strict=True)]
        share = float(np.mean(same))
        rows.append(
            {
                "check": "coupled",
                "config": r["config"],
                "temperature": r["temperature"],
                "rows_as_ar": share,
                "ok": share >= COUPLED_SHARE,
            }
        )
    return rows


def start_rollouts(impls: tuple[str, ...], jobs: int, only: str = "") -> list[tuple[str, subprocess.Popen]]:
    """rollout_runs() of every implementation, each split over `jobs` child processes started now
    and running at once (compilation dominates and is single-threaded): (implementation, child)
    pairs for `collect_rollouts`. The implementation is chosen by JAXSPEC_TREE_VERIFY_IMPL when a
    child traces the rollout loop; each child prints one JSON row per finished case."""
    return [
        (
            impl,
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.gpu.check_spec",
                    "--rollouts-only",
                    f"--shard={shard}/{jobs}",
                    f"--only={only}",
                ],
                cwd=ROOT,
                env=dict(os.environ, JAXSPEC_TREE_VERIFY_IMPL=impl),
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,  # its own process group: `stop` ends what it started too
            ),
        )
        for impl in impls
        for shard in range(jobs)
    ]


def collect_rollouts(children: list[tuple[str, subprocess.Popen]], end: float | None) -> dict[str, list[dict]]:
    """Each implementation's rows from its children, by case index; at `end` (`time.monotonic()`)
    the children still running are stopped and the cases they finished are kept."""
    runs: dict[str, list[dict]] = {impl: [] for impl, _ in children}
    for impl, child in children:
        try:
            out, _ = child.communicate(timeout=None if end is None else max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            stop(child)
            out, _ = child.communicate()
        else:
            if child.returncode != 0:
                raise RuntimeError(f"rollout child ({impl}) exited {child.returncode}")
        runs[impl] += [json.loads(line) for line in out.splitlines() if line.startswith("{") and line.endswith("}")]
    return {impl: sorted(rows, key=lambda r: r["index"]) for impl, rows in runs.items()}


def stop(child: subprocess.Popen) -> None:
    """Kills a rollout child's process group: the child and any process it started, which would
    otherwise hold its output pipe open and keep `communicate` waiting past the deadline."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_impls(
    impls: tuple[str, ...], jobs: int, only: str = "", deadline: float | None = None
) -> dict[str, list[dict]]:
    """`start_rollouts` then `collect_rollouts`, stopping at `deadline` seconds from now."""
    children = start_rollouts(impls, jobs, only)
    return collect_rollouts(children, None if deadline is None else time.monotonic() + deadline)


def finished_by_all(runs: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Each implementation's rows restricted to the cases every implementation finished."""
    common = set.intersection(*({r["index"] for r in rows} for rows in runs.values()))
    return {impl: [r for r in rows if r["index"] in common] for impl, rows in runs.items()}


def print_kernel_row(r: dict) -> None:
    print(
        f"kernel n={r['nodes']:2d} {r['tree']:8s} V={r['vocab']:6d} T={r['temperature']}: flipped "
        f"{r['flipped_rows']:.4f} consistent {r['consistent']} logprob err {r['logprob_err']:.1e} accepted "
        f"{r['mean_accepted_reference']:.3f}/{r['mean_accepted_kernel']:.3f} {'OK' if r['ok'] else 'MISMATCH'}",
        flush=True,
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write every row as JSON here")
    p.add_argument("--rollouts-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)
    p.add_argument("--jobs", type=int, default=6, help="rollout processes per implementation, run at once")
    p.add_argument("--skip-rollouts", action="store_true", help="only the kernel check")
    p.add_argument("--skip-kernel", action="store_true", help="only the rollout check")
    p.add_argument("--only", default="", help="only the rollout cases whose label contains this (e.g. 'slots=')")
    p.add_argument(
        "--kernels", default="", help="only the kernel cases whose tree column contains this (e.g. '/c': coupled)"
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no kernel case and stop the rollout processes this long after the check started (so that an "
        "outer timeout a little longer still gets the summary; the kernel part alone ran past 230 s on an H100); "
        "compare the cases that finished (exit 3 if one is missing)",
    )
    args = p.parse_args(argv)
    if not args.skip_kernel and not kernel_cases(args.kernels):
        p.error(f"--kernels {args.kernels!r}: no kernel case's tree column contains it (chain, random, /q, /c)")
    if not args.skip_rollouts and not any(args.only in label for _, label, _ in rollout_cases()):
        p.error(f"--only {args.only!r}: no rollout case's label contains it")
    started = time.monotonic()
    if args.rollouts_only:
        shard, shards = (int(x) for x in args.shard.split("/"))
        rollout_runs(shard, shards, args.only, emit=lambda row: print(json.dumps(row), flush=True))
        # Every row is out: exit now rather than through the GPU client's teardown (lease SS's check
        # ran ~40 s past its deadline after every case had printed).
        os._exit(0)
    if jax.default_backend() != "gpu":
        print(f"check_spec: needs a GPU (backend {jax.default_backend()})", file=sys.stderr)
        return 2
    end = None if args.deadline is None else started + args.deadline
    # The rollout children compile (on the CPU) while this process runs the kernel check.
    children = [] if args.skip_rollouts else start_rollouts(("reference", "triton"), args.jobs, args.only)
    try:
        rows = [] if args.skip_kernel else kernel_checks(emit=print_kernel_row, end=end, only=args.kernels)
    except BaseException:
        for _, child in children:
            stop(child)
        raise
    missing = 0 if args.skip_kernel else len(kernel_cases(args.kernels)) - len(rows)
    if not args.skip_rollouts:
        wanted = sum(args.only in label for _, label, _ in rollout_cases())
        runs = finished_by_all(collect_rollouts(children, end))
        missing += wanted - len(runs["reference"])
        for r in compare_rollouts(runs["reference"], runs["triton"]):
            rows.append(r)
            print(
                f"rollout {r['config']:30s} T={r['temperature']}: acceptance {r['acceptance_reference']:.3f} "
                f"(reference) {r['acceptance_kernel']:.3f} (triton) rate diff {r['rate_diff']:.3f} tokens equal "
                f"{r['tokens_equal']} {'OK' if r['ok'] else 'MISMATCH'}"
            )
        for r in coupled_rows(runs["triton"]):
            rows.append(r)
            print(
                f"coupled {r['config']:30s} T={r['temperature']}: rows with the autoregressive tokens "
                f"{r['rows_as_ar']:.3f} {'OK' if r['ok'] else 'MISMATCH'}"
            )
    bad = [r for r in rows if not r["ok"]]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
    print(
        f"check_spec on {jax.devices()[0].device_kind} ({time.monotonic() - started:.0f} s): "
        f"{len(rows) - len(bad)} of {len(rows)} agree"
        + (f"; MISMATCH in {len(bad)}" if bad else "")
        + (f"; {missing} cases not finished by the deadline" if missing else "")
    )
    return 1 if bad else 3 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
