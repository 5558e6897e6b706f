"""An experiment: jaxspec's Triton kernels launched inside XLA's command buffers (CUDA graphs).

Every jaxspec kernel runs through jax-triton, whose lowering (0.3.x) emits a legacy custom call,
`triton_kernel_call`. XLA records a custom call into a command buffer only when it is a typed-FFI
handler registered as command-buffer compatible, so each kernel is launched by the host on its own
and cuts the step's graph around it; lease RR's profile and `bench layer-kernels` suggest ~8-10 us
of host time per such launch against ~2 us of device time for a norm or the prologue. jaxlib also
registers the same launcher as a typed-FFI handler (`triton_kernel_call_ffi`), without the trait.

This script registers that handler again under its own name with the command-buffer trait, makes
jax-triton's lowering emit it (the same kernel and launch parameters, as the typed-FFI call's
`opaque` attribute), and then runs a jaxspec command in this process, e.g. the decode benchmark:

    env JAXSPEC_ATTENTION_MERGE=triton JAXSPEC_ATTENTION_PROLOGUE=triton JAXSPEC_RESIDUAL_NORM=triton \\
      python3 benchmarks/triton_command_buffers.py bench decode --model configs/models/qwen3-1.7b.json \\
      --batch 1 8 --prompt 768 --new 512 --iters 2 --peer none --out decode_graphs.json

Compare with the same command through `python3 -m jaxspec.cli` in the same lease; `-m MODULE ...`
runs a module instead (a GPU check: `-m tests.gpu.check_residual_norm`). A GPU only
(jax-triton 0.3.x on a CUDA jaxlib). `--check-lowering` needs no GPU, only the CUDA jaxlib plugin and
jax-triton: it lowers Qwen3-1.7B's decode step for an H200 (`compiled_kernels.compile_step`) and
exits non-zero unless every Triton call is the typed-FFI call to this script's target.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import jax

TARGET = "jaxspec_triton_kernel_call"


def register_target() -> None:
    """jaxlib's typed-FFI Triton launcher under TARGET, command-buffer compatible (before JAX's
    backends start)."""
    from jax._src.lib import gpu_triton
    from jaxlib import xla_client

    stages = gpu_triton._cuda_triton.registrations()["triton_kernel_call_ffi"]
    compatible = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
    jax.ffi.register_ffi_target(TARGET, stages, platform="CUDA", api_version=1, traits=compatible)


def redirect_lowering() -> None:
    """jax-triton's lowering, emitting TARGET as a typed-FFI call: its legacy call's backend config
    (the zlib-compressed launch proto) becomes the `opaque` attribute the FFI handler reads."""
    import jax_triton.triton_lib as triton_lib

    def typed_ffi_lowering(name, *, api_version, backend_config, **kwargs):
        rule = jax.ffi.ffi_lowering(TARGET, api_version=4, **kwargs)
        return lambda ctx, *args: rule(ctx, *args, opaque=backend_config)

    class JaxWithTypedFfi(types.ModuleType):
        ffi = types.SimpleNamespace(ffi_lowering=typed_ffi_lowering)

        def __getattr__(self, name):
            return getattr(jax, name)

    triton_lib.jax = JaxWithTypedFfi("jax")


def check_lowering() -> int:
    """Prints the Triton custom calls of Qwen3-1.7B's decode step lowered for an H200 (no device)
    by target and form; exit 1 unless every one is TARGET as a typed-FFI call (its attributes a
    dictionary holding the opaque launch proto)."""
    import collections
    import re

    sys.path.insert(0, str(Path(__file__).parent))
    from compiled_kernels import compile_step

    lowered = compile_step("configs/models/qwen3-1.7b.json", 1, 1, 1024, 16, lowered=True)
    calls = re.findall(r"stablehlo\.custom_call @(\w*triton\w*)\((.*)", lowered)
    forms = collections.Counter((target, "mhlo.backend_config = {opaque" in rest) for target, rest in calls)
    print(dict(forms))
    return 0 if calls and set(forms) == {(TARGET, True)} else 1


if __name__ == "__main__":
    register_target()
    redirect_lowering()
    if sys.argv[1:] == ["--check-lowering"]:
        raise SystemExit(check_lowering())
    if sys.argv[1:2] == ["-m"]:
        import runpy

        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
        raise SystemExit(0)
    from jaxspec.cli import main

    raise SystemExit(main(sys.argv[1:]))
