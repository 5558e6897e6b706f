"""The packages form layers: each imports only from its own layer and those below it (e.g. the
memory a copy of the weights needs lives in jaxspec.models, so jaxspec.run.placement never reaches
up into jaxspec.rollout). Function-local imports count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxspec"

# Modules every layer may use: they import nothing of jaxspec beyond each other.
BASE = {"atomic", "distributed", "exits", "peer_watch", "config_io", "optim", "assets"}

# What each lower package may import besides BASE and itself.
BELOW = {
    "kernels": set(),
    "models": {"kernels"},
    "run": {"models", "kernels"},
    "draft": {"models", "kernels"},
    "rollout": {"draft", "models", "kernels"},
}


def jaxspec_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level jaxspec subpackage or module) of every import in the file at `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "jaxspec" else [f"jaxspec.{a.name}" for a in node.names]
        found += [(node.lineno, name.split(".")[1]) for name in names if name.startswith("jaxspec.")]
    return found


def upward_imports(package: str) -> list[str]:
    allowed = BASE | BELOW[package] | {package}
    return [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports jaxspec.{target}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for line, target in jaxspec_imports(path)
        if target not in allowed
    ]


@pytest.mark.parametrize("package", sorted(BELOW))
def test_no_import_reaches_up_a_layer(package):
    assert upward_imports(package) == []


def test_base_modules_import_only_each_other():
    for name in sorted(BASE - {"assets"}):
        targets = {target for _, target in jaxspec_imports(PACKAGE / f"{name}.py")}
        assert targets <= BASE, f"jaxspec/{name}.py imports {sorted(targets - BASE)}"


def test_an_upward_import_is_reported(tmp_path):
    """Negative control: the check names the file, line and the higher package it reaches."""
    module = tmp_path / "placement.py"
    module.write_text("import jax\n\ndef f():\n    from jaxspec.rollout.memory import check_fits\n")
    assert jaxspec_imports(module) == [(4, "rollout")]
