"""The merge kernel combines the attention kernel's split partials as `attention_partials.merge` does,
and writes each query row where the model reads it.

Triton's interpreter runs the kernel's own code on the CPU on random partials with empty splits
(m = -inf), rows that see nothing in any split (their output 0), padding rows past T x G (never
written), one split and several, float32 and float16 outputs, a head dim that is not a power of
two. The expected output is `merge` (the jnp reference) moved from [B, Nk, R, D] to the model's
[B, T, Nq, D] by the index arithmetic written out in numpy (token r // G, query head kv * G + r % G);
two splits' weights exchanged must fail the comparison. Compiling the kernel for sm90 checks that it
is valid Triton for Hopper.
"""

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton", reason="the Triton kernel's tests need the triton package (the test extra has it)")
pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")

from jaxspec.kernels import attention_merge_triton as kernel  # noqa: E402
from jaxspec.kernels.attention_partials import Partials, merge  # noqa: E402
from tests.kernels.triton_compile import compile_for_hopper  # noqa: E402

# name: batch, kv heads, splits, rows R, head dim, new tokens T, group G, output dtype
CASES = {
    "decode-f32": (3, 2, 4, 16, 32, 1, 4, jnp.float32),
    "verify-f16": (2, 2, 3, 16, 16, 3, 4, jnp.float16),
    "one-split": (2, 4, 1, 16, 16, 2, 8, jnp.float32),
    "odd-head-dim": (1, 2, 2, 32, 24, 4, 6, jnp.float32),
}


def random_partials(batch, kv_heads, splits, rows, head_dim, seed=0) -> Partials:
    """Partials as the kernel returns them: some splits empty for some rows (m = -inf, l = o = 0),
    row 1 of (row 0, kv head 0) empty in every split."""
    rng = np.random.default_rng(seed)
    m = rng.normal(0, 3, (batch, kv_heads, splits, rows)).astype(np.float32)
    empty = rng.random(m.shape) < 0.3
    empty[0, 0, :, 1] = True
    m[empty] = -np.inf
    l = np.where(empty, 0.0, rng.uniform(1, 20, m.shape)).astype(np.float32)  # noqa: E741
    o = np.where(empty[..., None], 0.0, rng.normal(0, 5, (*m.shape, head_dim))).astype(np.float32)
    return Partials(jnp.asarray(o), jnp.asarray(m), jnp.asarray(l))


def in_model_layout(merged: np.ndarray, num_new: int, group: int) -> np.ndarray:
    """[B, Nk, R, D] -> [B, T, Nk * G, D]: query row r of kv head h is token r // G's query head h * G + r % G."""
    batch, kv_heads, _, head_dim = merged.shape
    out = np.zeros((batch, num_new, kv_heads * group, head_dim), merged.dtype)
    for h in range(kv_heads):
        for r in range(num_new * group):
            out[:, r // group, h * group + r % group] = merged[:, h, r]
    return out


@pytest.mark.parametrize("name", CASES)
def test_the_kernel_merges_as_the_reference(name):
    batch, kv_heads, splits, rows, head_dim, num_new, group, dtype = CASES[name]
    parts = random_partials(batch, kv_heads, splits, rows, head_dim)
    got = kernel.merge_partials(parts, num_new=num_new, group=group, dtype=dtype, interpret=True)
    assert got.shape == (batch, num_new, kv_heads * group, head_dim) and got.dtype == dtype
    want = in_model_layout(np.asarray(merge(parts)), num_new, group)
    tol = 1e-6 if dtype == jnp.float32 else 2.0**-10
    np.testing.assert_allclose(np.float32(got), np.asarray(want, dtype).astype(np.float32), rtol=tol, atol=tol)
    if name == "decode-f32":
        assert np.all(np.asarray(got)[0, 0, 1] == 0.0)  # row 1 of (row 0, kv head 0) saw nothing


def test_exchanged_split_weights_fail_the_comparison():
    """The control: the reference with two splits' normalisers l exchanged disagrees."""
    batch, kv_heads, splits, rows, head_dim, num_new, group, dtype = CASES["decode-f32"]
    parts = random_partials(batch, kv_heads, splits, rows, head_dim)
    got = kernel.merge_partials(parts, num_new=num_new, group=group, dtype=dtype, interpret=True)
    swapped = parts._replace(l=parts.l[:, :, ::-1])
    want = in_model_layout(np.asarray(merge(swapped)), num_new, group)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_too_few_rows_raise():
    parts = random_partials(1, 2, 2, 16, 16)
    with pytest.raises(ValueError, match=r"R >= num_new x group = 20"):
        kernel.merge_partials(parts, num_new=5, group=4, dtype=jnp.float32, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "splits, rows, head_dim, num_new, group", [(8, 16, 128, 1, 2), (4, 64, 128, 4, 16), (1, 128, 64, 16, 8)]
)
def test_the_kernel_compiles_for_hopper(splits, rows, head_dim, num_new, group, dtype):
    """Triton compiles the kernel for sm90 at decode and verification shapes (2 to 16 query heads
    per kv head, up to 128 query rows) with the warps it launches with."""
    constants = kernel.launch_constants(8, splits, rows, head_dim, num_new=num_new, group=group)
    warps = kernel.default_num_warps(rows, head_dim)
    compile_for_hopper(kernel._merge_partials, [jnp.float32] * 3 + [dtype], constants, num_warps=warps, num_stages=1)
