"""DyT models certified in pure fp16 against the same architecture with LayerNorm and the QK-norm zoo model.

Three variants of each model, same data, same budget, same seeds, the learning rate tuned per variant:

* ``dyt``: the zoo's DyT model at its certified defaults (``gpt2_dyt_mini``, ``certblocks_vit_dyt_tiny_patch16_224``:
  every normalizer a DyT, a DyT on queries and keys, branch gains; certified in pure fp16 at initialization);
* ``preln``: the same class with LayerNorms in place of the DyTs, plain attention and no gains (``norm="layer"``,
  ``qk_norm=None``, ``init_values=None``): the Pre-LN transformer;
* ``qknorm``: the QK-norm zoo model at its defaults (``gpt2_qknorm_mini``, ``certblocks_vit_tiny_patch16_224``).

Parts (each selectable; all run when none is named):

* ``--gpt``: GPT-2 mini (6 layers, 6 heads, width 384) with ``vocab_size=256``, ``block_size`` 64, a byte-level LM
  on the Python standard library's sources (``monitor_gpt.stdlib_bytes``, the last 10% held out), the loop of
  ``certified_defaults.py`` (AdamW, betas (0.9, 0.95), weight decay 0.1 on the matrices, warmup then cosine to
  lr / 10, clipping 1).  The validation loss in bits per byte (fixed held-out windows) at half and at the full
  horizon (the ranking is read at both).
* ``--vit``: ViT-Ti (12 blocks, width 192) at 32 px, patch 8, on scikit-learn's digits (``certified_defaults``'s
  data, split and loop: AdamW, one epoch of warmup then cosine to 0, weight decay 0.05).  Test accuracy at half and
  at the full horizon.
* ``--pure``: the ``dyt`` models trained with every tensor in fp16 (parameters, activations, gradients, optimizer
  state; no autocast, no loss scaling), and the same in bf16, at the ``dyt`` variant's tuned learning rate and
  seed 0.  AdamW's ``eps`` is 1e-4 in these runs (the square-root of fp16's smallest normal number is 7.8e-3: an
  ``eps`` of 1e-8 is 0 in fp16); an fp32 run with the same ``eps`` is the reference.  Records non-finite losses,
  gradients and parameters, and the fp16 certificate at the start and at the end.  ``--pure-state float32`` keeps
  AdamW's two moments in float32 (:class:`Float32StateAdamW`; the parameters, activations and gradients stay in the
  dtype): in fp16 the second moment ``(1 - beta2) g^2`` underflows to 0 for ``|g| < 7.7e-3``, which is nearly every
  entry of these models, and AdamW becomes momentum over ``eps``.

``--dyt-overrides JSON`` changes the ``dyt`` variant's constructor arguments and ``--dyt-edit JSON`` its weights after
construction (:func:`apply_edit`: the MLP branches' gains, the query/key DyTs' ``gamma``, the output projections'
scale, ``erf`` for ``tanh``); both are recorded with every run (the ablations of docs/dyt.md).

Protocol: for each variant, seed 0 at every learning rate of the grid (``--gpt-lrs``, ``--vit-lrs``); the best one
(lowest final validation bits per byte / highest final test accuracy, ties to the lower loss) is then run on the
other seeds.  Within a seed, the data order is the same for every variant.  Results: a markdown report and
``benchmarks/results/dyt_accuracy.json``.

scikit-learn is needed for the ViT part (``pip install certblocks[bench]``).

Usage::

    python benchmarks/experiments/dyt_accuracy.py                  # everything (about 80 min of CPU on 1 thread)
    python benchmarks/experiments/dyt_accuracy.py --gpt --seeds 0  # one part, one seed
    python benchmarks/experiments/dyt_accuracy.py --quick          # tiny sizes, a few steps: the test's mode
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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from certified_defaults import digits_data, gpt_batch, gpt_eval, lr_at, spread, vit_batches  # noqa: E402
from monitor_gpt import stdlib_bytes  # noqa: E402

_BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_JSON = os.path.join(_BENCH, "results", "dyt_accuracy.json")
VARIANTS = ("dyt", "preln", "qknorm")
#: the DyT variants: ``alpha_init`` 3, ``qk_alpha_init`` 10 (the pilot's best on the digits ViT) and the largest round
#: branch gain that certifies in fp16 at initialization (docs/dyt.md), named here so that the comparison does not move
#: when a zoo default does
DYT_GPT = dict(alpha_init=3.0, qk_alpha_init=10.0, init_values=0.01)
DYT_VIT = dict(alpha_init=3.0, qk_alpha_init=10.0, init_values=0.005)
GPT_MODELS = {"dyt": ("gpt2_dyt_mini", DYT_GPT),
              "preln": ("gpt2_dyt_mini", dict(norm="layer", qk_norm=None, init_values=None, certify=False)),
              "qknorm": ("gpt2_qknorm_mini", {})}
VIT_MODELS = {"dyt": ("certblocks_vit_dyt_tiny_patch16_224", DYT_VIT),
              # timm.create_model drops keyword arguments that are None: no gains and plain attention are spelled 0 and
              # False here (None would leave the model's defaults, the DyT on queries and keys and gains of 5e-3)
              "preln": ("certblocks_vit_dyt_tiny_patch16_224", dict(norm="layer", qk_norm=False, init_values=0,
                                                                    certify=False)),
              "qknorm": ("certblocks_vit_tiny_patch16_224", {})}
#: tiny sizes of --quick (the test's mode): GPT 1 layer of width 32, ViT 1 block of width 32
QUICK_GPT = dict(n_layer=1, n_head=2, n_embd=32)
QUICK_VIT = dict(depth=1, embed_dim=32, num_heads=2)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _keep(out: Dict[str, Any], args: argparse.Namespace) -> Dict[str, Any]:
    """Append a finished run to ``args.runs_log`` (JSON lines, without the loss curve) so that a part stopped early
    keeps the runs it finished."""
    if getattr(args, "runs_log", None):
        with open(args.runs_log, "a") as f:
            f.write(json.dumps({k: v for k, v in out.items() if k != "train_loss"}, default=str) + "\n")
    return out


def _overrides(variant: str, args: argparse.Namespace) -> Dict[str, Any]:
    """``--dyt-overrides`` for the ``dyt`` variant (constructor keyword arguments over its defaults), else none."""
    return dict(getattr(args, "dyt_overrides", None) or {}) if variant == "dyt" else {}


#: the changes ``--dyt-edit`` makes to the dyt variant after construction (the ablations of docs/dyt.md)
EDITS = ("mlp_gain", "qk_gamma", "proj_scale", "kind")


def check_edit(edit: Dict[str, Any]) -> None:
    """Raise ``ValueError`` for an ``--dyt-edit`` with a key not in :data:`EDITS` or a ``kind`` not a DyT's."""
    from certblocks.blocks.dyt import DYT_KINDS

    unknown = sorted(set(edit) - set(EDITS))
    if unknown:
        raise ValueError(f"--dyt-edit: unknown keys {unknown}; allowed: {list(EDITS)}")
    if "kind" in edit and edit["kind"] not in DYT_KINDS:
        raise ValueError(f"--dyt-edit: kind must be one of {list(DYT_KINDS)}, got {edit['kind']!r}")


