"""The long-answer workload's configs (pretrain_long, pretrain_long_medium, head_long, grpo_long): they validate,
describe one data distribution, fit its longest answers, and their data sections reach the
generator of every command; a bad tally value is refused naming its key."""

import dataclasses
import re
from pathlib import Path

import pytest

from jaxspec.config_io import load_config
from jaxspec.draft_training.config import DraftTrainConfig
from jaxspec.draft_training.config import validate as validate_draft
from jaxspec.draft_training.data import prompt_pool
from jaxspec.pretrain.config import PretrainConfig
from jaxspec.pretrain.config import validate as validate_pretrain
from jaxspec.pretrain.data import prepare_problems
from jaxspec.rl.config import GRPOConfig
from jaxspec.rl.data import prompt_files
from jaxspec.rl.validation import validate as validate_grpo
from jaxspec.tasks import ChatTokenizer, generate_problems, load_prompts, train_tokenizer
from jaxspec.tasks.tally import StepLaw

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHORT_LAW = ["data.tally.steps.median=6", "data.tally.steps.sigma=0.3", "data.tally.steps.max_steps=9"]


def _load(name, overrides=()):
    cls, validate = {
        "pretrain_long.yaml": (PretrainConfig, validate_pretrain),
        "pretrain_long_medium.yaml": (PretrainConfig, validate_pretrain),
        "head_long.yaml": (DraftTrainConfig, validate_draft),
        "grpo_long.yaml": (GRPOConfig, validate_grpo),
    }[name]
    cfg = load_config(cls, CONFIGS / name, list(overrides))
    validate(cfg, name)
    return cfg


@pytest.fixture(scope="module")
def tally_tok(tmp_path_factory):
    """The BPE `jaxspec pretrain` trains on configs/pretrain_long.yaml's corpus (here on 200 of its problems)."""
    data = _load("pretrain_long.yaml").data
    problems = generate_problems(200, data.seed, data.levels, data.kinds, tally=data.tally)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer((t for p in problems for t in (p["question"], p["solution"])), data.vocab_size, path)
    return ChatTokenizer.from_file(path)


def test_the_configs_validate_and_share_one_workload():
    long, medium, draft, grpo = (
        _load(n) for n in ("pretrain_long.yaml", "pretrain_long_medium.yaml", "head_long.yaml", "grpo_long.yaml")
    )
    for data in (long.data, medium.data, draft.data, draft.eval.data, grpo.data):
        assert data.kinds == ("tally",) and data.tally == long.data.tally
    assert long.data.tally.variation == 0.5  # the calibrated point (BENCHMARKS.md)
    assert medium.data == long.data
    assert (
        medium.model.hidden_size,
        medium.model.num_layers,
        medium.model.num_heads,
        medium.model.num_kv_heads,
        medium.model.head_dim,
        medium.model.intermediate_size,
    ) == (2048, 28, 16, 8, 128, 6144)  # Qwen3-1.7B
    assert (long.model.hidden_size, long.model.num_layers) == (1024, 16)  # the `small` policy's shape
    for cfg in (long, medium):
        assert cfg.data.max_len < cfg.model.max_position_embeddings
        assert cfg.train.eval_max_new_tokens + 96 <= cfg.model.max_position_embeddings
    assert grpo.rollout.max_new_tokens + draft.data.max_prompt_len <= long.model.max_position_embeddings
    assert grpo.reward == "arithmetic" and grpo.spec.method == "eagle3" and grpo.spec.num_draft_tokens == 3


def test_the_longest_answers_the_law_allows_fit_a_packed_row(tally_tok):
    """Problems of max_steps days (the law's longest) fit data.max_len with their prompt, and the
    prompts fit head_long's max_prompt_len."""
    long, draft = _load("pretrain_long.yaml"), _load("head_long.yaml")
    steps = long.data.tally.steps
    longest = dataclasses.replace(
        long.data.tally,
        steps=StepLaw(median=steps.max_steps, sigma=1e-9, min_steps=steps.max_steps, max_steps=steps.max_steps),
    )
    for p in generate_problems(8, seed=1, kinds=("tally",), tally=longest):
        tokens = len(tally_tok.encode_prompt(p["question"])) + len(tally_tok.encode_response(p["solution"]))
        assert 16384 < tokens <= long.data.max_len
    prompts = generate_problems(400, seed=2, kinds=("tally",), tally=long.data.tally)
    assert max(len(tally_tok.encode_prompt(p["question"])) for p in prompts) <= draft.data.max_prompt_len


def _days(question):
    return int(re.search(r"after (\d+) days\?$", question).group(1))


def test_every_command_generates_the_configured_workload(tmp_path, tally_tok):
    """pretrain, draft train and train generate tally problems of the configured law."""
    long = _load("pretrain_long.yaml", SHORT_LAW + ["data.num_train=20", "data.num_eval=4"])
    train, held_out = prepare_problems(long.data, tmp_path / "pretrain")
    assert {p["kind"] for p in train + held_out} == {"tally"}
    assert all(3 <= _days(p["question"]) <= 9 for p in train + held_out)

    grpo = _load("grpo_long.yaml", SHORT_LAW + ["data.num_train=12", "data.num_eval=3"])
    train_file, eval_file = prompt_files(grpo.data, tmp_path / "grpo")
    records = load_prompts(train_file) + load_prompts(eval_file)
    assert len(records) == 15 and all(3 <= _days(r["prompt"]) <= 9 for r in records)

    draft = _load("head_long.yaml", SHORT_LAW + ["data.num_prompts=10"])
    pool = prompt_pool(draft.data, tally_tok)
    assert len(pool) == 10
    assert all(3 <= _days(tally_tok.decode(ids).split("\n")[1]) <= 9 for ids in pool)


@pytest.mark.parametrize(
    "name, key",
    [
        ("pretrain_long.yaml", "data.tally.variation"),
        ("grpo_long.yaml", "data.tally.variation"),
        ("head_long.yaml", "data.tally.variation"),
        ("head_long.yaml", "eval.data.tally.variation"),
    ],
)
def test_a_bad_tally_value_names_its_key(name, key):
    with pytest.raises(ValueError, match=rf"{re.escape(key)}: must be in \[0, 1\], got 1.5"):
        _load(name, [f"{key}=1.5"])
    with pytest.raises(ValueError, match=r"data\.tally\.steps\.max_steps: must be >= steps\.min_steps=3, got 2"):
        _load(name, ["data.tally.steps.max_steps=2"])
    with pytest.raises(ValueError, match=r"data\.tally\.steps\.law.*expected one of \['lognormal', 'pareto'\]"):
        _load(name, ["data.tally.steps.law=cauchy"])
    with pytest.raises(ValueError, match=r"data\.kinds: must be a non-empty subset of \['arithmetic', 'word', 'tally'"):
        _load(name, ["data.kinds=[tallies]"])
