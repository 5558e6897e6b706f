"""GPU check of the attention paths that only run on a GPU, against the paths the CPU tests cover.

    pytest -m gpu tests/gpu/test_attention.py                  # the check, as tests
    python3 -m tests.gpu.check_attention [cache] [ttt]         # both by default; exit 0 when they agree

cache: `cache_attention` by the Triton attention kernel (impl "triton", through jax-triton: the
`triton` extra) on the dense cache viewed as one page per row, against the exact attention of
the same bf16 values (the dense path in float32 at the highest matmul precision), in bf16 with
the small policy's heads: decode steps, chains, random trees of 6 to 40 nodes, finished rows,
new tokens past the last cache slot. The bf16 dense path is held to the same bound, and row 0's
cache replaced by row 1's must break the kernel's row 0 (the negative control).
ttt: `ttt_attention` on cuDNN against the factored XLA path at T=1152 with packed segments,
outputs and gradients, and the time of a forward and backward pass of each.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.draft.loss import ttt_attention
from jaxspec.models.attention import cache_attention

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 64
TOLERANCE = 0.05  # bf16 outputs of unit-scale inputs


def random_trees(rng, b: int, t: int) -> np.ndarray:
    mask = np.zeros((b, t, t), bool)
    for i in range(b):
        mask[i, 0, 0] = True
        for n in range(1, t):
            mask[i, n] = mask[i, rng.integers(0, n)]
            mask[i, n, n] = True
    return mask


def check_cache_attention() -> bool:
    rng = np.random.default_rng(0)
    ok = True
    for b, t, tree, max_len in [
        (8, 1, False, 300),
        (8, 4, False, 300),
        (8, 6, True, 1152),
        (4, 16, True, 500),
        (4, 40, True, 500),
        (64, 4, False, 1152),
    ]:
        ks = jax.random.split(jax.random.key(t), 3)
        q = jax.random.normal(ks[0], (b, t, HEADS, HEAD_DIM), jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, max_len, KV_HEADS, HEAD_DIM), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, max_len, KV_HEADS, HEAD_DIM), jnp.bfloat16)
        cache_len = jnp.asarray(rng.integers(0, max_len - 1, b).astype(np.int32)).at[0].set(max_len - 2)
        active = jnp.asarray(rng.random(b) < 0.7).at[0].set(True)  # row 0 reads the cache the control corrupts
        mask = jnp.asarray(random_trees(rng, b, t)) if tree else None
        with jax.default_matmul_precision("highest"):
            f32 = (x.astype(jnp.float32) for x in (q, k, v))
            want = np.asarray(cache_attention(*f32, cache_len, mask, active=active, impl="xla"))
        outs = {}
        for impl in ("xla", "triton"):
            attend = jax.jit(lambda *a, impl=impl: cache_attention(*a, active=active, impl=impl))
            outs[impl] = np.asarray(attend(q, k, v, cache_len, mask).astype(jnp.float32))
        wrong = np.asarray(attend(q, k.at[0].set(k[1]), v.at[0].set(v[1]), cache_len, mask).astype(jnp.float32))
        errors = {impl: float(np.abs(out - want).max()) for impl, out in outs.items()}
        wrong_err = float(np.abs(wrong[0] - want[0]).max())
        case_ok = max(errors.values()) < TOLERANCE and wrong_err > TOLERANCE and np.isfinite(outs["triton"]).all()
        ok &= bool(case_ok)
        print(
            f"cache attention b={b} t={t} tree={tree} max_len={max_len}: |triton-exact| {errors['triton']:.4f} "
            f"|xla-exact| {errors['xla']:.4f} |wrong cache-exact| {wrong_err:.4f}: {'OK' if case_ok else 'MISMATCH'}"
        )
    print(f"cache attention: {'OK' if ok else 'MISMATCH'}")
    return ok


def check_ttt_attention() -> bool:
    ok = True
    for b, t, steps in [(2, 1152, 0), (2, 1152, 2), (8, 1152, 2)]:
        ks = jax.random.split(jax.random.key(steps), 5)
        q = jax.random.normal(ks[0], (b, t, HEADS, HEAD_DIM), jnp.bfloat16)
        prefix_k, prefix_v = (jax.random.normal(key, (b, t, KV_HEADS, HEAD_DIM), jnp.bfloat16) for key in ks[1:3])
        own_k, own_v = (jax.random.normal(key, (b, t, steps, KV_HEADS, HEAD_DIM), jnp.bfloat16) for key in ks[3:5])
        segments = jnp.asarray(np.repeat(np.arange(1, 5), t // 4)[None].repeat(b, 0), jnp.int32)

        def loss(q, pk, pv, ok_, ov, impl):
            out = ttt_attention(q, pk, pv, ok_, ov, segments, impl)
            return (out.astype(jnp.float32) ** 2).sum() / 1e3, out

        results, seconds = {}, {}
        for impl in ("xla", "cudnn"):
            fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True), static_argnums=5)
            jax.block_until_ready(fn(q, prefix_k, prefix_v, own_k, own_v, impl))
            start = time.perf_counter()
            for _ in range(10):
                results[impl] = fn(q, prefix_k, prefix_v, own_k, own_v, impl)
            jax.block_until_ready(results[impl])
            seconds[impl] = (time.perf_counter() - start) / 10
        (_, out_x), grads_x = results["xla"]
        (_, out_c), grads_c = results["cudnn"]
        out_err = float(jnp.abs(out_x.astype(jnp.float32) - out_c.astype(jnp.float32)).max())
        grad_err = max(
            float(
                jnp.abs(gx.astype(jnp.float32) - gc.astype(jnp.float32)).max()
                / (jnp.abs(gx.astype(jnp.float32)).max() + 1e-6)
            )
            for gx, gc in zip(grads_x, grads_c)
            if gx.size
        )
        ok &= out_err < TOLERANCE and grad_err < TOLERANCE
        print(
            f"ttt b={b} t={t} S={steps}: |cudnn-xla| out {out_err:.4f} grad rel {grad_err:.4f}; fwd+bwd xla "
            f"{seconds['xla'] * 1e3:.2f} ms cudnn {seconds['cudnn'] * 1e3:.2f} ms "
            f"({seconds['xla'] / seconds['cudnn']:.2f}x)"
        )
    print(f"ttt attention: {'OK' if ok else 'MISMATCH'}")
    return ok


def main(argv: list[str]) -> int:
    if jax.default_backend() != "gpu":
        print("needs a GPU", file=sys.stderr)
        return 2
    checks = argv or ["cache", "ttt"]
    unknown = set(checks) - {"cache", "ttt"}
    if unknown:
        print(f"unknown check(s) {sorted(unknown)}: choose from cache, ttt", file=sys.stderr)
        return 2
    ok = True
    if "cache" in checks:
        ok &= check_cache_attention()
    if "ttt" in checks:
        ok &= check_ttt_attention()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
