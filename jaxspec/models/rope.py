"""Rotary position embeddings with the scalings Hugging Face defines for Qwen and Llama models.

Inverse frequencies are computed in float32 exactly as `transformers` does, so logits match to
float32 rounding. Rotation uses the "rotate half" layout (first half / second half of head_dim).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxspec.models.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Returns (inv_freq float32 [head_dim // 2], attention scaling applied to cos/sin)."""
    rope = cfg.rope
    rope_type = rope.get("rope_type", "default")
    dim = cfg.head_dim
    base = cfg.rope_theta
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(base), exponents)).astype(np.float32)
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return (inv_freq / np.float32(rope["factor"])).astype(np.float32), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope_type == "yarn":
        return _yarn(cfg, rope)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _llama3(inv_freq: np.ndarray, rope: dict) -> np.ndarray:
    factor = rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(cfg: ModelConfig, rope: dict) -> tuple[np.ndarray, float]:
    # transformers 5 semantics: `factor` is used as given (4.x replaced it by
    # max_position_embeddings / original_max_position_embeddings whenever the latter was set);
    # the ratio is only the fallback when no factor is given.
    dim, base = cfg.head_dim, cfg.rope_theta
    original = rope.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = rope.get("factor")
    if factor is None:
        factor = cfg.max_position_embeddings / original

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all_dim:
            attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention = get_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    pos_freqs = np.power(np.float32(base), np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    extrapolation_factor = 1 - ramp
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv.astype(np.float32), float(attention)


def rope_tables(cfg: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin float32 [B, T, head_dim] for int32 positions [B, T]."""
    inv_freq, scale = inv_frequencies(cfg)
    inv = jnp.asarray(inv_freq)
    if cfg.rope.get("rope_type") == "dynamic":
        inv = _dynamic_inv_freq(cfg, inv, jnp.max(positions) + 1)
    # Both halves from one [D] table (a constant unless dynamic): elementwise from the positions,
    # so that XLA computes cos and sin in one fusion (a concatenation of the angles would be two).
    angles = positions.astype(jnp.float32)[..., None] * jnp.concatenate([inv, inv])  # [B, T, D]
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def _dynamic_inv_freq(cfg: ModelConfig, inv: jnp.ndarray, seq_len: jnp.ndarray) -> jnp.ndarray:
    """Dynamic NTK scaling: grows the base once the sequence exceeds max_position_embeddings.

    As in transformers, the trained context is max_position_embeddings even when the rope
    parameters also carry an original_max_position_embeddings.
    """
    original = cfg.max_position_embeddings
    factor = cfg.rope["factor"]
    dim = cfg.head_dim
    seq = jnp.maximum(seq_len.astype(jnp.float32), original)
    base = cfg.rope_theta * ((factor * seq / original) - (factor - 1)) ** (dim / (dim - 2))
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    scaled = 1.0 / (base**exponents)
    return jnp.where(seq_len > original, scaled, inv)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x [B, T, N, D] rotated by cos/sin [B, T, D]; computed in float32, returned in x.dtype."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)
