"""Runs a notebook of notebooks/ top to bottom in a real Jupyter kernel of this interpreter."""

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def run_notebook(name: str, checks: str, timeout_s: int = 300) -> None:
    """Executes notebooks/<name> with `checks` (Python code run after the last cell, in the
    notebook's namespace) appended; any failing cell raises nbclient's CellExecutionError.

    The kernel starts from this interpreter (jupyter_client runs the "python3" kernel with
    sys.executable), in notebooks/ as a reader's would, with this checkout first on its path, one
    CPU device, and JAX's cheap compilation as the rest of the suite uses."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(checks))
    repo = str(NOTEBOOKS.parent)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(
        PYTHONPATH=os.pathsep.join([repo, *filter(None, [os.environ.get("PYTHONPATH")])]),
        JAX_PLATFORMS="cpu",
        JAX_DISABLE_MOST_OPTIMIZATIONS="1",
        MPLBACKEND="agg",
    )
    client = NotebookClient(
        nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute(env=env)
