"""GPU check before a packed-row pretraining run: flash attention (cuDNN) with segment ids gives
the masked XLA attention's logits and gradients, finite everywhere (padding included), for rows of
one sequence, of a few with padding after them, and of `segment_cap` sequences of 1 to 80 tokens:
with the segments as a mask, and on a Hopper or newer GPU also through cuDNN's packed layout
(`jaxspec.models.packed_attention`). The exit status speaks for the layout this environment selects
for long rows (what a long-answer run started from it uses); the other's row is printed
beside it, and with --all (and as a test) every layout must agree.

    pytest -m gpu tests/gpu/test_cudnn_segments.py    # the check, as a test: every layout
    python3 -m tests.gpu.check_cudnn_segments [--all] # exit 0 when they agree, 3 when they do not
"""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import ModelConfig, forward, init_params, packed_attention
from jaxspec.models.packed_attention import segment_cap


def main(every_layout: bool = False) -> int:
    if jax.default_backend() != "gpu":
        print("no GPU: training attention is XLA's, nothing to check")
        return 0
    cfg = ModelConfig(
        family="qwen3",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
    )
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 512, (4, 256)), jnp.int32)
    segments = np.zeros((4, 256), np.int32)
    segments[0, :100], segments[0, 100:230] = 1, 2  # then padding
    segments[1, :256] = 1
    ends = [1, 2, 40, 41, 100, 180, 255, 256]  # segment_cap(256) = 8 sequences, of 1 to 80 tokens
    for s, (start, end) in enumerate(zip([0, *ends[:-1]], ends), start=1):
        segments[2, start:end] = s
    for s, (start, end) in enumerate([(0, 3), (3, 67), (67, 68), (68, 131), (131, 200)], start=1):
        segments[3, start:end] = s
    assert segments.max() == segment_cap(256)
    segments = jnp.asarray(segments)

    def loss(p, *, impl):
        logits = forward(cfg, p, tokens, mask=segments > 0, segment_ids=segments, attention_impl=impl)
        return jnp.where((segments > 0)[..., None], logits, 0.0).astype(jnp.float32).sum() / 1e4, logits

    def run(impl: str, layout: str):
        before = os.environ.get(packed_attention.ENV)
        os.environ[packed_attention.ENV] = layout  # read when the forward is traced: a new jit per layout
        try:
            return jax.jit(jax.value_and_grad(functools.partial(loss, impl=impl), has_aux=True))(params)
        finally:
            os.environ.pop(packed_attention.ENV)
            if before is not None:
                os.environ[packed_attention.ENV] = before

    (_, lx), gx = run("xla", "mask")
    valid = np.asarray(segments > 0)
    # what a run from here uses for long rows (a long-answer pretraining's)
    long_rows = packed_attention.packed_layout_here(packed_attention.AUTO_MIN_WIDTH, on_mesh=False)
    selected = "packed" if long_rows else "mask"
    ok = True
    for layout in ("mask", "packed") if packed_attention.hopper_or_newer() else ("mask",):
        counts = every_layout or layout == selected
        try:
            (_, lc), gc = run("cudnn", layout)
        except Exception as e:  # noqa: BLE001 - a layout this cuDNN cannot run is a disagreement
            print(f"cudnn ({layout}) failed to run: {type(e).__name__}: {e}")
            ok = ok and not counts
            continue
        logit_err = float(np.abs(np.asarray(lx)[valid] - np.asarray(lc)[valid]).max())
        grad_err = max(
            float(
                jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()
                / (jnp.abs(a.astype(jnp.float32)).max() + 1e-6)
            )
            for a, b in zip(jax.tree.leaves(gx), jax.tree.leaves(gc))
        )
        finite = bool(jnp.isfinite(lc).all()) and all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(gc))
        agree = logit_err < 0.1 and grad_err < 0.05 and finite
        ok = ok and (agree or not counts)
        print(
            f"cudnn ({layout}) vs xla with segment ids: max logit diff {logit_err:.4f}, max relative grad diff "
            f"{grad_err:.4f}, finite everywhere {finite}: {'OK' if agree else 'MISMATCH'}"
        )
    return 0 if ok else 3  # not 1, which a failure to run (e.g. an ImportError) also gives


if __name__ == "__main__":
    sys.exit(main(every_layout="--all" in sys.argv[1:]))
