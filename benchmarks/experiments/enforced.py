"""Enforced forecasters on ETTh1: accuracy and cost per step of ``certblocks.enforce``'s caps.

``enforce(model, dtype)`` caps the weights its residual updates' certificates read (parametrizations) so that
the model stays certified in ``dtype`` whatever training does to them.  This script trains two zoo forecasters
with and without the caps, on the same data, batches and initial weights, over several seeds:

* ``mamba_forecaster_lg`` at the quick protocol's size (``benchmarks/experiments/stability.py --quick``): width 64,
  ``d_ff`` 64, ``dt_rank`` 16, 3 layers (6 updates), input 96, horizon 96, channel-independent;
* ``toto_style`` at its 4m scale (width 256, 4 heads, sigmoid-gated MLP 688, 4 layers: 8 updates), context 96,
  patch 32.  It forecasts the next patch at every patch position: trained on that (input ``x``, target ``x``
  shifted by one patch, the first 32 steps of the horizon closing it); its 96-step forecast rolls three patches
  forward (each forecast patch appended, the context shifted).

Variants: ``plain`` (no caps), ``bf16`` (``enforce(model, "bf16")``: the zoo's certification dtype) and ``fp16``
(``enforce(model, "fp16")``: a smaller budget, caps below the initial norms, ``alpha < 1``).  A seed builds the
same initial weights for every variant (enforce then shrinks them by ``alpha`` where ``alpha < 1``) and sees the
same batches.

Protocol (the quick protocol of ``stability.py``): ETTh1 with the standard 12/4/4-month split, standardized with
the train statistics (``benchmarks/experiments/ett.py``); Adam, learning rate 1e-3, MSE loss, 64 steps of 16 windows
(x 7 channels), fp32; test MSE and MAE (standardized targets) on every 8th test window.  Cost per step: a
training step (forward, backward, optimizer step; the enforced models' forward under ``parametrize.cached()``,
one cap per tensor per forward) timed on one batch, the variants of a model interleaved (``--time-repeats``
rounds of ``--time-steps`` steps each after a warm-up step: the machine's load drifts alike for all), the median
over rounds of each round's median, and its ratio to ``plain``; the training runs' own step times are in the JSON.
Each run records ``alpha`` and the certificate after training: for an enforced run the
model's certificate in its dtype at the input radius fixed by ``enforce`` (``r0``; the embedding is not capped)
and ``Lip(G) = 1`` (the head is not capped either), for a plain run its certificate in bf16 and fp16.

Results: a markdown table (mean ± std over seeds) and ``benchmarks/results/enforced.json``.

Usage::

    python benchmarks/experiments/enforced.py --seeds 0 1 2 3 4 5 6 7 8 9  # both models, 3 variants (~15 min, 1 thread)
    python benchmarks/experiments/enforced.py --models mamba_forecaster_lg --seeds 0 --steps 8 --out /tmp/e.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.utils import parametrize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ett import default_data_path, load_ett, make_loaders

OUT_JSON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "enforced.json")
#: model -> constructor overrides (the quick protocol's Mamba size; toto at its 4m scale, context 96)
MODELS: Dict[str, Dict[str, Any]] = {
    "mamba_forecaster_lg": dict(d_model=64, d_ff=64, dt_rank=16, e_layers=3, seq_len=96, pred_len=96, n_vars=7),
    "toto_style": dict(context=96, patch=32),
}
VARIANTS = ("plain", "bf16", "fp16")
SEQ_LEN = PRED_LEN = 96
WARMUP = 2


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build(name: str, seed: int, **overrides: Any) -> nn.Module:
    """The zoo model ``name`` with the benchmark's size, seeded."""
    from certblocks.zoo import create_model

    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    torch.manual_seed(seed)
    return create_model(name, **{**MODELS[name], **overrides})


