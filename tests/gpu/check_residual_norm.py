"""GPU check of the residual-norm kernel against the model's own add and RMS norm it replaces.

    pytest -m gpu tests/gpu/test_residual_norm.py         # the check, as a test
    python3 -m tests.gpu.check_residual_norm              # exit 0 when they agree

`residual_norm` (`jaxspec.kernels.residual_norm_triton` through jax-triton), compiled for the GPU
in bfloat16, against `residual_norm_reference` (XLA) on the same inputs at the model widths
(Qwen3-1.7B's 2048, Qwen3-8B's 4096, Qwen2.5-14B's 5120), for a decode step's rows and a
verification step's, with a sublayer's output to add and without (a first norm). The sums must be
equal bit for bit, each normed element within `TOLERANCE` of the reference relative to
max(1, |reference|) (one reduction order against another); a weight with one channel moved by 25%
must break the agreement (the negative control). Prints every
case, and any deprecation warning raised while the kernel compiles.
"""

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels.residual_norm_triton import residual_norm
from jaxspec.models.residual_norm import residual_norm_reference
from tests.gpu import check_main

EPS = 1e-6
TOLERANCE = 2.0**-6  # relative to max(1, |reference|): 2 units in the last place of bfloat16
CASES = [  # (name, rows, channels, with a delta)
    ("qwen3-1.7b decode", 8, 2048, True),
    ("qwen3-8b decode", 64, 4096, True),
    ("qwen3-8b verify", 256, 4096, True),
    ("qwen3-8b first norm", 64, 4096, False),
    ("14b-wide decode", 4, 5120, True),
]


def relative_error(got: jax.Array, want: jax.Array) -> float:
    """The largest |got - want| / max(1, |want|) over the elements."""
    got, want = np.float32(got), np.float32(want)
    return float((np.abs(got - want) / np.maximum(1.0, np.abs(want))).max())


def check_residual_norm() -> bool:
    ok = True
    for i, (name, rows, channels, with_delta) in enumerate(CASES):
        kx, kd, kw = jax.random.split(jax.random.key(i), 3)
        x = 4.0 * jax.random.normal(kx, (rows, 1, channels), jnp.bfloat16)
        delta = jax.random.normal(kd, (rows, 1, channels), jnp.bfloat16) if with_delta else None
        weight = (1 + 0.3 * jax.random.normal(kw, (channels,))).astype(jnp.bfloat16)
        want = jax.jit(residual_norm_reference, static_argnums=3)(x, delta, weight, EPS)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = residual_norm(x, delta, weight, eps=EPS)
        deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
        sums_differ = int(np.sum(np.asarray(got[0] != want[0])))
        err = relative_error(got[1], want[1])
        moved = residual_norm(x, delta, weight.at[channels // 3].multiply(1.25), eps=EPS)
        wrong_err = relative_error(moved[1], want[1])
        case_ok = sums_differ == 0 and err < TOLERANCE < wrong_err and not deprecations
        ok &= case_ok
        print(
            f"residual norm {name} ({rows} x {channels}): sums differing {sums_differ}, |kernel-reference| "
            f"{err:.4f} (bound {TOLERANCE:.4f}); moved weight: {wrong_err:.4f}; deprecations "
            f"{deprecations or 'none'}: {'OK' if case_ok else 'MISMATCH'}"
        )
    print(f"residual norm: {'OK' if ok else 'MISMATCH'}")
    return ok


if __name__ == "__main__":
    sys.exit(check_main("residual_norm", check_residual_norm, sys.argv[1:]))
