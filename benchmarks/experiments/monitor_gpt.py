"""Certificate monitor on a diverging no-LN GPT-2: byte-level LM on the Python standard library's sources.

Three forms of a small GPT-2 (``--layers`` blocks of attention + MLP, width ``--width``), built from
certblocks blocks with ``build_stack(certify=False)``, trained with the same AdamW learning rate:

* ``preln``: Pre-LN (``NormedUpdate(LayerNorm, block)``), the usual GPT-2;
* ``noln``: no LayerNorm, plain attention (the form that diverges at a high learning rate);
* ``qknorm``: no LayerNorm, QK-normalized attention (QK-LayerNorm, see the comment in ``ByteGPT``);
* ``enforced``: the no-LN form under :func:`certblocks.enforce` (caps for ``--amp``), embedding rows kept
  within the ``r0`` the caps were chosen for.

The forward runs under CPU autocast in ``--amp`` (default fp16: the certificate's dtype, whose overflow is
what ends a diverging run); the monitor (``CertificateMonitor(stack, dtype, every=...)``) watches each
form and its alerts are recorded.  For the no-LN form the script reports the first alert, the update it
names, and how many steps it came before the first non-finite loss.  Curves: ``benchmarks/out/monitor_gpt_*.png``,
figures: ``benchmarks/out/monitor_gpt.json``, monitor records: ``benchmarks/out/monitor_gpt_<form>.csv``
(``--tag`` suffixes them).  The on-data alerts read the measured headroom by default (``--basis``); the (T)
estimate's headroom is recorded beside it.

Usage::

    python benchmarks/experiments/monitor_gpt.py            # 6 layers, width 256
    python benchmarks/experiments/monitor_gpt.py --quick    # 4 layers, width 128, fewer steps
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from certblocks.zoo._layers import NormedUpdate
from torch import nn

from certblocks.blocks import MLP, Attention, QKNormAttention
from certblocks.monitor import CertificateMonitor, CertificateWarning
from certblocks.stack import build_stack

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out")


def stdlib_bytes(limit: int) -> torch.Tensor:
    """The bytes of the standard library's ``.py`` files (sorted paths), up to ``limit`` bytes."""
    root = sysconfig.get_paths()["stdlib"]
    chunks: List[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        if "site-packages" in dirpath or "test" in os.path.relpath(dirpath, root).split(os.sep):
            continue
        for f in sorted(filenames):
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f), "rb") as fh:
                    b = fh.read()
                chunks.append(b)
                total += len(b)
                if total >= limit:
                    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


class ByteGPT(nn.Module):
    """Embedding + certblocks stack + final LayerNorm + tied head."""

    def __init__(self, form: str, layers: int, width: int, heads: int, block: int) -> None:
        super().__init__()
        blocks: List[nn.Module] = []
        for _ in range(layers):
            if form == "preln":
                blocks += [NormedUpdate(Attention(width, heads), width, "layer"),
                           NormedUpdate(MLP(width, 4 * width), width, "layer")]
            elif form in ("noln", "enforced"):
                blocks += [Attention(width, heads), MLP(width, 4 * width)]
            elif form == "qknorm":
                # qk_norm="layer": the fused RMS/l2 QK-norm backward fails under CPU autocast (mixed dtypes)
                blocks += [QKNormAttention(width, heads, qk_norm="layer"), MLP(width, 4 * width)]
            else:
                raise ValueError(f"form must be 'preln', 'noln', 'qknorm' or 'enforced', got {form!r}")
        self.wte = nn.Embedding(256, width)
        self.wpe = nn.Embedding(block, width)
        self.stack = build_stack(blocks, "fp16", seq_len=block, certify=False)
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)
        self.head.weight = self.wte.weight
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.ndim == 2:
                    p.normal_(0.0, 0.02)
                elif name.endswith("bias"):
                    p.zero_()
        self.stack.r0 = self.radius()

    def radius(self) -> float:
        return float(self.wte.weight.detach().norm(dim=1).max() + self.wpe.weight.detach().norm(dim=1).max())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        logits = self.head(self.ln_f(self.stack(x)))
        return F.cross_entropy(logits.float().reshape(-1, 256), targets.reshape(-1))


@torch.no_grad()
def first_nonfinite_update(model: ByteGPT, x: torch.Tensor, amp: torch.dtype) -> Any:
    """The first update whose output (the state after it) is not finite on ``x`` (same forward, autocast)."""
    with torch.autocast("cpu", dtype=amp):
        h = model.wte(x) + model.wpe(torch.arange(x.shape[1]))
        for k, blk in enumerate(model.stack.blocks):
            v = blk(h)
            if not torch.isfinite(v).all():
                return f"blocks.{k} (velocity)"
            h = h + model.stack.dt * v
            if not torch.isfinite(h).all():
                return f"blocks.{k} (state)"
    return "head"


