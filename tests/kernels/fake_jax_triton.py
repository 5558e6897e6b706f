"""`jax_triton` stood in for on a machine without a GPU jaxlib: its `triton_call` runs the kernel it
is given in Triton's interpreter, so the GPU path of a `jaxspec.kernels.triton_call` kernel (the
arrays, outputs and constexprs it hands jax-triton) traces and runs on the CPU, in the call of
jax-triton 0.3 (`triton_call`) or of 0.4 (`triton_call_04`). The interpreter cannot multiply
bfloat16: run float32 or float16 through it. `kernels_in` names the kernels a jaxpr calls in the
interpreter (either path)."""

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


def triton_call_04(*args, kernel, out_type, grid, num_warps, num_stages, name, **kwargs):
    """jax-triton 0.4's call: the operands fill the kernel's parameters by position, then by keyword
    (the other keywords are its constexprs); each parameter left without one is an output, in
    `out_type`'s order; a `jax.Ref` operand is updated in place, in no output; an int operand is a
    static scalar."""
    from jaxspec.kernels import triton_call as kernel_calls

    assert num_warps >= 1 and num_stages >= 1 and name
    names = [p.name for p in kernel.params if not p.is_constexpr]
    operands = dict(zip(names, args)) | {key: value for key, value in kwargs.items() if key in names}
    constants = {key: value for key, value in kwargs.items() if key not in names}
    assert sorted(constants) == sorted(p.name for p in kernel.params if p.is_constexpr)
    missing = [name for name in names if name not in operands]
    assert len(missing) == len(out_type), f"out_type has {len(out_type)} outputs, {len(missing)} parameters unbound"
    refs = [name for name in names if isinstance(operands.get(name), jax.Ref)]
    arrays = [name for name in names if name in operands and not isinstance(operands[name], int)]

    def run(*values):
        given = dict(zip(arrays, map(kernel_calls.to_torch, values)))
        outs = dict(zip(missing, map(kernel_calls.zeros_torch, out_type)))
        params = {name: given.get(name, operands.get(name, outs.get(name))) for name in names}
        kernel_calls.interpret(kernel.fn, grid, **params, **constants)
        return tuple(kernel_calls.to_numpy(t) for t in [*outs.values(), *(given[name] for name in refs)])

    values = [operands[name][...] if name in refs else operands[name] for name in arrays]
    shapes = tuple(out_type) + tuple(jax.ShapeDtypeStruct(operands[n].shape, operands[n].dtype) for n in refs)
    results = jax.pure_callback(run, shapes, *values)
    for name, value in zip(refs, results[len(out_type) :]):
        operands[name][...] = value
    return list(results[: len(out_type)])


def install(monkeypatch, version: str = "0.3") -> None:
    """`import jax_triton` gives this module's stand-in for jax-triton `version` ("0.3" or "0.4")
    until the test ends."""
    call = {"0.3": triton_call, "0.4": triton_call_04}[version]
    monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_call=call))


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
