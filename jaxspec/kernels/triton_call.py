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
import inspect
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
    input_output_aliases {argument index: output index}: the output is that argument updated in
    place (its buffer on a GPU, a copy in the interpreter), so a kernel may write only part of it.
    The kernel writes it through the argument's pointer and never reads the output's own parameter:
    jax-triton 0.3 passes the buffer there a second time, 0.4 (which passes an argument updated in
    place as a `jax.Ref`, once) gets a 0 for it."""
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
        launch = dict(kernel=compiled(fn), grid=grid, num_warps=num_warps, num_stages=num_stages, name=name)
        if "out_type" not in inspect.signature(jax_triton.triton_call).parameters:  # jax-triton 0.3
            aliased = {"input_output_aliases": aliases} if aliases else {}
            return tuple(jax_triton.triton_call(*args, out_shape=list(out_shape), **launch, **aliased, **constants))
        refs = {arg: jax.new_ref(args[arg]) for arg in aliases}
        out_params = launch["kernel"].arg_names[len(args) : len(args) + len(out_shape)]
        unread = {out_params[out]: 0 for out in aliases.values()}
        free = [shape for out, shape in enumerate(out_shape) if out not in aliases.values()]
        args = [refs.get(i, a) for i, a in enumerate(args)]
        written = iter(jax_triton.triton_call(*args, out_type=free, **launch, **unread, **constants))
        updated = {out: refs[arg][...] for arg, out in aliases.items()}
        return tuple(updated[out] if out in updated else next(written) for out in range(len(out_shape)))


def _run_interpreted(*arrays, fn, grid, out_shape, constants, aliases=None) -> tuple[np.ndarray, ...]:
    """The kernel in Triton's interpreter on torch CPU copies of `arrays` (numpy); the outputs as
    numpy, each aliased one (`aliases`: argument index -> output index) its argument's copy, passed
    to the kernel as both."""
    inputs = list(map(to_torch, arrays))
    outs = [zeros_torch(s) for s in out_shape]
    for arg, out in (aliases or {}).items():
        outs[out] = inputs[arg]
    interpret(fn, grid, *inputs, *outs, **constants)
    return tuple(map(to_numpy, outs))


def interpret(fn, grid, *args, **kwargs) -> None:
    """`fn` over `grid` in Triton's interpreter on torch CPU tensors (updated in place)."""
    # log(0) = -inf and 0 / 0 = nan, as on a GPU; the lock: the devices of a mesh call back at once
    with np.errstate(divide="ignore", invalid="ignore"), _INTERPRETER:
        interpreted(fn)[grid](*args, **kwargs)


def to_torch(x):
    """A torch CPU copy of the array `x` (numpy has no bfloat16: its bits are moved)."""
    import torch

    x = np.asarray(x)
    if x.dtype == jnp.bfloat16:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def zeros_torch(shape: jax.ShapeDtypeStruct):
    """A torch CPU tensor of zeros of `shape`'s shape and dtype."""
    import torch

    return torch.zeros(shape.shape, dtype=getattr(torch, jnp.dtype(shape.dtype).name))


def to_numpy(t) -> np.ndarray:
    """The torch CPU tensor `t` as numpy (bfloat16 by its bits)."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    return t.numpy()
