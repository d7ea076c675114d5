"""Benchmark of certblocks.kernels.selective_scan (not a test).

CPU (default), fp32, (B=2, D=256, N=16, L=1024), with z (silu gate), D, delta_bias and softplus:
the ``torch`` backend against (a) the ``reference`` backend (per-timestep loop with autograd),
(b) mamba-ssm's ``selective_scan_ref`` (its backward is quadratic in L: run once) and (c) the
bound set by this CPU's exp throughput (``torch.exp`` over B*D*L*N float32 elements; also shown with a
preallocated output, which removes the page faults of a fresh 33 MB result and is the stricter bound).
Targets: torch >= 5x faster than (a) in forward+backward; torch forward within 4x of (c).

``--gpu``: on CUDA, bf16, (B=8, L=2048, D=2048 and 4096, N=16): the ``triton`` backend's forward,
forward+backward (silu and sigmoid gates) and decode step against mamba-ssm's CUDA ``selective_scan_fn`` / Triton
``selective_state_update`` when importable, and against the bound max(fewest bytes moved / measured
device-to-device copy bandwidth, exponentials / measured rate of ``tl.exp``).  CUDA events, medians; the decode
step also as the replay of a CUDA graph of ``--decode-calls`` steps (launch overhead removed).
``--gpu --device cpu`` is a smoke run of the same code under ``TRITON_INTERPRET=1`` (tiny ``--gpu-*`` sizes).

Prints a table, writes JSON to benchmarks/out/, progress on stderr.

    python benchmarks/bench_selective_scan.py [--repeats 5] [--mamba-ref-repeats 1] [--gpu]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from certblocks.kernels import selective_scan, selective_state_update


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_inputs(batch, dim, dstate, seqlen, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = dict(
        u=torch.randn(batch, dim, seqlen, generator=g),
        delta=torch.rand(batch, dim, seqlen, generator=g) * 0.5 - 2.0,
        A=-torch.exp(torch.rand(dim, dstate, generator=g) * 2.0),
        B=torch.randn(batch, dstate, seqlen, generator=g),
        C=torch.randn(batch, dstate, seqlen, generator=g),
        D=torch.randn(dim, generator=g),
        z=torch.randn(batch, dim, seqlen, generator=g),
        delta_bias=torch.rand(dim, generator=g) - 4.0,
    )
    out = {}
    for k, v in x.items():
        v = v.to(device)
        if k in ("u", "delta", "z", "B", "C"):
            v = v.to(dtype)
        out[k] = v
    return out


def cpu_timer(fn, repeats, warmup=1):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def cuda_timer(fn, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return statistics.median(ts), ts


def fwd_fn(scan, x):
    def f():
        with torch.no_grad():
            scan(**x)

    return f


def fwdbwd_fn(scan, x):
    xs = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in x.items()}

    def f():
        for v in xs.values():
            v.grad = None
        out = scan(**xs)
        out.float().sum().backward()

    return f


_EXP_KERNEL = None


def exp_rate(dev, timer, repeats):
    """Exponentials per second of a Triton kernel that only chains ``tl.exp`` (the scan kernels' costly op),
    8+ independent chains a thread: the exp-unit ceiling of the bound."""
    global _EXP_KERNEL
    import triton
    import triton.language as tl

    if _EXP_KERNEL is None:
        @triton.jit
        def _exp_chain_kernel(x_ptr, out_ptr, ITERS: tl.constexpr, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs)
            for _ in range(ITERS):
                x = tl.exp(x * -1.0001)  # stays in (0.36, 1]: no denormals, no overflow
            tl.store(out_ptr + offs, x)

        _EXP_KERNEL = _exp_chain_kernel
    cuda = dev == "cuda"
    block, iters = (1024, 1024) if cuda else (64, 8)
    programs = 32 * torch.cuda.get_device_properties(0).multi_processor_count if cuda else 2
    x = torch.rand(block * programs, device=dev) * 0.5 + 0.5
    y = torch.empty_like(x)
    t, _ = timer(lambda: _EXP_KERNEL[(programs,)](x, y, ITERS=iters, BLOCK=block, num_warps=4), repeats)
    if not torch.isfinite(y).all():
        raise RuntimeError("the exp-rate kernel produced a non-finite value")
    return x.numel() * iters / t


def graph_time(fn, calls, repeats):
    """Per-call device time of ``fn`` captured ``calls`` times in one CUDA graph (launch overhead removed)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    t, ts = cuda_timer(g.replay, repeats)
    return t / calls, [v / calls for v in ts]


def machine():
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = dict(
        python=platform.python_version(), torch=torch.__version__, platform=platform.platform(), cpu=cpu,
        cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
    )
    try:
        info["loadavg"] = os.getloadavg()
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def print_table(title, rows, cols):
    print(f"\n{title}")
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))


