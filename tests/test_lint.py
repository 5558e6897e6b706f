"""The tree passes the linter and is formatted as pyproject.toml's [tool.ruff] configures."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("ruff") is None:
        if os.environ.get("CI"):  # the test extra installs it
            raise AssertionError("ruff is not installed (pip install -e '.[test]')")
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check():
    result = ruff("check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format():
    result = ruff("format", "--no-cache", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr
