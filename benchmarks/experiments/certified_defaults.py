"""Certified defaults against the present defaults: does a model with branch gains train as well?

The zoo's ``gpt2_qknorm_*`` and ``certblocks_vit_*`` models take learnable per-channel branch gains (timm's
LayerScale, ``ls1.gamma`` / ``ls2.gamma``, argument ``init_values``).  The certified default is
``init_values=0.1`` (GPT-2) and ``init_values=1e-3`` (ViT); ``init_values=0`` is the previous model without
gains (the *present default*, built with ``certify=False``).  This script trains both, on real data, over
several seeds, and compares them.  Both variants of a seed start from the same weights (a gain is a constant
at initialization, so the random draws of the other parameters are the same) and see the same batches.

Parts (each selectable; all run when none is named):

* ``--gpt``: ``gpt2_qknorm_mini`` (6 layers, 6 heads, width 384), ``vocab_size=256``, ``block_size=128``,
  byte-level LM on the Python standard library's sources (``monitor_gpt.stdlib_bytes``), the last 10% held
  out.  AdamW (lr 1e-3, linear warmup then cosine to lr / 10, betas (0.9, 0.95), weight decay 0.1 on the
  matrices only, gradient clipping at 1), batch 16, a fixed number of steps.  Reports the validation loss in
  bits per byte (a fixed set of held-out windows, the same for every run) and the train loss curve.
* ``--vit``: ``certblocks_vit_tiny_patch16_224`` (12 blocks, width 192) at 32 px, patch 8 (16 tokens + cls),
  on scikit-learn's digits (8x8, 1797 images, 10 classes): pixels scaled to [0, 1], bilinear upsampling to
  32x32, 3 channels (repeated), normalized with the model's mean/std; a fixed stratified 80/20 split (seed 0).
  AdamW (lr 1e-3, one epoch of linear warmup then cosine to 0, weight decay 0.05 on the matrices only, not on
  ``pos_embed`` / ``cls_token``), batch 64, a fixed number of epochs.  Reports test accuracy and the final
  train loss (mean over the last epoch).
* ``--forecasters``: ``mamba_forecaster_lg``, ``patchtst_noln`` and ``toto_style`` did not change in this work
  (they were certified already); each is built at its defaults and its certificate checked (no training).

Variants: ``certified`` (the default ``init_values``, ``certify=True``; a size it refuses is rebuilt with
``certify=False`` and the refusal recorded), ``present`` (``init_values=0``, ``certify=False``) and, with
``--gpt-gains`` / ``--vit-gains``, ``gain=X`` (``init_values=X``, ``certify=False``).  Each run records the
certificate at initialization (``model.certificate()``: ``ok``, ``certified_depth``, ``depth``; the models'
certification dtype, bf16), the non-finite losses, and the time per step.  Results: a markdown table per part
(mean ± std, median and per-seed values over the seeds) and ``benchmarks/results/certified_defaults.json``
(``--merge`` adds the runs of this call to that file, replacing those of the same part, variant and seed).

scikit-learn is needed for the ViT part only: ``pip install certblocks[bench]``.

Usage::

    python benchmarks/experiments/certified_defaults.py --quick   # all parts, seeds 0 1 2 (about 16 min on 2 cores)
    python benchmarks/experiments/certified_defaults.py           # longer training (GPT 600 steps, ViT 30 epochs)
    python benchmarks/experiments/certified_defaults.py --vit --quick --vit-gains 1e-2 --variants --merge
    python benchmarks/experiments/certified_defaults.py --gpt --seeds 0 --gpt-steps 50 --bf16 --out /tmp/cd.json
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
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from monitor_gpt import stdlib_bytes

from certblocks.stack import CertificationError

_BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
OUT_JSON = os.path.join(_BENCH, "results", "certified_defaults.json")
GPT_MODEL = "gpt2_qknorm_mini"
VIT_MODEL = "certblocks_vit_tiny_patch16_224"
FORECASTERS = ("mamba_forecaster_lg", "patchtst_noln", "toto_style")
#: the certified defaults of the zoo (``init_values``), for the tables (the models are built without it)
CERTIFIED_GAIN = {"gpt": 0.1, "vit": 1e-3}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- shared ----------------------------------------------------------------------------------------------------
def variant_kwargs(variant: str) -> Tuple[Dict[str, Any], bool]:
    """``(constructor overrides, certify)`` of a variant: ``certified``, ``present`` or ``gain=X``."""
    if variant == "certified":
        return {}, True
    if variant == "present":
        return {"init_values": 0}, False
    if variant.startswith("gain="):
        return {"init_values": float(variant[5:])}, False
    raise ValueError(f"variant must be 'certified', 'present' or 'gain=X', got {variant!r}")


def build(factory: Callable[..., nn.Module], variant: str, seed: int, **kwargs: Any) -> Tuple[nn.Module, Dict]:
    """The model of ``variant`` (seeded) and its certificate at initialization.

    A ``certified`` model that its size is refused for (``CertificationError``) is rebuilt with ``certify=False``;
    the returned record says so (``refused``).
    """
    over, certify = variant_kwargs(variant)
    refused = None
    torch.manual_seed(seed)
    try:
        model = factory(**kwargs, **over, certify=certify)
    except CertificationError as e:
        refused = str(e).splitlines()[0]
        _log(f"{variant}: refused at this size ({refused}); rebuilt with certify=False")
        torch.manual_seed(seed)
        model = factory(**kwargs, **over, certify=False)
    c = model.certificate()
    cert = {"ok": bool(c.ok), "certified_depth": c.certified_depth, "depth": c.depth, "dtype": str(c.dtype),
            "certify": certify and refused is None, "refused": refused,
            "init_values": getattr(model, "init_values", None) or 0}
    return model, cert


def param_groups(model: nn.Module, weight_decay: float, exclude: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """AdamW groups: ``weight_decay`` on the matrices (``ndim >= 2``) but ``exclude``, none on the rest (gains,
    norm scales, biases)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and name not in exclude else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, total: int, warmup: int, lr: float, min_lr: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from ``lr`` to ``min_lr`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * min(1.0, frac)))


def autocast(bf16: bool) -> Any:
    """CPU bf16 autocast, or a no-op (fp32)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)


def curve_summary(losses: List[float]) -> Dict[str, float]:
    """The train loss at 10/25/50/75/100% of the run: mean over the last ``n / 10`` steps up to that point."""
    n = len(losses)
    w = max(1, n // 10)
    out = {}
    for pct in (10, 25, 50, 75, 100):
        end = max(1, round(n * pct / 100))
        window = [v for v in losses[max(0, end - w):end] if math.isfinite(v)]
        out[f"{pct}%"] = statistics.fmean(window) if window else float("nan")
    return out


def spread(values: List[float]) -> Dict[str, Optional[float]]:
    """Mean, std (sample; 0 for one value), median, min and max of the finite ``values``."""
    vs = [v for v in values if v is not None and math.isfinite(v)]
    if not vs:
        return {"mean": None, "std": None, "median": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(vs), "std": statistics.stdev(vs) if len(vs) > 1 else 0.0,
            "median": statistics.median(vs), "min": min(vs), "max": max(vs), "n": len(vs)}


def summarize(runs: List[Dict[str, Any]], metrics: Sequence[str]) -> List[Dict[str, Any]]:
    """Per variant (in order of first appearance): the spread of each metric over the seeds."""
    order: List[str] = []
    for r in runs:
        if r["variant"] not in order:
            order.append(r["variant"])
    rows = []
    for v in order:
        rs = sorted((r for r in runs if r["variant"] == v), key=lambda r: r["seed"])
        row: Dict[str, Any] = {"variant": v, "seeds": [r["seed"] for r in rs],
                               "init_values": rs[0]["cert_init"]["init_values"],
                               "certify": [r["cert_init"]["certify"] for r in rs],
                               "cert_ok_init": [r["cert_init"]["ok"] for r in rs],
                               "cert_depth_init": [f"{r['cert_init']['certified_depth']}/{r['cert_init']['depth']}"
                                                   for r in rs],
                               "nonfinite_runs": sum(r["first_nonfinite_step"] is not None for r in rs)}
        for m in metrics + ("ms_per_step",):
            row[m] = {**spread([r[m] for r in rs]), "per_seed": [r[m] for r in rs]}
        row["curve_mean"] = {k: statistics.fmean(r["curve"][k] for r in rs) for k in rs[0]["curve"]}
        rows.append(row)
    return rows


def _fmt(s: Dict[str, Any], digits: int, scale: float = 1.0) -> Tuple[str, str, str]:
    if s["mean"] is None:
        return "-", "-", "-"
    per = ", ".join("nan" if v is None or not math.isfinite(v) else f"{scale * v:.{digits}f}" for v in s["per_seed"])
    return f"{scale * s['mean']:.{digits}f} ± {scale * s['std']:.{digits}f}", f"{scale * s['median']:.{digits}f}", per


def table(rows: List[Dict[str, Any]], metric: str, label: str, digits: int, scale: float = 1.0,
          extra: Sequence[Tuple[str, str, int]] = ()) -> str:
    """A markdown table of :func:`summarize`'s rows for ``metric`` (and ``extra``: (key, label, digits))."""
    head = (f"| variant | init_values | certified at init (bf16) | {label} mean ± std | median | per seed "
            + "".join(f"| {lab} mean ± std " for _, lab, _ in extra)
            + "| train loss @25/50/75/100% | ms/step | non-finite |")
    out = [head, "|" + "---|" * (9 + len(extra))]
    for r in rows:
        ok, n = sum(r["cert_ok_init"]), len(r["cert_ok_init"])
        certified = ("yes" if ok == n else "no" if ok == 0 else f"{ok}/{n}") + " "
        certified += f"({', '.join(sorted(set(r['cert_depth_init'])))} updates"
        certified += ", built with certify=True)" if all(r["certify"]) else ", certify=False)"
        mean, med, per = _fmt(r[metric], digits, scale)
        cols = "".join(f"| {_fmt(r[k], d)[0]} " for k, _, d in extra)
        curve = " / ".join(f"{r['curve_mean'][k]:.3f}" for k in ("25%", "50%", "75%", "100%"))
        ms = r["ms_per_step"]["mean"]
        out.append(f"| {r['variant']} | {r['init_values']:g} | {certified} | {mean} | {med} | {per} {cols}"
                   f"| {curve} | {ms:.0f} | {r['nonfinite_runs']}/{len(r['seeds'])} |")
    return "\n".join(out)


# -- GPT-2 -----------------------------------------------------------------------------------------------------
def gpt_batch(data: torch.Tensor, block: int, batch: int, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``block + 1`` bytes: inputs and next-byte targets."""
    ix = torch.randint(0, data.numel() - block - 1, (batch,), generator=g)
    x = torch.stack([data[i:i + block] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block] for i in ix])
    return x, y


@torch.no_grad()
def gpt_eval(model: nn.Module, val: torch.Tensor, args: argparse.Namespace) -> float:
    """Mean validation loss in bits per byte over ``args.gpt_eval_batches`` fixed windows batches (seed 1234)."""
    model.eval()
    g = torch.Generator().manual_seed(1234)
    total = 0.0
    for _ in range(args.gpt_eval_batches):
        x, y = gpt_batch(val, args.gpt_block, args.gpt_batch, g)
        with autocast(args.bf16):
            logits, _ = model(x)
        total += float(F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1)))
    model.train()
    return total / args.gpt_eval_batches / math.log(2)


def gpt_run(variant: str, seed: int, train: torch.Tensor, val: torch.Tensor, args: argparse.Namespace
            ) -> Dict[str, Any]:
    """Train one GPT-2 variant for ``args.gpt_steps`` AdamW steps; final validation bits per byte."""
    from certblocks.zoo import create_model

    model, cert = build(lambda **kw: create_model(GPT_MODEL, **kw), variant, seed, vocab_size=256,
                        block_size=args.gpt_block)
    _log(f"gpt {variant} seed {seed}: certificate at init ok={cert['ok']} {cert['certified_depth']}/{cert['depth']}")
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=args.gpt_lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(seed)
    steps, warmup = args.gpt_steps, max(1, args.gpt_steps // 15)
    losses: List[float] = []
    step_s: List[float] = []
    first_nonfinite = None
    t0 = time.time()
    for step in range(steps):
        ts = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, warmup, args.gpt_lr, args.gpt_lr / 10)
        x, y = gpt_batch(train, args.gpt_block, args.gpt_batch, g)
        with autocast(args.bf16):
            logits, _ = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        lv = float(loss.detach())
        losses.append(lv)
        if not math.isfinite(lv):
            first_nonfinite = step
            _log(f"gpt {variant} seed {seed}: non-finite loss at step {step}; run stopped")
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step_s.append(time.perf_counter() - ts)
        if step % 50 == 0 or step == steps - 1:
            _log(f"gpt {variant} seed {seed} step {step}/{steps}: loss {lv:.3f} ({time.time() - t0:.0f} s)")
    val_bpb = gpt_eval(model, val, args) if first_nonfinite is None else float("nan")
    gains = [float(p.detach().abs().mean()) for n, p in model.named_parameters() if n.endswith(".gamma")]
    res = {"part": "gpt", "variant": variant, "seed": seed, "cert_init": cert, "val_bpb": val_bpb,
           "final_train_loss": curve_summary(losses)["100%"], "curve": curve_summary(losses),
           "first_nonfinite_step": first_nonfinite, "steps_run": len(losses),
           "ms_per_step": 1000 * statistics.fmean(step_s) if step_s else float("nan"),
           "seconds": time.time() - t0, "mean_abs_gain_final": statistics.fmean(gains) if gains else None,
           "train_loss": losses}
    _log(f"gpt {variant} seed {seed}: val {val_bpb:.4f} bits/byte, {res['ms_per_step']:.0f} ms/step, "
         f"{res['seconds']:.0f} s")
    return res


def gpt_part(args: argparse.Namespace) -> Dict[str, Any]:
    """Every GPT-2 variant and seed; the runs and their summary."""
    data = stdlib_bytes(args.gpt_corpus_bytes)
    n_val = data.numel() // 10
    train, val = data[:-n_val], data[-n_val:]
    _log(f"gpt: corpus {data.numel()} bytes (train {train.numel()}, validation {val.numel()}); "
         f"{args.gpt_steps} steps of {args.gpt_batch} x {args.gpt_block} bytes")
    runs = [gpt_run(v, s, train, val, args) for v in args.gpt_variant_list for s in args.seeds]
    settings = {"model": GPT_MODEL, "vocab_size": 256, "block_size": args.gpt_block, "batch": args.gpt_batch,
                "steps": args.gpt_steps, "warmup": max(1, args.gpt_steps // 15), "lr": args.gpt_lr,
                "min_lr": args.gpt_lr / 10, "betas": [0.9, 0.95], "weight_decay": 0.1, "grad_clip": 1.0,
                "corpus_bytes": data.numel(), "val_bytes": n_val, "eval_batches": args.gpt_eval_batches,
                "bf16": args.bf16}
    return {"settings": settings, "runs": runs}


# -- ViT -------------------------------------------------------------------------------------------------------
def digits_data(mean: Sequence[float], std: Sequence[float]) -> Tuple[torch.Tensor, ...]:
    """scikit-learn's digits as ``(x_train, y_train, x_test, y_test)``: 3x32x32 images normalized with
    ``mean`` / ``std`` after scaling the pixels to [0, 1]; stratified 80/20 split, seed 0."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:
        raise SystemExit("the ViT part needs scikit-learn (the digits data set): pip install certblocks[bench] "
                         "(or pip install scikit-learn)") from e
    d = load_digits()
    idx_train, idx_test = train_test_split(list(range(len(d.target))), test_size=0.2, stratify=d.target,
                                           random_state=0)
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False).clamp(0.0, 1.0).repeat(1, 3, 1, 1)
    x = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    y = torch.tensor(d.target, dtype=torch.long)
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def vit_batches(n: int, batch: int, g: torch.Generator) -> Iterator[torch.Tensor]:
    """The indices of one shuffled epoch, in batches (the last one may be smaller)."""
    perm = torch.randperm(n, generator=g)
    yield from perm.split(batch)


def vit_run(variant: str, seed: int, data: Tuple[torch.Tensor, ...], args: argparse.Namespace) -> Dict[str, Any]:
    """Train one ViT variant for ``args.vit_epochs`` epochs; test accuracy and final train loss."""
    import timm

    x_tr, y_tr, x_te, y_te = data
    model, cert = build(lambda **kw: timm.create_model(VIT_MODEL, **kw), variant, seed, num_classes=10,
                        img_size=32, patch_size=8)
    _log(f"vit {variant} seed {seed}: certificate at init ok={cert['ok']} {cert['certified_depth']}/{cert['depth']}")
    opt = torch.optim.AdamW(param_groups(model, 0.05, exclude=("pos_embed", "cls_token")), lr=args.vit_lr)
    g = torch.Generator().manual_seed(seed)
    per_epoch = math.ceil(len(y_tr) / args.vit_batch)
    steps, warmup = args.vit_epochs * per_epoch, per_epoch
    losses: List[float] = []
    step_s: List[float] = []
    first_nonfinite = None
    t0 = time.time()
    step = 0
    for epoch in range(args.vit_epochs):
        for idx in vit_batches(len(y_tr), args.vit_batch, g):
            ts = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, warmup, args.vit_lr, 0.0)
            with autocast(args.bf16):
                logits = model(x_tr[idx])
            loss = F.cross_entropy(logits.float(), y_tr[idx])
            lv = float(loss.detach())
            losses.append(lv)
            step += 1
            if not math.isfinite(lv):
                first_nonfinite = step - 1
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step_s.append(time.perf_counter() - ts)
        if first_nonfinite is not None:
            _log(f"vit {variant} seed {seed}: non-finite loss at step {first_nonfinite}; run stopped")
            break
        if epoch % 5 == 0 or epoch == args.vit_epochs - 1:
            _log(f"vit {variant} seed {seed} epoch {epoch}: loss {statistics.fmean(losses[-per_epoch:]):.3f} "
                 f"({time.time() - t0:.0f} s)")
    model.eval()
    with torch.no_grad(), autocast(args.bf16):
        logits = model(x_te).float()
    acc = float((logits.argmax(-1) == y_te).float().mean())
    test_loss = float(F.cross_entropy(logits, y_te))
    last = [v for v in losses[-per_epoch:] if math.isfinite(v)]
    gains = [float(p.detach().abs().mean()) for n, p in model.named_parameters() if n.endswith(".gamma")]
    res = {"part": "vit", "variant": variant, "seed": seed, "cert_init": cert,
           "test_acc": acc if first_nonfinite is None else float("nan"),
           "test_loss": test_loss if first_nonfinite is None else float("nan"),
           "final_train_loss": statistics.fmean(last) if last else float("nan"), "curve": curve_summary(losses),
           "first_nonfinite_step": first_nonfinite, "steps_run": len(losses),
           "ms_per_step": 1000 * statistics.fmean(step_s) if step_s else float("nan"),
           "seconds": time.time() - t0, "mean_abs_gain_final": statistics.fmean(gains) if gains else None,
           "train_loss": losses}
    _log(f"vit {variant} seed {seed}: test accuracy {acc:.4f}, final train loss {res['final_train_loss']:.4f}, "
         f"{res['ms_per_step']:.0f} ms/step, {res['seconds']:.0f} s")
    return res


def vit_part(args: argparse.Namespace) -> Dict[str, Any]:
    """Every ViT variant and seed; the runs and their summary."""
    import certblocks.zoo  # noqa: F401  (the certblocks ViTs register with timm when certblocks.zoo is imported)
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(VIT_MODEL)
    data = digits_data(cfg.mean, cfg.std)
    _log(f"vit: digits, train {len(data[1])}, test {len(data[3])}; {args.vit_epochs} epochs of batch {args.vit_batch}")
    runs = [vit_run(v, s, data, args) for v in args.vit_variant_list for s in args.seeds]
    settings = {"model": VIT_MODEL, "img_size": 32, "patch_size": 8, "num_classes": 10, "batch": args.vit_batch,
                "epochs": args.vit_epochs, "steps": args.vit_epochs * math.ceil(len(data[1]) / args.vit_batch),
                "warmup": "1 epoch", "lr": args.vit_lr, "min_lr": 0.0, "weight_decay": 0.05,
                "train": len(data[1]), "test": len(data[3]), "mean": list(cfg.mean), "std": list(cfg.std),
                "bf16": args.bf16}
    return {"settings": settings, "runs": runs}


# -- forecasters -----------------------------------------------------------------------------------------------
def forecaster_part() -> Dict[str, Any]:
    """Build each forecaster at its defaults and check its certificate (their defaults did not change)."""
    from certblocks.zoo import create_model

    checks = []
    for name in FORECASTERS:
        torch.manual_seed(0)
        c = create_model(name).certificate()
        checks.append({"model": name, "ok": bool(c.ok), "certified_depth": c.certified_depth, "depth": c.depth,
                       "dtype": str(c.dtype)})
        _log(f"{name}: defaults unchanged in this work; certificate ok={c.ok} ({c.certified_depth}/{c.depth}, "
             f"{c.dtype})")
    return {"checks": checks}


# -- main ------------------------------------------------------------------------------------------------------
def merge(old: Dict[str, Any], new: Dict[str, Any]) -> Dict[str, Any]:
    """``new``'s parts merged into ``old``: runs of the same variant and seed replaced, settings must match."""
    out = dict(old)
    out["meta"] = {**new["meta"], "calls": old.get("meta", {}).get("calls", []) + new["meta"]["calls"]}
    for part in ("gpt", "vit", "forecasters"):
        if part not in new:
            continue
        if part not in old or part == "forecasters":
            out[part] = new[part]
            continue
        if old[part]["settings"] != new[part]["settings"]:
            raise SystemExit(f"--merge: the {part} settings differ from those in the file; not merged "
                             f"(file {old[part]['settings']}, now {new[part]['settings']})")
        keys = {(r["variant"], r["seed"]) for r in new[part]["runs"]}
        runs = [r for r in old[part]["runs"] if (r["variant"], r["seed"]) not in keys] + new[part]["runs"]
        out[part] = {**new[part], "runs": runs, "seconds": old[part]["seconds"] + new[part]["seconds"]}
    return out


def report(result: Dict[str, Any]) -> str:
    """Markdown tables of every part in ``result`` (summaries recomputed from the runs)."""
    out = []
    if "gpt" in result:
        s = result["gpt"]["settings"]
        out += [f"GPT-2 ({s['model']}, bytes, {s['steps']} steps of {s['batch']} x {s['block_size']}; "
                f"{result['gpt']['seconds']:.0f} s): validation bits per byte (lower is better)", "",
                table(result["gpt"]["summary"], "val_bpb", "val bits/byte", 4), ""]
    if "vit" in result:
        s = result["vit"]["settings"]
        out += [f"ViT ({s['model']} at 32 px / patch 8, digits, {s['epochs']} epochs = {s['steps']} steps of "
                f"{s['batch']}; {result['vit']['seconds']:.0f} s): test accuracy in % (higher is better)", "",
                table(result["vit"]["summary"], "test_acc", "test acc %", 2, 100.0,
                      extra=(("final_train_loss", "final train loss", 4),)), ""]
    if "forecasters" in result:
        out += ["Forecasters (defaults unchanged, certificate at the defaults):", "",
                "| model | certified | certified depth |", "|---|---|---|"]
        out += [f"| {c['model']} | {'yes' if c['ok'] else 'NO'} | {c['certified_depth']}/{c['depth']} ({c['dtype']}) |"
                for c in result["forecasters"]["checks"]]
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpt", action="store_true", help="run the GPT-2 part (all parts run when none is named)")
    p.add_argument("--vit", action="store_true", help="run the ViT part")
    p.add_argument("--forecasters", action="store_true", help="run the forecaster check")
    p.add_argument("--quick", action="store_true", help="GPT 150 steps, ViT 12 epochs (the full mode: 600, 30)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="*", default=None,
                   help="variants of both parts among 'certified', 'present' (default: both; give none to run "
                        "only the --gpt-gains / --vit-gains ones)")
    p.add_argument("--gpt-gains", type=float, nargs="*", default=[], help="extra GPT variants gain=X (certify=False)")
    p.add_argument("--vit-gains", type=float, nargs="*", default=[], help="extra ViT variants gain=X (certify=False)")
    p.add_argument("--gpt-steps", type=int, default=None)
    p.add_argument("--gpt-batch", type=int, default=16)
    p.add_argument("--gpt-block", type=int, default=128)
    p.add_argument("--gpt-lr", type=float, default=1e-3)
    p.add_argument("--gpt-corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--gpt-eval-batches", type=int, default=40, help="validation batches (fixed windows)")
    p.add_argument("--vit-epochs", type=int, default=None)
    p.add_argument("--vit-batch", type=int, default=64)
    p.add_argument("--vit-lr", type=float, default=1e-3)
    p.add_argument("--bf16", action="store_true", help="forward under CPU bf16 autocast (default fp32)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=OUT_JSON)
    p.add_argument("--merge", action="store_true", help="add this call's runs to the JSON file at --out")
    args = p.parse_args(argv)
    if not (args.gpt or args.vit or args.forecasters):
        args.gpt = args.vit = args.forecasters = True
    args.gpt_steps = args.gpt_steps or (150 if args.quick else 600)
    args.vit_epochs = args.vit_epochs or (12 if args.quick else 30)
    base = ["certified", "present"] if args.variants is None else args.variants
    for v in base:
        if v not in ("certified", "present"):
            p.error(f"--variants takes 'certified' and 'present', got {v!r}")
    args.gpt_variant_list = base + [f"gain={x:g}" for x in args.gpt_gains]
    args.vit_variant_list = base + [f"gain={x:g}" for x in args.vit_gains]
    for name in ("gpt_steps", "gpt_batch", "gpt_block", "gpt_eval_batches", "vit_epochs", "vit_batch", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.vit:  # fail before any training when the ViT part cannot run
        try:
            import sklearn  # noqa: F401
        except ImportError:
            p.error("the ViT part needs scikit-learn: pip install certblocks[bench] (or run --gpt / --forecasters)")
    torch.set_num_threads(args.threads)

    command = "python benchmarks/experiments/certified_defaults.py " + " ".join(sys.argv[1:] if argv is None else argv)
    call = {"command": command.strip(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "args": {k: v for k, v in vars(args).items() if not k.endswith("_variant_list")}, "seconds": {}}
    result: Dict[str, Any] = {"meta": {
        "calls": [call], "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"}}
    for part, run in (("gpt", gpt_part), ("vit", vit_part), ("forecasters", None)):
        if not getattr(args, part):
            continue
        t0 = time.time()
        result[part] = forecaster_part() if run is None else run(args)
        result[part]["seconds"] = call["seconds"][part] = round(time.time() - t0, 1)
        _log(f"{part}: {result[part]['seconds']:.0f} s")
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            result = merge(json.load(f), result)
    for part, metrics in (("gpt", ("val_bpb", "final_train_loss")),
                          ("vit", ("test_acc", "test_loss", "final_train_loss"))):
        if part in result:
            result[part]["summary"] = summarize(result[part]["runs"], metrics)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(report(result))
    print(f"\nJSON: {args.out}")
    bad = [c["model"] for c in result.get("forecasters", {}).get("checks", []) if not c["ok"]]
    if bad:
        print(f"FAILED: not certified at their defaults: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
