"""The kernels XLA compiles one decode or verification step of a model into for an H100 / H200, counted
on any machine: no GPU needed.

A small decode step is bound by its kernel launches (Qwen3-1.7B at batch 1: ~650 kernels of a few
microseconds), so the count is the first thing a fused kernel must lower. XLA's GPU compiler runs
here without a device (deviceless ahead-of-time compilation: `jax.experimental.topologies` with a
target description of the card), on the same `extend` a rollout step runs (random weights of a model
config's shape, q/k/v fused as rollouts hold them, a paged cache of --context positions per row,
greedy tokens from the logits; with the rollout loops' compiler options,
`jaxspec.rollout.compiler_options`: no split-K for policies of hidden size >= 4096), once per kernel
setting: the environment variables of
`jaxspec.models` that choose XLA's pieces or a Triton kernel. Every setting runs the attention
kernel with its merge kernel; "gpu_default" is what one GPU runs by default (the prologue and the
residual norms too; here the backend is the CPU, where "auto" would pick XLA's pieces). Each
launch of the optimized entry computation is counted: XLA's fusions by kind (kLoop, kInput:
elementwise and reductions; kCustom: its Triton GEMMs and normalizations), cuBLAS calls and the
Triton kernels' custom calls.
Without a device XLA does not autotune, so its GEMMs' tiles (not their number) differ from a GPU's.

Needs the CUDA jaxlib plugin (`pip install 'jax[cuda12]' jax-triton`; the CUDA libraries load without
a driver) and runs with JAX_PLATFORMS=cpu, which this script sets. jax-triton asks the GPU for its
compute capability when it lowers a kernel; with none here the script answers the target's (9.0),
and a sparse layer's grouped matmuls are told they run on a GPU (their "auto" choice).

    python3 benchmarks/compiled_kernels.py --model configs/models/qwen3-1.7b.json --batch 1 8 --new 1 4
    python3 benchmarks/compiled_kernels.py --model configs/models/small-policy-32k.json --batch 64 --new 3 \
        --draft --settings gpu_default      # an EAGLE-3 head's 3-token chain proposal (per_layer: its one layer)
    python3 benchmarks/compiled_kernels.py ... --xla-flags=--xla_gpu_experimental_force_split_k=1   # no split-K
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ATTENTION = {"JAXSPEC_PAGED_ATTENTION": "triton", "JAXSPEC_ATTENTION_MERGE": "triton"}  # in every setting
SETTINGS = {  # name -> the variables a step is compiled under
    "attention": ATTENTION,
    "+prologue": ATTENTION | {"JAXSPEC_ATTENTION_PROLOGUE": "triton"},
    "+residual_norm": ATTENTION | {"JAXSPEC_RESIDUAL_NORM": "triton"},
    "+thin_matmul": ATTENTION | {"JAXSPEC_THIN_MATMUL": "triton"},
    "gpu_default": ATTENTION | {"JAXSPEC_ATTENTION_PROLOGUE": "triton", "JAXSPEC_RESIDUAL_NORM": "triton"},
    "+prologue+thin_matmul": ATTENTION | {"JAXSPEC_ATTENTION_PROLOGUE": "triton", "JAXSPEC_THIN_MATMUL": "triton"},
    "all": ATTENTION
    | {"JAXSPEC_ATTENTION_PROLOGUE": "triton", "JAXSPEC_RESIDUAL_NORM": "triton", "JAXSPEC_THIN_MATMUL": "triton"},
}
H200 = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150754820096 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H200"
"""
ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4}
NOT_LAUNCHES = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%\S+ = (?:\([^=]*\)|\S+) ([\w-]+)\(")


def computations(hlo: str) -> dict[str, list[str]]:
    """The module's computations by name ("ENTRY" for the entry one): their instruction lines."""
    found, name = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(ENTRY )?%([\w.\-]+) \(", line)
        if header:
            name = "ENTRY" if header.group(1) else header.group(2)
            found[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            found[name].append(line)
    return found


def launches(hlo: str, computation: str = "ENTRY") -> collections.Counter:
    """A computation's launches (default the entry's), instruction by instruction: a Counter of what
    each one launches (fusion:<kind>[:<backend kind>], custom-call:<target>, or the op). A while
    loop counts as "while" and its body's launches times its known trip count (once, and
    "while:unknown trips", where XLA does not know it)."""
    bodies = computations(hlo)
    counts = collections.Counter()
    for line in bodies[computation]:
        match = _INSTRUCTION.match(line)
        if not match or match.group(1) in NOT_LAUNCHES:
            continue
        op = match.group(1)
        if op == "fusion":
            kind = re.search(r"kind=(\w+)", line).group(1)
            backend = re.search(r'"kind":"(\w+)"', line)
            op = f"fusion:{kind}" + (f":{backend.group(1)}" if backend else "")
        elif op == "custom-call":
            op = "custom-call:" + re.search(r'custom_call_target="([^"]+)"', line).group(1)
        elif op == "while":
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            body = launches(hlo, re.search(r"body=%([\w.\-]+)", line).group(1))
            for inner, n in body.items():
                counts[inner] += n * (int(trips.group(1)) if trips else 1)
            if not trips:
                counts["while:unknown trips"] += 1
        counts[op] += 1
    return counts


def summary(row: dict) -> str:
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(row["kinds"].items(), key=lambda kv: -kv[1]))
    where = f"{row['model']} B={row['batch']} T={row['new']} {row['setting']:<15}"
    copies = f", largest copy {row['largest_copy_bytes']} B" if row["largest_copy_bytes"] else ""
    return f"{where} {row['launches']:4d} launches ({row['per_layer']}/layer){copies}: {kinds}"


def deviceless_mesh(devices: int):
    """The `Sharding` of a mesh of `devices` H200s over the data axis, for compiling in this process
    without a device (the CPU backend; jax-triton told the target's compute capability)."""
    os.environ.update(JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
    # The command-buffer launcher loads each kernel's PTX when XLA compiles the step, with the ptxas
    # XLA finds here, which may be older than the PTX Triton writes; jax-triton's own call defers that
    # to the first launch. The launches counted are the same.
    os.environ.setdefault("JAXSPEC_TRITON_COMMAND_BUFFERS", "off")
    import jax_triton.triton_lib
    from jax.experimental import topologies

    from jaxspec.models import moe
    from jaxspec.models.sharding import Sharding

    jax_triton.triton_lib.triton_kernel_call_lib.get_compute_capability = lambda device: 90
    moe.on_gpu = lambda: True  # a sparse layer's "auto" grouped matmuls choose as on the target
    topology = topologies.get_topology_desc(platform="cuda", target_config=H200, topology=f"1x1x{devices}")
    return Sharding(topologies.make_mesh(topology, (devices, 1, 1), ("data", "fsdp", "tensor")))


def abstract(sharding, shape: tuple[int, ...], dtype, axes: tuple | None = None):
    """A `jax.ShapeDtypeStruct` of `shape` laid out on the `Sharding`'s mesh by `axes` (None: replicated)."""
    import jax

    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.named(axes or (None,) * len(shape), shape))


def compile_step(model: str, batch: int, new: int, context: int, page_size: int, devices: int = 1) -> str:
    """The optimized HLO of `extend` over `new` tokens per row for H200s, in this process: on one, or
    on a mesh of `devices` over the data axis (the rows split over them, each device's pages a group
    of the pools, as the slot engine lays them out; the weights replicated)."""
    sharding = deviceless_mesh(devices)
    import jax
    import jax.numpy as jnp

    from jaxspec.models import ModelConfig, init_params
    from jaxspec.models.paged import PagedKVCache
    from jaxspec.models.params import fuse_qkv
    from jaxspec.models.sharding import KV_PAGES_AXES
    from jaxspec.models.transformer import extend
    from jaxspec.rollout.compiler_options import rollout_compiler_options

    cfg = ModelConfig.from_json(model)

    spec = functools.partial(abstract, sharding)
    params = jax.eval_shape(lambda: fuse_qkv(init_params(cfg, jax.random.key(0), jnp.bfloat16)))
    params = jax.tree.map(lambda a: spec(a.shape, a.dtype), params)
    per_row = -(-(context + new) // page_size)
    pages = (cfg.num_kv_heads, cfg.head_dim)
    if devices == 1:
        pool = spec((batch * per_row, page_size, *pages), jnp.bfloat16)
    else:
        pool = spec((devices, batch // devices * per_row, page_size, *pages), jnp.bfloat16, KV_PAGES_AXES)
    table = spec((batch, per_row), jnp.int32, ("batch", None))
    cache = PagedKVCache(k=(pool,) * cfg.num_layers, v=(pool,) * cfg.num_layers, page_table=table)

    def step(params, cache, tokens, positions, cache_len):
        on_mesh = sharding if devices > 1 else None
        logits, _, cache = extend(cfg, params, cache, tokens, positions, cache_len, sharding=on_mesh)
        return jnp.argmax(logits, axis=-1), cache

    rows = spec((batch, new), jnp.int32, ("batch", None))
    args = (params, cache, rows, rows, spec((batch,), jnp.int32, ("batch",)))
    compiled = jax.jit(step, donate_argnums=1, compiler_options=rollout_compiler_options(cfg))
    return compiled.lower(*args).compile().as_text()


def compile_proposal(model: str, batch: int, depth: int, context: int, page_size: int) -> str:
    """The optimized HLO of an EAGLE-3 head's proposal of a `depth`-token chain at T=0 for one H200
    (`Eagle3Drafter.propose`: its pending chunk, then a pass a level), a random head of the model's
    shape over a paged head cache of `context` positions per row."""
    sharding = deviceless_mesh(1)
    import jax
    import jax.numpy as jnp

    from jaxspec.draft import DraftConfig, init_eagle3
    from jaxspec.models import ModelConfig
    from jaxspec.models.paged import PagedKVCache
    from jaxspec.models.params import fuse_qkv
    from jaxspec.rollout.compiler_options import rollout_compiler_options
    from jaxspec.rollout.sampling import Sampling
    from jaxspec.rollout.speculative.eagle3 import Eagle3Drafter, HeadState

    cfg = ModelConfig.from_json(model)
    dcfg = DraftConfig.for_policy(cfg, None, None)
    drafter = Eagle3Drafter(dcfg, Sampling(temperature=0.0), depth=depth, width=1, num_nodes=depth, stochastic=False)

    spec = functools.partial(abstract, sharding)
    head = jax.eval_shape(lambda: fuse_qkv(init_eagle3(cfg, jax.random.key(0), dtype=jnp.bfloat16)[1]))
    head = jax.tree.map(lambda a: spec(a.shape, a.dtype), head)
    per_row = -(-context // page_size)
    pool = spec((batch * per_row, page_size, dcfg.num_kv_heads, dcfg.head_dim), jnp.bfloat16)
    cache = PagedKVCache(k=(pool,), v=(pool,), page_table=spec((batch, per_row), jnp.int32))
    chunk = (batch, drafter.chunk)
    state = HeadState(
        cache, spec(chunk, jnp.int32), spec((*chunk, 3 * cfg.hidden_size), jnp.bfloat16), spec((batch,), jnp.int32)
    )

    def propose(head, embed, state, root, cache_len, active, key):
        state, tree = drafter.propose({"head": head, "embed": embed}, state, root, cache_len, active, key)
        return state, tree.tokens

    rows = spec((batch,), jnp.int32)
    args = (head, spec((cfg.vocab_size, cfg.hidden_size), jnp.bfloat16), state, rows, rows, spec((batch,), jnp.bool_))
    compiled = jax.jit(propose, donate_argnums=2, compiler_options=rollout_compiler_options(cfg))
    return compiled.lower(*args, spec((2,), jnp.uint32)).compile().as_text()


def largest_copy_bytes(hlo: str) -> int:
    """The bytes of the largest `copy` in the entry computation (0: none), e.g. of a KV pool that
    the step was meant to update in place."""
    entry = hlo[hlo.index("\nENTRY") :].split("\n}\n")[0]
    sizes = [0]
    for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\]\S* copy\(", entry):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        sizes.append(count * ITEM_BYTES.get(dtype, 4))
    return max(sizes)


def count(model: str, batch: int, new: int, setting: str, args: argparse.Namespace) -> dict:
    """One row: the step of (model, batch, new) compiled under `setting` in a child process."""
    one = ["--one", f"{model},{batch},{new}", "--devices", str(args.devices)]
    one += ["--context", str(args.context), "--page-size", str(args.page_size)] + ["--draft"] * args.draft
    env = {**os.environ, **SETTINGS[setting]}
    if args.xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    done = subprocess.run([sys.executable, __file__, *one], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"compiling {model} B={batch} T={new} {setting} failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    total = sum(result["kinds"].values())
    layers = 1 if args.draft else json.loads(Path(model).read_text())["num_hidden_layers"]  # the head: one
    row = dict(model=Path(model).stem, batch=batch, new=new, devices=args.devices, setting=setting, launches=total)
    return row | dict(
        per_layer=round(total / layers, 1), kinds=result["kinds"], largest_copy_bytes=result["largest_copy_bytes"]
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["configs/models/qwen3-1.7b.json", "configs/models/qwen3-8b.json"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--new", type=int, nargs="+", default=[1, 4], help="tokens per row (decode: 1)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--devices", type=int, default=1, help="H200s of a mesh over the data axis (grouped pools)")
    p.add_argument("--draft", action="store_true", help="an EAGLE-3 head's proposal of a --new-token chain, not a step")
    p.add_argument(
        "--xla-flags",
        default=None,
        metavar="FLAGS",
        help="XLA_FLAGS to compile under (added to the environment's), e.g. "
        "--xla_gpu_experimental_force_split_k=1: GEMMs without split-K (each split-K GEMM is a second launch, "
        "its reduction)",
    )
    p.add_argument("--out", default=None, help="JSON of every row")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's step: model,batch,new
    args = p.parse_args(argv)
    if args.draft and args.devices != 1:
        p.error("--draft compiles the proposal for one H200: --devices must be 1")

    if args.one:  # each setting compiles in a fresh process: the variables are read when traced
        model, batch, new = args.one.split(",")
        if args.draft:
            hlo = compile_proposal(model, int(batch), int(new), args.context, args.page_size)
        else:
            hlo = compile_step(model, int(batch), int(new), args.context, args.page_size, args.devices)
        print(json.dumps({"kinds": launches(hlo), "largest_copy_bytes": largest_copy_bytes(hlo)}))
        return 0
    rows = []
    for model in args.model:
        for batch in args.batch:
            for new in args.new:
                for name in args.settings:
                    rows.append(count(model, batch, new, name, args))
                    print(summary(rows[-1]))
    if args.out:
        meta = {"target": "NVIDIA H200 (deviceless compilation, sm90)", "jax": importlib.metadata.version("jax")}
        meta |= {"context": args.context, "page_size": args.page_size, "draft": args.draft}
        meta |= {"xla_flags": args.xla_flags, "rows": rows}
        Path(args.out).write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