@torch.no_grad()
def apply_edit(model: nn.Module, edit: Dict[str, Any]) -> nn.Module:
    """Change a built DyT model in place: ``mlp_gain`` the MLP branches' gains (``ls2.gamma``), ``qk_gamma`` the
    query and key DyTs' ``gamma``, ``proj_scale`` multiplies the branches' output projections (the attention's
    ``c_proj`` / ``proj``, the MLP's ``fc2``), ``kind`` every DyT's function (``"erf"``)."""
    from certblocks.blocks import MLP, DyT, LayerScale, QKDyTAttention

    check_edit(edit)
    for name, m in model.named_modules():
        if "mlp_gain" in edit and name.rsplit(".", 1)[-1] == "ls2" and isinstance(m, LayerScale):
            m.gamma.fill_(float(edit["mlp_gain"]))
        if isinstance(m, QKDyTAttention):
            if "qk_gamma" in edit:
                m.q_norm.weight.fill_(float(edit["qk_gamma"]))
                m.k_norm.weight.fill_(float(edit["qk_gamma"]))
            if "proj_scale" in edit:
                (getattr(m, "c_proj", None) or m.proj).weight.mul_(float(edit["proj_scale"]))
        if isinstance(m, MLP) and "proj_scale" in edit:
            m.fc2.weight.mul_(float(edit["proj_scale"]))
        if isinstance(m, DyT) and "kind" in edit:
            m.kind = edit["kind"]
    return model


def _edit(variant: str, args: argparse.Namespace) -> Dict[str, Any]:
    """``--dyt-edit`` for the ``dyt`` variant, else none."""
    return dict(getattr(args, "dyt_edit", None) or {}) if variant == "dyt" else {}


def _edited(variant: str, model: nn.Module, args: argparse.Namespace) -> nn.Module:
    edit = _edit(variant, args)
    return apply_edit(model, edit) if edit else model


def _cert(model: nn.Module) -> Dict[str, Any]:
    """The fp16 certificate of a zoo model: ``ok``, ``certified_depth``, ``depth``."""
    c = model.certificate("fp16")
    return {"ok": bool(c.ok), "certified_depth": c.certified_depth, "depth": c.depth}


