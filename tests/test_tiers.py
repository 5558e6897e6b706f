"""The suite's two tiers (tests/conftest.py): a plain `pytest` leaves out the files marked slow;
`-m slow`, or naming a file, runs them."""

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.conftest import leaves_out_the_slow_tier

ROOT = Path(__file__).resolve().parents[1]
SLOW_MARK = re.compile(r"^pytestmark = (\[\s*)?pytest\.mark\.slow\b", re.MULTILINE)


def options(file_or_dir=(), markexpr=""):
    values = {"file_or_dir": list(file_or_dir), "markexpr": markexpr}
    return SimpleNamespace(getoption=values.__getitem__)


def test_only_a_plain_run_over_the_suite_leaves_out_the_slow_tier():
    assert leaves_out_the_slow_tier(options())
    assert leaves_out_the_slow_tier(options(markexpr="not gpu"))
    assert not leaves_out_the_slow_tier(options(markexpr="slow"))
    assert not leaves_out_the_slow_tier(options(markexpr="slow or not slow"))
    assert not leaves_out_the_slow_tier(options(file_or_dir=["tests/rl/test_train.py"]))


def suite_files() -> set[str]:
    return {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")}


def slow_files() -> set[str]:
    return {name for name in suite_files() if SLOW_MARK.search((ROOT / name).read_text())}


def test_a_plain_collection_has_no_test_of_a_slow_file_and_keeps_every_other_file():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    collected = {line.split("::")[0] for line in out.splitlines() if "::" in line}
    slow = slow_files()
    assert "tests/rl/test_train.py" in slow and "tests/rl/test_step.py" not in slow
    assert collected == suite_files() - slow
