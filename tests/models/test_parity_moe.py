"""Qwen3-MoE logits, router logits and load-balancing loss against transformers (PyTorch CPU, fp32) on
random local checkpoints of several expert layouts."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from jaxspec.models import forward, load_hf
from jaxspec.models.moe import load_balancing_loss
from jaxspec.models.transformer import forward_router
from tests.models.hf_reference import hf_logits, random_tokens, rel_max_err, saved_checkpoint

FP32_TOL = 1e-5  # relative to max |logit|
SEQ = 20

CASES = {  # qwen3_moe config overrides (default: 4 experts, 2 per token, every layer sparse)
    "e4_k2": dict(),
    "e4_k2_norm_topk": dict(norm_topk_prob=True),
    "e8_k3_mlp_only_0_tied": dict(num_experts=8, num_experts_per_tok=3, mlp_only_layers=[0], tie_word_embeddings=True),
    "e6_k1_step2_4_layers": dict(num_experts=6, num_experts_per_tok=1, decoder_sparse_step=2, num_hidden_layers=4),
    "e16_k4_norm_topk_step2_mlp_only_3": dict(
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        num_hidden_layers=4,
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    """(name, HF model, folder it was saved to by transformers)."""
    return saved_checkpoint(
        tmp_path_factory, request.param, "qwen3_moe", CASES[request.param], seed=sorted(CASES).index(request.param)
    )


def test_fp32_logits_match_transformers(checkpoint):
    name, model, path = checkpoint
    cfg, params = load_hf(path)
    hf = model.config
    assert cfg.family == "qwen3_moe" and cfg.num_experts == hf.num_experts
    assert cfg.sparse_layers == tuple(
        i for i, layer in enumerate(model.model.layers) if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    ), name
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    tokens = random_tokens(1, (2, SEQ), cfg.vocab_size)
    ref = hf_logits(model, tokens)
    ours = forward(cfg, params, tokens)
    assert rel_max_err(ours, ref) < FP32_TOL, name


def test_router_logits_and_load_balancing_loss_match_transformers(checkpoint):
    name, model, path = checkpoint
    cfg, params = load_hf(path)
    tokens = random_tokens(2, (2, SEQ), cfg.vocab_size)
    mask = np.arange(SEQ)[None, :] < np.asarray([[SEQ], [13]])
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(tokens.astype(np.int64)),
            output_router_logits=True,
            attention_mask=torch.from_numpy(mask.astype(np.int64)),
        )
    _, _, router = forward_router(cfg, params, tokens, mask=jnp.asarray(mask))
    assert router.shape == (len(cfg.sparse_layers), 2, SEQ, cfg.num_experts)
    # HF's router logits are [B*T, E] per sparse layer; padded positions differ (HF masks their keys too).
    ref_router = np.stack([r.numpy().reshape(2, SEQ, -1) for r in out.router_logits])
    assert rel_max_err(router[:, mask], ref_router[:, mask]) < FP32_TOL, name
    ref_loss = load_balancing_loss_func(
        tuple(torch.from_numpy(ref_router.reshape(len(router), 2 * SEQ, -1))),
        cfg.num_experts,
        cfg.num_experts_per_tok,
        torch.from_numpy(mask),
    )
    loss = load_balancing_loss(router, cfg.num_experts_per_tok, jnp.asarray(mask))
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5), name
    unmasked = load_balancing_loss_func(
        tuple(torch.from_numpy(ref_router.reshape(len(router), 2 * SEQ, -1))), cfg.num_experts, cfg.num_experts_per_tok
    )
    assert float(load_balancing_loss(jnp.asarray(ref_router), cfg.num_experts_per_tok)) == pytest.approx(
        float(unmasked), rel=1e-5
    )
