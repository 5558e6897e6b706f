"""jaxspec's Triton kernels recorded into XLA's command buffers (CUDA graphs) with the rest of a step.

jax-triton lowers a kernel to a custom call of jaxlib's Triton launcher, which XLA runs from the host
on its own: it cuts the step's command buffer around every kernel. On an H100 that costs ~8-10 us of
host time per kernel against ~2 us of device time for a norm, which made the residual-norm, prologue
and merge kernels slower than XLA's pieces in a Qwen3-1.7B decode step, while the same kernels in
the step's graph make it 1.09-1.14x faster (lease SS, `benchmarks/results/ss_h100/`).

jaxlib also registers that launcher as a typed-FFI handler (`triton_kernel_call_ffi`), with an
`initialize` stage that loads the kernel before a graph is captured, but without XLA's
command-buffer trait. `install` registers the same handler again under TARGET with the trait and
lowers every jax-triton call to TARGET: the same kernel and launch parameters (jax-triton's
compressed launch proto becomes the typed call's `opaque` attribute), the same aliasing.

JAXSPEC_TRITON_COMMAND_BUFFERS="off" keeps jax-triton's own lowering (a kernel outside the graphs).
`in_graphs` says whether the kernels run inside the graphs here: the small kernels of a decoder layer
(residual norm, attention prologue, attention merge) are the default ("auto") only where they do.
"""

from __future__ import annotations

import functools
import logging
import os

import jax
from jax._src.lib.mlir import ir
from jax.interpreters import mlir

TARGET = "jaxspec_triton_kernel_call"
ENV = "JAXSPEC_TRITON_COMMAND_BUFFERS"
LAUNCHER = "triton_kernel_call_ffi"  # jaxlib's typed-FFI Triton launcher

logger = logging.getLogger(__name__)


@functools.cache
def install() -> bool:
    """Registers TARGET and jax-triton's lowering to it on CUDA, once; False (nothing changed) where
    JAXSPEC_TRITON_COMMAND_BUFFERS is "off", the CUDA jaxlib has no launcher that loads kernels
    before graph capture, or its plugin registers no target with the command-buffer trait (jaxlib
    0.10, Python 3.11's newest)."""
    setting = os.environ.get(ENV, "on")
    if setting not in ("on", "off"):
        raise ValueError(f"{ENV}={setting!r}: expected 'on' or 'off'")
    if setting == "off":
        return False
    from jax._src.lib import gpu_triton

    plugin = getattr(gpu_triton, "_cuda_triton", None)
    if plugin is None:  # no CUDA jaxlib
        return False
    stages = plugin.registrations().get(LAUNCHER)
    if not stages or "initialize" not in stages:
        from jax._src.lib import version_str as jaxlib_version

        logger.warning(
            "jaxlib %s's Triton launcher has no 'initialize' stage (stages: %s), so it cannot run inside "
            "XLA's CUDA graphs: Triton kernels launch on their own and the layer kernels' 'auto' stays on "
            "XLA's pieces",
            jaxlib_version,
            ", ".join(sorted(stages or ())),
        )
        return False
    from jax_triton import triton_lib
    from jaxlib import xla_client

    traits = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
    try:
        jax.ffi.register_ffi_target(TARGET, stages, platform="CUDA", api_version=1, traits=traits)
    except jax.errors.JaxRuntimeError as e:  # jaxlib 0.10's CUDA plugin: "does not support custom call traits"
        logger.warning(
            "jaxlib's CUDA plugin refuses a Triton launcher with XLA's command-buffer trait (%s): Triton kernels "
            "launch on their own and the layer kernels' 'auto' stays on XLA's pieces",
            e,
        )
        return False
    # jax-triton 0.3 builds its CUDA target with get_cuda_backend, 0.4 with make_cuda_target
    backend = getattr(triton_lib, "get_cuda_backend", None) or triton_lib.make_cuda_target
    jax_triton_rule = functools.partial(triton_lib.triton_kernel_call_lowering, backend)
    mlir.register_lowering(
        triton_lib.triton_kernel_call_p, functools.partial(as_typed_call, jax_triton_rule), platform="cuda"
    )
    return True


def in_graphs() -> bool:
    """Whether jaxspec's Triton kernels run inside XLA's command buffers here: the default backend is
    a GPU, jax-triton imports and `install` succeeded (it is called when this is)."""
    if jax.default_backend() != "gpu":
        return False
    try:
        import jax_triton  # noqa: F401
    except ImportError:
        return False
    return install()


def layer_kernel_default(on_mesh: bool) -> str:
    """What "auto" picks for a decoder layer's small kernels (residual norm, attention prologue):
    "triton" where the Triton kernels run inside the graphs (`in_graphs`), off a mesh (on a mesh until
    the sharded kernels have run in a multi-GPU check); else "xla"."""
    return "triton" if not on_mesh and in_graphs() else "xla"


def as_typed_call(rule, ctx: mlir.LoweringRuleContext, *args: ir.Value, **params) -> list[ir.Value]:
    """`rule`'s custom call (jax-triton's lowering of one kernel call) replaced by a typed-FFI call to
    TARGET with the same operands, launch proto, aliasing (params' input_output_aliases) and side
    effect."""
    results = rule(ctx, *args, **params)
    op = results[0].owner
    op = getattr(op, "operation", op)
    proto, side_effect = launch_proto(op), ir.BoolAttr(op.attributes["has_side_effect"]).value
    op.erase()
    aliases = dict(params.get("input_output_aliases") or {})
    typed = jax.ffi.ffi_lowering(TARGET, operand_output_aliases=aliases, has_side_effect=side_effect)
    return typed(ctx, *args, opaque=proto)


def launch_proto(op: ir.Operation) -> bytes:
    """The compressed launch proto of jax-triton's custom call `op`: its backend_config string
    (0.3's legacy call) or its typed call's `opaque` attribute (0.4)."""
    if "mhlo.backend_config" in op.attributes:
        return ir.StringAttr(ir.DictAttr(op.attributes["mhlo.backend_config"])["opaque"]).value_bytes
    return ir.StringAttr(op.attributes["backend_config"]).value_bytes
