"""notebooks/quickstart.ipynb runs in a kernel; its rollouts, log-probs and plots hold up."""

from tests.notebooks.kernel import run_notebook


def test_quickstart_notebook():
    run_notebook(
        "quickstart.ipynb",
        """
assert head[0].aux_layer_ids is not None and prompts[0][:2] == [tok.bos_id, tok.tokenizer.token_to_id("<|user|>")]
assert logprob_gap.max() < 1e-4, logprob_gap.max()      # the trainer's recomputation
assert ar.stats.get("acceptance_length", 1.0) == 1.0
assert [by_k[k][0].stats["acceptance_length"] for k in ks] == sorted(by_k[k][0].stats["acceptance_length"] for k in ks)
assert by_k[3][0].stats["acceptance_length"] > 2.0      # the embedded head agrees with its policy
assert len(left.patches) == max(ks) and len(right.lines) == 2  # both plots drawn
""",
    )


def test_the_committed_quickstart_shows_its_figure():
    """The committed outputs hold the acceptance and throughput figure (displayed explicitly, so a
    re-execution under a non-interactive plotting backend keeps it)."""
    import nbformat

    from tests.notebooks.kernel import NOTEBOOKS

    nb = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    plotting = [c for c in nb.cells if c.cell_type == "code" and "plt.subplots" in c.source]
    assert len(plotting) == 1
    assert any("image/png" in output.get("data", {}) for output in plotting[0].outputs)
