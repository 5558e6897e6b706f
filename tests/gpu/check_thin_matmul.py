"""GPU check of the thin-matmul kernel against the exact product, beside XLA's GEMM of the same inputs.

    pytest -m gpu tests/gpu/test_thin_matmul.py         # the check, as a test
    python3 -m tests.gpu.check_thin_matmul              # exit 0 when it agrees

`thin_matmul` (`jaxspec.kernels.thin_matmul_triton` through jax-triton), compiled for the GPU in
bfloat16 at the shapes of a decode or verification step of Qwen3-1.7B and Qwen3-8B (the fused q/k/v,
the attention output, the gate/up projection with its SwiGLU, the down projection, the LM head:
tied and read transposed, float32 logits), against the product of the same bf16 inputs in float32
at the highest precision. Each element must lie within `ROUNDING` of that product relative to
|product| plus `ACCUMULATION` of sum |x| |w| (the SwiGLU form: a few roundings of each projection,
as the model rounds them); XLA's own GEMM is measured against the same bound and printed beside it.
A weight with one column scaled by 1.25 must break the agreement (the negative control). Prints every
case, and any deprecation warning raised while the kernel compiles.

The expert form (`expert_matmul`) at Qwen3-30B-A3B's experts (128, H 2048, I 768, top-8 routing of
random tokens) for 1, 64 and 256 tokens: the experts' gate and up with the SwiGLU from the gathered
token rows, and the down projection written back in token order times each row's routing weight,
against the same products by
`jax.lax.ragged_dot` in float32 at the highest precision (the SwiGLU's projections rounded as the
model rounds them; the down projection exact, within two roundings: the kernel rounds its product,
then the product times the weight, as the model does); the control gives every row its neighbouring
expert's weights.
"""

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels.expert_matmul_triton import expert_matmul
from jaxspec.kernels.thin_matmul_triton import thin_matmul
from jaxspec.models.projection import swiglu
from tests.gpu import check_main

ROUNDING = 2.0**-8  # one rounding to bfloat16, relative
ACCUMULATION = 2.0**-16  # float32 sums in another order, relative to sum |x| |w|
# name: rows, x's shape per row, w's shape, contracted dims, form ("plain", "swiglu", "transposed")
CASES = [
    ("qwen3-1.7b qkv decode", 1, (2048,), (2048, 8, 4, 128), 1, "plain"),
    ("qwen3-1.7b o verify", 128, (16, 128), (16, 128, 2048), 2, "plain"),
    ("qwen3-1.7b gate/up swiglu", 32, (2048,), (2048, 2, 6144), 1, "swiglu"),
    ("qwen3-1.7b tied lm head", 8, (2048,), (151936, 2048), 1, "transposed"),
    ("qwen3-8b qkv verify", 256, (4096,), (4096, 8, 6, 128), 1, "plain"),
    ("qwen3-8b down decode", 64, (12288,), (12288, 4096), 1, "plain"),
    ("qwen3-8b gate/up swiglu", 4, (4096,), (4096, 2, 12288), 1, "swiglu"),
    ("qwen3-8b lm head", 64, (4096,), (4096, 151936), 1, "plain"),
]


def exact(x: jax.Array, w: jax.Array, contract: int, form: str) -> tuple[np.ndarray, np.ndarray]:
    """The product in float32 at the highest precision and sum |x| |w| (its accumulation scale)."""
    x2 = x.reshape(x.shape[0], -1).astype(jnp.float32)
    w2 = (w.T if form == "transposed" else w.reshape(x2.shape[1], -1)).astype(jnp.float32)
    dot = jax.jit(lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST))
    return np.asarray(dot(x2, w2)), np.asarray(dot(jnp.abs(x2), jnp.abs(w2)))


