"""Tiny random Qwen3 policies (dense and mixture-of-experts) in HF folders with the math task's tokenizer,
shared by the RL tests."""

import dataclasses
import zlib

import jax
import pytest

from jaxspec.models import init_params, save_hf
from jaxspec.pretrain.config import ModelShape
from jaxspec.pretrain.run import model_config
from jaxspec.rewards.registry import register_reward, registered_rewards
from jaxspec.tasks import ChatTokenizer, generate_problems, train_tokenizer
from tests.rl.runs import train_cli, write_config

SHAPE = ModelShape(
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    max_position_embeddings=256,
)
MOE_SHAPE = dataclasses.replace(
    SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.05
)


def digit_fraction(response: str, example: dict) -> float:
    """Share of the response's characters that are digits: easy to learn from a random policy."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def rare_hash(response: str, example: dict) -> float:
    """1 for about one response in ten (by a hash of its text): many groups score all 0."""
    return float(zlib.crc32(response.encode()) % 10 == 0)


def zero(response: str, example: dict) -> float:
    """0 for every response: no group is informative."""
    return 0.0


if "digit_fraction" not in registered_rewards():
    register_reward("digit_fraction")(digit_fraction)
    register_reward("rare_hash")(rare_hash)
    register_reward("zero")(zero)


def _saved_policy(root, shape: ModelShape):
    """(HF folder of a random policy of `shape` with tokenizer.json, its ModelConfig, params)."""
    problems = generate_problems(300, 0, (1,))
    train_tokenizer((text for p in problems for text in (p["question"], p["solution"])), 300, root / "tok.json")
    tok = ChatTokenizer.from_file(root / "tok.json")
    cfg = model_config(shape, tok)
    params = init_params(cfg, jax.random.PRNGKey(0))
    save_hf(cfg, params, root / "policy", tokenizer_file=root / "tok.json")
    return root / "policy", cfg, params


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory):
    """(HF folder of a random 2-layer policy with tokenizer.json, its ModelConfig, params)."""
    return _saved_policy(tmp_path_factory.mktemp("rl_policy"), SHAPE)


@pytest.fixture(scope="session")
def tiny_moe_policy(tmp_path_factory):
    """As `tiny_policy`, with both layers mixture-of-experts (top-2 of 4 experts, router_aux_loss_coef 0.05)."""
    return _saved_policy(tmp_path_factory.mktemp("rl_moe_policy"), MOE_SHAPE)


@pytest.fixture(scope="session")
def full_run(tiny_policy, tmp_path_factory):
    """12 uninterrupted GRPO steps rewarding digits, checkpoints at 6 and 12."""
    root = tmp_path_factory.mktemp("grpo")
    config = write_config(root / "run.yaml", tiny_policy[0])
    assert train_cli("--config", config, "--run-dir", root / "full") == 0
    return config, root / "full"
