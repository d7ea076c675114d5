"""Timing of the budget computations (issue: "well under a second").

    python benchmarks/bench_budget.py [--repeats 7]

Prints a table (median of repeats) and writes benchmarks/out/bench_budget.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

from certblocks import BlockCertificate
from certblocks.certificate import certify_stack


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    hetero = [BlockCertificate(1 if k % 2 else 0.5, 1 + (k % 3), c=1e-3 * (1 + k % 5), b=1e-4, l1=1e-3, l0=1e-3)
              for k in range(10_000)]
    cases = {
        "certify_stack, 10,000 heterogeneous updates, bf16": lambda: certify_stack(hetero, "bf16"),
        "certify_stack, 10,000 updates, fp64": lambda: certify_stack(hetero, "fp64"),
    }
    for q in (0, 0.5, 1, 2, 5):
        cert = BlockCertificate(q, 2, c=1.0, l1=1.0, l0=1.0)
        cases[f"BlockCertificate(q={q:g}, sigma=2).depths('fp64')"] = lambda cert=cert: cert.depths("fp64")
    cases["BlockCertificate(q=0.5, sigma=1, c=l1=l0=1e-6).depths('fp64') (closed-form tail)"] = (
        lambda: BlockCertificate(0.5, 1, c=1e-6, l1=1e-6, l0=1e-6).depths("fp64"))
    # a refused chain's report: to_dict() computes no fix unless asked; with fixes=True, each lever's value by
    # bisection, certified again (dataclasses.replace: a fresh certificate, so the fixes are not the kept ones)
    chain = [BlockCertificate(1, 1, c=0.05, l1=0.2, l0=0.1, name=f"u{k}") for k in range(1000)]
    refused = certify_stack(chain, "fp16")
    assert not refused.ok
    cases["StackCertificate.to_dict(), 1,000-update refused chain (fp16)"] = lambda: refused.to_dict()
    cases["StackCertificate.to_dict(fixes=True), same chain, fixes not yet computed"] = (
        lambda: dataclasses.replace(refused).to_dict(fixes=True))
    rows = [(name, median_time(fn, args.repeats)) for name, fn in cases.items()]
    width = max(len(n) for n, _ in rows)
    print(f"{'case'.ljust(width)}  median [ms]")
    for name, t in rows:
        print(f"{name.ljust(width)}  {1e3 * t:10.2f}")
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "bench_budget.json").write_text(json.dumps(
        {"machine": platform.platform(), "python": platform.python_version(), "repeats": args.repeats,
         "median_seconds": dict(rows)}, indent=2))


if __name__ == "__main__":
    main()
