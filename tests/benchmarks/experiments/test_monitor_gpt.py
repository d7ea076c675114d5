"""benchmarks/experiments/monitor_gpt.py --replot: the figure of a committed run is drawn again from its JSON."""

from __future__ import annotations

import os

from monitor_gpt import main

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "results")


def test_replot_a_saved_run(tmp_path) -> None:
    png = tmp_path / "again.png"
    summary = main(["--replot", os.path.join(RESULTS, "monitor_gpt_full_lr2e-3.json"), str(png)])
    assert summary["args"]["lr"] == 0.002 and summary["results"][0]["form"] == "noln"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
