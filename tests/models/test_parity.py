"""Logits parity with Hugging Face transformers (PyTorch CPU, fp32) on random local checkpoints."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import forward, forward_hidden, load_hf
from jaxspec.models.blocks import rms_norm
from tests.models.hf_reference import (
    hf_config,
    hf_hidden_states,
    hf_logits,
    perturbed_model,
    random_tokens,
    rel_max_err,
    saved_checkpoint,
)

FP32_TOL = 1e-5  # relative to max |logit|
# bf16 weights and activations against the fp32 reference: a sanity bound that catches a wrong
# cast or layout, not a claim about bf16 accuracy (observed: 0.6e-2 to 1.9e-2 on these models).
BF16_TOL = 5e-2

SEQ = 20

# Most cases share one set of shapes (hidden 32, 4 heads, 2 KV heads, head_dim 8, vocab 97) so the
# eagerly executed forwards reuse each other's compiled ops.
CASES = {
    # family, config overrides
    "qwen2_gqa2_untied": ("qwen2", dict()),
    "qwen2_mha_tied_vocab131": ("qwen2", dict(num_key_value_heads=4, vocab_size=131, tie_word_embeddings=True)),
    "qwen3_head_dim24_mqa": ("qwen3", dict(num_key_value_heads=1, head_dim=24)),
    "qwen3_tied_3_layers": ("qwen3", dict(tie_word_embeddings=True, num_hidden_layers=3)),
    "llama_mha": ("llama", dict(num_key_value_heads=4)),
    "llama_gqa4_tied_vocab131": (
        "llama",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=4, tie_word_embeddings=True, vocab_size=131),
    ),
    "llama_linear": ("llama", dict(rope_parameters=dict(rope_type="linear", factor=3.0, rope_theta=500.0))),
    "llama_dynamic": (
        "llama",
        dict(max_position_embeddings=12, rope_parameters=dict(rope_type="dynamic", factor=2.5, rope_theta=100.0)),
    ),
    "llama_yarn": (
        "llama",
        dict(
            max_position_embeddings=4096,
            rope_parameters=dict(
                rope_type="yarn", factor=4.0, original_max_position_embeddings=1024, rope_theta=10000.0
            ),
        ),
    ),
    # factor differs from max_position_embeddings / original_max_position_embeddings (2048 / 1024)
    "llama_yarn_factor_not_ratio": (
        "llama",
        dict(
            max_position_embeddings=2048,
            rope_parameters=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=1024,
                rope_theta=10000.0,
                beta_fast=16.0,
                beta_slow=2.0,
            ),
        ),
    ),
    "llama_yarn_mscale": (
        "llama",
        dict(
            max_position_embeddings=256,
            rope_parameters=dict(rope_type="yarn", factor=8.0, rope_theta=10000.0, mscale=0.8, mscale_all_dim=0.5),
        ),
    ),
    "llama_yarn_attention_factor": (
        "llama",
        dict(
            rope_parameters=dict(rope_type="yarn", factor=2.0, rope_theta=10000.0, attention_factor=1.3, truncate=False)
        ),
    ),
    # head_dim 8, theta 1e4: wavelengths 6.3, 63, 628, 6283 hit the kept, smoothed and scaled bands
    "llama_llama3": (
        "llama",
        dict(
            max_position_embeddings=512,
            rope_parameters=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
                rope_theta=10000.0,
            ),
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    """(name, HF model, folder the model was saved to)."""
    family, overrides = CASES[request.param]
    return saved_checkpoint(tmp_path_factory, request.param, family, overrides, seed=sorted(CASES).index(request.param))


def test_fp32_logits_match_transformers(checkpoint):
    name, model, path = checkpoint
    cfg, params = load_hf(path)
    tokens = random_tokens(1, (2, SEQ), cfg.vocab_size)
    ref = hf_logits(model, tokens)
    ours = forward(cfg, params, tokens)
    assert ours.dtype == jnp.float32 and ours.shape == ref.shape
    assert rel_max_err(ours, ref) < FP32_TOL, name


# The HF dynamic-rope module keeps the longest sequence it has seen, so every test of that
# checkpoint stays at SEQ positions; test_dynamic_rope_* cover other positions with fresh models.
@pytest.mark.parametrize("checkpoint", sorted(set(CASES) - {"llama_dynamic"}), indirect=True)
def test_fp32_logits_match_transformers_at_offset_positions(checkpoint):
    """Positions far from 0 (and different per row) make every rope frequency matter."""
    name, model, path = checkpoint
    cfg, params = load_hf(path)
    tokens = random_tokens(2, (2, SEQ), cfg.vocab_size)
    positions = np.stack([np.arange(SEQ) + 37, np.arange(SEQ) + 301]).astype(np.int32)
    ref = hf_logits(model, tokens, position_ids=positions)
    ours = forward(cfg, params, tokens, positions=jnp.asarray(positions))
    assert rel_max_err(ours, ref) < FP32_TOL, name


@pytest.mark.parametrize(
    "checkpoint", sorted(n for n, (_, o) in CASES.items() if "rope_parameters" in o), indirect=True
)
def test_rope_scaling_changes_logits(checkpoint):
    """Guards the parity tests above: the scaled rope must differ measurably from the default one."""
    name, _, path = checkpoint
    cfg, params = load_hf(path)
    tokens = random_tokens(3, (2, SEQ), cfg.vocab_size)
    offset = 0 if cfg.rope["rope_type"] == "dynamic" else 301
    positions = jnp.broadcast_to(jnp.arange(SEQ, dtype=jnp.int32) + offset, (2, SEQ))
    plain = dataclasses.replace(cfg, rope_scaling=(("rope_type", "default"),))
    scaled = forward(cfg, params, tokens, positions=positions)
    assert rel_max_err(forward(plain, params, tokens, positions=positions), scaled) > 1e-3, name


def test_bf16_logits_close_to_fp32_transformers(checkpoint):
    name, model, path = checkpoint
    cfg, params = load_hf(path, dtype="bfloat16")
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))
    tokens = random_tokens(6, (2, SEQ), cfg.vocab_size)
    ours = forward(cfg, params, tokens)
    assert ours.dtype == jnp.float32
    assert rel_max_err(ours, hf_logits(model, tokens)) < BF16_TOL, name


def _dynamic_model(rope_parameters, seed, tmp_path, name):
    model = perturbed_model(hf_config("llama", max_position_embeddings=12, rope_parameters=rope_parameters), seed)
    model.save_pretrained(tmp_path / name)
    return model, *load_hf(tmp_path / name)


def test_dynamic_rope_triggers_past_max_position_embeddings(tmp_path):
    """Both rescale the base once max(position) + 1 exceeds max_position_embeddings (12), not before."""
    tokens = random_tokens(4, (2, SEQ), 97)
    within = np.broadcast_to(np.arange(SEQ) * 11 // (SEQ - 1), (2, SEQ)).astype(np.int32)  # 0 .. 11
    beyond = np.broadcast_to(np.arange(SEQ), (2, SEQ)).astype(np.int32)  # 0 .. 19
    ours = {}
    for rope in (CASES["llama_dynamic"][1]["rope_parameters"], dict(rope_type="default", rope_theta=100.0)):
        model, cfg, params = _dynamic_model(rope, 11, tmp_path, rope["rope_type"])
        for name, positions in (("within", within), ("beyond", beyond)):  # HF only ever grows its base
            ours[rope["rope_type"], name] = forward(cfg, params, tokens, positions=jnp.asarray(positions))
            ref = hf_logits(model, tokens, position_ids=positions)
            assert rel_max_err(ours[rope["rope_type"], name], ref) < FP32_TOL, (rope, name)
    assert rel_max_err(ours["dynamic", "within"], ours["default", "within"]) < FP32_TOL
    assert rel_max_err(ours["dynamic", "beyond"], ours["default", "beyond"]) > 1e-3


def test_dynamic_rope_ignores_original_max_position_embeddings(tmp_path):
    """transformers scales dynamic rope against max_position_embeddings (12), never the original (6)."""
    rope = dict(rope_type="dynamic", factor=2.0, rope_theta=100.0, original_max_position_embeddings=6)
    model, cfg, params = _dynamic_model(rope, 12, tmp_path, "dynamic")
    tokens = random_tokens(5, (2, SEQ), cfg.vocab_size)
    positions = np.broadcast_to(np.arange(SEQ) * 11 // (SEQ - 1), (2, SEQ)).astype(np.int32)  # 0 .. 11
    ours = forward(cfg, params, tokens, positions=jnp.asarray(positions))
    assert rel_max_err(ours, hf_logits(model, tokens, position_ids=positions)) < FP32_TOL


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    model = perturbed_model(hf_config("qwen3", num_hidden_layers=3), seed=21)
    path = tmp_path_factory.mktemp("qwen3_three_layers")
    model.save_pretrained(path)
    cfg, params = load_hf(path)
    return model, cfg, params


def test_right_padding_mask_matches_unpadded_rows(qwen3):
    """Valid positions of a right-padded batch equal each row run alone, unpadded (HF reference)."""
    model, cfg, params = qwen3
    lengths = [13, 4]
    tokens = random_tokens(7, (2, SEQ), cfg.vocab_size)  # padding slots hold real tokens, not zeros
    mask = np.arange(SEQ)[None, :] < np.asarray(lengths)[:, None]
    padded = forward(cfg, params, tokens, mask=jnp.asarray(mask))
    for row, n in enumerate(lengths):
        alone = hf_logits(model, tokens[row : row + 1, :n])
        assert rel_max_err(padded[row, :n], alone[0]) < FP32_TOL, row


def test_left_padding_mask_with_positions_matches_unpadded_rows(qwen3):
    """Left padding only works through the mask (padding keys precede valid queries)."""
    model, cfg, params = qwen3
    lengths = np.asarray([11, 6])
    tokens = random_tokens(8, (2, SEQ), cfg.vocab_size)
    pad = SEQ - lengths
    mask = np.arange(SEQ)[None, :] >= pad[:, None]
    positions = np.maximum(np.arange(SEQ)[None, :] - pad[:, None], 0).astype(np.int32)
    ours = forward(cfg, params, tokens, mask=jnp.asarray(mask), positions=jnp.asarray(positions))
    for row, n in enumerate(lengths):
        alone = hf_logits(model, tokens[row : row + 1, SEQ - n :])
        assert rel_max_err(ours[row, SEQ - n :], alone[0]) < FP32_TOL, row
    unmasked = forward(cfg, params, tokens, positions=jnp.asarray(positions))
    assert rel_max_err(unmasked[1, SEQ - 6 :], hf_logits(model, tokens[1:, SEQ - 6 :])[0]) > 1e-3


def test_segment_ids_match_separate_forwards(qwen3):
    """Packed sequences equal each segment run alone (HF reference), positions restarting at 0."""
    model, cfg, params = qwen3
    segment_lengths = [[7, 9, 4], [1, 18, 1]]
    tokens = random_tokens(9, (2, SEQ), cfg.vocab_size)
    segment_ids = np.stack([np.repeat(np.arange(len(ls)), ls) for ls in segment_lengths]).astype(np.int32)
    packed = forward(cfg, params, tokens, segment_ids=jnp.asarray(segment_ids))
    for row, lens in enumerate(segment_lengths):
        start = 0
        for n in lens:
            alone = hf_logits(model, tokens[row : row + 1, start : start + n])
            assert rel_max_err(packed[row, start : start + n], alone[0]) < FP32_TOL, (row, start)
            start += n


def test_segment_ids_with_padding_and_explicit_positions(qwen3):
    """Packed rows with trailing padding; explicit positions reproduce the default ones exactly."""
    model, cfg, params = qwen3
    tokens = random_tokens(10, (2, SEQ), cfg.vocab_size)
    segment_ids = jnp.asarray([[0] * 6 + [1] * 10 + [2] * 4, [0] * 15 + [1] * 5], jnp.int32)
    mask = jnp.asarray([[True] * 16 + [False] * 4, [True] * 17 + [False] * 3])
    positions = jnp.asarray([list(range(6)) + list(range(10)) + [0] * 4, list(range(15)) + list(range(5))], jnp.int32)
    implicit = forward(cfg, params, tokens, mask=mask, segment_ids=segment_ids)
    explicit = forward(cfg, params, tokens, mask=mask, segment_ids=segment_ids, positions=positions)
    np.testing.assert_array_equal(np.asarray(implicit[0, :16]), np.asarray(explicit[0, :16]))
    np.testing.assert_array_equal(np.asarray(implicit[1, :17]), np.asarray(explicit[1, :17]))
    assert rel_max_err(implicit[0, 6:16], hf_logits(model, tokens[:1, 6:16])[0]) < FP32_TOL
    assert rel_max_err(implicit[1, 15:17], hf_logits(model, tokens[1:, 15:17])[0]) < FP32_TOL


def test_forward_hidden_matches_transformers_hidden_states(qwen3):
    model, cfg, params = qwen3
    tokens = random_tokens(11, (2, SEQ), cfg.vocab_size)
    ref = hf_hidden_states(model, tokens)
    layers = tuple(range(cfg.num_layers))
    logits, hidden = forward_hidden(cfg, params, tokens, layers)
    assert hidden.shape == (cfg.num_layers, 2, SEQ, cfg.hidden_size)
    for i in layers[:-1]:
        assert rel_max_err(hidden[i], ref[i + 1]) < FP32_TOL, i
    # HF's last hidden state is the final layer's output after the final norm.
    last = rms_norm(hidden[-1], params["final_norm"], cfg.rms_norm_eps)
    assert rel_max_err(last, ref[-1]) < FP32_TOL
    assert rel_max_err(logits, hf_logits(model, tokens)) < FP32_TOL


@pytest.mark.parametrize("layers", [(2, 0), (1, 1), (0, 0, 1), (2, 1, 2, 0)])
def test_forward_hidden_returns_layers_in_requested_order(qwen3, layers):
    _, cfg, params = qwen3
    tokens = random_tokens(12, (2, SEQ), cfg.vocab_size)
    _, every = forward_hidden(cfg, params, tokens, (0, 1, 2))
    _, chosen = forward_hidden(cfg, params, tokens, layers)
    np.testing.assert_array_equal(np.asarray(chosen), np.asarray(every)[list(layers)])


@pytest.mark.parametrize("layer", [3, -1])
def test_forward_hidden_rejects_layer_out_of_range(qwen3, layer):
    _, cfg, params = qwen3
    with pytest.raises(ValueError, match=f"hidden layer id {layer} outside"):
        forward_hidden(cfg, params, jnp.zeros((2, SEQ), jnp.int32), (layer,))