def train(form: str, data: torch.Tensor, args: argparse.Namespace) -> Dict[str, Any]:
    torch.manual_seed(args.seed)
    model = ByteGPT(form, args.layers, args.width, args.heads, args.block)
    emb_cap = None
    if form == "enforced":
        from certblocks.enforcement import enforce

        # the certificate is for inputs of norm <= r0: keep every embedding row within r0 / 2 (renormed after
        # each step), and cap the updates' weights for that r0
        emb_cap = model.radius()
        model.stack.r0 = 2.0 * emb_cap
        rep = enforce(model.stack, args.amp, r0=model.stack.r0)
        print(f"enforced: alpha = {rep.alpha:.4g}, {len(rep.caps)} capped tensors, r0 = {model.stack.r0:.4g}",
              flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    # linear warm-up over --warmup steps (0: the full lr from the first step)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) if args.warmup else 1.0)
    every = args.every if form == "noln" else args.every_stable
    mon = CertificateMonitor(model.stack, args.amp, every=every, r0=model.stack.r0 if emb_cap else model.radius(),
                             logit_samples=2, horizon=args.horizon, headroom_basis=args.basis,
                             estimate_every=args.estimate_every or None)
    g = torch.Generator().manual_seed(args.seed)
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.amp]
    losses: List[float] = []
    first_nonfinite = None
    failing = None
    t0 = time.time()
    for step in range(args.steps):
        ix = torch.randint(0, data.numel() - args.block - 1, (args.batch,), generator=g)
        x = torch.stack([data[i:i + args.block] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + args.block] for i in ix])
        with torch.autocast("cpu", dtype=amp):
            loss = model(x, y)
        lv = float(loss.detach())
        losses.append(lv)
        if not math.isfinite(lv):
            first_nonfinite = step
            failing = first_nonfinite_update(model, x, amp)
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if emb_cap is None:  # the embedding is trained: the certificate's input radius follows it
            mon.updates.r0 = model.radius()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CertificateWarning)  # recorded in mon.alerts
            mon.step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if emb_cap is not None:
            with torch.no_grad():
                for w in (model.wte.weight, model.wpe.weight):
                    w.copy_(torch.renorm(w, 2, 0, emb_cap))
        if step % 50 == 0:
            print(f"{form} step {step} loss {lv:.3f} ({time.time() - t0:.0f} s, {len(mon.alerts)} alerts)", flush=True)
    mon.to_csv(os.path.join(OUT, f"monitor_gpt{args.tag}_{form}.csv"))
    first_alert = mon.alerts[0] if mon.alerts else None
    data_alerts = [a for a in mon.alerts if a["quantity"] in ("headroom", "headroom trend")]
    first_data = data_alerts[0] if data_alerts else None
    return {"form": form, "losses": losses, "first_nonfinite": first_nonfinite,
            "final_loss": losses[-1], "first_nonfinite_update": failing, "seconds": time.time() - t0,
            "steps_run": len(losses),
            "first_alert": None if first_alert is None else {k: first_alert[k] for k in
                                                             ("step", "update", "quantity", "value")},
            "alerts_by_quantity": {q: sum(a["quantity"] == q for a in mon.alerts)
                                   for q in sorted({a["quantity"] for a in mon.alerts})},
            "warning_steps_before_nonfinite": (first_nonfinite - first_alert["step"]
                                               if first_alert is not None and first_nonfinite is not None else None),
            "first_data_alert": None if first_data is None else {k: first_data[k] for k in
                                                                  ("step", "update", "quantity", "cause", "value")},
            "data_alerts": len(data_alerts),
            "data_warning_steps_before_nonfinite": (None if first_data is None or first_nonfinite is None
                                                    else first_nonfinite - first_data["step"]),
            "headroom": [[r["step"], r.get("data/alert_headroom")] for r in mon.records],
            "headroom_estimate": [[r["step"], r.get("data/headroom")] for r in mon.records],
            "headroom_measured": [[r["step"], r.get("data/headroom_measured")] for r in mon.records],
            "estimate_checks_below_1": sum(r.get("data/headroom") is not None and not r["data/headroom"] >= 1.0
                                           for r in mon.records),
            "checks": len(mon.records),
            "kappa": [[r["step"]] + [r[k] for k in r if k.endswith("/kappa")] for r in mon.records],
            "margin_grad": [[r["step"], r["stack/margin_grad"]] for r in mon.records]}


