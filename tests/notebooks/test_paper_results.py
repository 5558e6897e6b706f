"""notebooks/paper_results.ipynb runs in a kernel on the committed benchmark results."""

from tests.notebooks.kernel import run_notebook


def test_paper_results_notebook():
    run_notebook(
        "paper_results.ipynb",
        """
assert card == "NVIDIA H100 80GB HBM3" and card_l == "4 x NVIDIA H200"
assert list(methods["EAGLE-3 head"]) == [1, 2, 3, 4, 5, 7] and list(methods["draft model (4 layers)"]) == [2, 3, 4]
assert round(methods["EAGLE-3 head"][4]["speedup"], 2) == 2.01            # BENCHMARKS.md, lease M table
assert all(card in ax.get_title() for ax in (left, right)) and all(card_l in a.get_title() for a in axes)
assert card_l in ax.get_title()
assert round(summaries["ar_lr2e6"]["step_s"] / summaries["frozen_lr2e6"]["step_s"], 2) == 1.41  # lease L
""",
    )
