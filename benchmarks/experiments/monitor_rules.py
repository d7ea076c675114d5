"""Replay the on-data alert rules of :class:`certblocks.CertificateMonitor` on recorded monitor runs.

``benchmarks/experiments/monitor_gpt.py`` writes, per run, the monitor's records (``monitor_gpt<tag>_<form>.csv``: the
measured headroom ``data/headroom_measured`` and the (T) estimate's ``data/headroom`` at every check) and the
run's outcome (``monitor_gpt<tag>.json``: the first non-finite step).  This script replays, on those records,
each alert rule the monitor offers -- the headroom below a threshold, or its least-squares trend over the last
``window`` checks reaching zero within ``horizon`` steps (the trend of
:class:`certblocks.ondata.watch.OnDataWatch`) -- on each headroom basis, and tabulates for every rule how many
steps ahead of the first non-finite loss it warned in each diverging run and how many checks alerted in each run
that finished.

Usage::

    python benchmarks/experiments/monitor_rules.py benchmarks/out/monitor_gpt_full_*.json [--out FILE.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from certblocks.ondata.watch import OnDataWatch

BASES = {"measured": "data/headroom_measured", "estimate": "data/headroom"}


def load_runs(paths: Sequence[str]) -> List[Dict[str, Any]]:
    """Each run of each ``monitor_gpt*.json``: its label, outcome and ``(step, headroom)`` series per basis."""
    runs = []
    for path in paths:
        with open(path) as fh:
            doc = json.load(fh)
        tag = os.path.basename(path)[len("monitor_gpt"):-len(".json")]
        args = doc["summary"]["args"]
        for res in doc["summary"]["results"]:
            with open(os.path.join(os.path.dirname(path), f"monitor_gpt{tag}_{res['form']}.csv")) as fh:
                rows = list(csv.DictReader(fh))
            series = {b: [(int(r["step"]), _num(r.get(k))) for r in rows] for b, k in BASES.items()}
            runs.append({"run": f"{res['form']} (lr {args['lr']:g}, warm-up {args.get('warmup', 0)}, "
                                f"{args['layers']}x{args['width']})",
                         "first_nonfinite": res["first_nonfinite"], "steps_run": res["steps_run"], "series": series})
    return runs


def _num(v: Optional[str]) -> Optional[float]:
    if v in (None, ""):
        return None
    x = float(v)
    return None if math.isnan(x) else x


def replay(series: List[Tuple[int, Optional[float]]], *, threshold: Optional[float], horizon: Optional[int],
           window: int) -> List[int]:
    """The checks (steps) at which the rule alerts: :meth:`OnDataWatch.observe`, the monitor's own decision."""
    w = OnDataWatch("fp16", threshold=threshold, horizon=horizon, window=window, steps=1, tol=0.0, logit_samples=1)
    steps = []
    for step, h in series:
        if h is None:
            continue
        below, zero = w.observe(step, h)
        if below or zero is not None:
            steps.append(step)
    return steps


def evaluate(runs: List[Dict[str, Any]], rules: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    for rule in rules:
        row: Dict[str, Any] = {"rule": rule, "diverging": [], "finishing": []}
        for run in runs:
            hits = replay(run["series"][rule["basis"]], threshold=rule["threshold"], horizon=rule["horizon"],
                          window=rule["window"])
            end = run["first_nonfinite"]
            if end is not None:
                before = [s for s in hits if s < end]
                row["diverging"].append({"run": run["run"], "first_nonfinite": end,
                                         "steps_ahead": end - before[0] if before else None})
            else:
                row["finishing"].append({"run": run["run"], "alerts": len(hits),
                                         "checks": len(run["series"][rule["basis"]])})
        out.append(row)
    return out


def default_rules() -> List[Dict[str, Any]]:
    rules = []
    for basis in BASES:
        rules.append({"basis": basis, "threshold": 1.0, "horizon": None, "window": 5})
        for window in (5, 10, 20):
            for horizon in (20, 50):
                rules.append({"basis": basis, "threshold": None, "horizon": horizon, "window": window})
    return rules


def rule_name(r: Dict[str, Any]) -> str:
    if r["threshold"] is not None:
        return f"{r['basis']}, below {r['threshold']:g} nat"
    return f"{r['basis']}, trend: window {r['window']}, horizon {r['horizon']}"


def markdown(rows: List[Dict[str, Any]]) -> str:
    div = [d["run"] for d in rows[0]["diverging"]]
    fin = [f["run"] for f in rows[0]["finishing"]]
    head = ["rule"] + [f"{r} (non-finite at {d['first_nonfinite']}): steps ahead"
                       for r, d in zip(div, rows[0]["diverging"])] + [f"{r}: alerts / checks" for r in fin]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [rule_name(row["rule"])]
        cells += ["none" if d["steps_ahead"] is None else str(d["steps_ahead"]) for d in row["diverging"]]
        cells += [f"{f['alerts']} / {f['checks']}" for f in row["finishing"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Any = None) -> List[Dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="monitor_gpt*.json files (their CSVs next to them)")
    p.add_argument("--out", default=None, help="write the evaluation as JSON here")
    args = p.parse_args(argv)
    rows = evaluate(load_runs(args.runs), default_rules())
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
