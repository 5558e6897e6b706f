"""benchmarks/knob_curve.py: the acceptance length at every depth from a chain's per-position rates,
checked against the acceptance length `bench spec` counted in a recorded GPU run."""

import json
import shutil
from pathlib import Path

import pytest

from tests.benchmarks.scripts import load_script

knob_curve = load_script("knob_curve")

RECORDED = Path(__file__).resolve().parents[2] / "benchmarks/results/ae_h200/spec_long.json"


def test_depth_curve_ends_at_the_counted_acceptance_length():
    """The chains' rates come from the run's accepted-token counts; the curve's last point is the
    acceptance length bench spec counted (tokens per step) for each chain of that run."""
    rows = json.loads(RECORDED.read_text())["rows"]
    chains = [r for r in rows if r["config"].startswith("eagle3 chain")]
    assert len(chains) == 2
    for row in chains:
        curve = knob_curve.acceptance_by_depth(row["acceptance_per_position"])
        assert curve[-1] == pytest.approx(row["acceptance_length"], abs=1e-6)
        assert all(a < b for a, b in zip(curve, curve[1:]))


def test_acceptance_by_depth_by_hand():
    assert knob_curve.acceptance_by_depth([0.5, 0.5, 1.0]) == [1.5, 1.75, 2.0]
    assert knob_curve.acceptance_by_depth([0.0, 1.0]) == [1.0, 1.0]
    assert knob_curve.acceptance_by_depth([0.0, float("nan"), float("nan")]) == [1.0, 1.0, 1.0]


def test_table_json_and_plot(tmp_path, capsys):
    for variation in ("0.7", "0.5"):
        shutil.copyfile(RECORDED, tmp_path / f"spec_long_v{variation}.json")
    files = sorted(tmp_path.glob("spec_long_v*.json"))
    assert (
        knob_curve.main([*map(str, files), "--out", str(tmp_path / "curve.json"), "--plot", str(tmp_path / "c.png")])
        == 0
    )
    points = json.loads((tmp_path / "curve.json").read_text())
    assert [p["variation"] for p in points] == [0.5, 0.7]
    assert points[0]["nats_per_token"] == pytest.approx(0.51685, abs=1e-4)
    assert len(points[0]["acceptance"]) == 7
    assert (tmp_path / "c.png").stat().st_size > 0
    assert "| 0.5 | 0.517 | 1.63 | 2.05 | 2.32 |" in capsys.readouterr().out


def test_bad_files_are_named(tmp_path):
    wrong_name = tmp_path / "spec_long.json"
    shutil.copyfile(RECORDED, wrong_name)
    with pytest.raises(SystemExit, match="spec_long.json: not a spec_long_v"):
        knob_curve.main([str(wrong_name)])
    no_chain = tmp_path / "spec_long_v0.6.json"
    data = json.loads(RECORDED.read_text())
    data["rows"] = [r for r in data["rows"] if r["config"] != "eagle3 chain k=7"]
    no_chain.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match=r"spec_long_v0.6.json: needs the rows 'ar' and 'eagle3 chain k=7'"):
        knob_curve.main([str(no_chain)])
    with pytest.raises(SystemExit, match="spec_long_v0.9.json: not a `jaxspec bench spec` result"):
        knob_curve.main([str(tmp_path / "spec_long_v0.9.json")])
