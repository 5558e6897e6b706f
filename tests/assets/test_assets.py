"""The path helpers of the embedded assets: the tiny policy's EAGLE-3 head fits the tiny policy."""

import json

import pytest

import jaxspec.assets as assets
from jaxspec.draft import load_eagle3
from jaxspec.models import ModelConfig


def test_tiny_eagle3_path_is_a_head_for_the_tiny_policy():
    cfg = ModelConfig.from_hf(json.loads((assets.tiny_policy_path() / "config.json").read_text()))
    dcfg, dparams = load_eagle3(assets.tiny_eagle3_path(), policy=cfg)  # raises when it does not fit
    assert dcfg.hidden_size == cfg.hidden_size and dcfg.vocab_size == cfg.vocab_size
    assert dparams["lm_head"].shape == (cfg.hidden_size, dcfg.draft_vocab_size)


def test_missing_assets_name_the_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "TINY_EAGLE3", tmp_path / "tiny-eagle3")
    with pytest.raises(FileNotFoundError, match="embedded EAGLE-3 head missing: .*tiny-eagle3"):
        assets.tiny_eagle3_path()
