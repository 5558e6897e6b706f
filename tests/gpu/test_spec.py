"""tests/gpu/check_spec.py: on a GPU, the compiled verification kernels and every rollout method
against the jnp reference; on the CPU, the kernel check's stochastic-draft cases in Triton's
interpreter."""

import jax.numpy as jnp
import pytest

import jaxspec.kernels.tree_stochastic_triton as stochastic
from tests.gpu import check_spec, check_spec_kernels


def mismatches(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r["ok"]]


@pytest.mark.gpu
def test_compiled_verification_kernels_agree_with_the_reference():
    rows = check_spec_kernels.kernel_checks()
    assert len(rows) == 96 and not mismatches(rows), mismatches(rows)


@pytest.mark.gpu
def test_every_rollout_method_agrees_with_the_reference():
    runs = check_spec.run_impls(("reference", "triton"), jobs=6)
    rows = check_spec.compare_rollouts(runs["reference"], runs["triton"])
    assert len(rows) == len(check_spec.rollout_cases()) and not mismatches(rows), mismatches(rows)
    coupled = check_spec.coupled_rows(runs["triton"])
    assert len(coupled) == 6 and not mismatches(coupled), coupled


@pytest.mark.parametrize("chain", [True, False])
def test_stochastic_kernel_case_agrees_with_the_reference(chain):
    row = check_spec_kernels.kernel_case(5, chain, 512, 1.0, 16, seed=7, interpret=True, stochastic=True)
    assert row["ok"] and row["tree"] == ("chain/q" if chain else "random/q") and row["flipped_rows"] == 0.0


def test_coupled_kernel_case_agrees_with_the_reference():
    row = check_spec_kernels.kernel_case(5, False, 512, 1.0, 16, seed=7, interpret=True, coupled=True)
    assert row["ok"] and row["tree"] == "random/c" and row["flipped_rows"] == 0.0


def test_coupled_rows_compare_each_coupled_run_with_the_autoregressive_one():
    """Rows of a coupled run are compared with the coupled autoregressive run at its temperature;
    a run with a quarter of its rows departing fails, uncoupled runs are not compared."""

    def run(config, temperature, tokens, coupled=True):
        return {"config": config, "temperature": temperature, "tokens": tokens, "coupled": coupled}

    ar = [[1, 2], [3, 4], [5, 6], [7, 8]]
    runs = [
        run(check_spec.COUPLED_AR, 1.0, ar),
        run("chain coupled", 1.0, ar),
        run("tree coupled", 1.0, [[1, 2], [3, 4], [5, 6], [7, 9]]),
        run("tree coupled", 0.0, ar),  # no autoregressive run at T=0 among these: not compared
        run("chain", 1.0, [[0, 0]] * 4, coupled=False),
    ]
    rows = check_spec.coupled_rows(runs)
    assert [(r["config"], r["rows_as_ar"], r["ok"]) for r in rows] == [
        ("chain coupled", 1.0, True),
        ("tree coupled", 0.75, True),
    ]
    runs[2]["tokens"] = [[1, 2], [3, 4], [0, 6], [7, 9]]
    assert [r["ok"] for r in check_spec.coupled_rows(runs)] == [True, False]


def test_a_wrong_stochastic_kernel_fails_the_case(monkeypatch):
    kernel = stochastic.verify_stochastic_triton
    wrong = lambda *a, **k: kernel(*a, **k)._replace(next_token=jnp.zeros(16, jnp.int32))  # noqa: E731
    monkeypatch.setattr(stochastic, "verify_stochastic_triton", wrong)
    row = check_spec_kernels.kernel_case(5, True, 512, 1.0, 16, seed=7, interpret=True, stochastic=True)
    assert not row["ok"] and row["flipped_rows"] > 0.5


def test_a_deadline_keeps_the_cases_every_implementation_finished(monkeypatch):
    """run_impls(..., deadline): children that print some cases and then hang are stopped at the
    deadline, with the process each started (which holds the output pipe open: stopping the child
    alone would leave the collection waiting for it); the rows each finished are kept, and
    finished_by_all keeps the cases both finished."""
    import subprocess
    import sys
    import time

    script = (
        "import json, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "impl = sys.argv[1]\n"
        "for i in ([0, 1, 2] if impl == 'a' else [0, 2]):\n"
        "    print(json.dumps({'index': i, 'impl': impl}), flush=True)\n"
        "time.sleep(60)\n"
    )

    popen = subprocess.Popen

    def child(argv, *, env, **kwargs):
        return popen([sys.executable, "-c", script, env["JAXSPEC_TREE_VERIFY_IMPL"]], env=env, **kwargs)

    monkeypatch.setattr(check_spec.subprocess, "Popen", child)
    began = time.monotonic()
    runs = check_spec.run_impls(("a", "b"), jobs=1, deadline=3.0)
    assert time.monotonic() - began < 30
    assert [r["index"] for r in runs["a"]] == [0, 1, 2] and [r["index"] for r in runs["b"]] == [0, 2]
    common = check_spec.finished_by_all(runs)
    assert [r["index"] for r in common["a"]] == [0, 2] and [r["impl"] for r in common["b"]] == ["b", "b"]


