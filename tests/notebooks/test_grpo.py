"""notebooks/grpo.ipynb runs in a kernel: GRPO from Python with live plots, then a resume."""

import shutil

from tests.notebooks.kernel import NOTEBOOKS, run_notebook


def test_grpo_notebook():
    try:
        run_notebook(
            "grpo.ipynb",
            """
assert [r["step"] for r in metrics] == list(range(7)) and first_run == 4
assert records == [{k: v for k, v in r.items() if k != "time_unix_s"} for r in metrics[:5]] + records[5:]
assert [r["step"] for r in records[5:]] == [5, 6]           # the resumed run streamed its steps only
assert all(r["acceptance_length"] > 1.5 for r in metrics[1:])  # the embedded head drafts for the policy
assert list(axes[2].lines[0].get_xdata()) == [1, 2, 3, 4, 5, 6]  # the step-time panel, after the resume
""",
        )
    finally:  # the notebook's run directory, and runs/ when nothing else is in it
        shutil.rmtree(NOTEBOOKS / "runs" / "grpo-notebook", ignore_errors=True)
        if (NOTEBOOKS / "runs").is_dir() and not any((NOTEBOOKS / "runs").iterdir()):
            (NOTEBOOKS / "runs").rmdir()