def optimizer_groups(model: nn.Module, weight_decay: float, gain_lr_scale: float,
                     exclude: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """:func:`certblocks.blocks.gain_param_groups` (``weight_decay`` on the matrices but ``exclude``, the branch gains
    in a group of their own without weight decay) with each group's learning rate as ``lr_scale``, the multiple of
    the schedule's rate this script sets at every step (``gain_lr_scale`` for the gains, 1 for the rest)."""
    from certblocks.blocks import gain_param_groups

    groups = gain_param_groups(model, 1.0, weight_decay=weight_decay, gain_lr_scale=gain_lr_scale, no_decay=exclude)
    for g in groups:
        g["lr_scale"] = g.pop("lr")
    return groups


class Float32StateAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) whose moments and arithmetic are float32 for parameters
    of any dtype: each step reads the parameter and its gradient in float32 and writes the result back rounded to the
    parameter's dtype.  The ``--pure-state float32`` runs' optimizer (torch's AdamW keeps its state in the
    parameter's dtype)."""

    def __init__(self, params: Any, lr: float, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p, dtype=torch.float32),
                                 exp_avg_sq=torch.zeros_like(p, dtype=torch.float32))
                state["step"] += 1
                t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                g = p.grad.float()
                m.mul_(b1).add_(g, alpha=1.0 - b1)
                v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                p32 = p.float().mul_(1.0 - group["lr"] * group["weight_decay"])
                denom = (v / (1.0 - b2**t)).sqrt_().add_(group["eps"])
                p32.addcdiv_(m, denom, value=-group["lr"] / (1.0 - b1**t))
                p.copy_(p32)


def _adamw(groups: List[Dict[str, Any]], state: str, **kw: Any) -> torch.optim.Optimizer:
    """torch's AdamW (``state="param"``: moments in the parameters' dtype) or :class:`Float32StateAdamW`."""
    return Float32StateAdamW(groups, **kw) if state == "float32" else torch.optim.AdamW(groups, **kw)


def _has_gains(model: nn.Module) -> bool:
    from certblocks.blocks import LayerScale

    return any(isinstance(m, LayerScale) for m in model.modules())


def _nonfinite_params(model: nn.Module) -> int:
    return sum(int((~torch.isfinite(p.detach())).sum()) for p in model.parameters())


def _grads_finite(model: nn.Module) -> bool:
    return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())


# -- GPT-2 -----------------------------------------------------------------------------------------------------
def build_gpt(variant: str, seed: int, args: argparse.Namespace) -> nn.Module:
    from certblocks.zoo import create_model

    name, kw = GPT_MODELS[variant]
    kw = {**kw, **_overrides(variant, args)}
    torch.manual_seed(seed)
    model = create_model(name, vocab_size=256, block_size=args.gpt_block, **kw, **(QUICK_GPT if args.quick else {}))
    return _edited(variant, model, args)


