"""Attention over packed rows in cuDNN's packed layout: the (offset, length) spans read from segment
ids equal a brute-force scan of random packed rows; attention restricted to those spans (causal
within each, zero on padding) is the segment-masked attention the forward computes otherwise, and
the forward takes that path exactly where it should (cuDNN on Hopper GPUs, one or a mesh). cuDNN
itself runs in the GPU check (`tests/gpu/check_cudnn_segments.py`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import ModelConfig, forward, make_mesh
from jaxspec.models import packed_attention as packed_module
from jaxspec.models import transformer as transformer_module
from jaxspec.models.attention import attention
from jaxspec.models.packed_attention import packed_attention, packed_layout_here, segment_cap, segment_spans
from jaxspec.models.sharding import Sharding
from tests.models.hf_reference import random_params


def random_segments(rows: int, width: int, most: int, seed: int) -> np.ndarray:
    """int32 [rows, width]: 0 to `most` contiguous sequences of random lengths from the row's start,
    numbered 1, 2, ..., then padding (0); one row all padding, one a single sequence filling it, one
    with `most` sequences."""
    rng = np.random.default_rng(seed)
    segments = np.zeros((rows, width), np.int32)
    for r in range(2, rows):
        count = most if r == 2 else rng.integers(1, most + 1)
        cuts = np.sort(rng.choice(np.arange(1, width + 1), size=count, replace=False))
        start = 0
        for s, end in enumerate(cuts, start=1):
            segments[r, start:end] = s
            start = end
    segments[1] = 1
    return segments


def brute_spans(segments: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's runs of equal ids, scanned token by token; -1 for a run of padding."""
    lengths = -np.ones((len(segments), slots), np.int32)
    offsets = -np.ones((len(segments), slots + 1), np.int32)
    for r, row in enumerate(segments):
        run = -1
        for i, sid in enumerate(row):
            if i == 0 or sid != row[i - 1]:
                run += 1
                if sid:
                    offsets[r, run], lengths[r, run] = i, 0
            if sid:
                lengths[r, run] += 1
    return lengths, offsets


def span_masks(lengths, offsets, width: int):
    """(inside bool [B, T]: the position lies in a span, mask bool [B, T, T]: i attends to j, both
    in one span and j <= i) of `segment_spans`' (lengths, offsets)."""
    i = jnp.arange(width)
    start, end = offsets[:, :-1, None], offsets[:, :-1, None] + lengths[:, :, None]  # [B, M, 1]
    member = (lengths[:, :, None] > 0) & (i >= start) & (i < end)  # [B, M, T]
    same = jnp.einsum("bmi,bmj->bij", member.astype(jnp.int32), member.astype(jnp.int32)) > 0
    return member.any(axis=1), same & (i[None, :, None] >= i[None, None, :])


def spans_attention(q, k, v, segment_ids):
    """What `packed_attention` has cuDNN compute, from the spans alone: token i attends to j when
    both lie in one span and j <= i; zero outside every span."""
    lengths, offsets = segment_spans(segment_ids, segment_cap(q.shape[1]))
    inside, mask = span_masks(lengths, offsets, q.shape[1])
    return jnp.where(inside[:, :, None, None], attention(q, k, v, mask), 0.0)


def random_qkv(rows: int, width: int, seed: int, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (rows, width, heads, dim))
    k = jax.random.normal(ks[1], (rows, width, kv_heads, dim))
    v = jax.random.normal(ks[2], (rows, width, kv_heads, dim))
    return q, k, v


def segment_masked_attention(q, k, v, segments):
    """The forward's other path: causal attention under the mask of equal segment ids, zero on padding."""
    i = jnp.arange(segments.shape[1])
    masked = (segments[:, :, None] == segments[:, None, :]) & (i[:, None] >= i[None, :])
    return jnp.where((segments > 0)[:, :, None, None], attention(q, k, v, masked), 0.0)


def test_segment_cap():
    assert [segment_cap(w) for w in (1, 4096, 4097, 8192, 16384, 16640, 30720)] == [8, 8, 16, 16, 32, 40, 64]


@pytest.mark.parametrize("seed", range(4))
def test_spans_equal_a_scan_of_the_rows(seed):
    most = 8
    segments = random_segments(6, 40, most, seed)
    lengths, offsets = jax.jit(segment_spans, static_argnums=1)(jnp.asarray(segments), most)
    expected_lengths, expected_offsets = brute_spans(segments, most)
    np.testing.assert_array_equal(lengths, expected_lengths)
    np.testing.assert_array_equal(offsets, expected_offsets)
    assert (expected_lengths == -1).all(axis=1).any() and (expected_lengths != -1).all(axis=1).any()  # empty, full
    np.testing.assert_array_equal(np.where(lengths > 0, lengths, 0).sum(axis=1), (segments > 0).sum(axis=1))