def test_the_rollout_children_start_before_the_kernel_check_and_stop_with_it(monkeypatch):
    """main starts the rollout processes, runs the kernel check while they compile, then collects
    them by the deadline counted from its start; a kernel check that fails stops them."""
    order = []

    class Child:
        pass

    monkeypatch.setattr(check_spec, "stop", lambda child: order.append("kill"))
    monkeypatch.setattr(check_spec.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(check_spec, "start_rollouts", lambda *a: order.append("start") or [("reference", Child())])
    monkeypatch.setattr(check_spec, "kernel_checks", lambda **kw: order.append("kernels") or [])
    monkeypatch.setattr(check_spec, "kernel_cases", lambda only="": [{}])  # one case, not run: counted missing

    def collect(children, end):
        order.append(("collect", 495 < end - check_spec.time.monotonic() <= 500))
        return {"reference": [], "triton": []}

    monkeypatch.setattr(check_spec, "collect_rollouts", collect)
    assert check_spec.main(["--deadline", "500"]) == 3  # no case finished
    assert order == ["start", "kernels", ("collect", True)]

    def failing(**kw):
        raise RuntimeError("kernel check failed")

    order.clear()
    monkeypatch.setattr(check_spec, "kernel_checks", failing)
    with pytest.raises(RuntimeError, match="kernel check failed"):
        check_spec.main([])
    assert order == ["start", "kill"]


def agreeing_row(**case) -> dict:
    """The row `kernel_case` returns for `case` (its keyword arguments) where the kernel agrees."""
    tree = check_spec_kernels.tree_label(case["chain"], case.get("stochastic", False), case.get("coupled", False))
    agreed = {"flipped_rows": 0.0, "consistent": True, "logprob_err": 0.0, "ok": True}
    return {**case, "tree": tree, **agreed, "mean_accepted_reference": 1.0, "mean_accepted_kernel": 1.0}


def test_kernel_rows_print_as_they_finish_and_a_deadline_cuts_the_rest(monkeypatch, capsys):
    """Each kernel case's row is printed when it finishes, so a check stopped by an outer timeout
    still shows what ran; past the deadline no case starts, and main counts the cases left (exit 3)."""
    clock = [0.0]

    def case(**kw):
        clock[0] += 10.0  # each case "takes" 10 s
        return agreeing_row(**kw)

    monkeypatch.setattr(check_spec_kernels, "kernel_case", case)
    monkeypatch.setattr(check_spec_kernels.time, "monotonic", lambda: clock[0])
    printed = []
    rows = check_spec_kernels.kernel_checks(emit=printed.append, end=25.0)
    assert len(rows) == 3 and printed == rows  # cases start at 0, 10 and 20 s; none at 30

    monkeypatch.setattr(check_spec.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(check_spec.time, "monotonic", lambda: clock[0])
    clock[0] = 0.0
    assert check_spec.main(["--skip-rollouts", "--deadline", "25"]) == 3
    out = capsys.readouterr().out
    assert out.count("kernel n=") == 3
    assert f"{len(check_spec_kernels.kernel_cases()) - 3} cases not finished by the deadline" in out


def test_the_kernel_filter_runs_the_coupled_cases_alone(monkeypatch, capsys):
    """--kernels /c runs the coupled draws' kernel cases and no other (the cases of a quick check
    of the coupled path on a card); with them all run, nothing is missing (exit 0)."""
    ran = []

    def case(**kw):
        ran.append(kw)
        return agreeing_row(**kw)

    monkeypatch.setattr(check_spec_kernels, "kernel_case", case)
    monkeypatch.setattr(check_spec.jax, "default_backend", lambda: "gpu")
    assert check_spec.main(["--skip-rollouts", "--kernels", "/c"]) == 0
    assert len(ran) == 10 and all(kw.get("coupled") for kw in ran)
    assert capsys.readouterr().out.count("/c ") == 10
    assert len(check_spec_kernels.kernel_cases()) == 96


@pytest.mark.parametrize(("flag", "value"), [("--kernels", "/x"), ("--only", "no such method")])
def test_a_filter_that_selects_nothing_is_refused(flag, value, capsys):
    """A filter that matches no case would pass with nothing checked: it is a usage error (exit 2)
    that names the flag."""
    with pytest.raises(SystemExit) as stopped:
        check_spec.main([flag, value])
    assert stopped.value.code == 2
    assert flag in capsys.readouterr().err
