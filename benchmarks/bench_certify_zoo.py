"""Time ``certblocks certify`` over every zoo model: this checkout against a baseline revision, same run.

Usage: python benchmarks/bench_certify_zoo.py [--baseline REV] [--repeats 3] [--json out.json]

Each measurement is one fresh interpreter running the CLI's ``certify`` command without a model (what
``make demo`` prints: every zoo model built at its defaults and certified in fp16, bf16 and fp32), timed
wall-clock from start to exit, imports included.  The baseline revision is checked out with
``git worktree`` into a temporary folder and laid out as the installed package (``kernels/`` and
``zoo/`` inside ``certblocks/``), then run with ``PYTHONPATH`` pointing at it, so both sides use the same
interpreter and libraries.  Runs alternate between the two sides; the table gives the median of the
repeats and the ratio.  Default baseline: ``a47c216``, the last commit before the bounds layer.
Target: under 20 s for this checkout on the development machine (2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_RUN = "import sys; from certblocks.cli import main; sys.exit(main(['certify']))"


def _layout(rev: str, work: Path) -> Path:
    """Check out ``rev`` and lay it out as the installed package; returns the folder for ``PYTHONPATH``."""
    tree = work / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                   capture_output=True)
    site = work / "site"
    shutil.copytree(tree / "certblocks", site / "certblocks")
    shutil.copytree(tree / "kernels", site / "certblocks" / "kernels")
    shutil.copytree(tree / "zoo", site / "certblocks" / "zoo")
    return site


def _time(pythonpath: str | None) -> float:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _RUN], env=env, capture_output=True, text=True,
                          cwd=tempfile.gettempdir())
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"certify failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="a47c216", help="git revision to compare against ('' for none)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")

    times: dict = {"this checkout": []}
    work = Path(tempfile.mkdtemp(prefix="certblocks-bench-"))
    try:
        site = None
        if args.baseline:
            site = _layout(args.baseline, work)
            times[f"baseline {args.baseline}"] = []
        for _ in range(args.repeats):
            times["this checkout"].append(_time(None))
            if site is not None:
                times[f"baseline {args.baseline}"].append(_time(str(site)))
    finally:
        if (work / "tree").exists():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "tree")],
                           capture_output=True)
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"certblocks certify (every zoo model), {args.repeats} repeats, median wall time")
    for k, v in times.items():
        print(f"  {k:<24} {med[k]:7.1f} s   runs: {', '.join(f'{t:.1f}' for t in v)}")
    if len(med) == 2:
        base = med[f"baseline {args.baseline}"]
        print(f"  speed-up: {base / med['this checkout']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"times_s": times, "median_s": med, "machine": platform.platform(),
                                               "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}, indent=1))


if __name__ == "__main__":
    main()