def gpt_run(variant: str, seed: int, lr: float, data: Tuple[torch.Tensor, torch.Tensor], args: argparse.Namespace,
            dtype: torch.dtype = torch.float32, eps: float = 1e-8, gain_lr_scale: float = 1.0,
            state: str = "param") -> Dict[str, Any]:
    """One GPT-2 run: ``args.gpt_steps`` AdamW steps in ``dtype`` (parameters and everything: pure); validation
    bits per byte at half and full horizon."""
    train, val = data
    model = build_gpt(variant, seed, args)
    cert_init = _cert(model)
    model = model.to(dtype)
    opt = _adamw(optimizer_groups(model, 0.1, gain_lr_scale), state, lr=lr, betas=(0.9, 0.95), eps=eps)
    g = torch.Generator().manual_seed(seed)
    steps, warmup = args.gpt_steps, max(1, args.gpt_steps // 15)
    out: Dict[str, Any] = {"part": "gpt", "variant": variant, "seed": seed, "lr": lr, "gain_lr_scale": gain_lr_scale,
                           "steps": steps,
                           "dtype": str(dtype)[6:], "eps": eps, "optimizer_state": state, "cert_init": cert_init,
                           "has_gains": _has_gains(model), "overrides": _overrides(variant, args),
                           "edit": _edit(variant, args),
                           "first_nonfinite_step": None, "nonfinite_grad_steps": 0}
    losses: List[float] = []
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = group["lr_scale"] * lr_at(step, steps, warmup, lr, lr / 10)
        x, y = gpt_batch(train, args.gpt_block, args.gpt_batch, g)
        logits, _ = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))  # in the model's dtype
        lv = float(loss.detach())
        losses.append(lv)
        if not math.isfinite(lv):
            out["first_nonfinite_step"] = step
            _log(f"gpt {variant} seed {seed} lr {lr:g} {dtype}: non-finite loss at step {step}; run stopped")
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if not _grads_finite(model):
            out["nonfinite_grad_steps"] += 1
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step + 1 == steps // 2:
            out["val_bpb_half"] = gpt_eval(model, val, args)
        if step % 100 == 0 or step == steps - 1:
            _log(f"gpt {variant} seed {seed} lr {lr:g} {str(dtype)[6:]} step {step}/{steps}: loss {lv:.3f} "
                 f"({time.time() - t0:.0f} s)")
    finished = out["first_nonfinite_step"] is None
    out.update(val_bpb=gpt_eval(model, val, args) if finished else float("nan"),
               final_train_loss=statistics.fmean(losses[-max(1, steps // 10):]) if finished else float("nan"),
               nonfinite_params=_nonfinite_params(model), seconds=time.time() - t0, train_loss=losses)
    out.setdefault("val_bpb_half", float("nan"))
    if dtype != torch.float32:
        out["cert_end"] = _cert(model.float()) if out["nonfinite_params"] == 0 else None
    _log(f"gpt {variant} seed {seed} lr {lr:g} {str(dtype)[6:]}: val {out['val_bpb']:.4f} bits/byte "
         f"(half {out['val_bpb_half']:.4f}), {out['seconds']:.0f} s")
    return _keep(out, args)


# -- ViT -------------------------------------------------------------------------------------------------------
def build_vit(variant: str, seed: int, args: argparse.Namespace) -> nn.Module:
    import certblocks.zoo  # noqa: F401  (registers the certblocks ViTs with timm)
    import timm

    name, kw = VIT_MODELS[variant]
    kw = {**kw, **_overrides(variant, args)}
    torch.manual_seed(seed)
    model = timm.create_model(name, num_classes=10, img_size=32, patch_size=8, **kw,
                              **(QUICK_VIT if args.quick else {}))
    return _edited(variant, model, args)


@torch.no_grad()
def vit_eval(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Tuple[float, float]:
    """Test accuracy and loss (the loss in float32)."""
    model.eval()
    p = next(model.parameters())
    logits = model(x.to(p.dtype)).float()
    model.train()
    return float((logits.argmax(-1) == y).float().mean()), float(F.cross_entropy(logits, y))


def vit_run(variant: str, seed: int, lr: float, data: Tuple[torch.Tensor, ...], args: argparse.Namespace,
            dtype: torch.dtype = torch.float32, eps: float = 1e-8, gain_lr_scale: float = 1.0,
            state: str = "param") -> Dict[str, Any]:
    """One ViT run: ``args.vit_epochs`` epochs in ``dtype`` (pure); test accuracy at half and full horizon."""
    x_tr, y_tr, x_te, y_te = data
    model = build_vit(variant, seed, args)
    cert_init = _cert(model)
    model = model.to(dtype)
    opt = _adamw(optimizer_groups(model, 0.05, gain_lr_scale, exclude=("pos_embed", "cls_token")), state, lr=lr,
                 eps=eps)
    g = torch.Generator().manual_seed(seed)
    per_epoch = math.ceil(len(y_tr) / args.vit_batch)
    steps, warmup = args.vit_epochs * per_epoch, per_epoch
    out: Dict[str, Any] = {"part": "vit", "variant": variant, "seed": seed, "lr": lr, "gain_lr_scale": gain_lr_scale,
                           "dtype": str(dtype)[6:], "eps": eps, "optimizer_state": state, "cert_init": cert_init,
                           "has_gains": _has_gains(model), "overrides": _overrides(variant, args),
                           "edit": _edit(variant, args),
                           "first_nonfinite_step": None, "nonfinite_grad_steps": 0}
    losses: List[float] = []
    t0, step = time.time(), 0
    for epoch in range(args.vit_epochs):
        for idx in vit_batches(len(y_tr), args.vit_batch, g):
            for group in opt.param_groups:
                group["lr"] = group["lr_scale"] * lr_at(step, steps, warmup, lr, 0.0)
            loss = F.cross_entropy(model(x_tr[idx].to(dtype)), y_tr[idx])
            lv = float(loss.detach())
            losses.append(lv)
            step += 1
            if not math.isfinite(lv):
                out["first_nonfinite_step"] = step - 1
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if not _grads_finite(model):
                out["nonfinite_grad_steps"] += 1
            opt.step()
        if out["first_nonfinite_step"] is not None:
            _log(f"vit {variant} seed {seed} lr {lr:g} {dtype}: non-finite loss at step {out['first_nonfinite_step']}")
            break
        if epoch + 1 == args.vit_epochs // 2:
            out["test_acc_half"], out["test_loss_half"] = vit_eval(model, x_te, y_te)
    finished = out["first_nonfinite_step"] is None
    acc, test_loss = vit_eval(model, x_te, y_te) if finished else (float("nan"), float("nan"))
    out.update(test_acc=acc, test_loss=test_loss, nonfinite_params=_nonfinite_params(model),
               final_train_loss=statistics.fmean(losses[-per_epoch:]) if finished else float("nan"),
               seconds=time.time() - t0, train_loss=losses)
    out.setdefault("test_acc_half", float("nan"))
    if dtype != torch.float32:
        out["cert_end"] = _cert(model.float()) if out["nonfinite_params"] == 0 else None
    _log(f"vit {variant} seed {seed} lr {lr:g} {str(dtype)[6:]}: test accuracy {acc:.4f} "
         f"(half {out['test_acc_half']:.4f}), {out['seconds']:.0f} s")
    return _keep(out, args)


# -- protocol --------------------------------------------------------------------------------------------------
def better(part: str, a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """``a`` is a better run than ``b``: lower final bits per byte (GPT), higher test accuracy then lower test loss
    (ViT); a non-finite run is never better."""
    if part == "gpt":
        va, vb = a["val_bpb"], b["val_bpb"]
        return math.isfinite(va) and (not math.isfinite(vb) or va < vb)
    ka, kb = (a["test_acc"], -a["test_loss"]), (b["test_acc"], -b["test_loss"])
    return math.isfinite(ka[0]) and (not math.isfinite(kb[0]) or ka > kb)


def tune_and_run(part: str, run: Callable[..., Dict[str, Any]], lrs: Sequence[float], seeds: Sequence[int],
                 variants: Sequence[str], gain_lr_scales: Sequence[float] = (1.0,)) -> Dict[str, Any]:
    """Seed ``seeds[0]`` at every learning rate and (for a model with branch gains) every gain learning-rate scale,
    then the other seeds at the best setting, per variant."""
    runs: List[Dict[str, Any]] = []
    best_lr: Dict[str, List[float]] = {}
    for v in variants:
        grid = [run(v, seeds[0], lr, gain_lr_scales[0]) for lr in lrs]
        if grid[0]["has_gains"]:
            grid += [run(v, seeds[0], lr, scale) for scale in gain_lr_scales[1:] for lr in lrs]
        runs += grid
        best = grid[0]
        for r in grid[1:]:
            if better(part, r, best):
                best = r
        best_lr[v] = [best["lr"], best["gain_lr_scale"]]
        _log(f"{part} {v}: best learning rate {best['lr']:g}, gain scale {best['gain_lr_scale']:g} "
             f"(of {list(lrs)} x {list(gain_lr_scales) if grid[0]['has_gains'] else [gain_lr_scales[0]]})")
        runs += [run(v, s, best["lr"], best["gain_lr_scale"]) for s in seeds[1:]]
    return {"runs": runs, "best_lr": best_lr}


def summarize(part: str, result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per variant, at its tuned learning rate: the spread over seeds of the final and half-horizon metrics."""
    keys = ("val_bpb", "val_bpb_half", "final_train_loss") if part == "gpt" else \
        ("test_acc", "test_acc_half", "test_loss", "final_train_loss")
    rows = []
    for v, (lr, scale) in result["best_lr"].items():
        rs = sorted((r for r in result["runs"] if r["variant"] == v and r["lr"] == lr
                     and r.get("gain_lr_scale", 1.0) == scale and r["dtype"] == "float32"), key=lambda r: r["seed"])
        row: Dict[str, Any] = {"variant": v, "lr": lr, "gain_lr_scale": scale, "seeds": [r["seed"] for r in rs],
                               "cert_fp16_init": [r["cert_init"]["ok"] for r in rs],
                               "cert_depth_init": rs[0]["cert_init"]["certified_depth"],
                               "depth": rs[0]["cert_init"]["depth"],
                               "nonfinite_runs": sum(r["first_nonfinite_step"] is not None for r in rs)}
        for k in keys:
            row[k] = {**spread([r[k] for r in rs]), "per_seed": [r[k] for r in rs]}
        row["lr_grid"] = {_setting(r): r[keys[0]] for r in result["runs"]
                          if r["variant"] == v and r["seed"] == rs[0]["seed"] and r["dtype"] == "float32"}
        rows.append(row)
    return rows


def _setting(r: Dict[str, Any]) -> str:
    """``lr`` or ``lr x gain scale`` (a scale other than 1) of a run or a summary row."""
    scale = r.get("gain_lr_scale", 1.0)
    return f"{r['lr']:g}" + (f" x{scale:g}" if scale != 1.0 else "")


def ranking(rows: List[Dict[str, Any]], key: str, higher: bool) -> List[str]:
    """The variants ordered best first by the mean of ``key``."""
    return [r["variant"] for r in sorted(rows, key=lambda r: (-1 if higher else 1) * r[key]["mean"])]


def goals(gpt_rows: Optional[List[Dict[str, Any]]], vit_rows: Optional[List[Dict[str, Any]]]) -> Dict[str, Any]:
    """The issue's goals, read from the means: DyT within 1 point of accuracy and 2% of bits per byte of the best
    baseline (Pre-LN or QK-norm)."""
    out: Dict[str, Any] = {}
    if gpt_rows:
        by = {r["variant"]: r["val_bpb"]["mean"] for r in gpt_rows}
        if "dyt" in by and len(by) > 1:
            ref = min(v for k, v in by.items() if k != "dyt")
            out["gpt_rel_bpb_vs_best_baseline"] = by["dyt"] / ref - 1.0
            out["gpt_goal_met"] = by["dyt"] <= 1.02 * ref
        out["gpt_ranking_full"] = ranking(gpt_rows, "val_bpb", False)
        out["gpt_ranking_half"] = ranking(gpt_rows, "val_bpb_half", False)
    if vit_rows:
        by = {r["variant"]: r["test_acc"]["mean"] for r in vit_rows}
        if "dyt" in by and len(by) > 1:
            ref = max(v for k, v in by.items() if k != "dyt")
            out["vit_points_vs_best_baseline"] = 100.0 * (by["dyt"] - ref)
            out["vit_goal_met"] = by["dyt"] >= ref - 0.01
        out["vit_ranking_full"] = ranking(vit_rows, "test_acc", True)
        out["vit_ranking_half"] = ranking(vit_rows, "test_acc_half", True)
    return out


def report(result: Dict[str, Any]) -> str:
    """Markdown tables of the parts in ``result``."""
    out: List[str] = []

    def fmt(s: Dict[str, Any], digits: int, scale: float = 1.0) -> str:
        return "-" if s["mean"] is None else f"{scale * s['mean']:.{digits}f} ± {scale * s['std']:.{digits}f}"

    if "gpt" in result:
        s = result["gpt"]["settings"]
        out += [f"GPT-2 mini on bytes ({s['steps']} steps of {s['batch']} x {s['block_size']} bytes): validation bits "
                "per byte (lower is better), mean ± std over seeds at the tuned learning rate", "",
                "| variant | lr x gain lr scale (grid: seed-0 bits/byte) | fp16 certified at init | val bits/byte | "
                "at half horizon | per seed |", "|---|---|---|---|---|---|"]
        for r in result["gpt"]["summary"]:
            grid = ", ".join(f"{k}: {v:.3f}" for k, v in r["lr_grid"].items())
            per = ", ".join(f"{v:.4f}" for v in r["val_bpb"]["per_seed"])
            out.append(f"| {r['variant']} | {_setting(r)} ({grid}) | {'yes' if all(r['cert_fp16_init']) else 'no'} "
                       f"{r['cert_depth_init']}/{r['depth']} | {fmt(r['val_bpb'], 4)} | {fmt(r['val_bpb_half'], 4)} | "
                       f"{per} |")
        out.append("")
    if "vit" in result:
        s = result["vit"]["settings"]
        out += [f"ViT-Ti on digits ({s['epochs']} epochs of batch {s['batch']}): test accuracy % (higher is better), "
                "mean ± std over seeds at the tuned learning rate", "",
                "| variant | lr x gain lr scale (grid: seed-0 acc %) | fp16 certified at init | test acc % | "
                "at half horizon | test loss | per seed |", "|---|---|---|---|---|---|---|"]
        for r in result["vit"]["summary"]:
            grid = ", ".join(f"{k}: {100 * v:.1f}" for k, v in r["lr_grid"].items())
            per = ", ".join(f"{100 * v:.2f}" for v in r["test_acc"]["per_seed"])
            out.append(f"| {r['variant']} | {_setting(r)} ({grid}) | {'yes' if all(r['cert_fp16_init']) else 'no'} "
                       f"{r['cert_depth_init']}/{r['depth']} | {fmt(r['test_acc'], 2, 100.0)} | "
                       f"{fmt(r['test_acc_half'], 2, 100.0)} | {fmt(r['test_loss'], 4)} | {per} |")
        out.append("")
    if "pure" in result:
        moments = ("AdamW's moments in float32" if result["pure"].get("optimizer_state") == "float32"
                   else "AdamW's moments in the dtype too")
        out += ["Pure low-precision training of the DyT models (every tensor in the dtype, no autocast, no loss "
                f"scaling; {moments}; AdamW eps 1e-4, seed 0, the tuned learning rate):", "",
                "| model | dtype | metric | non-finite loss at | steps with non-finite grads | non-finite params | "
                "fp16 certificate at end |", "|---|---|---|---|---|---|---|"]
        for r in result["pure"]["runs"]:
            metric = f"{r['val_bpb']:.4f} bits/byte" if r["part"] == "gpt" else f"{100 * r['test_acc']:.2f}% acc"
            end = r.get("cert_end")
            cert = "-" if end is None else f"{'yes' if end['ok'] else 'no'} {end['certified_depth']}/{end['depth']}"
            out.append(f"| {r['part']} | {r['dtype']} | {metric} | {r['first_nonfinite_step']} | "
                       f"{r['nonfinite_grad_steps']} | {r['nonfinite_params']} | {cert} |")
        out.append("")
    if result.get("goals"):
        out.append("Goals: " + json.dumps(result["goals"]))
    return "\n".join(out)


def _json_object(text: str) -> Dict[str, Any]:
    """argparse type of ``--dyt-overrides`` and ``--dyt-edit``: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpt", action="store_true", help="the GPT-2 part (all parts run when none is named)")
    p.add_argument("--vit", action="store_true", help="the ViT part")
    p.add_argument("--pure", action="store_true", help="pure fp16 and bf16 training of the DyT models")
    p.add_argument("--quick", action="store_true", help="tiny sizes and a few steps (the test's mode)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--gpt-lrs", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3])
    p.add_argument("--vit-lrs", type=float, nargs="+", default=[5e-4, 1e-3, 2e-3])
    p.add_argument("--gain-lr-scales", type=float, nargs="+", default=[1.0],
                   help="grid of the branch gains' learning rate as a multiple of the schedule's (models with gains)")
    p.add_argument("--gpt-steps", type=int, default=None, help="default 240 (--quick: 4)")
    p.add_argument("--gpt-batch", type=int, default=8)
    p.add_argument("--gpt-block", type=int, default=64)
    p.add_argument("--gpt-corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--gpt-eval-batches", type=int, default=None, help="default 40 (--quick: 2)")
    p.add_argument("--vit-epochs", type=int, default=None, help="default 6 (--quick: 2)")
    p.add_argument("--vit-batch", type=int, default=64)
    p.add_argument("--pure-lr", type=float, nargs=2, default=None, metavar=("GPT_LR", "VIT_LR"),
                   help="learning rates of --pure (default: the dyt variant's tuned ones, else 2e-3 and 1e-3)")
    p.add_argument("--pure-gain-lr-scale", type=float, nargs=2, default=None, metavar=("GPT", "VIT"),
                   help="the gain learning-rate scales of --pure (default: the tuned ones, else 1)")
    p.add_argument("--pure-parts", nargs="+", default=["gpt", "vit"], choices=["gpt", "vit"],
                   help="the models of --pure (default both)")
    p.add_argument("--pure-dtypes", nargs="+", default=["float32", "float16", "bfloat16"],
                   choices=["float32", "float16", "bfloat16"],
                   help="the dtypes of --pure (float32: the reference with the same AdamW eps)")
    p.add_argument("--pure-state", default="param", choices=["param", "float32"],
                   help="AdamW's moments in the parameters' dtype (torch's AdamW) or in float32 (Float32StateAdamW)")
    p.add_argument("--dyt-overrides", type=_json_object, default=None, metavar="JSON",
                   help="constructor keyword arguments of the dyt variant over its defaults, a JSON object (e.g. "
                        "'{\"alpha_init\": 1.0, \"init_values\": 0.05}'); recorded with every run")
    p.add_argument("--dyt-edit", type=_json_object, default=None, metavar="JSON",
                   help=f"changes to the built dyt variant, a JSON object with keys of {list(EDITS)} (apply_edit); "
                        "recorded with every run")
    p.add_argument("--runs-log", default=None, help="append every finished run to this JSON-lines file")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="print the report of these result files together (parts run separately) and exit")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=OUT_JSON)
    args = p.parse_args(argv)
    if args.dyt_edit:
        try:
            check_edit(args.dyt_edit)
        except ValueError as e:
            p.error(str(e))
    args.bf16 = False  # certified_defaults.gpt_eval's autocast flag: the runs here hold the model in its own dtype
    if args.merge:
        return merge(args.merge, args.out)
    if not (args.gpt or args.vit or args.pure):
        args.gpt = args.vit = args.pure = True
    args.gpt_steps = args.gpt_steps or (4 if args.quick else 240)
    args.gpt_eval_batches = args.gpt_eval_batches or (2 if args.quick else 40)
    args.vit_epochs = args.vit_epochs or (2 if args.quick else 6)
    if args.quick:
        args.gpt_corpus_bytes = min(args.gpt_corpus_bytes, 200_000)
    torch.set_num_threads(args.threads)

    command = "python benchmarks/experiments/dyt_accuracy.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result: Dict[str, Any] = {"meta": {
        "command": command.strip(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {torch.get_num_threads()} torch threads",
        "args": vars(args), "seconds": {}}}
    gpt_data = vit_data = None
    if args.gpt or args.pure:
        corpus = stdlib_bytes(args.gpt_corpus_bytes)
        n_val = corpus.numel() // 10
        gpt_data = (corpus[:-n_val], corpus[-n_val:])
    if args.vit or args.pure:
        vit_data = digits_data((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))  # the zoo ViTs' mean / std
        if args.quick:
            vit_data = (vit_data[0][:256], vit_data[1][:256], vit_data[2][:128], vit_data[3][:128])
    for part in ("gpt", "vit"):
        if not getattr(args, part):
            continue
        t0 = time.time()
        if part == "gpt":
            res = tune_and_run("gpt", lambda v, s, lr, g: gpt_run(v, s, lr, gpt_data, args, gain_lr_scale=g),
                               args.gpt_lrs, args.seeds, args.variants, args.gain_lr_scales)
            res["settings"] = {"model": GPT_MODELS["dyt"][0], "vocab_size": 256, "block_size": args.gpt_block,
                               "batch": args.gpt_batch, "steps": args.gpt_steps, "lrs": args.gpt_lrs,
                               "gain_lr_scales": args.gain_lr_scales}
        else:
            res = tune_and_run("vit", lambda v, s, lr, g: vit_run(v, s, lr, vit_data, args, gain_lr_scale=g),
                               args.vit_lrs, args.seeds, args.variants, args.gain_lr_scales)
            res["settings"] = {"model": VIT_MODELS["dyt"][0], "img_size": 32, "patch_size": 8,
                               "batch": args.vit_batch, "epochs": args.vit_epochs, "lrs": args.vit_lrs,
                               "gain_lr_scales": args.gain_lr_scales}
        res["summary"] = summarize(part, res)
        result[part] = res
        result["meta"]["seconds"][part] = round(time.time() - t0, 1)
    if args.pure:
        t0 = time.time()
        tuned = {part: result.get(part, {}).get("best_lr", {}).get("dyt") for part in ("gpt", "vit")}
        lrs = args.pure_lr or (tuned["gpt"][0] if tuned["gpt"] else 2e-3, tuned["vit"][0] if tuned["vit"] else 1e-3)
        scales = args.pure_gain_lr_scale or (tuned["gpt"][1] if tuned["gpt"] else 1.0,
                                             tuned["vit"][1] if tuned["vit"] else 1.0)
        runs = []
        for dtype in (getattr(torch, d) for d in args.pure_dtypes):
            if "gpt" in args.pure_parts:
                runs.append(gpt_run("dyt", args.seeds[0], lrs[0], gpt_data, args, dtype=dtype, eps=1e-4,
                                    gain_lr_scale=scales[0], state=args.pure_state))
            if "vit" in args.pure_parts:
                runs.append(vit_run("dyt", args.seeds[0], lrs[1], vit_data, args, dtype=dtype, eps=1e-4,
                                    gain_lr_scale=scales[1], state=args.pure_state))
        result["pure"] = {"runs": runs, "lrs": list(lrs), "eps": 1e-4, "optimizer_state": args.pure_state}
        result["meta"]["seconds"]["pure"] = round(time.time() - t0, 1)
    result["goals"] = goals(result.get("gpt", {}).get("summary"), result.get("vit", {}).get("summary"))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(report(result))
    print(f"\nJSON: {args.out}")
    return result


def merge(paths: Sequence[str], out: str) -> Dict[str, Any]:
    """The parts of several result files in one (the ``pure`` runs concatenated), the goals recomputed; written to
    ``out`` and printed as markdown."""
    result: Dict[str, Any] = {"meta": {"merged": list(paths), "commands": []}}
    for path in paths:
        with open(path) as f:
            part = json.load(f)
        result["meta"]["commands"].append(part["meta"]["command"])
        for key in ("gpt", "vit"):
            if key in part:
                result[key] = part[key]
        if "pure" in part:
            result.setdefault("pure", {"runs": [], "lrs": [], "eps": part["pure"]["eps"]})
            result["pure"]["runs"] += part["pure"]["runs"]
            result["pure"]["lrs"] += part["pure"]["lrs"]
    result["goals"] = goals(result.get("gpt", {}).get("summary"), result.get("vit", {}).get("summary"))
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(report(result))
    return result


if __name__ == "__main__":
    main()
