from pathlib import Path

import jax

from jaxspec.assets import tiny_policy_path
from jaxspec.config_io import load_config
from jaxspec.models import load_hf
from jaxspec.pretrain.config import PretrainConfig
from jaxspec.pretrain.data import prepare_problems
from jaxspec.pretrain.evaluate import greedy_accuracy
from jaxspec.tasks import ChatTokenizer

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "pretrain_tiny.yaml"


def test_embedded_tiny_policy_solves_some_held_out_problems(tmp_path):
    path = tiny_policy_path()
    cfg, params = load_hf(path)
    tok = ChatTokenizer.from_file(path)
    assert cfg.family == "qwen3" and cfg.vocab_size == tok.vocab_size
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (tok.eos_id, tok.pad_id, tok.bos_id)
    run = load_config(PretrainConfig, CONFIG)
    _, held_out = prepare_problems(run.data, tmp_path)  # the preset's held-out set, regenerated
    accuracy, responses = greedy_accuracy(
        cfg, params, tok, held_out[:64], run.train.eval_max_new_tokens, jax.random.PRNGKey(0), batch_size=64
    )
    assert all("\\boxed{" in r for r in responses[:8])
    assert 0.05 < accuracy < 0.7, accuracy
