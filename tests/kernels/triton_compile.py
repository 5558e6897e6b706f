"""Triton's own compiler run on a kernel for an H100/H200 (sm90) on any machine, down to a cubin,
with the constexprs and the 16-byte pointer alignment jax-triton gives it: a kernel that is not a
valid GPU program (a shape, dtype or operation the compiler rejects) fails on the CPU, where
Triton's interpreter would run it."""

from __future__ import annotations

import jax.numpy as jnp
import triton
from triton.backends.compiler import GPUTarget

from jaxspec.kernels.triton_call import compiled

POINTEE = {jnp.bfloat16: "bf16", jnp.float16: "fp16", jnp.float32: "fp32", jnp.int32: "i32"}


def compile_for_hopper(fn, pointer_dtypes: list, constants: dict, *, num_warps: int = 4, num_stages: int = 3):
    """The kernel function `fn` (a `jaxspec.kernels.triton_call` kernel) compiled for sm90, its
    pointer arguments (inputs then outputs) of `pointer_dtypes`; the compiled kernel."""
    kernel = compiled(fn)
    pointers = [f"*{POINTEE[dtype]}" for dtype in pointer_dtypes]
    signature = {**dict(zip(kernel.arg_names, pointers)), **{name: "constexpr" for name in constants}}
    assert list(signature) == kernel.arg_names, "pointer_dtypes and constants must name every argument"
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
