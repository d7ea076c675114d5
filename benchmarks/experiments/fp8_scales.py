"""fp8 with static scales from certificates against dynamic amax scaling (issue 28 item 3).

fp8 training casts each Linear's input and weight to e4m3 with a per-tensor scale ``s``.  A certificate bounds every
entry of every Linear's input for every input in its ball, so ``s = peak / 448`` never saturates, by construction
(:func:`certblocks.fp8.fp8_scales`, docs/theory.md section 7); what it costs is resolution.  This script trains two
models, then evaluates them with every ``nn.Linear`` computing on fp8-cast inputs and weights (emulated on CPU by
casting to ``torch.float8_e4m3fn`` and back, :func:`certblocks.fp8.fp8_emulation`), once with the certified static
scales and once with dynamic amax scaling (``s = amax(x) / 448`` at every call: the common recipe), against the same
model in bf16 (CPU autocast) and fp32:

* **bytes**: the zoo's ``gpt2_qknorm_tiny`` (4 layers, 4 heads, width 128, QK-norm attention, no LayerNorm in the
  updates, unit branch gains) with ``vocab_size=256`` and ``block_size`` 64, a byte-level language model on the Python
  standard library's sources (``monitor_gpt.stdlib_bytes``, the last 10% held out), trained in fp32 with
  ``certified_defaults``' schedule (AdamW lr 1e-3, warm-up then cosine to lr / 10, betas (0.9, 0.95), weight decay 0.1
  on the matrices, clipping at 1), batch 16; metric: held-out bits per byte on fixed windows.  Certified scales at the
  example batch's shape (token ids: no input radius is needed).
* **digits**: the zoo's ViT-Ti (``certblocks_vit_tiny_patch16_224``: 12 blocks, width 192, QK-norm attention,
  branch gains 1e-2) at 32 px / patch 8 on scikit-learn's digits (8x8 images upsampled to 32x32, 3 channels, the
  model's mean/std; a stratified 80/20 split, seed 0), trained in fp32 (AdamW lr 1e-3, one epoch of warm-up then
  cosine to 0, weight decay 0.05 on the matrices but ``pos_embed`` / ``cls_token``), batch 64; metrics: test
  accuracy and loss.  The input's per-token norm (a row of 32 pixels, the image's last dimension) is at most
  ``sqrt(32) max |normalized pixel|``: that is ``r0``.

Measured per model: the metric in fp32, bf16, fp8-static and fp8-dynamic; for each Linear input the certified
peak, the observed amax (fp32 pass over the evaluation data), their ratio (goal: within 16x for most tensors), and
for both fp8 runs the saturated values (count, fraction) and the values flushed to zero (nonzero values the cast made
0, fraction of the nonzero ones); the goal on the metric: static within 2% of dynamic (relative loss; accuracy in
points).  A Linear without a finite certified peak runs with dynamic scaling in the static run (counted).

The digits come from scikit-learn when it is installed (``pip install certblocks[bench]``) or from ``--digits PATH``
(the ``digits.csv.gz`` that scikit-learn ships: 64 pixels and the label per line); ``--quick`` without either uses
synthetic 8x8 digits (class templates plus noise) and says so.

Usage::

    python benchmarks/experiments/fp8_scales.py --threads 1                 # both models (about 10 min, 1 core)
    python benchmarks/experiments/fp8_scales.py --quick                     # test sizes, a few steps (seconds)
    python benchmarks/experiments/fp8_scales.py --digits /path/digits.csv.gz --parts digits
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from certified_defaults import gpt_batch, lr_at, param_groups  # noqa: E402
from monitor_gpt import stdlib_bytes  # noqa: E402

from certblocks.fp8 import Fp8Stats, fp8_emulation, fp8_scales  # noqa: E402

_BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_JSON = os.path.join(_BENCH, "results", "fp8_scales.json")
WITHIN = 16.0  # the goal: certified peak within 16x of the observed amax
METRIC_TOL = 0.02  # the goal: static within 2% of dynamic


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the comparison ---------------------------------------------------------------------------------------------
def observed_amax(model: nn.Module, run: Callable[[], Any]) -> Dict[str, float]:
    """The largest ``|x|`` of each Linear's input over ``run()`` in the model's own precision (fp32)."""
    amax: Dict[str, float] = {}
    hooks = []
    for path, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            def hook(m: nn.Module, args: Tuple[torch.Tensor, ...], path: str = path) -> None:
                amax[path] = max(amax.get(path, 0.0), float(args[0].detach().abs().max()))
            hooks.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    return amax


def _totals(stats: Dict[str, Dict[str, Fp8Stats]], which: str) -> Dict[str, Any]:
    t = Fp8Stats()
    for rec in stats.values():
        t.add(rec[which])
    return {"values": t.values, "saturated": t.saturated, "saturated_fraction": t.saturated_fraction,
            "flushed": t.flushed, "flushed_fraction": t.flushed_fraction}


def compare(model: nn.Module, example: torch.Tensor, r0: Optional[float],
            metric: Callable[[str], Dict[str, float]]) -> Dict[str, Any]:
    """Certified scales of ``model``, then ``metric(mode)`` in fp32, bf16, fp8-static and fp8-dynamic.

    ``metric(mode)`` evaluates the model on the fixed evaluation data; ``mode`` is ``"fp32"``, ``"bf16"`` or
    ``"fp8"`` (the caller's fp8 emulation is active).
    """
    model.eval()
    t0 = time.time()
    scales = fp8_scales(model, example, r0=r0)
    t_scales = time.time() - t0
    res: Dict[str, Any] = {"scales_seconds": round(t_scales, 2)}
    res["fp32"] = metric("fp32")
    res["bf16"] = metric("bf16")
    amax = observed_amax(model, lambda: metric("fp32"))
    runs = {}
    for name, sc in (("static", scales), ("dynamic", "dynamic")):
        with fp8_emulation(model, sc) as st:
            m = metric("fp8")
        runs[name] = {"metric": m, "input": _totals(st, "input"), "weight": _totals(st, "weight"),
                      "per_linear": {p: {"input_saturated": r["input"].saturated, "input_flushed": r["input"].flushed,
                                         "input_flushed_fraction": r["input"].flushed_fraction,
                                         "input_values": r["input"].values} for p, r in st.items()}}
    res.update(runs)
    per = []
    for path, s in scales.items():
        a = amax.get(path)
        ratio = s.input_peak / a if a and math.isfinite(s.input_peak) else math.inf
        per.append({"module": path, "input_peak": s.input_peak, "input_scale": s.input_scale, "observed_amax": a,
                    "ratio": ratio, "weight_amax": s.weight_amax, "weight_scale": s.weight_scale,
                    "certified": s.certified, "why": s.why})
    res["linears"] = per
    ratios = [p["ratio"] for p in per]
    finite = [r for r in ratios if math.isfinite(r)]
    res["ratio_summary"] = {
        "linears": len(per), "certified": sum(1 for p in per if p["certified"]),
        "within_16x": sum(1 for r in ratios if r <= WITHIN), "fraction_within_16x": (
            sum(1 for r in ratios if r <= WITHIN) / len(ratios) if ratios else 0.0),
        "median": statistics.median(finite) if finite else math.inf, "min": min(finite) if finite else math.inf,
        "max": max(finite) if finite else math.inf}
    res["goals"] = goals(res)
    return res


def goals(res: Dict[str, Any]) -> Dict[str, Any]:
    """Whether the two goals are met: most certified peaks within 16x of the observed amax; the static metric within
    2% of the dynamic one (the loss relatively; the accuracy in points)."""
    s, d = res["static"]["metric"], res["dynamic"]["metric"]
    loss_key = "bits_per_byte" if "bits_per_byte" in s else "loss"
    rel = (s[loss_key] - d[loss_key]) / d[loss_key]
    out = {"fraction_within_16x": res["ratio_summary"]["fraction_within_16x"],
           "ratio_goal_met": res["ratio_summary"]["fraction_within_16x"] > 0.5,
           "loss_key": loss_key, "static_vs_dynamic_loss": rel, "loss_goal_met": rel <= METRIC_TOL,
           "static_saturated": res["static"]["input"]["saturated"] + res["static"]["weight"]["saturated"]}
    if "accuracy" in s:
        out["static_minus_dynamic_accuracy"] = s["accuracy"] - d["accuracy"]
        out["accuracy_goal_met"] = s["accuracy"] >= d["accuracy"] - METRIC_TOL
    return out


def _precision(mode: str) -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16) if mode == "bf16" else contextlib.nullcontext()


# -- bytes: the zoo GPT-2 ---------------------------------------------------------------------------------------
def gpt_part(a: argparse.Namespace) -> Dict[str, Any]:
    from certblocks.zoo import create_model

    data = stdlib_bytes(a.corpus_bytes)
    n_val = data.numel() // 10
    train, val = data[:-n_val], data[-n_val:]
    torch.manual_seed(a.seed)
    model = create_model(a.gpt_model, vocab_size=256, block_size=a.block, certify=False)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=a.lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(a.seed)
    warmup = max(1, a.gpt_steps // 15)
    t0 = time.time()
    losses: List[float] = []
    model.train()
    for step in range(a.gpt_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a.gpt_steps, warmup, a.lr, a.lr / 10)
        x, y = gpt_batch(train, a.block, a.batch, g)
        logits, _ = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if step % 100 == 0 or step == a.gpt_steps - 1:
            _log(f"bytes step {step}/{a.gpt_steps}: loss {losses[-1]:.3f} ({time.time() - t0:.0f} s)")
    train_s = time.time() - t0
    ge = torch.Generator().manual_seed(1234)
    batches = [gpt_batch(val, a.block, a.batch, ge) for _ in range(a.eval_batches)]

    def metric(mode: str) -> Dict[str, float]:
        model.eval()
        total = 0.0
        with torch.no_grad(), _precision(mode):
            for x, y in batches:
                logits, _ = model(x)
                total += float(F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1)))
        return {"bits_per_byte": total / len(batches) / math.log(2)}

    res = compare(model, batches[0][0], None, metric)
    res["settings"] = {"model": a.gpt_model, "vocab_size": 256, "block_size": a.block, "batch": a.batch,
                       "steps": a.gpt_steps, "lr": a.lr, "corpus_bytes": data.numel(), "eval_batches": a.eval_batches,
                       "train_precision": "fp32", "example_batch": list(batches[0][0].shape)}
    res["train_seconds"] = round(train_s, 1)
    res["final_train_loss"] = statistics.fmean(losses[-max(1, len(losses) // 10):])
    return res


# -- digits: the zoo ViT ----------------------------------------------------------------------------------------
def load_digits(path: Optional[str], quick: bool) -> Tuple[torch.Tensor, torch.Tensor, str]:
    """``(images (N, 8, 8) in [0, 16], labels, source)``: scikit-learn's digits, the file at ``path``, or (quick mode
    only) synthetic digits."""
    if path:
        rows = [list(map(float, line.split(","))) for line in gzip.open(path, "rt") if line.strip()]
        t = torch.tensor(rows)
        return t[:, :64].reshape(-1, 8, 8), t[:, 64].long(), f"digits.csv.gz ({path})"
    try:
        from sklearn.datasets import load_digits as sk

        d = sk()
        return torch.tensor(d.images, dtype=torch.float32), torch.tensor(d.target), "scikit-learn load_digits"
    except ImportError as exc:
        if not quick:
            raise SystemExit("the digits part needs scikit-learn (pip install certblocks[bench]) or --digits PATH "
                             "to scikit-learn's digits.csv.gz") from exc
    g = torch.Generator().manual_seed(0)
    templates = torch.rand(10, 8, 8, generator=g) * 16
    y = torch.arange(300) % 10
    x = (templates[y] + 4 * torch.randn(300, 8, 8, generator=g)).clamp(0, 16)
    return x, y, "synthetic (quick mode: class templates plus noise)"


def digits_split(images: torch.Tensor, labels: torch.Tensor, mean: Sequence[float], std: Sequence[float]
                 ) -> Tuple[torch.Tensor, ...]:
    """A stratified 80/20 split (seed 0) of the images as 3x32x32 normalized tensors."""
    g = torch.Generator().manual_seed(0)
    train_idx, test_idx = [], []
    for c in labels.unique():
        idx = (labels == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        k = max(1, round(0.2 * len(idx)))
        test_idx += idx[:k].tolist()
        train_idx += idx[k:].tolist()
    x = (images.float() / 16.0).unsqueeze(1)
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False).clamp(0.0, 1.0).repeat(1, 3, 1, 1)
    x = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    tr, te = torch.tensor(sorted(train_idx)), torch.tensor(sorted(test_idx))
    return x[tr], labels[tr], x[te], labels[te]


def vit_part(a: argparse.Namespace) -> Dict[str, Any]:
    import certblocks.zoo  # noqa: F401  (registers the certblocks ViTs with timm)
    import timm

    torch.manual_seed(a.seed)
    kw = dict(num_classes=10, img_size=32, patch_size=8, certify=False)
    if a.quick:
        kw.update(embed_dim=32, depth=2, num_heads=2)
    model = timm.create_model("certblocks_vit_tiny_patch16_224", **kw)
    cfg = model.pretrained_cfg
    images, labels, source = load_digits(a.digits, a.quick)
    x_tr, y_tr, x_te, y_te = digits_split(images, labels, cfg["mean"], cfg["std"])
    opt = torch.optim.AdamW(param_groups(model, 0.05, exclude=("pos_embed", "cls_token")), lr=a.lr)
    g = torch.Generator().manual_seed(a.seed)
    per_epoch = math.ceil(len(y_tr) / a.vit_batch)
    steps = a.vit_epochs * per_epoch
    t0 = time.time()
    step = 0
    losses: List[float] = []
    model.train()
    for epoch in range(a.vit_epochs):
        for idx in torch.randperm(len(y_tr), generator=g).split(a.vit_batch):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, per_epoch, a.lr, 0.0)
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            step += 1
        _log(f"digits epoch {epoch}: loss {statistics.fmean(losses[-per_epoch:]):.3f} ({time.time() - t0:.0f} s)")
    train_s = time.time() - t0

    def metric(mode: str) -> Dict[str, float]:
        model.eval()
        with torch.no_grad(), _precision(mode):
            logits = torch.cat([model(c) for c in x_te.split(128)]).float()
        return {"accuracy": float((logits.argmax(-1) == y_te).float().mean()),
                "loss": float(F.cross_entropy(logits, y_te))}

    pix = max(max(abs(m) / s, abs(1 - m) / s) for m, s in zip(cfg["mean"], cfg["std"]))
    r0 = pix * math.sqrt(32)
    res = compare(model, x_te[:a.vit_batch], r0, metric)
    res["settings"] = {"model": "certblocks_vit_tiny_patch16_224", "img_size": 32, "patch_size": 8,
                       "sizes": {k: v for k, v in kw.items() if k in ("embed_dim", "depth", "num_heads")} or "ViT-Ti",
                       "epochs": a.vit_epochs, "batch": a.vit_batch, "lr": a.lr, "data": source,
                       "train": len(y_tr), "test": len(y_te), "r0": r0, "train_precision": "fp32",
                       "example_batch": [min(a.vit_batch, len(y_te)), 3, 32, 32]}
    res["train_seconds"] = round(train_s, 1)
    res["final_train_loss"] = statistics.fmean(losses[-per_epoch:])
    return res


# -- report ----------------------------------------------------------------------------------------------------
def _pct(v: float) -> str:
    return f"{100 * v:.3g}%"


def report(result: Dict[str, Any]) -> str:
    out = []
    for part, r in result.items():
        if part == "meta":
            continue
        key = r["goals"]["loss_key"]
        unit = "bits/byte" if key == "bits_per_byte" else "test loss"
        out += [f"{part} ({r['settings']['model']}, {r['train_seconds']:.0f} s of training):", "",
                "| precision | " + unit + (" | accuracy |" if "accuracy" in r["fp32"] else " |"),
                "|---|---|" + ("---|" if "accuracy" in r["fp32"] else "")]
        for mode, m in (("fp32", r["fp32"]), ("bf16", r["bf16"]), ("fp8, certified static scales",
                                                                   r["static"]["metric"]),
                        ("fp8, dynamic amax scales", r["dynamic"]["metric"])):
            acc = f" {100 * m['accuracy']:.2f}% |" if "accuracy" in m else ""
            out.append(f"| {mode} | {m[key]:.4f} |{acc}")
        s = r["ratio_summary"]
        out += ["", f"certified peak / observed amax over {s['linears']} Linear inputs ({s['certified']} with a finite "
                    f"peak): median {s['median']:.3g}, min {s['min']:.3g}, max {s['max']:.3g}; within {WITHIN:g}x: "
                    f"{s['within_16x']} of {s['linears']}"]
        for which in ("static", "dynamic"):
            i, w = r[which]["input"], r[which]["weight"]
            out.append(f"{which}: inputs saturated {i['saturated']} ({_pct(i['saturated_fraction'])}), flushed "
                       f"{i['flushed']} ({_pct(i['flushed_fraction'])} of nonzero); weights saturated "
                       f"{w['saturated']}, flushed {w['flushed']} ({_pct(w['flushed_fraction'])})")
        gl = r["goals"]
        out.append(f"goals: ratio within 16x for most tensors: {'met' if gl['ratio_goal_met'] else 'NOT met'}; "
                   f"static vs dynamic {key}: {100 * gl['static_vs_dynamic_loss']:+.2f}% "
                   f"({'met' if gl['loss_goal_met'] else 'NOT met'})" +
                   (f"; accuracy {100 * gl['static_minus_dynamic_accuracy']:+.2f} points "
                    f"({'met' if gl['accuracy_goal_met'] else 'NOT met'})" if "accuracy_goal_met" in gl else ""))
        out.append("")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", default=["bytes", "digits"], choices=["bytes", "digits"])
    p.add_argument("--quick", action="store_true", help="test sizes and a few steps (the test's mode)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpt-model", default=None, help="zoo GPT-2 (default gpt2_qknorm_tiny; quick: gpt2_qknorm_test)")
    p.add_argument("--gpt-steps", type=int, default=None, help="AdamW steps (default 600; quick 3)")
    p.add_argument("--block", type=int, default=None, help="bytes per window (default 64; quick 16)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--corpus-bytes", type=int, default=None, help="default 4,000,000; quick 200,000")
    p.add_argument("--eval-batches", type=int, default=None, help="held-out batches (default 16; quick 2)")
    p.add_argument("--vit-epochs", type=int, default=None, help="default 12; quick 1")
    p.add_argument("--vit-batch", type=int, default=64)
    p.add_argument("--digits", default=None, help="path to scikit-learn's digits.csv.gz (default: scikit-learn)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help=f"JSON (default {OUT_JSON}; quick: not written unless given)")
    a = p.parse_args(argv)
    a.gpt_model = a.gpt_model or ("gpt2_qknorm_test" if a.quick else "gpt2_qknorm_tiny")
    a.gpt_steps = a.gpt_steps if a.gpt_steps is not None else (3 if a.quick else 600)
    a.block = a.block or (16 if a.quick else 64)
    a.corpus_bytes = a.corpus_bytes or (200_000 if a.quick else 4_000_000)
    a.eval_batches = a.eval_batches or (2 if a.quick else 16)
    a.vit_epochs = a.vit_epochs if a.vit_epochs is not None else (1 if a.quick else 12)
    torch.set_num_threads(a.threads)
    command = "python benchmarks/experiments/fp8_scales.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result: Dict[str, Any] = {"meta": {
        "command": command.strip(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"}}
    for part in a.parts:
        t0 = time.time()
        result[part] = gpt_part(a) if part == "bytes" else vit_part(a)
        result[part]["seconds"] = round(time.time() - t0, 1)
        _log(f"{part}: {result[part]['seconds']:.0f} s")
    out = a.out or (None if a.quick else OUT_JSON)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print(report(result))
    if out:
        print(f"JSON: {out}")
    return result


if __name__ == "__main__":
    main()
