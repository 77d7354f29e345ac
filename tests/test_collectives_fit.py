"""The simulator's link model for a worker group's collectives: fitted to measured all-reduces and
all-to-alls (`tandem profile --collectives`), and used by `tandem plan --intra-link` in place of the
data sheet's NVLink."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.sim.collectives import fit_link, load
from tandem.sim.hardware import Link


def test_fit_recovers_a_known_link() -> None:
    link = Link("known", 8e9, 12e-6)
    points = [(kind, nbytes, f(nbytes, 4)) for nbytes in (2_048, 65_536, 4_194_304)
              for kind, f in (("all_reduce", link.all_reduce_seconds), ("all_to_all", link.all_to_all_seconds))]
    fitted = fit_link(points, 4, "fit")
    assert fitted.latency_s == pytest.approx(12e-6, rel=1e-6) and fitted.bandwidth == pytest.approx(8e9, rel=1e-6)


@pytest.mark.whole_machine  # a rank on each of the host's cores, timed
def test_measured_link_prices_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two ranks on this machine: each fitted link (all-reduce, all-to-all) predicts its measured points
    within a factor of 2;
    a plan priced with it (shared memory between CPU processes: GB/s, not NVLink's 450) gets fewer
    tokens per GPU from a wide expert-parallel pool than the data sheet promises."""
    from tandem.cli import main

    links = tmp_path / "links.json"
    assert main(["profile", "--collectives", str(links), "--group-size", "2"]) == 0
    fit = load(links)
    assert fit.ranks == 2 and fit.device == "cpu" and len(fit.points) == 10
    assert all(link.latency_s >= 0 and 1e7 < link.bandwidth < 1e12 for link in fit.links.values())
    assert fit.max_error < 1.0, fit.points
    capsys.readouterr()
    sheet, measured = tmp_path / "sheet.json", tmp_path / "measured.json"
    common = ["plan", "--model-shape", "deepseek-v3", "--gpu", "H200", "--slo-tpot", "50", "--ep-widths", "8"]
    assert main([*common, "--output", str(sheet)]) == 0
    assert main([*common, "--output", str(measured), "--intra-link", str(links)]) == 0
    assert "links within a node (measured" in capsys.readouterr().out
    tokens = {name: max(r["tokens_per_gpu"] for r in json.loads(p.read_text()))
              for name, p in (("sheet", sheet), ("measured", measured))}
    assert tokens["measured"] < tokens["sheet"]