def swiglu_exact(x: jax.Array, gate_up: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """silu(g) * u with g and u the exact projections rounded to bfloat16 (as the model rounds
    them), and the bound's scale: the accumulation error carried through the product."""
    both, scale = exact(x, gate_up, 1, "plain")
    both, scale = both.reshape(x.shape[0], 2, -1), scale.reshape(x.shape[0], 2, -1)
    gate, up = (np.float32(np.asarray(both[:, i], jnp.bfloat16)) for i in (0, 1))
    silu = np.float32(np.asarray(gate / (1 + np.exp(-gate)), jnp.bfloat16))
    return silu * up, scale.max(axis=1) * (np.abs(silu) + np.abs(up))


def worst(got, want: np.ndarray, scale: np.ndarray, units: float) -> float:
    """The largest |got - want| over its bound (units x the one-rounding bound); <= 1 agrees."""
    err = np.abs(np.float32(got).reshape(want.shape) - want)
    return float(np.max(err / (units * (ROUNDING * np.abs(want) + ACCUMULATION * scale) + 1e-30)))


def check_thin_matmul() -> bool:
    ok = True
    for i, (name, rows, x_row, w_shape, contract, form) in enumerate(CASES):
        kx, kw = jax.random.split(jax.random.key(i))
        x = jax.random.normal(kx, (rows, *x_row), jnp.bfloat16)
        fan_in = int(np.prod(x_row))
        w = (jax.random.normal(kw, w_shape) / fan_in**0.5).astype(jnp.bfloat16)
        out = jnp.float32 if form == "transposed" or w_shape[-1] == 151936 else None
        if form == "swiglu":
            kernel = jax.jit(lambda x, w: thin_matmul(x, w, swiglu=True))
            xla = jax.jit(lambda x, w: swiglu(x, w))
            want, scale = swiglu_exact(x, w)
            units = 4.0
        else:
            transposed = form == "transposed"
            kernel = jax.jit(lambda x, w: thin_matmul(x, w, contract=contract, transpose=transposed, out_dtype=out))
            xla = jax.jit(lambda x, w: jnp.tensordot(x, w.T if transposed else w, contract, preferred_element_type=out))
            want, scale = exact(x, w, contract, form)
            units = 1.0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = kernel(x, w)
        deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
        err = worst(got, want, scale, units)
        xla_err = worst(xla(x, w), want, scale, units)
        moved = w.at[..., 7].multiply(1.25) if form != "transposed" else w.at[7].multiply(1.25)
        wrong_err = worst(kernel(x, moved), want, scale, units)
        case_ok = err <= 1.0 < wrong_err and not deprecations
        ok &= case_ok
        print(
            f"thin matmul {name} ({rows} rows, w {list(w_shape)}): worst error / bound {err:.3f} (XLA's "
            f"{xla_err:.3f}); moved column: {wrong_err:.1f}; deprecations {deprecations or 'none'}: "
            f"{'OK' if case_ok else 'MISMATCH'}"
        )
    ok &= check_expert_matmul()
    print(f"thin matmul: {'OK' if ok else 'MISMATCH'}")
    return ok


def check_expert_matmul(experts: int = 128, hidden: int = 2048, inter: int = 768, top_k: int = 8) -> bool:
    ok = True
    high = jax.lax.Precision.HIGHEST
    grouped = jax.jit(lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes, precision=high))
    for tokens in (1, 64, 256):
        keys = jax.random.split(jax.random.key(100 + tokens), 6)
        x = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
        gate, up = (
            (jax.random.normal(k, (experts, hidden, inter)) / hidden**0.5).astype(jnp.bfloat16) for k in keys[1:3]
        )
        down = (jax.random.normal(keys[3], (experts, inter, hidden)) / inter**0.5).astype(jnp.bfloat16)
        picks = jax.lax.top_k(jax.random.uniform(keys[4], (tokens, experts)), top_k)[1].reshape(-1)
        ids, order = jax.lax.sort((picks, jnp.arange(picks.size, dtype=jnp.int32)), num_keys=1, is_stable=True)
        sizes = jnp.bincount(picks, length=experts).astype(jnp.int32)
        factor = jax.random.uniform(keys[5], (tokens * top_k,)).astype(jnp.bfloat16)  # token-major
        rows = x[order // top_k].astype(jnp.float32)
        g, u = (np.asarray(grouped(rows, w.astype(jnp.float32), sizes)) for w in (gate, up))
        g_scale = np.asarray(grouped(jnp.abs(rows), jnp.abs(gate.astype(jnp.float32)), sizes))
        g, u = (np.float32(np.asarray(v, jnp.bfloat16)) for v in (g, u))
        silu = np.float32(np.asarray(g / (1 + np.exp(-g)), jnp.bfloat16))
        first = jax.jit(lambda x, g, u, ids, o: expert_matmul(x, g, ids, source=o, repeat=top_k, up=u))
        second = jax.jit(lambda a, d, ids, o, f: expert_matmul(a, d, ids, dest=o, scale=f))
        act = first(x, gate, up, ids, order)
        act_err = worst(act, silu * u, g_scale * (np.abs(silu) + np.abs(u)), 4.0)
        a32, down32 = act.astype(jnp.float32), down.astype(jnp.float32)
        at = np.asarray(order)
        product, d_scale = (
            np.empty((tokens * top_k, hidden), np.float32),
            np.empty((tokens * top_k, hidden), np.float32),
        )
        # Exact, unrounded: the kernel's two roundings (its product, then times the weight) are the
        # bound's two units; a reference rounded to bfloat16 would be a third, unbudgeted rounding.
        product[at] = np.asarray(grouped(a32, down32, sizes))
        d_scale[at] = np.asarray(grouped(jnp.abs(a32), jnp.abs(down32), sizes))
        f32 = np.float32(factor)[:, None]
        out_err = worst(second(act, down, ids, order, factor), product * f32, d_scale * f32, 2.0)
        wrong_err = worst(second(act, jnp.roll(down, 1, axis=0), ids, order, factor), product * f32, d_scale * f32, 2.0)
        case_ok = act_err <= 1.0 and out_err <= 1.0 < wrong_err
        ok &= case_ok
        print(
            f"expert matmul qwen3-30b-a3b {tokens} tokens ({int((sizes > 0).sum())} experts touched): gate/up "
            f"swiglu worst error / bound {act_err:.3f}, down x routing weight {out_err:.3f}; experts moved: "
            f"{wrong_err:.1f}: {'OK' if case_ok else 'MISMATCH'}"
        )
    return ok


if __name__ == "__main__":
    sys.exit(check_main("thin_matmul", check_thin_matmul, sys.argv[1:]))
