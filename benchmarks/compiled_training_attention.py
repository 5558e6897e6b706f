"""The attention XLA compiles a training step over packed rows into for H200s, on one or on a mesh:
no GPU needed.

A loss gradient of a model config's forward over packed rows (random weights, rows of --seq tokens
holding sequences separated by segment ids, cuDNN flash attention) is compiled without a device
(deviceless ahead-of-time compilation, as in `compiled_kernels.py`) under each
JAXSPEC_PACKED_ATTENTION layout, on one H200 and on the meshes given (rows over data, heads over
tensor, the weights laid out by the sharding rules). Each row of the table: the layout, the mesh,
the attention custom calls, the shape one device's forward call computes ([rows, heads, T, D]: how
JAX's partitioning split it), the [rows, 1, T, T] buffers (the segment mask's bias) and the
collectives of the step. The packed layout should split as the mask's calls do and add no
collective.

Needs the CUDA jaxlib plugin (`pip install 'jax[cuda12]'`; the CUDA libraries load without a
driver); runs with JAX_PLATFORMS=cpu, which this script sets. cuDNN's compute-capability check and
jaxspec's Hopper check are answered for the target (9.0).

    python3 benchmarks/compiled_training_attention.py --meshes 1,1 2,1 1,2 2,2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.update(JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
COLLECTIVES = ("all-reduce", "all-reduce-start", "reduce-scatter", "all-gather", "all-gather-start", "all-to-all")


def compile_gradient(model: str, layout: str, data: int, tensor: int, rows: int, seq: int) -> str:
    """The optimized HLO of the packed-row loss gradient under JAXSPEC_PACKED_ATTENTION=`layout` on a
    (data, 1, tensor) mesh of H200s."""
    os.environ["JAXSPEC_PACKED_ATTENTION"] = layout
    import jax
    import jax.numpy as jnp
    from jax._src.cudnn import fused_attention_stablehlo
    from jax.experimental import topologies

    from benchmarks.compiled_kernels import H200
    from jaxspec.models import ModelConfig, forward, init_params, packed_attention
    from jaxspec.models.sharding import Sharding, param_shardings

    fused_attention_stablehlo.check_compute_capability = lambda capability: True
    packed_attention.hopper_or_newer = lambda: True
    topology = topologies.get_topology_desc(platform="cuda", target_config=H200, topology=f"1x1x{data * tensor}")
    sharding = Sharding(topologies.make_mesh(topology, (data, 1, tensor), ("data", "fsdp", "tensor")))
    cfg = ModelConfig.from_json(model)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), jnp.bfloat16))
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, param_shardings(sharding, shapes)
    )
    tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=sharding.named(("batch", None), (rows, seq)))

    def loss(params, tokens, segment_ids):
        logits = forward(
            cfg,
            params,
            tokens,
            mask=segment_ids > 0,
            segment_ids=segment_ids,
            attention_impl="cudnn",
            sharding=sharding,
        )
        return jnp.where((segment_ids > 0)[..., None], logits, 0.0).sum()

    return jax.jit(jax.grad(loss)).lower(params, tokens, tokens).compile().as_text()


def describe(hlo: str, rows: int, seq: int) -> dict:
    """The attention calls, one device's forward call shape, mask-sized buffers and collectives."""
    calls = sorted(set(re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', hlo)))
    forward_call = next(
        line for line in hlo.splitlines() if re.search(r'custom_call_target="__cudnn\$fmha\w*Softmax"', line)
    )
    shape = re.search(r"= \(\w+\[([\d,]+)\]", forward_call).group(1)
    masks = len(re.findall(rf"\[\d+,1,{seq},{seq}\]", hlo))
    collectives = {op: len(re.findall(rf" {op}\(", hlo)) for op in COLLECTIVES}
    collectives = {op: n for op, n in collectives.items() if n}
    # XLA schedules some all-reduces as async pairs and others not, differently per compilation: the total compares
    return dict(
        calls=calls, device_call=shape, mask_buffers=masks, collectives=sum(collectives.values()), by_kind=collectives
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="configs/models/small-policy.json")
    p.add_argument("--meshes", nargs="+", default=["1,1", "2,1", "1,2", "2,2"], help="data,tensor sizes")
    p.add_argument("--rows", type=int, default=4, help="packed rows of the step (divisible by every data size)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per row")
    p.add_argument("--out", default=None, help="JSON of every row")
    args = p.parse_args(argv)
    results = []
    for mesh in args.meshes:
        data, tensor = (int(n) for n in mesh.split(","))
        for layout in ("mask", "packed"):
            hlo = compile_gradient(args.model, layout, data, tensor, args.rows, args.seq)
            results.append(dict(layout=layout, data=data, tensor=tensor) | describe(hlo, args.rows, args.seq))
            print(json.dumps(results[-1]))
    if args.out:
        meta = dict(target="NVIDIA H200 (deviceless compilation, sm90)", model=args.model, rows=args.rows, seq=args.seq)
        Path(args.out).write_text(json.dumps(meta | {"results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
