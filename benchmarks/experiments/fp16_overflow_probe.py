"""Where do the byte models of ``lr_sensitivity.py`` overflow fp16? (an open question of
``benchmarks/results/lr_sensitivity.md``)

In the learning-rate grid the q = 1 byte models (``sigmoid_noln``, ``qknorm_noln``) blow up in fp16 at a lower
learning rate (6.3e-3) than SwiGLU (``swiglu_noln``, 1.6e-2), and survive the same runs in bf16: an overflow of
fp16's range, not an optimization blow-up.  This script reruns those runs (the grid's model, data, seed, batch
order, optimizer, GradScaler and clipping: ``lr_sensitivity.run_bytes``'s loop without its headroom checks) with
forward hooks on every module of the residual stack, the final LayerNorm and the head, and reports per step:

* the largest ``|entry|`` of the residual stream entering each update (float32 under autocast) and of every
  module's output (float16 matmul outputs, float32 elsewhere);
* at the first non-finite loss, the first module in call order whose output is not finite, and what it read;
* the GradScaler's scale.

Usage::

    python benchmarks/experiments/fp16_overflow_probe.py [--variants qknorm_noln sigmoid_noln swiglu_noln] [--lr 0.0063]
        [--seeds 0] [--out benchmarks/results/fp16_overflow_probe.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lr_sensitivity as lrs  # noqa: E402


def _max_abs(t: Any) -> Optional[float]:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
        return None
    v = float(t.detach().abs().max().to(torch.float64))
    return math.inf if math.isnan(v) else v


class Probe:
    """Forward hooks: per module, the largest ``|output|`` and its dtype; per update, the largest stream entry."""

    def __init__(self, model: nn.Module) -> None:
        self.step: Dict[str, Any] = {}
        self.order: List[str] = []
        self.handles = []
        for name, m in model.named_modules():
            if name and (name.startswith("stack.blocks.") or name in ("ln_f", "head")):
                self.handles.append(m.register_forward_hook(self._post(name)))
        for k, m in enumerate(model.stack.blocks):
            self.handles.append(m.register_forward_pre_hook(self._pre(f"stack.blocks.{k}")))

    def _post(self, name: str) -> Any:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            y = out[0] if isinstance(out, (tuple, list)) else out
            v = _max_abs(y)
            if v is not None:
                self.order.append(name)
                self.step[name] = {"max": v, "dtype": str(y.dtype).replace("torch.", "")}
        return hook

    def _pre(self, name: str) -> Any:
        def hook(mod: nn.Module, args: Any) -> None:
            v = _max_abs(args[0]) if args else None
            if v is not None:
                self.step[name + " <input>"] = {"max": v, "dtype": str(args[0].dtype).replace("torch.", "")}
        return hook

    def reset(self) -> None:
        self.step, self.order = {}, []

    def first_nonfinite(self) -> Optional[Dict[str, Any]]:
        for name in self.order:
            if self.step[name]["max"] == math.inf:
                return {"module": name, **self.step[name]}
        return None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def probe_run(variant: str, lr: float, seed: int, precision: str, data: Any, a: argparse.Namespace
              ) -> Dict[str, Any]:
    """``lr_sensitivity.run_bytes``'s loop (no headroom checks) with the probe; per-step figures."""
    train_bytes, _ = data
    torch.manual_seed(seed)
    model = lrs.ByteLM(variant, a.layers, a.byte_width, a.heads, a.block)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    g = torch.Generator().manual_seed(seed)
    probe = Probe(model)
    steps: List[Dict[str, Any]] = []
    nonfinite, culprit = None, None
    try:
        for step in range(a.byte_steps):
            x, y = lrs.byte_batch(train_bytes, a, g)
            probe.reset()
            with lrs._autocast(precision, "cpu"):
                loss = model(x, y)
            stream = max(v["max"] for k, v in probe.step.items() if k.endswith("<input>"))
            half = [v["max"] for v in probe.step.values() if v["dtype"] in ("float16", "bfloat16")]
            top = max(((k, v["max"]) for k, v in probe.step.items()), key=lambda kv: kv[1])
            steps.append({"step": step, "loss": float(loss.detach()), "stream_max": stream,
                          "half_max": max(half, default=0.0), "largest": top[0], "largest_max": top[1],
                          "scale": float(scaler.get_scale()) if scaler.is_enabled() else None})
            if not math.isfinite(float(loss.detach())):
                nonfinite, culprit = step, probe.first_nonfinite()
                culprit_inputs = {k: v for k, v in probe.step.items() if k.endswith("<input>")}
                steps[-1]["stream_inputs"] = culprit_inputs
                break
            lrs.byte_step(model, opt, scaler, loss, a.clip)
    finally:
        probe.remove()
    return {"variant": variant, "lr": lr, "seed": seed, "precision": precision, "nonfinite_step": nonfinite,
            "first_nonfinite": culprit, "steps": steps}


def summary_line(r: Dict[str, Any]) -> str:
    s = r["steps"]
    head = f"{r['variant']} {r['precision']} lr {r['lr']:g} seed {r['seed']}: "
    if r["nonfinite_step"] is None:
        return head + (f"finite for {len(s)} steps; stream max {max(x['stream_max'] for x in s):.4g}, half max "
                       f"{max(x['half_max'] for x in s):.4g}")
    last_ok = s[-2] if len(s) > 1 else None
    c = r["first_nonfinite"] or {}
    prev = "" if last_ok is None else (f"; step before: stream max {last_ok['stream_max']:.4g}, largest "
                                       f"{last_ok['largest']} {last_ok['largest_max']:.4g}")
    return head + (f"non-finite loss at step {r['nonfinite_step']}: first non-finite output "
                   f"{c.get('module')} ({c.get('dtype')}), stream max then {s[-1]['stream_max']:.4g}{prev}")


def main(argv: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="*", default=["qknorm_noln", "sigmoid_noln", "swiglu_noln"],
                   choices=sorted(lrs.VARIANTS["bytes"]))
    p.add_argument("--lr", type=float, nargs="*", default=[0.0063])
    p.add_argument("--seeds", type=int, nargs="*", default=[0])
    p.add_argument("--precisions", nargs="*", default=["fp16", "bf16"], choices=list(lrs.PRECISIONS))
    p.add_argument("--byte-steps", type=int, default=150)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    grid = {name.replace("-", "_"): default for name, default, _ in lrs.INT_OPTIONS}  # the grid's model and batch
    a = argparse.Namespace(**{**grid, "clip": 1.0, "byte_steps": args.byte_steps})
    data = lrs.byte_data(args.corpus_bytes, a.block, a.eval_windows)
    out = []
    for variant in args.variants:
        for lr in args.lr:
            for seed in args.seeds:
                for prec in args.precisions:
                    r = probe_run(variant, lr, seed, prec, data, a)
                    out.append(r)
                    print(summary_line(r), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh)
    return out


if __name__ == "__main__":
    main()