def bench_cpu(args):
    B, D, N, L = args.batch, args.dim, args.dstate, args.seqlen
    x = make_inputs(B, D, N, L, torch.float32, "cpu")
    kw = dict(delta_softplus=True)
    rows, res = [], {}

    def add(name, kind, t, ts, note=""):
        res[f"{name}/{kind}"] = dict(median_s=t, min_s=min(ts), times_s=ts, note=note)
        rows.append(dict(impl=name, pass_=kind, median_ms=f"{t * 1e3:.1f}", min_ms=f"{min(ts) * 1e3:.1f}",
                         repeats=len(ts), note=note))

    log(f"CPU, fp32, B={B} D={D} N={N} L={L}, threads={torch.get_num_threads()}")
    big = torch.randn(B * D * L * N)
    # The exp bound, the torch backend and the reference backend are timed round-robin (one repeat of
    # each in turn) so that a fluctuating machine load hits all of them alike; medians per item.
    big_out = torch.empty_like(big)
    items = [
        ("exp bound (torch.exp over B*D*L*N)", "fwd", lambda: torch.exp(big), args.repeats),
        ("exp bound, preallocated output (out=)", "fwd", lambda: torch.exp(big, out=big_out), args.repeats),
    ]
    for backend in ("torch", "reference"):
        scan = lambda backend=backend, **k: selective_scan(**k, **kw, backend=backend)
        items.append((f"certblocks {backend}", "fwd", fwd_fn(scan, x), args.repeats))
        items.append((f"certblocks {backend}", "fwd+bwd", fwdbwd_fn(scan, x), args.repeats))
    times = {(n, k): [] for n, k, _, _ in items}
    for n, k, f, _ in items:
        log(f"warm-up {n} {k}")
        f()
    for r in range(max(reps for *_, reps in items)):
        log(f"round {r + 1}")
        for n, k, f, reps in items:
            if r < reps:
                t0 = time.perf_counter()
                f()
                times[(n, k)].append(time.perf_counter() - t0)
    for (n, k), ts in times.items():
        add(n, k, statistics.median(ts), ts)
    try:
        from certblocks.testing.mamba_cpu import install_selective_scan_stub

        install_selective_scan_stub()  # mamba-ssm built without its CUDA extension
        from mamba_ssm.ops.selective_scan_interface import selective_scan_ref
    except Exception as exc:
        log(f"mamba-ssm not importable ({exc!r}): skipping its reference")
        selective_scan_ref = None
    if selective_scan_ref is not None:
        mscan = lambda **k: selective_scan_ref(**k, **kw)
        log("mamba-ssm selective_scan_ref: forward")
        t, ts = cpu_timer(fwd_fn(mscan, x), max(1, min(args.repeats, 3)))
        add("mamba-ssm selective_scan_ref", "fwd", t, ts)
        if args.mamba_ref_repeats > 0:
            Lm = args.mamba_ref_seqlen or L
            xm = x if Lm == L else make_inputs(B, D, N, Lm, torch.float32, "cpu")
            log(f"mamba-ssm selective_scan_ref: forward+backward at L={Lm} ({args.mamba_ref_repeats} run(s), slow)")
            t, ts = cpu_timer(fwdbwd_fn(mscan, xm), args.mamba_ref_repeats, warmup=0)
            add("mamba-ssm selective_scan_ref", "fwd+bwd", t, ts, "" if Lm == L else f"at L={Lm}")
    tt = lambda k: res[k]["median_s"]
    tm = lambda k: res[k]["min_s"]
    summary = {}
    for label, f in (("medians", tt), ("minima (best of repeats: least disturbed by machine load)", tm)):
        summary[f"fwd+bwd speed-up of torch over reference (target >= 5), {label}"] = f(
            "certblocks reference/fwd+bwd"
        ) / f("certblocks torch/fwd+bwd")
        summary[f"fwd speed-up of torch over reference, {label}"] = f("certblocks reference/fwd") / f(
            "certblocks torch/fwd"
        )
        summary[f"torch fwd / exp bound (target <= 4), {label}"] = f("certblocks torch/fwd") / f(
            "exp bound (torch.exp over B*D*L*N)/fwd"
        )
        summary[f"torch fwd / exp bound with preallocated output (stricter), {label}"] = f(
            "certblocks torch/fwd"
        ) / f("exp bound, preallocated output (out=)/fwd")
    if "mamba-ssm selective_scan_ref/fwd+bwd" in res and not args.mamba_ref_seqlen:
        summary["fwd+bwd speed-up of torch over mamba-ssm selective_scan_ref"] = tt(
            "mamba-ssm selective_scan_ref/fwd+bwd"
        ) / tt("certblocks torch/fwd+bwd")
    if "mamba-ssm selective_scan_ref/fwd" in res:
        summary["fwd speed-up of torch over mamba-ssm selective_scan_ref"] = tt(
            "mamba-ssm selective_scan_ref/fwd"
        ) / tt("certblocks torch/fwd")
    for r in rows:
        r["pass"] = r.pop("pass_")
    print_table(f"selective_scan, CPU fp32, B={B} D={D} N={N} L={L} (median of repeats)", rows,
                ["impl", "pass", "median_ms", "min_ms", "repeats", "note"])
    print()
    for k, v in summary.items():
        print(f"{k}: {v:.2f}")
    return dict(config=dict(batch=B, dim=D, dstate=N, seqlen=L, dtype="float32", device="cpu"), results=res,
                summary=summary)


