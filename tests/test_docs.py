"""The documentation site: it builds in strict mode, and its configuration reference lists every key
of each command's config with its real default and documentation."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
import yaml

from jaxspec.config_io import from_dict, set_dotted, to_dict
from jaxspec.draft_training.config import DraftTrainConfig
from jaxspec.pretrain.config import PretrainConfig
from jaxspec.rl.config import GRPOConfig
from jaxspec.run.run_dir import flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import config_reference  # noqa: E402

_ROW = re.compile(r"^\| `(?P<key>[\w.]+)` \| `(?P<type>[^`]*)` \| `(?P<default>[^`]*)` \| (?P<doc>.*) \|$", re.M)


def require(module: str):
    """The module, or a skip where the docs extra is not installed (CI installs it: a failure there)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"{module} is not installed (pip install -e '.[docs]')")


def test_site_builds_in_strict_mode(tmp_path):
    require("mkdocs")
    require("mkdocstrings")
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "<code>rollout.max_staleness</code>" in (site / "configuration/train/index.html").read_text("utf-8")
    assert "jaxspec.rollout.generate" in (site / "api/rollout/index.html").read_text("utf-8")
    assert (site / "benchmarks/results/l_h200x4/grpo_curves_l_lr2e6.png").is_file()  # a figure BENCHMARKS.md shows


def reference_rows(cls) -> dict[str, dict[str, str]]:
    """{dotted key: {"type", "default", "doc"}} of the rendered reference's tables."""
    return {m["key"]: m.groupdict() for m in _ROW.finditer(config_reference.render(cls))}


@pytest.mark.parametrize(
    "cls, required",
    [
        (GRPOConfig, {"train.steps": 5}),
        (
            PretrainConfig,
            {
                "data.num_train": 10,
                "model.hidden_size": 8,
                "model.intermediate_size": 16,
                "model.num_layers": 1,
                "model.num_heads": 2,
                "model.num_kv_heads": 1,
                "model.head_dim": 4,
                "train.steps": 3,
                "train.batch_size": 2,
            },
        ),
        (DraftTrainConfig, {"train.steps": 3}),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_reference_lists_every_key_with_its_default(cls, required):
    rows = reference_rows(cls)
    assert {key for key, row in rows.items() if row["default"] == "required"} == set(required)
    assert all(row["doc"].strip() for row in rows.values())
    # The rendered defaults, read back as YAML by the config loader, give the config's own defaults.
    from_reference, baseline = {}, {}
    for key, row in rows.items():
        set_dotted(from_reference, key, required[key] if key in required else yaml.safe_load(row["default"]))
    for key, value in required.items():
        set_dotted(baseline, key, value)
    for f in dataclasses.fields(cls):  # sections without a default whose keys all have one
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            baseline.setdefault(f.name, {})
    expected = from_dict(cls, baseline)
    assert from_dict(cls, from_reference) == expected
    assert set(rows) == set(flatten(to_dict(expected)))


def test_reference_types_read_as_yaml():
    rows = reference_rows(GRPOConfig)
    assert rows["rollout.dtype"]["type"] == '"float32" | "bfloat16"'
    assert rows["rollout.sub_batch"]["type"] == "int | null"
    assert rows["spec.ngram_sizes"]["type"] == "list[int]" and rows["spec.ngram_sizes"]["default"] == "[3, 2, 1]"
    assert config_reference.yaml_type(tuple[int, int, int] | None) == "[int, int, int] | null"
    assert config_reference.yaml_type(Literal["a", "b"]) == '"a" | "b"'


def test_docstring_fields_are_split_at_their_names():
    doc = """Intro. e.g. alpha: an example, not alpha's documentation.

    alpha / beta: shared text
        continued on an indented line.
    gamma (async): its text. delta: a second field on the same line,
    continued at the same indentation.
    epsilon: text
        indented.
    Closing remark back at the fields' indentation.
    """
    description, docs = config_reference.parse_docstring(doc, ["alpha", "beta", "gamma", "delta", "epsilon"])
    assert docs == {
        "alpha": "shared text continued on an indented line.",
        "beta": "shared text continued on an indented line.",
        "gamma": "its text.",
        "delta": "a second field on the same line, continued at the same indentation.",
        "epsilon": "text indented.",
    }
    assert (
        description == "Intro. e.g. alpha: an example, not alpha's documentation. Closing remark back at the "
        "fields' indentation."
    )


def test_escaping_keeps_code_and_shows_angle_brackets():
    escaped = config_reference._escape("writes <run-dir>/x, a * b | c, `<keep|this*>`")
    assert escaped == r"writes &lt;run-dir>/x, a \* b \| c, `<keep|this*>`"


@dataclasses.dataclass(frozen=True)
class _Section:
    """A section.

    documented: has its text.
    """

    documented: int = 1
    forgotten: int = 2


@dataclasses.dataclass(frozen=True)
class _Run:
    """A run."""

    section: _Section = _Section()


def test_undocumented_field_fails_the_build():
    with pytest.raises(config_reference.UndocumentedFields, match=r"_Section\.forgotten \(tests/test_docs\.py\)"):
        config_reference.render(_Run)
    require("mkdocs")
    from mkdocs.exceptions import PluginError

    spec = importlib.util.spec_from_file_location("jaxspec_docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = type("Page", (), {"file": type("File", (), {"src_uri": "configuration/run.md"})()})()
    text = "# Run\n\n<!-- config-reference tests.test_docs:_Run -->\n"
    with pytest.raises(PluginError, match=r"configuration/run\.md: .*_Section\.forgotten"):
        hooks.on_page_markdown(text, page, None, None)
    text = "# Run\n\n<!-- config-reference jaxspec.rl.config:EvalConfig -->\n"
    assert "| `every` | `int` | `0` | 0 disables validation. |" in hooks.on_page_markdown(text, page, None, None)


def test_api_docstring_fields_become_paragraphs():
    require("griffe")
    griffe_fields = importlib.import_module("griffe_fields")
    lines = [
        "Intro.",
        "alpha: first",
        "continued.",
        "beta / alpha: both",
        "other: not a parameter",
        "```",
        "alpha: code <x>",
        "```",
        "<run-dir>",
    ]
    expected = [
        "Intro.",
        "",
        "alpha: first",
        "continued.",
        "",
        "beta / alpha: both",
        "other: not a parameter",
        "```",
        "alpha: code <x>",
        "```",
        "&lt;run-dir>",
    ]
    assert griffe_fields.paragraphs("\n".join(lines), {"alpha", "beta"}) == "\n".join(expected)
