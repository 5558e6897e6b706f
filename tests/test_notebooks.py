"""The notebooks run top to bottom and their final checks hold."""

import json
from pathlib import Path

import numpy as np

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def run_code_cells(path: Path) -> dict:
    """Executes a notebook's code cells in order in one namespace; returns the namespace."""
    namespace: dict = {}
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{path.name}", "exec"), namespace)
    return namespace


def test_quickstart_runs_and_logprobs_match_the_trainer():
    ns = run_code_cells(NOTEBOOKS / "quickstart.ipynb")
    assert ns["spec_out"].stats["generated_tokens"] == int(np.asarray(ns["spec_out"].lengths).sum())
    n = ns["n"]
    np.testing.assert_allclose(np.asarray(ns["recomputed"]), np.asarray(ns["spec_out"].logprobs[0, :n]), atol=1e-5)
