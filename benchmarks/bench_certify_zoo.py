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

``--models`` (default: GPT-2 124M and ViT-B/16) also times, for this checkout only and each in a fresh
interpreter per repeat, a model's build (``certify=False``), its first ``certificate()`` (radius, head and
update certificates, computed concurrently on torch's threads) and build plus certificate as the constructor
does it (``certify=True``: the certificate, and a refusal's message when it is not certified; timed until the
constructor returns or raises).  ``--models ''`` skips them.
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
_MODELS = "gpt2_qknorm_124m,certblocks_vit_base_patch16_224"
# one model, fresh interpreter: build (certify=False), certificate(), then build + certificate (certify=True)
_MODEL_RUN = """
import json, sys, time
import torch
from certblocks.stack import CertificationError
from certblocks.zoo import create_model
name = sys.argv[1]
torch.manual_seed(0)
t0 = time.perf_counter(); m = create_model(name, certify=False); t1 = time.perf_counter()
m.certificate(); t2 = time.perf_counter()
del m
torch.manual_seed(0)
t3 = time.perf_counter()
try:
    create_model(name)
    refused = False
except CertificationError:
    refused = True
t4 = time.perf_counter()
print(json.dumps({"build": t1 - t0, "certificate": t2 - t1, "build+certificate": t4 - t3, "refused": refused}))
"""


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
    ap.add_argument("--models", default=_MODELS, help="comma-separated zoo models timed one by one ('' for none)")
    ap.add_argument("--skip-zoo", action="store_true", help="only the per-model timings")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")

    times: dict = {"this checkout": []}
    work = Path(tempfile.mkdtemp(prefix="certblocks-bench-"))
    try:
        site = None
        if args.baseline and not args.skip_zoo:
            site = _layout(args.baseline, work)
            times[f"baseline {args.baseline}"] = []
        for _ in range(0 if args.skip_zoo else args.repeats):
            times["this checkout"].append(_time(None))
            if site is not None:
                times[f"baseline {args.baseline}"].append(_time(str(site)))
    finally:
        if (work / "tree").exists():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "tree")],
                           capture_output=True)
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items() if v}
    if med:
        print(f"certblocks certify (every zoo model), {args.repeats} repeats, median wall time")
    for k in med:
        print(f"  {k:<24} {med[k]:7.1f} s   runs: {', '.join(f'{t:.1f}' for t in times[k])}")
    if len(med) == 2:
        base = med[f"baseline {args.baseline}"]
        print(f"  speed-up: {base / med['this checkout']:.2f}x")
    models = _time_models([n for n in args.models.split(",") if n.strip()], args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps({"times_s": times, "median_s": med, "models_s": models,
                                               "machine": platform.platform(), "cpus": os.cpu_count(),
                                               "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%d")},
                                              indent=1))


def _time_models(names: list, repeats: int) -> dict:
    """Per-model medians (``_MODEL_RUN``), printed; ``{name: {phase: [runs], ..., "median": {...}}}``."""
    out: dict = {}
    if not names:
        return out
    print(f"per model, this checkout, {repeats} repeats, median wall time (s)")
    print(f"  {'model':<34} {'build':>7} {'certificate':>12} {'build+certificate':>18}")
    for name in names:
        runs = []
        for _ in range(repeats):
            proc = subprocess.run([sys.executable, "-c", _MODEL_RUN, name.strip()], capture_output=True, text=True,
                                  cwd=tempfile.gettempdir())
            if proc.returncode != 0:
                raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        phases = ("build", "certificate", "build+certificate")
        rec = {k: [r[k] for r in runs] for k in phases}
        rec["median"] = {k: statistics.median(rec[k]) for k in phases}
        rec["refused"] = runs[0]["refused"]
        out[name] = rec
        m = rec["median"]
        note = " (refused)" if rec["refused"] else ""
        print(f"  {name:<34} {m['build']:7.2f} {m['certificate']:12.2f} {m['build+certificate']:18.2f}{note}")
    return out


if __name__ == "__main__":
    main()