def plot(results: List[Dict[str, Any]], args: argparse.Namespace, path: Optional[str] = None) -> None:
    """Loss, kappa and on-data headroom against steps, into ``path`` (default ``out/monitor_gpt<tag>_loss.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4))
    for r in results:
        ax[0].plot(r["losses"], label=r["form"])
        if r["first_nonfinite"] is not None:
            ax[0].axvline(r["first_nonfinite"], ls=":", color="k")
        if r["first_alert"] is not None:
            ax[0].axvline(r["first_alert"]["step"], ls="--", alpha=0.5,
                          color=ax[0].lines[-2 if r["first_nonfinite"] is not None else -1].get_color())
        hs = [(st, h) for st, h in r["headroom"] if h is not None]
        if hs:
            ax[2].plot([h[0] for h in hs], [max(h[1], -5.0) for h in hs], label=f"{r['form']} ({args.basis})")
            he = [(st, h) for st, h in r["headroom_estimate"] if h is not None]
            ax[2].plot([h[0] for h in he], [max(h[1], -5.0) for h in he], ls="--", lw=0.8,
                       color=ax[2].lines[-1].get_color())
            if r["first_nonfinite"] is not None:
                ax[2].axvline(r["first_nonfinite"], ls=":", color="k")
        ks = r["kappa"]
        if ks and len(ks[0]) > 1:
            ax[1].semilogy([k[0] for k in ks], [max(k[1:]) for k in ks], label=f"{r['form']} max kappa")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("loss (nats/byte)")
    ax[0].set_title(f"byte LM, lr {args.lr:g}, {args.amp} (dashed: first alert, dotted: non-finite)")
    ax[0].legend()
    ax[1].set_xlabel("step")
    ax[1].set_title("largest query-key coefficient kappa")
    ax[1].legend()
    ax[2].axhline(1.0, ls="--", color="gray", lw=0.8)
    ax[2].set_xlabel("step")
    ax[2].set_title("on-data headroom, nats\n(solid: alerts' basis; dashed: (T) estimate; dotted: non-finite)",
                    fontsize=9)
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path or os.path.join(OUT, f"monitor_gpt{args.tag}_loss.png"), dpi=110)
    plt.close(fig)


def main(argv: Any = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="4 layers, width 128, fewer steps")
    p.add_argument("--forms", default="noln,qknorm,enforced,preln")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=6e-3)
    p.add_argument("--warmup", type=int, default=0, help="linear learning-rate warm-up steps (0: none)")
    p.add_argument("--every", type=int, default=2, help="monitor period of the noln form")
    p.add_argument("--every-stable", type=int, default=25, help="monitor period of the preln and qknorm forms")
    p.add_argument("--amp", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--horizon", type=int, default=None,
                   help="the monitor's trend alert: headroom reaching 0 within this many steps (default: off)")
    p.add_argument("--basis", default="measured", choices=["measured", "estimate", "certified"],
                   help="the headroom the on-data alerts read (CertificateMonitor's headroom_basis)")
    p.add_argument("--estimate-every", type=int, default=1,
                   help="Lanczos estimates at every this many checks (default 1: both bases recorded for "
                        "monitor_rules.py; 0: only where the alert basis needs them, the monitor's default)")
    p.add_argument("--tag", default="", help="suffix of the output files (runs side by side)")
    p.add_argument("--replot", nargs=2, metavar=("JSON", "PNG"), default=None,
                   help="draw the figure of a saved run (its monitor_gpt*.json) into PNG, and exit")
    args = p.parse_args(argv)
    if args.replot:
        with open(args.replot[0]) as fh:
            doc = json.load(fh)
        saved = argparse.Namespace(**{**vars(args), **doc["summary"]["args"]})
        plot(doc["curves"], saved, args.replot[1])
        return doc["summary"]
    if args.quick:
        args.layers, args.width, args.block, args.steps = 4, 128, 64, min(args.steps, 150)
    os.makedirs(OUT, exist_ok=True)
    data = stdlib_bytes(args.corpus_bytes)
    print(f"corpus: {data.numel()} bytes of {sysconfig.get_paths()['stdlib']}", flush=True)
    results = [train(f, data, args) for f in args.forms.split(",")]
    plot(results, args)
    summary = {"args": vars(args), "results": [{k: v for k, v in r.items() if k not in ("losses", "kappa",
                                                                                         "margin_grad", "headroom",
                                                                                         "headroom_estimate",
                                                                                         "headroom_measured")}
                                               for r in results]}
    with open(os.path.join(OUT, f"monitor_gpt{args.tag}.json"), "w") as fh:
        json.dump({"summary": summary, "curves": results}, fh)
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
