"""The Triton modules a function's Pallas kernels lower to for CUDA, parsed and verified on any
machine: what XLA does first when it compiles them on a GPU ("Failed to parse Triton module"), so
an ill-typed kernel fails on the CPU too. Interpret mode never builds these modules."""

from __future__ import annotations

import jax
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as triton_dialect

# The GPU the modules are lowered for: JAX 0.12 takes the compute capability from the mesh's
# abstract device when no GPU is attached (older JAX falls back to 9.0, an H100/H200's, by itself).
_H200 = jax.sharding.AbstractMesh(
    (1,),
    ("gpu",),
    (jax.sharding.AxisType.Explicit,),
    abstract_device=jax.sharding.AbstractDevice("NVIDIA H200", 132, "cuda"),
)


def triton_modules(fn, *args) -> list[bytes]:
    """The serialized Triton module of every Pallas kernel in `fn(*args)` lowered for CUDA (args may
    be jax.ShapeDtypeStruct)."""
    with jax.sharding.use_abstract_mesh(_H200):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    modules = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    config = (
                        inner.attributes["mhlo.backend_config"] if "mhlo.backend_config" in inner.attributes else None
                    )
                    if inner.name == "stablehlo.custom_call" and config is not None and "ir" in config:
                        modules.append(ir.StringAttr(config["ir"]).value_bytes)
                    walk(inner)

    for op in lowered.compiler_ir("stablehlo").body.operations:
        walk(op)
    return modules


def verify_triton(fn, *args) -> int:
    """Parse and verify every Triton module of `fn(*args)`; the number verified. Raises the MLIR
    error (naming the kernel's source line) for a module Triton rejects."""
    modules = triton_modules(fn, *args)
    context = ir.Context()
    triton_dialect.register_dialect(context)
    with context:
        for module in modules:
            assert ir.Module.parse(module).operation.verify()
    return len(modules)