def test_spans_attention_is_the_segment_masked_attention():
    rows, width = 5, 48
    segments = jnp.asarray(random_segments(rows, width, segment_cap(width), seed=7))
    q, k, v = random_qkv(rows, width, seed=0)
    expected = segment_masked_attention(q, k, v, segments)
    np.testing.assert_allclose(spans_attention(q, k, v, segments), expected, atol=1e-5)
    # negative control: spans one token short (a sequence's last token left out) are seen
    shifted = jnp.where(segments > 0, jnp.roll(segments, 1, axis=1), 0)
    assert not np.allclose(spans_attention(q, k, v, shifted), expected, atol=1e-3)


def nan_outside_spans_cudnn(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type, qkv_layout):
    """A stand-in for cuDNN's packed layout that, like it, leaves every position outside the spans
    unwritten, here NaN, in the output and in the q/k/v gradients."""
    del kv_seqlen, kv_offsets, scale, mask_type, qkv_layout
    inside, mask = span_masks(q_seqlen, q_offsets, q.shape[1])
    inside = inside[:, :, None, None]

    @jax.custom_vjp
    def call(q, k, v):
        return jnp.where(inside, attention(q, k, v, mask), jnp.nan)

    def call_fwd(q, k, v):
        return call(q, k, v), (q, k, v)

    def call_bwd(res, ct):
        _, vjp = jax.vjp(lambda *a: attention(*a, mask), *res)
        return tuple(jnp.where(inside, g, jnp.nan) for g in vjp(ct))

    call.defvjp(call_fwd, call_bwd)
    return call(q, k, v)


def test_positions_cudnn_leaves_unwritten_reach_neither_outputs_nor_gradients(monkeypatch):
    from jax._src.cudnn import fused_attention_stablehlo

    rows, width = 4, 32
    segments = jnp.asarray(random_segments(rows, width, segment_cap(width), seed=5))
    q, k, v = random_qkv(rows, width, seed=2)
    weights = jax.random.normal(jax.random.key(3), q.shape)  # a loss that reads every position, padding included

    def expected(q, k, v):
        return jnp.sum(segment_masked_attention(q, k, v, segments) * weights)

    monkeypatch.setattr(fused_attention_stablehlo, "dot_product_attention", nan_outside_spans_cudnn)
    value, grads = jax.value_and_grad(lambda *a: jnp.sum(packed_attention(*a, segments) * weights), (0, 1, 2))(q, k, v)
    want_value, want_grads = jax.value_and_grad(expected, (0, 1, 2))(q, k, v)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got, want, atol=1e-5)
    # negative control: the stand-in alone, its output selected but not its inputs, lets NaN through
    lengths, offsets = segment_spans(segments, segment_cap(width))
    spans = dict(q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets)
    spans.update(scale=1.0, mask_type=None, qkv_layout="BTNH")

    def unguarded(q, k, v):
        out = nan_outside_spans_cudnn(q, k, v, **spans)
        return jnp.sum(jnp.where((segments > 0)[:, :, None, None], out, 0.0) * weights)

    assert not all(bool(jnp.isfinite(g).all()) for g in jax.grad(unguarded, (0, 1, 2))(q, k, v))


CFG = ModelConfig(
    family="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)


def packed_forward(monkeypatch, sharding=None, layout="packed", segments=None, jitted=False):
    """forward over packed rows as a Hopper GPU would run it under JAXSPEC_PACKED_ATTENTION=`layout`,
    with cuDNN's packed layout replaced by `spans_attention` and its mask path by XLA's attention;
    jitted: under jit, closing over the rows (constants, as a check script's are); returns (logits,
    the number of packed calls, the valid positions)."""
    if segments is None:
        segments = jnp.asarray(random_segments(4, 64, segment_cap(64), seed=3))
    tokens = jax.random.randint(jax.random.key(1), segments.shape, 0, CFG.vocab_size)
    calls = []

    def packed(q, k, v, segment_ids):
        calls.append(q.shape)
        return spans_attention(q, k, v, segment_ids)

    monkeypatch.setenv(packed_module.ENV, layout)
    monkeypatch.setattr(packed_module, "hopper_or_newer", lambda: True)
    monkeypatch.setattr(transformer_module, "use_cudnn_attention", lambda *a: True)
    monkeypatch.setattr(transformer_module, "packed_attention", packed)
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda q, k, v, **kw: attention(q, k, v, kw["mask"][:, 0]))
    params = random_params(CFG, jax.random.key(0))
    run = functools.partial(forward, CFG, mask=segments > 0, segment_ids=segments, sharding=sharding)
    logits = jax.jit(run)(params, tokens) if jitted else run(params, tokens)
    return logits, len(calls), np.asarray(segments > 0)


