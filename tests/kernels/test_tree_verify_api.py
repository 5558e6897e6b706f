"""`jaxspec.kernels.tree_verify`: input validation, implementation dispatch, use under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import kernels
from jaxspec.kernels import tree_stochastic_triton, tree_verify, tree_verify_triton
from jaxspec.kernels.tree_verify_reference import verification_noise

B, N, V = 2, 4, 16


def valid_args():
    logits = jax.random.normal(jax.random.key(0), (B, N, V))
    parents = jnp.array([[-1, 0, 1, 1], [-1, 0, 0, 2]], jnp.int32)
    tokens = jnp.array([[0, 3, 4, 5], [0, 6, 7, 8]], jnp.int32)
    return logits, parents, tokens, jnp.array([4, 3], jnp.int32)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: (a[0][0],) + a[1:], "logits must be a float array"),
        (lambda a: (a[0].astype(jnp.int32),) + a[1:], "logits must be a float array"),
        (lambda a: (a[0], a[1][:, :3]) + a[2:], "parents must have shape"),
        (lambda a: a[:2] + (a[2][:1],) + a[3:], "draft_tokens must have shape"),
        (lambda a: a[:3] + (jnp.array([4, 3, 1]),), "num_nodes must have shape"),
        (lambda a: (a[0], a[1].astype(jnp.float32)) + a[2:], "parents must be an integer array"),
        (lambda a: a[:3] + (jnp.array([4, 5]),), r"num_nodes must be in \[1, 4\]"),
        (lambda a: a[:3] + (jnp.array([0, 3]),), r"num_nodes must be in \[1, 4\]"),
        (lambda a: (a[0], a[1].at[1, 0].set(0)) + a[2:], r"parents\[:, 0\] must be -1"),
        (lambda a: (a[0], a[1].at[0, 2].set(2)) + a[2:], r"parents\[0, 2\] = 2 must be in \[0, 2\)"),
        (lambda a: (a[0], a[1].at[1, 1].set(-1)) + a[2:], r"parents\[1, 1\] = -1"),
        (lambda a: a[:2] + (a[2].at[0, 3].set(V),) + a[3:], r"draft_tokens\[0, 3\] = 16 is outside the vocabulary"),
    ],
)
def test_invalid_inputs_name_the_argument(change, message):
    with pytest.raises(ValueError, match=message):
        tree_verify(*change(valid_args()), jax.random.key(0), temperature=1.0)


def test_padding_values_are_not_checked():
    """Nodes past num_nodes may hold anything (row 1 has 3 valid nodes): no error, and the result
    is the one with well-formed padding."""
    logits, parents, tokens, num = valid_args()
    clean = tree_verify(logits, parents, tokens, num, jax.random.key(0), temperature=1.0)
    junk = tree_verify(
        logits, parents.at[1, 3].set(7), tokens.at[1, 3].set(-5), num, jax.random.key(0), temperature=1.0
    )
    for want, got in zip(clean, junk):
        np.testing.assert_array_equal(got, want)


def test_auto_dispatches_to_the_triton_kernels_on_gpu(monkeypatch):
    """ "auto" runs the Triton kernels when JAX's default backend is a GPU, the reference elsewhere;
    sampled drafts (draft_probs, temperature > 0) run their own kernel where the others run theirs,
    and the reference when it is asked for, by argument or environment (what runs on the GPU
    itself is not testable on CPU: only the choice is)."""
    calls = []
    monkeypatch.setattr(tree_verify_triton, "verify_triton", lambda *a, **kw: calls.append(("triton", kw["interpret"])))
    monkeypatch.setattr(kernels, "verify_reference", lambda *a, **kw: calls.append(("reference", None)))
    monkeypatch.setattr(
        tree_stochastic_triton,
        "verify_stochastic_triton",
        lambda *a, **kw: calls.append(("stochastic", kw["interpret"])),
    )
    monkeypatch.setattr(kernels, "_jax_triton_imports", lambda: True)
    args = valid_args()
    q = jnp.ones_like(args[0])
    tree_verify(*args, jax.random.key(0), temperature=1.0)
    tree_verify(*args, jax.random.key(0), temperature=1.0, draft_probs=q)
    tree_verify(*args, jax.random.key(0), temperature=1.0, draft_probs=q, impl="triton-interpret")
    tree_verify(*args, jax.random.key(0), temperature=0.0, impl="triton-interpret")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    tree_verify(*args, jax.random.key(0), temperature=1.0)
    tree_verify(*args, jax.random.key(0), temperature=1.0, draft_probs=q)
    tree_verify(*args, jax.random.key(0), temperature=1.0, draft_probs=q, impl="triton")
    tree_verify(*args, jax.random.key(0), temperature=1.0, draft_probs=q, impl="reference")
    tree_verify(*args, jax.random.key(0), temperature=0.0, draft_probs=q, impl="triton")  # greedy: no q
    monkeypatch.setenv(kernels.IMPL_ENV, "triton")
    tree_verify(*args, jax.random.key(0), temperature=1.0, draft_probs=q)
    monkeypatch.setenv(kernels.IMPL_ENV, "reference")
    tree_verify(*args, jax.random.key(0), temperature=1.0, draft_probs=q)
    assert calls == [
        ("reference", None),
        ("reference", None),
        ("stochastic", True),
        ("triton", True),
        ("triton", False),
        ("stochastic", False),
        ("stochastic", False),
        ("reference", None),
        ("triton", False),
        ("stochastic", False),
        ("reference", None),
    ]


def test_auto_without_jax_triton_runs_the_reference_and_warns_once(monkeypatch, caplog):
    """On a GPU where jax-triton does not import, "auto" runs the reference and says once how to
    get the kernels; "triton" asked for explicitly is not replaced."""
    calls = []
    monkeypatch.setattr(kernels, "verify_reference", lambda *a, **kw: calls.append("reference"))
    monkeypatch.setattr(tree_verify_triton, "verify_triton", lambda *a, **kw: calls.append("triton"))
    monkeypatch.setattr(kernels, "_jax_triton_imports", lambda: False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    kernels._warn_no_jax_triton.cache_clear()
    args = valid_args()
    with caplog.at_level("WARNING", logger=kernels.__name__):
        for _ in range(3):
            tree_verify(*args, jax.random.key(0), temperature=1.0)
        tree_verify(*args, jax.random.key(0), temperature=1.0, impl="triton")
    assert calls == ["reference"] * 3 + ["triton"]
    [record] = caplog.records
    assert "pip install 'jaxspec[triton]'" in record.getMessage()


@pytest.mark.parametrize("temperature", [-0.5, float("nan"), float("inf"), True, "1.0"])
def test_invalid_temperature(temperature):
    with pytest.raises(ValueError, match="temperature"):
        tree_verify(*valid_args(), jax.random.key(0), temperature=temperature)


def test_invalid_draft_probs_and_impl(monkeypatch):
    logits, *rest = valid_args()
    with pytest.raises(ValueError, match="draft_probs must have the shape of logits"):
        tree_verify(logits, *rest, jax.random.key(0), temperature=1.0, draft_probs=logits[:, :2])
    with pytest.raises(ValueError, match="impl must be one of"):
        tree_verify(logits, *rest, jax.random.key(0), temperature=1.0, impl="cuda")
    monkeypatch.setenv(kernels.IMPL_ENV, "fast")
    with pytest.raises(ValueError, match="JAXSPEC_TREE_VERIFY_IMPL must be one of"):
        tree_verify(logits, *rest, jax.random.key(0), temperature=1.0)


def test_dispatch_env_override_and_jit(monkeypatch):
    """On CPU "auto" is the reference; the environment can force the interpreted kernel; both give
    the same result, also when called inside jit with traced arguments (shape checks only)."""
    args = valid_args()
    auto = tree_verify(*args, jax.random.key(3), temperature=1.0)
    monkeypatch.setenv(kernels.IMPL_ENV, "triton-interpret")
    forced = tree_verify(*args, jax.random.key(3), temperature=1.0)
    jitted = jax.jit(lambda *a: tree_verify(*a, temperature=1.0))(*args, jax.random.key(3))
    for x, y, z in zip(auto, forced, jitted):
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(z, x, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="parents must have shape"):
        jax.jit(lambda l, p: tree_verify(l, p, *args[2:], jax.random.key(0), temperature=1.0))(args[0], args[1][:, :2])


@pytest.mark.parametrize("impl", ["reference", "triton-interpret"])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("typed", [True, False])
def test_per_row_keys_give_each_row_its_draw_alone(impl, stochastic, typed):
    """One key per row (typed keys [B] or raw keys [B, 2]): row b gets what it gets verified alone
    as a batch of one under its own key, without vmap (which jax-triton's kernels do not support);
    a key count other than the rows' is refused."""
    if impl != "reference":
        pytest.importorskip("triton")
        pytest.importorskip("torch")
    logits, parents, tokens, num = valid_args()
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(3), (B, N, V))) if stochastic else None
    keys = jax.random.split(jax.random.key(7), B)
    if not typed:
        keys = jax.random.key_data(keys)
    got = tree_verify(logits, parents, tokens, num, keys, temperature=1.0, draft_probs=probs, impl=impl)
    for b in range(B):
        alone = tree_verify(
            logits[b : b + 1],
            parents[b : b + 1],
            tokens[b : b + 1],
            num[b : b + 1],
            keys[b],
            temperature=1.0,
            draft_probs=None if probs is None else probs[b : b + 1],
            impl=impl,
        )
        for want, have in zip(alone, got, strict=True):
            np.testing.assert_allclose(have[b], want[0], rtol=1e-6, atol=1e-6)
    per_row, shared = verification_noise(keys, B, N), verification_noise(keys[0], B, N)
    np.testing.assert_array_equal(per_row.uniforms[0], shared.uniforms[0])  # row 0 alone under keys[0]
    assert not np.any(per_row.uniforms[1] == shared.uniforms[1])  # row 1 under its own key
    with pytest.raises(ValueError, match="3 per-row keys for 2 rows"):
        tree_verify(logits, parents, tokens, num, jnp.concatenate([keys, keys[:1]]), temperature=1.0, impl=impl)
