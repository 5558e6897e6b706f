"""Running a Triton kernel from JAX (every kernel of jaxspec): compiled for the GPU through
`jax_triton.triton_call`, or in Triton's interpreter on the host (any backend, slow).

A kernel is a plain function in the Triton language (no `@triton.jit`): `compiled` and
`interpreted` wrap it on demand, so one module serves both without TRITON_INTERPRET being set
before triton is imported. For that the kernels reduce with `tl.reduce` and the standard
library's combine functions (`MAX`, `MIN`, `SUM`) rather than tl.max / tl.min / tl.sum, fill
with tl.full rather than tl.zeros, and call no helper functions: those are `@triton.jit`
functions, which the interpreter runs only when TRITON_INTERPRET was set at import.

On a GPU every call is recorded into XLA's command buffers with the rest of the step
(`jaxspec.kernels.command_buffers`), in PTX the CUDA toolkit of JAX's plugin reads
(`jaxspec.kernels.ptx_toolchain`). `triton` is imported with this module, `jax_triton` only when a
kernel is called for a GPU, and torch only to run a kernel in the interpreter.
"""

from __future__ import annotations

import functools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from jaxspec.kernels import command_buffers, ptx_toolchain

MAX = tl.standard._elementwise_max
MIN = tl.standard._elementwise_min
SUM = tl.standard._sum_combine
INSTALL = "pip install 'jaxspec[triton]'"
_INTERPRETER = threading.Lock()  # Triton's interpreter patches triton.language while it runs a kernel


@functools.cache
def compiled(fn) -> triton.JITFunction:
    """The kernel function `fn` as Triton compiles it for a GPU."""
    return triton.jit(fn)


@functools.cache
def interpreted(fn):
    """The kernel function `fn` as Triton's interpreter runs it (on torch CPU tensors):
    `triton.jit` reads TRITON_INTERPRET when it wraps the function."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return triton.jit(fn)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def call(
    fn,
    args: tuple,
    out_shape: tuple[jax.ShapeDtypeStruct, ...],
    *,
    grid: tuple[int, ...],
    constants: dict,
    name: str,
    interpret: bool,
    num_warps: int,
    num_stages: int,
    input_output_aliases: dict[int, int] | None = None,
) -> tuple[jax.Array, ...]:
    """`fn(*args, *outputs, **constants)` over `grid`: the outputs (`out_shape`, zero-filled in the
    interpreter, every element written by the kernel), under the jax scope `name` (which a
    profile's op_name then carries). interpret runs the kernel in Triton's interpreter through
    `jax.pure_callback`; otherwise jax-triton compiles it with num_warps and num_stages.
    input_output_aliases {argument index: output index}: the output is that argument's buffer,
    updated in place by the kernel (in the interpreter: a copy of it), so a kernel may write only
    part of it."""
    aliases = dict(input_output_aliases or {})
    with jax.named_scope(name):
        if interpret:
            run = functools.partial(
                _run_interpreted, fn=fn, grid=grid, out_shape=out_shape, constants=constants, aliases=aliases
            )
            return tuple(jax.pure_callback(run, tuple(out_shape), *args))
        try:
            import jax_triton
        except ImportError as e:
            raise ImportError(
                f"the Triton kernel {name} runs through jax-triton with a GPU jaxlib ({INSTALL}): {e}"
            ) from e
        ptx_toolchain.match()
        command_buffers.install()
        return tuple(
            jax_triton.triton_call(
                *args,
                kernel=compiled(fn),
                out_shape=list(out_shape),
                grid=grid,
                num_warps=num_warps,
                num_stages=num_stages,
                name=name,
                **({"input_output_aliases": aliases} if aliases else {}),
                **constants,
            )
        )


def _run_interpreted(*arrays, fn, grid, out_shape, constants, aliases=None) -> tuple[np.ndarray, ...]:
    """The kernel in Triton's interpreter on torch CPU copies of `arrays` (numpy); the outputs as
    numpy, each aliased one (`aliases`: argument index -> output index) starting as its argument."""
    import torch

    def to_torch(x):
        x = np.asarray(x)
        if x.dtype == jnp.bfloat16:  # numpy has no bfloat16: move its bits
            return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
        return torch.from_numpy(x.copy())

    def to_numpy(t):
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(jnp.bfloat16)
        return t.numpy()

    outs = [torch.zeros(s.shape, dtype=getattr(torch, jnp.dtype(s.dtype).name)) for s in out_shape]
    for arg, out in (aliases or {}).items():
        outs[out] = to_torch(arrays[arg])
    # log(0) = -inf and 0 / 0 = nan, as on a GPU; the lock: the devices of a mesh call back at once
    with np.errstate(divide="ignore", invalid="ignore"), _INTERPRETER:
        interpreted(fn)[grid](*map(to_torch, arrays), *outs, **constants)
    return tuple(map(to_numpy, outs))