def test_the_forward_runs_packed_rows_through_the_packed_layout(monkeypatch):
    segments = jnp.asarray(random_segments(4, 64, segment_cap(64), seed=3))
    tokens = jax.random.randint(jax.random.key(1), segments.shape, 0, CFG.vocab_size)
    params = random_params(CFG, jax.random.key(0))
    expected = forward(CFG, params, tokens, mask=segments > 0, segment_ids=segments, attention_impl="xla")
    logits, calls, valid = packed_forward(monkeypatch)
    assert calls == CFG.num_layers
    np.testing.assert_allclose(np.asarray(logits)[valid], np.asarray(expected)[valid], atol=1e-4)
    logits, calls, _ = packed_forward(monkeypatch, jitted=True)
    assert calls == CFG.num_layers
    np.testing.assert_allclose(np.asarray(logits)[valid], np.asarray(expected)[valid], atol=1e-4)
    _, calls, _ = packed_forward(monkeypatch, layout="mask")
    assert calls == 0
    _, calls, _ = packed_forward(monkeypatch, layout="auto")  # rows of 64 tokens: below AUTO_MIN_WIDTH
    assert calls == 0
    monkeypatch.setattr(packed_module, "AUTO_MIN_WIDTH", 64)
    _, calls, _ = packed_forward(monkeypatch, layout="auto")
    assert calls == CFG.num_layers


@pytest.mark.parametrize("data,tensor", [(2, 1), (1, 2)])
def test_a_mesh_runs_the_packed_layout_where_it_is_named(monkeypatch, data, tensor):
    """On a mesh "auto" keeps the segment mask; "packed" splits the layout's call as the rows (data)
    and heads (tensor) are split, with the logits of one device."""
    mesh = Sharding(make_mesh(data=data, fsdp=1, tensor=tensor, devices=jax.devices()[:2]))
    monkeypatch.setattr(packed_module, "AUTO_MIN_WIDTH", 64)  # rows as wide as "auto" takes on one device
    single, _, valid = packed_forward(monkeypatch)
    _, calls, _ = packed_forward(monkeypatch, mesh, layout="auto")
    assert calls == 0
    logits, calls, _ = packed_forward(monkeypatch, mesh, layout="packed")
    assert calls == CFG.num_layers
    np.testing.assert_allclose(np.asarray(logits)[valid], np.asarray(single)[valid], atol=1e-5)


def test_a_row_over_the_cap_fails_with_its_name(monkeypatch):
    """A row with more sequences than the layout reads would leave the rest attending to nothing: a
    forward called on it fails naming the row. One run fewer (the cap itself) runs."""
    cap = segment_cap(64)
    segments = np.zeros((2, 64), np.int32)
    segments[1, : cap + 1] = np.arange(1, cap + 2)
    for jitted in (False, True):  # outside jit; under jit closing over the rows
        with pytest.raises(ValueError, match=f"packed row 1 holds {cap + 1} runs of segment ids"):
            packed_forward(monkeypatch, segments=jnp.asarray(segments), jitted=jitted)
    segments[1, cap] = cap  # the last sequence two tokens long: cap sequences
    logits, calls, _ = packed_forward(monkeypatch, segments=jnp.asarray(segments))
    assert calls == CFG.num_layers and bool(jnp.isfinite(logits).all())


def test_the_setting_chooses_the_layout(monkeypatch):
    long, short = packed_module.AUTO_MIN_WIDTH, packed_module.AUTO_MIN_WIDTH - 1
    monkeypatch.delenv(packed_module.ENV, raising=False)
    assert packed_module.selected_layout() == "auto"
    assert jax.default_backend() != "gpu" and not packed_layout_here(long, on_mesh=False)
    assert packed_module.packing_cap(16384) is None  # no GPU: the packers bound rows only for the layout
    monkeypatch.setenv(packed_module.ENV, "packed")
    assert not packed_layout_here(long, on_mesh=False) and packed_module.packing_cap(16384) is None
    monkeypatch.setattr(packed_module, "hopper_or_newer", lambda: True)
    assert all(packed_layout_here(w, on_mesh=m) for w in (long, short) for m in (False, True))
    assert packed_module.packing_cap(16384) == 32 and packed_module.packing_cap(short) == 8
    monkeypatch.setenv(packed_module.ENV, "auto")  # long rows on one device
    assert packed_layout_here(long, on_mesh=False) and not packed_layout_here(long, on_mesh=True)
    assert not packed_layout_here(short, on_mesh=False)
    assert packed_module.packing_cap(16384) == 32 and packed_module.packing_cap(short) is None
    monkeypatch.setenv(packed_module.ENV, "mask")
    assert not packed_layout_here(long, on_mesh=False) and packed_module.packing_cap(16384) is None
    monkeypatch.setenv(packed_module.ENV, "sometimes")
    with pytest.raises(ValueError, match="JAXSPEC_PACKED_ATTENTION='sometimes'"):
        packed_layout_here(long, on_mesh=False)
