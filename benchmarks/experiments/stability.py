"""Blow-up experiment on ETTh1: do the certificates predict which forecasters blow up?

Trains the zoo's forecaster variants (built with ``certify=False`` so that uncertified ones can be
trained) on ETTh1 (standard 12/4/4-month split, input 96, channel-independent, targets
standardized with the train statistics; see ``benchmarks/experiments/ett.py``):

=================  ==================================  =====
variant            zoo model                           q
=================  ==================================  =====
mamba_free         ``mamba_forecaster_free``           5
mamba_lg           ``mamba_forecaster_lg``             1
mamba_rms/preln/periln ``mamba_forecaster_*``          0
patchtst_noln      ``patchtst_noln``                   1
patchtst_rms/preln/periln ``patchtst_*``               0
=================  ==================================  =====

``D`` is the number of layers (``e_layers``); each layer is two residual updates (mixer or
attention, then MLP), so a model has ``2 D`` updates.  Optimizer as in the paper (App. B.3): Adam,
learning rate 1e-3 (Mamba) / 1e-4 (PatchTST), MSE loss, a fixed number of steps (no early
stopping).  The default variants are the seven the protocol names (``--variants`` adds
patchtst_rms and patchtst_periln).

Budget (so that the full mode's 252 runs fit in under two hours on a 2-core CPU with one thread):
width 64 (``d_model`` 64; Mamba ``d_ff`` 64, ``dt_rank`` 16; PatchTST 8 heads, ``d_ff`` 128; the zoo
default is 128), 64 Adam steps of 16 windows (x 7 channels), test MSE on every 8th test window.
This is far less training than the paper's, which bounds what a run can show; every knob is an
option.  Each finished run is appended to a ``.jsonl`` log; ``--resume`` continues from it.

Precisions: ``fp32``; ``bf16`` = ``torch.autocast`` with bfloat16; ``fp16`` = autocast with float16
and a ``GradScaler``.

A run *blows up* when its training loss becomes non-finite (checked every step) or its final test
MSE (standardized targets) is non-finite or exceeds 10.  Per cell (backbone, variant, D, horizon,
precision) the script reports the blow-up count, the test MSE mean +- sd over the surviving seeds
relative to the median of the normalized variants' means of the same backbone and cell
(``rel = mse / ref - 1``), and each run's certificate from ``model.certificate(dtype)`` at
initialization and after training (max q, max sigma over the updates, certified depth of the
``2 D`` updates in the run's dtype).

Progress goes to stderr; results to ``benchmarks/out/stability_{quick,full}.json`` and a PNG of
the blow-up rate by variant and depth.

Usage::

    python benchmarks/experiments/stability.py --quick        # D=3, 1 seed, fp32/bf16/fp16, horizon 96: 21 runs
    python benchmarks/experiments/stability.py        # D in {3, 8}, 3 seeds, fp32/bf16/fp16, H in {96, 336}: 252 runs
    python benchmarks/experiments/stability.py --resume       # continue an interrupted run from its .jsonl log
    python benchmarks/experiments/stability.py --data PATH --variants mamba_free mamba_lg --steps 500 --width 128
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ett import default_data_path, load_ett, make_loaders

OUT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out")

#: variant -> (zoo model name, backbone, q, normalized)
VARIANTS: Dict[str, Tuple[str, str, int, bool]] = {
    "mamba_free": ("mamba_forecaster_free", "mamba", 5, False),
    "mamba_lg": ("mamba_forecaster_lg", "mamba", 1, False),
    "mamba_rms": ("mamba_forecaster_rms", "mamba", 0, True),
    "mamba_preln": ("mamba_forecaster_preln", "mamba", 0, True),
    "mamba_periln": ("mamba_forecaster_periln", "mamba", 0, True),
    "patchtst_noln": ("patchtst_noln", "patchtst", 1, False),
    "patchtst_rms": ("patchtst_rms", "patchtst", 0, True),
    "patchtst_preln": ("patchtst_preln", "patchtst", 0, True),
    "patchtst_periln": ("patchtst_periln", "patchtst", 0, True),
}
#: the variants the issue's protocol names (``--variants`` adds patchtst_rms and patchtst_periln)
DEFAULT_VARIANTS = ("mamba_free", "mamba_lg", "mamba_rms", "mamba_preln", "mamba_periln", "patchtst_noln",
                    "patchtst_preln")
LEARNING_RATES = {"mamba": 1e-3, "patchtst": 1e-4}


def width_overrides(backbone: str, width: int) -> Dict[str, int]:
    """Model size at ``d_model = width`` (the zoo's defaults are width 128; see the module docstring)."""
    if backbone == "mamba":
        return {"d_model": width, "d_ff": width, "dt_rank": max(1, width // 4)}
    return {"d_model": width, "d_ff": 2 * width, "n_heads": max(1, width // 8)}
PRECISIONS = ("fp32", "bf16", "fp16")
BLOWUP_MSE = 10.0


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_model(variant: str, depth: int, pred_len: int, seed: int, **overrides: Any) -> nn.Module:
    """A forecaster of ``variant`` with ``depth`` layers, seeded, built with ``certify=False``."""
    from certblocks.zoo import create_model

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    torch.manual_seed(seed)
    cfg: Dict[str, Any] = dict(e_layers=depth, pred_len=pred_len, certify=False)
    cfg.update(overrides)
    return create_model(VARIANTS[variant][0], **cfg)


def certificate_summary(model: nn.Module, precision: str) -> Dict[str, Any]:
    """``model.certificate(precision)`` summarized: max q, max sigma, certified depth, updates, ok."""
    try:
        c = model.certificate(precision)
    except Exception as e:  # a certificate that cannot be computed is reported, not hidden
        return {"error": f"{type(e).__name__}: {e}"}
    qs = [u.q for u in c.updates if u.q is not None]
    ss = [u.sigma for u in c.updates if u.sigma is not None]
    return {"dtype": c.dtype, "q": max(qs) if qs else None, "sigma": max(ss) if ss else None,
            "certified_depth": c.certified_depth, "forward_depth": c.forward_depth,
            "backward_depth": c.backward_depth, "updates": c.depth, "ok": c.ok,
            "r0": c.r0, "radius_out": c.radii[-1] if math.isfinite(c.radii[-1]) else "inf"}


def _autocast(precision: str, device: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def evaluate(model: nn.Module, loader: Iterable, precision: str, device: str = "cpu") -> float:
    """Mean squared error over all windows, channels and steps (forward in ``precision``, MSE in fp64)."""
    model.eval()
    se, n = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            with _autocast(precision, device):
                out = model(x)
            d = out.double() - y.double()
            se += float((d * d).sum())
            n += d.numel()
    model.train()
    return se / max(n, 1)


@dataclass
class RunResult:
    blew_up: bool
    reason: str
    steps_done: int
    final_train_loss: Optional[float]
    test_mse: Optional[float]
    seconds: float
    loss_trace: List[float] = field(default_factory=list)


def train_run(model: nn.Module, train: Iterable, test: Iterable, *, precision: str, steps: int, lr: float,
              device: str = "cpu", log_every: int = 50, label: str = "", max_grad_norm: Optional[float] = None
              ) -> RunResult:
    """Train ``model`` for ``steps`` Adam steps (MSE) in ``precision``; detect a blow-up.

    Args:
        model: the forecaster (``(B, L, C) -> (B, H, C)``).
        train: an iterable of ``(x, y)`` batches, cycled as needed.
        test: an iterable of ``(x, y)`` batches for the final test MSE.
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + GradScaler).
        steps: optimizer steps.
        lr: Adam learning rate.
        device: torch device type.
        log_every: progress line every this many steps (stderr).
        label: prefix of the progress lines.
        max_grad_norm: optional gradient clipping (off by default, as in the paper's protocol).

    Returns:
        A :class:`RunResult`; ``blew_up`` when the loss became non-finite (training stops there) or
        the final test MSE is non-finite or above 10.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    model.to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device, enabled=precision == "fp16")
    t0 = time.time()
    trace: List[float] = []
    it = iter(train)
    step = 0
    loss_v = None
    while step < steps:
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(train)
            x, y = next(it)
        x, y = x.to(device), y.to(device)
        with _autocast(precision, device):
            out = model(x)
        loss = ((out.float() - y.float()) ** 2).mean()
        loss_v = float(loss.detach())
        step += 1
        if not math.isfinite(loss_v):
            _log(f"{label} step {step}: loss {loss_v} -> BLOW-UP")
            return RunResult(True, f"non-finite loss at step {step}", step, loss_v, None, time.time() - t0, trace)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if max_grad_norm is not None:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        scaler.step(opt)
        scaler.update()
        if step % max(1, log_every) == 0 or step == 1:
            trace.append(loss_v)
            _log(f"{label} step {step}/{steps}: loss {loss_v:.4f} ({time.time() - t0:.0f} s)")
    mse = evaluate(model, test, precision, device)
    secs = time.time() - t0
    if not math.isfinite(mse):
        return RunResult(True, "non-finite test MSE", step, loss_v, None, secs, trace)
    if mse > BLOWUP_MSE:
        return RunResult(True, f"test MSE {mse:.4g} > {BLOWUP_MSE:g}", step, loss_v, mse, secs, trace)
    return RunResult(False, "", step, loss_v, mse, secs, trace)


def summarize(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per-cell rows: blow-ups, MSE mean/sd over survivors, relative to the normalized variants' median."""
    cells: Dict[Tuple, List[Dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault((r["variant"], r["depth"], r["pred_len"], r["precision"]), []).append(r)
    rows = []
    for (v, D, H, prec), rs in cells.items():
        ok = [r["test_mse"] for r in rs if not r["blew_up"]]
        mean = statistics.fmean(ok) if ok else None
        sd = statistics.stdev(ok) if len(ok) > 1 else (0.0 if ok else None)
        rows.append({"variant": v, "backbone": VARIANTS[v][1], "q": VARIANTS[v][2], "depth": D, "pred_len": H,
                     "precision": prec, "runs": len(rs), "blowups": sum(r["blew_up"] for r in rs),
                     "mse_mean": mean, "mse_sd": sd,
                     "cert_ok_init": sum(bool(r["cert_init"].get("ok")) for r in rs),
                     "cert_depth_init": [r["cert_init"].get("certified_depth") for r in rs],
                     "cert_depth_final": [r["cert_final"].get("certified_depth") for r in rs]})
    for row in rows:
        refs = [x["mse_mean"] for x in rows if x["backbone"] == row["backbone"] and VARIANTS[x["variant"]][3]
                and (x["depth"], x["pred_len"], x["precision"]) == (row["depth"], row["pred_len"], row["precision"])
                and x["mse_mean"] is not None]
        ref = statistics.median(refs) if refs else None
        row["ref_mse"] = ref
        row["rel_mean"] = None if ref is None or row["mse_mean"] is None else row["mse_mean"] / ref - 1
        row["rel_sd"] = None if ref is None or row["mse_sd"] is None else row["mse_sd"] / ref
    order = list(VARIANTS)
    rows.sort(key=lambda x: (order.index(x["variant"]), x["depth"], x["pred_len"], PRECISIONS.index(x["precision"])))
    return rows


def table(rows: List[Dict[str, Any]]) -> str:
    """A markdown table of :func:`summarize`'s rows."""
    out = ["| variant | q | D (updates) | H | precision | blow-ups | test MSE | rel. to normalized median "
           "| certified depth init -> final |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mse = "-" if r["mse_mean"] is None else f"{r['mse_mean']:.4f} ± {r['mse_sd']:.4f}"
        rel = "-" if r["rel_mean"] is None else f"{100 * r['rel_mean']:+.1f}% ± {100 * r['rel_sd']:.1f}%"
        cd = ", ".join(f"{a}->{b}" for a, b in zip(r["cert_depth_init"], r["cert_depth_final"]))
        out.append(f"| {r['variant']} | {r['q']} | {r['depth']} ({2 * r['depth']}) | {r['pred_len']} | "
                   f"{r['precision']} | {r['blowups']}/{r['runs']} | {mse} | {rel} | {cd} / {2 * r['depth']} |")
    return "\n".join(out)


def plot(rows: List[Dict[str, Any]], path: str) -> Optional[str]:
    """Blow-up rate (%) by variant and depth (all horizons, precisions and seeds pooled)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("matplotlib not installed: no plot (pip install matplotlib)")
        return None
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    depths = sorted({r["depth"] for r in rows})
    fig, ax = plt.subplots(figsize=(1.0 * len(variants) + 2, 3.5))
    w = 0.8 / len(depths)
    for j, D in enumerate(depths):
        rates, labels = [], []
        for v in variants:
            rs = [r for r in rows if r["variant"] == v and r["depth"] == D]
            n = sum(r["runs"] for r in rs)
            blown = sum(r["blowups"] for r in rs)
            rates.append(100.0 * blown / n if n else float("nan"))
            labels.append(f"{blown}/{n}")
        xs = [i + (j - (len(depths) - 1) / 2) * w for i in range(len(variants))]
        ax.bar(xs, rates, w, label=f"D = {D} layers")
        for x, rate, text in zip(xs, rates, labels):  # the counts, readable even at a rate of 0
            ax.text(x, (0.0 if math.isnan(rate) else rate) + 1.5, text, ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(variants)))
    ax.set_xticklabels([f"{v}\nq={VARIANTS[v][2]}" for v in variants], fontsize=7)
    ax.set_ylabel("blow-up rate (%)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=8)
    precs = sorted({r["precision"] for r in rows}, key=PRECISIONS.index)
    ax.set_title(f"ETTh1 blow-ups ({', '.join(precs)}; horizons {sorted({r['pred_len'] for r in rows})})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _run_key(r: Dict[str, Any]) -> Tuple:
    return (r["variant"], r["depth"], r["pred_len"], r["precision"], r["seed"])


def _load_done(path: str, settings: Dict[str, Any]) -> Dict[Tuple, Dict[str, Any]]:
    """Runs already in the JSONL log ``path`` that were made with the same ``settings``."""
    done: Dict[Tuple, Dict[str, Any]] = {}
    if not os.path.exists(path):
        return done
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            if r.get("settings") == settings:
                done[_run_key(r)] = r
    return done


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="D=3, 1 seed, fp32/bf16/fp16, horizon 96 (the full mode: D in {3, 8}, 3 seeds, H in {96, 336})")
    p.add_argument("--data", default=default_data_path())
    p.add_argument("--variants", nargs="*", default=list(DEFAULT_VARIANTS))
    p.add_argument("--depths", type=int, nargs="*", default=None)
    p.add_argument("--seeds", type=int, nargs="*", default=None)
    p.add_argument("--precisions", nargs="*", default=None, choices=PRECISIONS)
    p.add_argument("--horizons", type=int, nargs="*", default=None)
    p.add_argument("--width", type=int, default=64, help="d_model of every model (zoo default 128; default 64)")
    p.add_argument("--steps", type=int, default=64, help="optimizer steps per run (default 64)")
    p.add_argument("--batch-size", type=int, default=16, help="windows per batch (x the 7 channels; default 16)")
    p.add_argument("--test-stride", type=int, default=8, help="evaluate every n-th test window (default 8)")
    p.add_argument("--lr-scale", type=float, default=1.0,
                   help="multiply the protocol's learning rates (a stress test; default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--resume", action="store_true",
                   help="skip the runs already logged (same settings) in the mode's .jsonl log")
    p.add_argument("--out", default=OUT_DIR)
    a = p.parse_args(argv)
    for v in a.variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {list(VARIANTS)}")
    for name in ("width", "steps", "batch_size", "test_stride", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if not (a.lr_scale > 0 and math.isfinite(a.lr_scale)):
        p.error(f"--lr-scale must be a finite number > 0, got {a.lr_scale}")
    quick = a.quick
    depths = a.depths or ([3] if quick else [3, 8])
    seeds = a.seeds or ([2021] if quick else [2021, 2022, 2023])
    precisions = a.precisions or list(PRECISIONS)
    horizons = a.horizons or ([96] if quick else [96, 336])
    steps, bs, stride = a.steps, a.batch_size, a.test_stride
    torch.set_num_threads(a.threads)
    os.makedirs(a.out, exist_ok=True)
    tag = ("quick" if quick else "full") + ("" if a.lr_scale == 1.0 else f"_lr{a.lr_scale:g}")
    lrs = {k: v * a.lr_scale for k, v in LEARNING_RATES.items()}
    log_path = os.path.join(a.out, f"stability_{tag}.jsonl")
    settings = {"width": a.width, "steps": steps, "batch_size": bs, "test_stride": stride,
                "data": os.path.abspath(a.data)}
    if a.lr_scale != 1.0:
        settings["lr_scale"] = a.lr_scale
    done = _load_done(log_path, settings) if a.resume else {}
    if not a.resume and os.path.exists(log_path):
        os.remove(log_path)
    n_runs = len(a.variants) * len(depths) * len(seeds) * len(precisions) * len(horizons)
    _log(f"stability ({tag}): {n_runs} runs = {len(a.variants)} variants x D {depths} x seeds {seeds} x "
         f"{precisions} x H {horizons}; width {a.width}; {steps} steps of batch {bs}; test every {stride}-th "
         f"window; {a.threads} thread(s)" + (f"; {len(done)} runs resumed from {log_path}" if done else ""))
    data = {H: load_ett(a.data, pred_len=H, test_stride=stride) for H in horizons}
    runs: List[Dict[str, Any]] = []
    t_all = time.time()
    i = 0
    for H in horizons:
        for D in depths:
            for v in a.variants:
                for prec in precisions:
                    for seed in seeds:
                        i += 1
                        key = (v, D, H, prec, seed)
                        if key in done:
                            runs.append(done[key])
                            continue
                        label = f"[{i}/{n_runs}] {v} D={D} H={H} {prec} seed={seed}"
                        train, _, test = make_loaders(data[H], bs, seed=seed)
                        model = build_model(v, D, H, seed, **width_overrides(VARIANTS[v][1], a.width))
                        cert0 = certificate_summary(model, prec)
                        _log(f"{label}: init certificate q={cert0.get('q')} sigma={cert0.get('sigma')} certified "
                             f"{cert0.get('certified_depth')}/{cert0.get('updates')} in {prec}")
                        res = train_run(model, train, test, precision=prec, steps=steps,
                                        lr=lrs[VARIANTS[v][1]], log_every=max(1, steps // 2), label=label)
                        cert1 = certificate_summary(model, prec)
                        run = {"variant": v, "model": VARIANTS[v][0], "q_variant": VARIANTS[v][2], "depth": D,
                               "pred_len": H, "precision": prec, "seed": seed, "steps": steps, "batch_size": bs,
                               "settings": settings, "cert_init": cert0, "cert_final": cert1, **asdict(res)}
                        runs.append(run)
                        with open(log_path, "a") as f:
                            f.write(json.dumps(run, default=str) + "\n")
                        elapsed = time.time() - t_all
                        fresh = sum(1 for r in runs if _run_key(r) not in done)
                        eta = elapsed / fresh * (n_runs - len(runs))
                        _log(f"{label}: {'BLOW-UP (' + res.reason + ')' if res.blew_up else 'ok'}, test MSE "
                             f"{res.test_mse if res.test_mse is None else round(res.test_mse, 4)}, final certified "
                             f"{cert1.get('certified_depth')}/{cert1.get('updates')}, {res.seconds:.0f} s "
                             f"(total {elapsed:.0f} s, ETA {eta / 60:.0f} min)")
    rows = summarize(runs)
    elapsed = time.time() - t_all
    seconds_all = round(sum(float(r["seconds"]) for r in runs), 1)
    meta = {"command": "python benchmarks/experiments/stability.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "mode": tag, **settings, "learning_rates": lrs, "blowup_mse": BLOWUP_MSE,
            "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
                       f"{torch.get_num_threads()} threads",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": round(elapsed, 1),
            "seconds_training_all_runs": seconds_all, "resumed_runs": len(done)}
    path = os.path.join(a.out, f"stability_{tag}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "cells": rows, "runs": runs}, f, indent=1, default=str)
    png = plot(rows, os.path.join(a.out, f"stability_{tag}.png"))
    print(table(rows))
    print(f"\n{len(runs)} runs in {elapsed:.0f} s; JSON {path}" + (f"; plot {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