def forecast(model: nn.Module, x: torch.Tensor, horizon: int = PRED_LEN) -> torch.Tensor:
    """``(B, seq_len, C) -> (B, horizon, C)``: the forecaster's output, or toto's patches rolled forward."""
    if not hasattr(model, "patch_len"):
        return model(x)
    p = model.patch_len
    if horizon % p:
        raise ValueError(f"horizon {horizon} must be a multiple of the patch {p}")
    ctx, outs = x.transpose(1, 2), []  # (B, C, context)
    for _ in range(horizon // p):
        nxt = model(ctx)[..., -p:]  # the forecast of the patch after the context
        outs.append(nxt)
        ctx = torch.cat([ctx[..., p:], nxt], dim=-1)
    return torch.cat(outs, dim=-1).transpose(1, 2)


def train_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """MSE of the training objective: the horizon (Mamba), or the next patch at every position (toto)."""
    if not hasattr(model, "patch_len"):
        return (model(x) - y).square().mean()
    p = model.patch_len
    xt, yt = x.transpose(1, 2), y.transpose(1, 2)  # (B, C, L)
    target = torch.cat([xt[..., p:], yt[..., :p]], dim=-1)
    return (model(xt) - target).square().mean()


def evaluate(model: nn.Module, loader: Any) -> Dict[str, float]:
    """Test MSE and MAE over every window, channel and step of the horizon (float64 sums)."""
    model.eval()
    se = ae = 0.0
    n = 0
    with torch.no_grad(), parametrize.cached():
        for x, y in loader:
            d = forecast(model, x).double() - y.double()
            se += float(d.square().sum())
            ae += float(d.abs().sum())
            n += d.numel()
    model.train()
    return {"test_mse": se / max(n, 1), "test_mae": ae / max(n, 1)}


def certificate_record(model: nn.Module, dtype: str, r0: Optional[float]) -> Dict[str, Any]:
    """The model's certificate in ``dtype`` (at ``r0`` with ``Lip(G) = 1`` when given: enforce's plan)."""
    c = model.certificate(dtype) if r0 is None else model.certificate(dtype, r0=r0, lip_g=1.0)
    return {"dtype": dtype, "ok": bool(c.ok), "certified_depth": c.certified_depth, "depth": c.depth}


def run(name: str, variant: str, seed: int, splits: Any, steps: int, batch: int, lr: float) -> Dict[str, Any]:
    """Train one model of one variant and seed; its accuracy, step times, alpha and certificates."""
    from certblocks.enforcement import enforce

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    model = build(name, seed).train()
    alpha = r0 = None
    if variant != "plain":
        rep = enforce(model, variant)
        alpha, r0 = rep.alpha, rep.worst_case.r0
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    train, _, test = make_loaders(splits, batch, seed=seed)  # the same batches for every variant of a seed
    torch.manual_seed(seed)  # and the same dropout draws
    it = iter(train)
    times: List[float] = []
    losses: List[float] = []
    t_run = time.perf_counter()
    for _ in range(steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(train)
            x, y = next(it)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with parametrize.cached():  # one cap per tensor per forward (a no-op without parametrizations)
            loss = train_loss(model, x, y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - t_run
    res: Dict[str, Any] = {"model": name, "variant": variant, "seed": seed, "steps": steps, "alpha": alpha, "r0": r0,
                           "final_train_loss": statistics.fmean(losses[-max(1, steps // 10):]),
                           "finite": all(math.isfinite(v) for v in losses),
                           "ms_per_step": 1e3 * statistics.median(times[WARMUP:] or times), "train_seconds": seconds}
    res.update(evaluate(model, test))
    res["certificates"] = ([certificate_record(model, variant, r0)] if variant != "plain"
                           else [certificate_record(model, d, None) for d in ("bf16", "fp16")])
    a = "" if alpha is None else f", alpha {alpha:.3g}"
    _log(f"{name} {variant} seed {seed}: test MSE {res['test_mse']:.4f} MAE {res['test_mae']:.4f}, "
         f"{res['ms_per_step']:.1f} ms/step{a}, certified {[c['ok'] for c in res['certificates']]} "
         f"({seconds:.0f} s)")
    return res


def step_times(name: str, variants: Sequence[str], splits: Any, batch: int, lr: float, steps: int,
               repeats: int) -> Dict[str, float]:
    """Median ms per training step of each variant of ``name``, timed in interleaved rounds on one batch."""
    from certblocks.enforcement import enforce

    models, opts = {}, {}
    for v in variants:
        models[v] = build(name, 0).train()
        if v != "plain":
            enforce(models[v], v)
        opts[v] = torch.optim.Adam(models[v].parameters(), lr=lr)
    x, y = next(iter(make_loaders(splits, batch, seed=0)[0]))
    rounds: Dict[str, List[float]] = {v: [] for v in variants}
    for r in range(repeats):
        for v in (list(variants)[r % len(variants):] + list(variants)[:r % len(variants)]):  # rotate the order
            times = []
            for _ in range(steps + 1):
                t0 = time.perf_counter()
                opts[v].zero_grad(set_to_none=True)
                with parametrize.cached():
                    loss = train_loss(models[v], x, y)
                loss.backward()
                opts[v].step()
                times.append(time.perf_counter() - t0)
            rounds[v].append(statistics.median(times[1:]))
    out = {v: 1e3 * statistics.median(ts) for v, ts in rounds.items()}
    _log(f"{name}: ms/step " + ", ".join(f"{v} {t:.1f}" for v, t in out.items()))
    return out


def summarize(runs: List[Dict[str, Any]], timing: Dict[str, Dict[str, float]]) -> List[Dict[str, Any]]:
    """Per (model, variant): mean ± std of the metrics over seeds, median ms/step and its ratio to plain."""
    groups: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["model"], r["variant"]), []).append(r)
    rows = []
    for (name, variant), rs in groups.items():
        row: Dict[str, Any] = {"model": name, "variant": variant, "seeds": sorted(r["seed"] for r in rs)}
        for key in ("test_mse", "test_mae", "final_train_loss"):
            vals = [r[key] for r in rs]
            row[key] = statistics.fmean(vals)
            row[key + "_std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
        row["ms_per_step_runs"] = statistics.median(r["ms_per_step"] for r in rs)
        row["ms_per_step"] = timing.get(name, {}).get(variant)
        alphas = [r["alpha"] for r in rs if r["alpha"] is not None]
        row["alpha"] = statistics.median(alphas) if alphas else None
        row["certified"] = {c["dtype"]: sum(x["ok"] for r in rs for x in r["certificates"] if x["dtype"] == c["dtype"])
                            for c in rs[0]["certificates"]}
        row["finite"] = all(r["finite"] for r in rs)
        rows.append(row)
    for row in rows:
        plain = [x for x in rows if x["model"] == row["model"] and x["variant"] == "plain"]
        ok = plain and row["ms_per_step"] is not None and plain[0]["ms_per_step"] is not None
        row["step_ratio"] = row["ms_per_step"] / plain[0]["ms_per_step"] if ok else None
    order = list(MODELS)
    rows.sort(key=lambda x: (order.index(x["model"]), VARIANTS.index(x["variant"])))
    return rows


def table(rows: List[Dict[str, Any]]) -> str:
    """A markdown table of :func:`summarize`'s rows."""
    out = ["| model | variant | alpha | test MSE | test MAE | final train loss | ms/step | vs plain "
           "| certified after training |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        n = len(r["seeds"])
        cert = ", ".join(f"{d} {k}/{n}" for d, k in r["certified"].items())
        alpha = "-" if r["alpha"] is None else f"{r['alpha']:.3g}"
        ratio = "-" if r["step_ratio"] is None else f"{r['step_ratio']:.2f}x"
        ms = "-" if r["ms_per_step"] is None else f"{r['ms_per_step']:.1f}"
        out.append(f"| {r['model']} | {r['variant'] if r['variant'] == 'plain' else 'enforced ' + r['variant']} | "
                   f"{alpha} | {r['test_mse']:.4f} ± {r['test_mse_std']:.4f} | {r['test_mae']:.4f} ± "
                   f"{r['test_mae_std']:.4f} | {r['final_train_loss']:.4f} ± {r['final_train_loss_std']:.4f} | "
                   f"{ms} | {ratio} | {cert} |")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=default_data_path(), help="ETTh1 csv (default: %(default)s)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=64, help="Adam steps (the quick protocol: 64)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--test-stride", type=int, default=8, help="every n-th test window (the quick protocol: 8)")
    p.add_argument("--time-steps", type=int, default=10, help="timed steps per round (cost per step)")
    p.add_argument("--time-repeats", type=int, default=5, help="interleaved rounds (cost per step; 0: skip)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=OUT_JSON)
    args = p.parse_args(argv)
    for name in ("steps", "batch", "test_stride", "threads", "time_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.time_repeats < 0:
        p.error("--time-repeats must be >= 0")
    torch.set_num_threads(args.threads)
    splits = load_ett(args.data, seq_len=SEQ_LEN, pred_len=PRED_LEN, test_stride=args.test_stride)
    _log(f"ETTh1: {len(splits.train)} train windows, {len(splits.test)} test windows; {args.steps} steps of "
         f"{args.batch}")
    t0 = time.time()
    runs = []
    for seed in args.seeds:
        for name in args.models:
            for variant in args.variants:
                runs.append(run(name, variant, seed, splits, args.steps, args.batch, args.lr))
    timing = {name: step_times(name, args.variants, splits, args.batch, args.lr, args.time_steps, args.time_repeats)
              for name in args.models} if args.time_repeats else {}
    command = "python benchmarks/experiments/enforced.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"meta": {"command": command.strip(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "seconds": round(time.time() - t0, 1), "torch": torch.__version__,
                       "python": platform.python_version(),
                       "machine": f"{platform.machine()} {os.cpu_count()} cores, {torch.get_num_threads()} torch "
                                  "threads"},
              "settings": {"models": {m: MODELS[m] for m in args.models}, "steps": args.steps, "batch": args.batch,
                           "lr": args.lr, "test_stride": args.test_stride, "seq_len": SEQ_LEN,
                           "pred_len": PRED_LEN, "precision": "fp32", "time_steps": args.time_steps,
                           "time_repeats": args.time_repeats},
              "timing_ms_per_step": timing, "runs": runs, "summary": summarize(runs, timing)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(table(result["summary"]) + f"\n\nJSON: {args.out} ({result['meta']['seconds']:.0f} s)")
    return _check_certified(runs)


def _check_certified(runs: List[Dict[str, Any]]) -> int:
    """1 (and a message) when an enforced run is not certified after training: the guarantee failed."""
    bad = [f"{r['model']} {r['variant']} seed {r['seed']}" for r in runs
           if r["variant"] != "plain" and not all(c["ok"] for c in r["certificates"])]
    for b in bad:
        print(f"FAILED: {b}: not certified after training", file=sys.stderr)
    return int(bool(bad))


if __name__ == "__main__":
    sys.exit(main())
