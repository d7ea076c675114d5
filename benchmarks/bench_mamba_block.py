"""Benchmark: the LinearGrowthMamba block against its peers, forward and forward+backward.

CPU (default): certblocks ``LinearGrowthMamba`` and ``Mamba`` (torch scan backend) against HF
transformers ``MambaMixer`` on its CPU torch path, fp32, at (B=2, L=1024, d_model=128).  The HF
forward+backward takes tens of seconds there, so it runs once (``--hf-repeats``).

GPU (``--gpu``): the same script on CUDA, certblocks blocks (triton backend) against
``mamba_ssm.Mamba`` (its CUDA fast path), bf16 by default; ``--compile`` adds LinearGrowthMamba under
``torch.compile(fullgraph=True)`` (``mode="reduce-overhead"``, CUDA graphs, on a GPU).

Prints a table and writes JSON to ``benchmarks/out/``.  Times are medians over repeats after a
warm-up; ratios are peer time / certblocks time (higher is better for certblocks).

Usage::

    python benchmarks/bench_mamba_block.py                 # CPU
    python benchmarks/bench_mamba_block.py --gpu           # CUDA
    python benchmarks/bench_mamba_block.py --gpu --compile # CUDA, and LinearGrowthMamba under torch.compile
    python benchmarks/bench_mamba_block.py --threads 1          # stable figures on a busy shared CPU
    python benchmarks/bench_mamba_block.py --batch 2 --seqlen 256 --d-model 64 --hf-repeats 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], None], device: torch.device, repeats: int, warmup: int) -> List[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _measure(name: str, module: torch.nn.Module, x: torch.Tensor, repeats: int, warmup: int,
             device: torch.device) -> Dict[str, object]:
    def fwd() -> None:
        with torch.no_grad():
            module(x)

    def fwd_bwd() -> None:
        xr = x.detach().requires_grad_(True)
        module(xr).float().square().mean().backward()
        module.zero_grad(set_to_none=True)

    t_f = _time(fwd, device, repeats, warmup)
    t_fb = _time(fwd_bwd, device, repeats, warmup)
    row = {"name": name, "forward_s": statistics.median(t_f), "fwd_bwd_s": statistics.median(t_fb),
           "forward_all": t_f, "fwd_bwd_all": t_fb, "repeats": repeats}
    print(f"  {name:<34} forward {row['forward_s']:.4g} s   fwd+bwd {row['fwd_bwd_s']:.4g} s", flush=True)
    return row


def _hf_mixer(d_model: int, d_state: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module | None:
    try:
        import transformers
        import transformers.models.mamba.modeling_mamba as mm
    except Exception as e:  # optional peer
        print(f"  (transformers not available: {e})")
        return None
    # Use HF's torch path (the functions it would pick from mamba_ssm when that imports stay reachable).
    for fname in ("mamba_selective_scan", "mamba_selective_state_update", "causal_conv1d_fn", "causal_conv1d_update"):
        f = getattr(mm, fname, None)
        if f is not None and hasattr(f, "__wrapped__"):
            setattr(mm, fname, f.__wrapped__)
    cfg = transformers.MambaConfig(hidden_size=d_model, state_size=d_state, conv_kernel=4, expand=2,
                                   num_hidden_layers=1)
    return mm.MambaMixer(cfg, layer_idx=0).to(device=device, dtype=dtype)


def _mamba_ssm(d_model: int, d_state: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module | None:
    try:
        from mamba_ssm import Mamba as RefMamba
    except Exception as e:  # optional peer (needs its CUDA build)
        print(f"  (mamba_ssm not available: {type(e).__name__}: {e})")
        return None
    return RefMamba(d_model, d_state=d_state).to(device=device, dtype=dtype)


def main(argv: List[str] | None = None) -> Dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="run on CUDA against mamba_ssm.Mamba")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seqlen", type=int, default=None)
    ap.add_argument("--d-model", type=int, default=None)
    ap.add_argument("--d-state", type=int, default=16)
    ap.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--hf-repeats", type=int, default=1, help="repeats of the (slow) HF CPU path; 0 skips it")
    ap.add_argument("--compile", action="store_true",
                    help="also time LinearGrowthMamba under torch.compile(fullgraph=True) (CUDA graphs on a GPU)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads for all blocks (on a busy shared CPU, 1 gives stable timings)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/out/bench_mamba_block[_gpu].json)")
    args = ap.parse_args(argv)

    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # the checkout, after an installed certblocks
    from certblocks.blocks.mamba import LinearGrowthMamba, Mamba

    if args.gpu and not torch.cuda.is_available():
        ap.error("--gpu needs a CUDA device")
    device = torch.device("cuda" if args.gpu else "cpu")
    batch = args.batch or (8 if args.gpu else 2)
    seqlen = args.seqlen or (2048 if args.gpu else 1024)
    d_model = args.d_model or (1024 if args.gpu else 128)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        args.dtype or ("bf16" if args.gpu else "fp32")]

    print(f"bench_mamba_block: device={device}, B={batch}, L={seqlen}, d_model={d_model}, d_state={args.d_state}, "
          f"dtype={dtype}, threads={torch.get_num_threads()}")
    torch.manual_seed(0)
    x = torch.randn(batch, seqlen, d_model, device=device, dtype=dtype)
    rows = []
    lg = LinearGrowthMamba(d_model, d_state=args.d_state).to(device=device, dtype=dtype)
    rows.append(_measure("certblocks LinearGrowthMamba", lg, x, args.repeats, args.warmup, device))
    rows.append(_measure("certblocks Mamba (free)", Mamba.from_module(lg), x, args.repeats, args.warmup, device))
    if args.compile:
        mode = "reduce-overhead" if args.gpu else None
        compiled = torch.compile(lg, fullgraph=True, mode=mode)
        rows.append(_measure(f"LinearGrowthMamba compiled ({mode or 'default'})", compiled, x, args.repeats,
                             max(args.warmup, 3), device))  # CUDA graphs record on a later call than the first
    peer = None
    if args.gpu:
        ref = _mamba_ssm(d_model, args.d_state, device, dtype)
        if ref is not None:
            peer = _measure("mamba_ssm.Mamba (CUDA fast path)", ref, x, args.repeats, args.warmup, device)
    elif args.hf_repeats > 0:
        hf = _hf_mixer(d_model, args.d_state, device, dtype)
        if hf is not None:
            peer = _measure("HF MambaMixer (CPU torch path)", hf, x, args.hf_repeats, 0, device)
    if peer is not None and not args.gpu:
        # A shared CPU drifts during the long peer run: time the certblocks blocks again after it and take
        # the median over both sets of repeats (reported as *_all).
        print("  re-timing certblocks blocks after the peer run:")
        again = [_measure("certblocks LinearGrowthMamba", lg, x, args.repeats, args.warmup, device),
                 _measure("certblocks Mamba (free)", Mamba.from_module(lg), x, args.repeats, args.warmup, device)]
        for r, r2 in zip(rows, again):
            for key in ("forward", "fwd_bwd"):
                r[f"{key}_all"] = r[f"{key}_all"] + r2[f"{key}_all"]
                r[f"{key}_s"] = statistics.median(r[f"{key}_all"])
            r["repeats"] = 2 * args.repeats
    if peer is not None:
        rows.append(peer)
        for r in rows[:-1]:
            r["speedup_forward"] = peer["forward_s"] / r["forward_s"]
            r["speedup_fwd_bwd"] = peer["fwd_bwd_s"] / r["fwd_bwd_s"]

    print()
    head = f"| {'block':<34} | {'forward (s)':>11} | {'fwd+bwd (s)':>11} | {'x peer fwd':>10} | {'x peer f+b':>10} |"
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        sf = f"{r['speedup_forward']:.1f}x" if "speedup_forward" in r else "-"
        sb = f"{r['speedup_fwd_bwd']:.1f}x" if "speedup_fwd_bwd" in r else "-"
        print(f"| {r['name']:<34} | {r['forward_s']:>11.4g} | {r['fwd_bwd_s']:>11.4g} | {sf:>10} | {sb:>10} |")

    result = {
        "benchmark": "bench_mamba_block",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "cuda": torch.cuda.get_device_name(0) if args.gpu else None},
        "config": {"device": str(device), "batch": batch, "seqlen": seqlen, "d_model": d_model,
                   "d_state": args.d_state, "dtype": str(dtype), "repeats": args.repeats, "warmup": args.warmup,
                   "hf_repeats": args.hf_repeats, "compile": args.compile},
        "rows": rows,
    }
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "out" / (
        "bench_mamba_block_gpu.json" if args.gpu else "bench_mamba_block.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
