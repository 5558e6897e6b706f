"""`jax_triton` stood in for on a machine without a GPU jaxlib: its `triton_call` runs the kernel it
is given in Triton's interpreter, so the GPU path of a `jaxspec.kernels.triton_call` kernel (the
arrays, outputs and constexprs it hands jax-triton) traces and runs on the CPU. The interpreter
cannot multiply bfloat16: run float32 or float16 through it. `kernels_in` names the kernels a
jaxpr calls in the interpreter (either path)."""

from __future__ import annotations

import functools
import re
import sys
import types

import jax


def triton_call(*args, kernel, out_shape, grid, num_warps, num_stages, name, input_output_aliases=None, **constants):
    from jaxspec.kernels import triton_call as kernel_calls  # imports triton

    assert num_warps >= 1 and num_stages >= 1 and name
    assert sorted(kernel.arg_names[len(args) + len(out_shape) :]) == sorted(constants)  # and no more pointers
    aliases = dict(input_output_aliases or {})
    assert all(args[i].shape == out_shape[o].shape and args[i].dtype == out_shape[o].dtype for i, o in aliases.items())
    run = functools.partial(
        kernel_calls._run_interpreted,
        fn=kernel.fn,
        grid=grid,
        out_shape=tuple(out_shape),
        constants=constants,
        aliases=aliases,
    )
    return jax.pure_callback(run, tuple(out_shape), *args)


def install(monkeypatch) -> None:
    """`import jax_triton` gives this module's stand-in until the test ends."""
    monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_call=triton_call))


def kernels_in(jaxpr: str) -> set[str]:
    """The names of the kernel functions that `str(jaxpr)` runs in Triton's interpreter."""
    return set(re.findall(r"_run_interpreted at \w+>, fn=<function (\w+) at", jaxpr))


def kernel_calls(run, *args, wrapper: str, kernel: str | None = None) -> int:
    """How many times `run(*args)` calls the jitted kernel wrapper named `wrapper` (e.g.
    "residual_norm"), counted at its call sites once its kernel (default `_<wrapper>`) is in the
    traced program (a jaxpr prints a jitted function's body once); traced afresh, under the
    variables set now."""
    jax.clear_caches()
    jaxpr = str(jax.make_jaxpr(run)(*args))
    return len(re.findall(rf"name={wrapper}\b", jaxpr)) if (kernel or f"_{wrapper}") in kernels_in(jaxpr) else 0