def bench_gpu(args):
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device (or --device cpu with TRITON_INTERPRET=1 for a smoke run)")
    timer = cuda_timer if dev == "cuda" else cpu_timer
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except Exception as exc:
        log(f"mamba-ssm CUDA selective_scan_fn not importable ({exc!r})")
        selective_scan_fn = None
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as m_ssu
    except Exception as exc:
        log(f"mamba-ssm selective_state_update not importable ({exc!r})")
        m_ssu = None
    # the two ceilings: device-to-device copy bandwidth (read + write) and the rate of tl.exp
    buf = torch.empty((256 if dev == "cuda" else 4) * 2**20, dtype=torch.uint8, device=dev)
    t, _ = timer(buf.clone, 10)
    bw = 2 * buf.numel() / t
    del buf
    exps_per_s = exp_rate(dev, timer, 10)
    log(f"measured copy bandwidth {bw / 1e9:.0f} GB/s, tl.exp rate {exps_per_s / 1e12:.3f} T exp/s")
    kw = dict(delta_softplus=True)
    rows, res = [], {}

    def bound(D, kind, nbytes, exps):
        t_hbm, t_exp = nbytes / bw, exps / exps_per_s
        res[f"D={D}/HBM bound/{kind}"] = dict(median_s=t_hbm, bytes=nbytes)
        res[f"D={D}/exp bound/{kind}"] = dict(median_s=t_exp, exps=exps)
        res[f"D={D}/bound/{kind}"] = dict(median_s=max(t_hbm, t_exp), by="HBM" if t_hbm >= t_exp else "exp")
        for name, v in (("HBM bound", t_hbm), ("exp bound", t_exp)):
            rows.append(dict(D=D, impl=name, pass_=kind, median_ms=f"{v * 1e3:.4f}"))

    for D in args.gpu_dims:
        B, N, L = args.gpu_batch, 16, args.gpu_seqlen
        x = make_inputs(B, D, N, L, torch.bfloat16, dev)
        esz = 2
        bytes_fwd = esz * B * L * (4 * D + 2 * N)  # read u, delta, z, B, C; write out
        # backward: re-read u, delta, z, B, C and dout; write du, ddelta, dz, dB, dC
        bytes_bwd = bytes_fwd + esz * B * L * (7 * D + 4 * N)
        impls = [("certblocks triton", lambda **k: selective_scan(**k, **kw, backend="triton")),
                 ("certblocks triton (sigmoid gate)",
                  lambda **k: selective_scan(**k, **kw, gate="sigmoid", backend="triton"))]
        if selective_scan_fn is not None:
            impls.append(("mamba-ssm selective_scan_fn", lambda **k: selective_scan_fn(**k, **kw)))
        for name, scan in impls:
            for kind, mk in (("fwd", fwd_fn), ("fwd+bwd", fwdbwd_fn)):
                log(f"D={D} {name} {kind}")
                try:
                    t, ts = timer(mk(scan, x), args.repeats)
                except Exception as exc:
                    log(f"D={D} {name} {kind} failed: {exc!r}")
                    rows.append(dict(D=D, impl=name, pass_=kind, median_ms=f"failed: {type(exc).__name__}"))
                    continue
                res[f"D={D}/{name}/{kind}"] = dict(median_s=t, times_s=ts)
                rows.append(dict(D=D, impl=name, pass_=kind, median_ms=f"{t * 1e3:.3f}"))
        # the backward recomputes every decay: 2 exponentials per (b, d, t, n) in all
        bound(D, "fwd", bytes_fwd, B * D * L * N)
        bound(D, "fwd+bwd", bytes_bwd, 2 * B * D * L * N)
        # decode step
        state = torch.zeros(B, D, N, device=dev, dtype=torch.float32)
        g = torch.Generator(device="cpu").manual_seed(1)
        xs = torch.randn(B, D, generator=g).to(dev, torch.bfloat16)
        dts = torch.randn(B, D, generator=g).to(dev, torch.bfloat16)
        zs = torch.randn(B, D, generator=g).to(dev, torch.bfloat16)
        Bs, Cs = (torch.randn(B, N, generator=g).to(dev, torch.bfloat16) for _ in range(2))
        dargs = (state, xs, dts, x["A"], Bs, Cs, x["D"], zs, x["delta_bias"])
        dec = [("certblocks triton", lambda a=dargs: selective_state_update(*a, dt_softplus=True, backend="triton"))]
        if m_ssu is not None:
            dec.append(("mamba-ssm selective_state_update", lambda a=dargs: m_ssu(*a, dt_softplus=True)))
        for name, f in dec:
            log(f"D={D} {name} decode")
            try:
                t, ts = timer(f, args.repeats * 10)
                res[f"D={D}/{name}/decode"] = dict(median_s=t, times_s=ts)
                rows.append(dict(D=D, impl=name, pass_="decode", median_ms=f"{t * 1e3:.4f}"))
                if dev == "cuda":
                    t, ts = graph_time(f, args.decode_calls, args.repeats)
                    res[f"D={D}/{name} (CUDA graph)/decode"] = dict(median_s=t, times_s=ts)
                    rows.append(dict(D=D, impl=f"{name} (CUDA graph)", pass_="decode", median_ms=f"{t * 1e3:.4f}"))
            except Exception as exc:
                log(f"D={D} {name} decode failed: {exc!r}")
                rows.append(dict(D=D, impl=name, pass_="decode", median_ms=f"failed: {type(exc).__name__}"))
        # float32 state read and written, A; x, dt, z read and out written; B, C; D and dt_bias
        nbytes = 8 * B * D * N + 4 * D * N + esz * 4 * B * D + esz * 2 * B * N + 8 * D
        bound(D, "decode", nbytes, B * D * N)
        del x, state
        if dev == "cuda":
            torch.cuda.empty_cache()
    summary = {}
    for D in args.gpu_dims:
        for kind in ("fwd", "fwd+bwd", "decode"):
            b = res[f"D={D}/bound/{kind}"]
            for ours in ("certblocks triton", "certblocks triton (sigmoid gate)", "certblocks triton (CUDA graph)"):
                r = res.get(f"D={D}/{ours}/{kind}")
                if r:
                    summary[f"D={D} {kind}: {ours}, fraction of the bound ({b['by']}-bound; bound time / "
                            f"measured time)"] = b["median_s"] / r["median_s"]
            ours = res.get(f"D={D}/certblocks triton/{kind}")
            for peer in ("mamba-ssm selective_scan_fn", "mamba-ssm selective_state_update"):
                p = res.get(f"D={D}/{peer}/{kind}")
                if ours and p:
                    summary[f"D={D} {kind}: speed-up of triton over {peer} (target >= 1.0)"] = (
                        p["median_s"] / ours["median_s"])
    for r in rows:
        r["pass"] = r.pop("pass_")
    print_table(f"selective_scan, {dev} bf16, B={args.gpu_batch} L={args.gpu_seqlen} N=16 (median)", rows,
                ["D", "impl", "pass", "median_ms"])
    print()
    for k, v in summary.items():
        print(f"{k}: {v:.2f}")
    return dict(config=dict(batch=args.gpu_batch, seqlen=args.gpu_seqlen, dstate=16, dims=args.gpu_dims,
                            dtype="bfloat16", device=dev, copy_bandwidth_Bps=bw, exp_rate_per_s=exps_per_s),
                results=res, summary=summary)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="GPU mode (triton vs mamba-ssm CUDA, bf16)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--dstate", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--mamba-ref-repeats", type=int, default=1,
                   help="runs of mamba-ssm selective_scan_ref forward+backward (slow: ~30 s each); 0 skips")
    p.add_argument("--mamba-ref-seqlen", type=int, default=0, help="run mamba-ssm's fwd+bwd at this shorter L")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    p.add_argument("--gpu-dims", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--gpu-batch", type=int, default=8)
    p.add_argument("--gpu-seqlen", type=int, default=2048)
    p.add_argument("--decode-calls", type=int, default=100, help="decode steps captured in one CUDA graph")
    p.add_argument("--device", default="cuda", help="--gpu mode device (cpu: smoke run under TRITON_INTERPRET=1)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"), help="folder of the JSON")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    report = bench_gpu(args) if args.gpu else bench_cpu(args)
    report.update(
        command=" ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), machine=machine(),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "cpu" if not args.gpu else ("gpu" if args.device == "cuda" else "gpu_smoke_" + args.device)
    path = out / f"bench_selective_scan_{name}.json"
    path.write_text(json.dumps(report, indent=2))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
