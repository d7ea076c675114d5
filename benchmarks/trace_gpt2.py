"""Time certifying GPT-2 124M (12 layers, random init from GPT2Config()) from its graph.

Usage: python benchmarks/trace_gpt2.py [--seq-len 8] [--repeats 3] [--json out.json]

Prints the capture (torch.export + one concrete run) and analysis times, the median of
``--repeats`` full ``certblocks.trace.certify`` calls, and the number of residual updates.
Target: < 10 s on the development machine (2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    from transformers import GPT2Config, GPT2Model

    from certblocks.trace import certify
    from certblocks.trace.api import certify_velocity, find_residual_updates
    from certblocks.trace.capture import capture

    torch.manual_seed(0)
    model = GPT2Model(GPT2Config()).eval()
    ids = torch.randint(0, 50257, (1, args.seq_len))
    n_params = sum(p.numel() for p in model.parameters())

    # warm-up (first export initializes torch.export / dynamo machinery)
    t0 = time.perf_counter()
    cert = certify(model, ids)
    first = time.perf_counter() - t0

    # peer in the same run: torch.export alone (what any graph-based tool pays)
    from certblocks.trace.capture import _Wrapper

    exports = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        torch.export.export(_Wrapper(model), (ids,), kwargs={"use_cache": False}, strict=False)
        exports.append(time.perf_counter() - t0)

    totals, caps, anas = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        g = capture(model, (ids,), {})
        t1 = time.perf_counter()
        ups = find_residual_updates(g)
        for x, f, _ in ups:
            certify_velocity(g, x, f)
        t2 = time.perf_counter()
        caps.append(t1 - t0)
        anas.append(t2 - t1)
        t0 = time.perf_counter()
        cert = certify(model, ids)
        totals.append(time.perf_counter() - t0)

    res = {
        "model": "GPT-2 124M (GPT2Config(), random init)",
        "params": n_params,
        "seq_len": args.seq_len,
        "updates": len(cert),
        "first_call_s": round(first, 3),
        "certify_median_s": round(statistics.median(totals), 3),
        "capture_median_s": round(statistics.median(caps), 3),
        "analysis_median_s": round(statistics.median(anas), 3),
        "torch_export_median_s": round(statistics.median(exports), 3),
        "certify_over_export": round(statistics.median(totals) / statistics.median(exports), 2),
        "repeats": args.repeats,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "target_s": 10.0,
    }
    print(f"{'metric':22s} value")
    for k, v in res.items():
        print(f"{k:22s} {v}")
    print(f"certify(GPT-2 124M, seq-len {args.seq_len}): {res['certify_median_s']:.2f} s median "
          f"(first call {res['first_call_s']:.2f} s) -> {'OK' if res['certify_median_s'] < 10 else 'OVER'} "
          "the 10 s target")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
