"""The fp16 learning-rate grid under AMP, with the amp-fp16 certificate and the monitor (issue 28 item 5).

Does the ``amp-fp16`` certificate, and the :class:`~certblocks.CertificateMonitor` under the same policy, predict
which variants of ``lr_sensitivity.py``'s grid overflow, and do they name the tensor that does?

Training is ``lr_sensitivity.py``'s fp16 training, which already is AMP: the forward under
``torch.autocast("cpu", dtype=torch.float16)``, fp32 parameters and stream, a ``torch.amp.GradScaler("cpu")``
(initial scale 65536).  Same models, data, seeds, batch order, optimizers (ETTh1: ``stability.train_run``'s Adam
loop, rewritten here so that the monitor runs between backward and step; bytes: ``lr_sensitivity.run_bytes``'s
AdamW loop with clipping), same learning rates (``default x {1, 2.5, 6.3, 16, 40, 100}``).  The on-data headroom
checks of ``lr_sensitivity.py`` are replaced by:

* **probe** (forward hooks on every submodule, each training forward): the largest ``|output|`` per module and its
  dtype; the first module output held in fp16 that is not finite (an fp16 value past 65504 is ``inf``), in call
  order, and the first fp32 output past 65504 (legal in AMP: informational).
* **certificate** at ``--cert-steps`` (before the step's update): the model's ``amp-fp16`` certificate,

  - *spine*: :func:`certblocks.as_certified` ``(model).certificate("amp-fp16")``: the chain of the blocks' own
    certificates (ETTh1: the zoo forecaster's; bytes: the residual stack's, its ``r0`` set to the embedding's
    current bound), each intermediate against fp16's ``M`` (the policy's narrowest dtype: the blocks' dtypes are not
    known);
  - *graph* (bytes only): :func:`certblocks.certify` on the whole byte model (embedding, stack, final LayerNorm,
    tied head) captured under ``amp-fp16``, ``.stack("amp-fp16", loss="cross_entropy")``: each value against the
    ``M`` of the dtype it is held in, and ``max_loss_scale``.  The ETTh1 forecasters' graph is not certified: their
    instance normalization's ``aten.var`` has no rule, the chain is refused at map 0 with exponents not derived
    (recorded once per run).

  Per certificate: ``ok``, forward/backward/certified depth, ``max_loss_scale``, the first failure (kind, segment,
  reason) and the fp16-held value nearest fp16's ``M`` (segment and ``Peak.what``, bound / 65504).
* **monitor**: ``CertificateMonitor(model, "amp-fp16", every=...)`` (defaults otherwise: on-data alerts on the
  measured headroom below 1 nat; worst-case margins recorded, not alerted), ``step()`` after the scaled backward;
  its alerts (step, update, quantity) and per check ``stack/ok``, certified depth and the measured headroom.

**Overflow** (observed): ``forward``: a non-finite training loss (the run stops there; the probe names the first
fp16 output that is not finite); ``scaler``: the GradScaler's scale falls below 1 (even unscaled gradients overflow
fp16: the run stops) or the last ``--stuck`` steps were all skipped.  A run whose final loss is non-finite or
absurd (``lr_sensitivity``'s criteria) without either is a ``divergence``, not an overflow.  Skipped steps (the
scale halved) are counted in every run.

Outputs: ``benchmarks/out/amp_grid_{quick,full}.jsonl`` (a line per finished run, ``--resume`` continues),
``amp_grid_{mode}.json`` (runs and summary) and the printed tables (markdown).

Usage::

    python benchmarks/experiments/amp_grid.py --datasets etth1 --threads 1    # 54 runs
    python benchmarks/experiments/amp_grid.py --datasets bytes --threads 1    # 72 runs
    python benchmarks/experiments/amp_grid.py --quick                         # 2 learning rates, 1 seed, 6 steps
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lr_sensitivity as lrs  # noqa: E402
from ett import default_data_path, make_loaders  # noqa: E402
from stability import BLOWUP_MSE, build_model, evaluate, width_overrides  # noqa: E402

POLICY = "amp-fp16"
FP16_MAX = 65504.0
#: steps (0-based) before which the certificate is computed
CERT_STEPS = (0, 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the probe ------------------------------------------------------------------------------------------------
class Probe:
    """Forward hooks on every submodule of ``model``: per forward, the largest ``|output|`` of each and its dtype.

    Only active between :meth:`start` and the next :meth:`start` / :meth:`stop` (certificates and evaluations run
    with it off).
    """

    def __init__(self, model: nn.Module) -> None:
        self.active = False
        self.order: List[Tuple[str, float, str]] = []
        self.grads: List[Tuple[str, bool, str]] = []
        self.params = list(model.named_parameters())
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in model.named_modules() if n]

    def _hook(self, name: str) -> Any:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            if not self.active:
                return
            y = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(y, torch.Tensor) and y.is_floating_point() and y.numel():
                v = float(y.detach().abs().max().to(torch.float64))
                self.order.append((name, math.inf if math.isnan(v) else v, str(y.dtype).replace("torch.", "")))
                if y.requires_grad:  # the gradient of this output, in the order the backward delivers them
                    y.register_hook(lambda g, n=name: self.grads.append(
                        (n, bool(torch.isfinite(g).all()), str(g.dtype).replace("torch.", ""))))
        return hook

    def start(self) -> None:
        self.order, self.grads, self.active = [], [], True

    def first_grad_nonfinite(self) -> Optional[Dict[str, Any]]:
        """The first module output whose (scaled) gradient was not finite, in the backward's order; else the first
        parameter (module order) whose gradient is not (a weight gradient computed in fp16 inside the module: its
        output's gradient finite); ``None`` when every gradient is finite."""
        found = next(({"module": n, "dtype": d} for n, ok, d in self.grads if not ok), None)
        if found is None:
            found = next(({"module": n, "dtype": "parameter"} for n, p in self.params
                          if p.grad is not None and not bool(torch.isfinite(p.grad).all())), None)
        return found

    def stop(self) -> None:
        self.active = False

    def first_fp16_nonfinite(self) -> Optional[Dict[str, Any]]:
        """The first module output held in fp16 that is not finite (call order), or ``None``."""
        return next(({"module": n, "dtype": d} for n, v, d in self.order if d == "float16" and v == math.inf), None)

    def first_fp32_past(self) -> Optional[Dict[str, Any]]:
        """The first fp32 module output past fp16's ``M`` (harmless in AMP), or ``None``."""
        return next(({"module": n, "max": v} for n, v, d in self.order if d == "float32" and v > FP16_MAX), None)

    def top_fp16(self) -> Tuple[Optional[str], float]:
        """The fp16-held output with the largest ``|entry|`` of the forward, and that value."""
        best = max(((n, v) for n, v, d in self.order if d == "float16"), key=lambda nv: nv[1], default=(None, 0.0))
        return best[0], best[1]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# -- certificates ---------------------------------------------------------------------------------------------
def cert_summary(st: Any) -> Dict[str, Any]:
    """A :class:`~certblocks.StackCertificate` under amp-fp16 as a small dict: verdict, depths, loss scale, first
    failure, and the fp16-held value nearest fp16's ``M`` (its bound at the segment's certified input radius)."""
    f = st.first_failure
    nearest: Optional[Dict[str, Any]] = None
    segs = list(enumerate(st.updates)) + ([(len(st.updates), st.head)] if st.head is not None else [])
    for k, u in segs:
        peaks = u.held_peaks(POLICY) if hasattr(u, "held_peaks") else None
        if peaks is None:  # the dtypes of its values are not known: the peak against the narrowest (fp16)
            peaks = {} if u.peak is None else {"fp16": u.peak}
        p = peaks.get("fp16")
        if p is None or not p.derived:
            continue
        radius = st.radii[min(k, len(st.radii) - 1)]
        b = p.bound(radius) if math.isfinite(radius) else math.inf
        if nearest is None or b / FP16_MAX > nearest["ratio"]:
            nearest = {"segment": k, "name": u.name or ("head" if k == len(st.updates) else str(k)),
                       "what": p.what, "ratio": b / FP16_MAX}
    fwd_refused = f is not None and (f.kind == "forward" or st.forward_depth < st.depth)
    return {"ok": bool(st.ok), "forward_depth": st.forward_depth, "backward_depth": st.backward_depth,
            "certified_depth": st.certified_depth, "depth": st.depth, "max_loss_scale": st.max_loss_scale,
            "forward_refused": bool(fwd_refused),
            "failure": None if f is None else {"kind": f.kind, "name": f.name, "index": f.index,
                                               "reason": f.reason[:400]},
            "nearest_fp16": nearest}


def _safe(fn: Any) -> Dict[str, Any]:
    try:
        return cert_summary(fn())
    except Exception as e:  # a certificate that cannot be computed is recorded, the run goes on
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


class ByteLogits(nn.Module):
    """The byte model's logits (its forward returns the loss): the graph the whole-model certificate reads."""

    def __init__(self, m: lrs.ByteLM) -> None:
        super().__init__()
        self.m = m

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.m.head(self.m.ln_f(self.m.stack(self.m.embed(idx))))


def byte_certificates(model: lrs.ByteLM, shadow: lrs.ByteLM, x: torch.Tensor) -> Dict[str, Any]:
    """Spine (the stack's blocks, ``r0`` the embedding's current bound) and graph (the whole model on ``x``, captured
    under amp-fp16 on ``shadow``, a hook-free copy of the weights) certificates."""
    from certblocks import as_certified, certify

    model.stack.r0 = model.radius()
    spine = _safe(lambda: as_certified(model.stack).certificate(POLICY))
    shadow.load_state_dict(model.state_dict())
    shadow.stack.r0 = model.stack.r0  # its envelope: the capture's forward runs inside it
    graph = _safe(lambda: certify(ByteLogits(shadow).eval(), x, precision=POLICY).stack(POLICY, loss="cross_entropy"))
    return {"spine": spine, "graph": graph}


# -- one run --------------------------------------------------------------------------------------------------
def _monitor(target: nn.Module, every: int) -> Any:
    from certblocks.monitor import CertificateMonitor

    return CertificateMonitor(target, POLICY, every=every)


def _monitor_record(rec: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    if rec is None:
        return None
    keys = ("step", "stack/ok", "stack/certified_depth", "data/headroom_measured", "data/forward_headroom_measured",
            "data/backward_headroom_measured", "data/forward_max", "data/worst_update", "data/worst_quantity")
    return {k: rec.get(k) for k in keys}


class Run:
    """The per-run bookkeeping shared by the two datasets: probe, scaler, certificates, monitor, overflow."""

    def __init__(self, model: nn.Module, monitor_target: nn.Module, a: argparse.Namespace) -> None:
        self.a = a
        self.probe = Probe(model)
        self.scaler = torch.amp.GradScaler("cpu")
        self.monitor = _monitor(monitor_target, a.monitor_every) if a.monitor_every else None
        self.certs: List[Dict[str, Any]] = []
        self.monitor_records: List[Dict[str, Any]] = []
        self.trace: List[Dict[str, Any]] = []
        self.skipped: List[int] = []
        self.skipped_where: List[Optional[Dict[str, Any]]] = []  # per skipped step, its first non-finite gradient
        self.overflow: Optional[Dict[str, Any]] = None

    def forward_checked(self, step: int, loss: torch.Tensor) -> bool:
        """After the training forward of ``step``: record the probe; ``False`` (and the overflow) when the loss is
        not finite."""
        self.probe.stop()
        top, top_v = self.probe.top_fp16()
        lv = float(loss.detach())
        self.trace.append({"step": step, "loss": lv, "top_fp16": top, "top_fp16_max": top_v,
                           "scale": float(self.scaler.get_scale())})
        if math.isfinite(lv):
            return True
        self.overflow = {"kind": "forward", "step": step, "observed": self.probe.first_fp16_nonfinite(),
                         "fp32_past_fp16_max": self.probe.first_fp32_past()}
        return False

    def train_step(self, step: int, loss: torch.Tensor, opt: torch.optim.Optimizer, clip: Optional[float] = None
                   ) -> bool:
        """After the training forward of ``step``: the probe's record, then (a finite loss) the scaled backward, the
        monitor, unscale and clip (``clip``), the scaler's step and update.  ``False`` ends the run (an overflow)."""
        if not self.forward_checked(step, loss):
            return False
        opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.after_backward()
        if clip is not None:
            self.scaler.unscale_(opt)
            nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
        before = float(self.scaler.get_scale())
        self.scaler.step(opt)
        self.scaler.update()
        return self.after_update(step, before)

    def after_backward(self) -> None:
        if self.monitor is None:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rec = self.monitor.step()
        if rec is not None:
            self.monitor_records.append(_monitor_record(rec))

    def after_update(self, step: int, before: float) -> bool:
        """After ``scaler.update()``: count a skipped step; ``False`` (and the overflow) when the scaler collapsed."""
        now = float(self.scaler.get_scale())
        if now < before:
            self.skipped.append(step)
            self.skipped_where.append(self.probe.first_grad_nonfinite())
        if now < 1.0:
            self.overflow = {"kind": "scaler", "step": step, "observed": self.skipped_where[-1], "scale": now}
            return False
        return True

    def final(self, evaluate_fn: Any) -> Optional[float]:
        """The final evaluation with the probe on: a non-finite result (no overflow before) is an overflow of kind
        ``final`` at the step after the last, naming the first fp16 output that was not finite."""
        if self.overflow is not None:
            return None
        self.probe.start()
        try:
            v = evaluate_fn()
        finally:
            self.probe.stop()
        if not math.isfinite(v):
            self.overflow = {"kind": "final", "step": len(self.trace), "observed": self.probe.first_fp16_nonfinite(),
                             "fp32_past_fp16_max": self.probe.first_fp32_past()}
        return v

    def outcome(self, init: float, final: Optional[float], steps_done: int, t0: float, limit: float, what: str
                ) -> Dict[str, Any]:
        """The run's record: losses, blow-up and its reason, and :meth:`result`'s figures."""
        nonfinite = self.overflow["step"] if self.overflow is not None and self.overflow["kind"] == "forward" else None
        reason = _reason(nonfinite, final, limit, what)
        out = self.result(steps_done)
        return {"init_loss": init, "final_loss": final if final is None or math.isfinite(final) else None,
                "blew_up": bool(reason) or out["overflow"] is not None, "reason": reason, "nonfinite_step": nonfinite,
                "steps_done": steps_done, "seconds": time.time() - t0, **out}

    def result(self, steps_done: int) -> Dict[str, Any]:
        a = self.a
        if self.overflow is None and len(self.skipped) >= a.stuck and self.skipped[-a.stuck:] == list(
                range(steps_done - a.stuck, steps_done)):
            self.overflow = {"kind": "scaler", "step": self.skipped[-a.stuck], "observed": self.skipped_where[-1],
                             "scale": float(self.scaler.get_scale())}
        alerts = [] if self.monitor is None else [
            {"step": x["step"], "update": x["update"], "quantity": x["quantity"], "value": x["value"],
             "message": x["message"][:300]} for x in self.monitor.alerts]
        self.probe.remove()
        if self.monitor is not None:
            self.monitor.remove()
        return {"overflow": self.overflow, "skipped_steps": self.skipped, "skipped_where": self.skipped_where,
                "certs": self.certs,
                "monitor_alerts": alerts, "monitor_records": self.monitor_records, "trace": self.trace,
                "final_scale": float(self.scaler.get_scale())}


def _reason(nonfinite: Optional[int], final: Optional[float], limit: float, what: str) -> str:
    if nonfinite is not None:
        return f"non-finite loss at step {nonfinite + 1}"
    if final is None:
        return "the GradScaler collapsed"
    if final is None or not math.isfinite(final):
        return f"non-finite {what}"
    return f"{what} {final:.4g} > {limit:g}" if final > limit else ""


def run_etth1(variant: str, lr: float, seed: int, data: Any, a: argparse.Namespace) -> Dict[str, Any]:
    """``stability.train_run``'s loop (Adam, no clipping, GradScaler) with the probe, certificates and monitor."""
    from certblocks import as_certified

    train, _, test = make_loaders(data, a.batch_size, seed=seed)
    model = build_model(variant, a.depth, a.pred_len, seed, **width_overrides("mamba", a.width))
    torch.manual_seed(seed)
    init = evaluate(model, test, "fp16")
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    run = Run(model, model, a)
    t0 = time.time()
    it = iter(train)
    steps_done = 0
    for step in range(a.steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(train)
            x, y = next(it)
        if step in a.cert_steps:
            run.certs.append({"step": step, "spine": _safe(lambda: as_certified(model).certificate(POLICY))})
        run.probe.start()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        steps_done = step + 1
        if not run.train_step(step, ((out.float() - y.float()) ** 2).mean(), opt):
            break
    final = run.final(lambda: evaluate(model, test, "fp16"))
    return run.outcome(init, final, steps_done, t0, BLOWUP_MSE, "test MSE")


def run_bytes(variant: str, lr: float, seed: int, data: Tuple[torch.Tensor, torch.Tensor], a: argparse.Namespace
              ) -> Dict[str, Any]:
    """``lr_sensitivity.run_bytes``'s loop (AdamW, GradScaler, clipping) with the probe, certificates and monitor."""
    train_bytes, windows = data
    torch.manual_seed(seed)
    model = lrs.ByteLM(variant, a.layers, a.byte_width, a.heads, a.block)
    init = lrs.byte_eval(model, windows, "fp16")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    shadow = lrs.ByteLM(variant, a.layers, a.byte_width, a.heads, a.block)
    run = Run(model, model.stack, a)
    t0 = time.time()
    steps_done = 0
    for step in range(a.byte_steps):
        x, y = lrs.byte_batch(train_bytes, a, g)
        if step in a.cert_steps:
            run.certs.append({"step": step, **byte_certificates(model, shadow, x[:1])})
        model.stack.r0 = model.radius()  # the monitor's spine certificate at the embedding's current bound
        run.probe.start()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x, y)
        steps_done = step + 1
        if not run.train_step(step, loss, opt, clip=a.clip):
            break
    final = run.final(lambda: lrs.byte_eval(model, windows, "fp16"))
    return run.outcome(init, final, steps_done, t0, lrs.BLOWUP_BITS, "held-out bits/byte")


# -- the verdicts ---------------------------------------------------------------------------------------------
def _block_of(path: Optional[str]) -> Optional[str]:
    """The residual update a module path lies in (``stack.blocks.7.fc2`` -> ``blocks.7``; ``layers.2.mixer.x`` ->
    ``layers.2``), or ``None``."""
    if not path:
        return None
    parts = path.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in ("blocks", "layers") and parts[i + 1].isdigit():
            return f"{p}.{parts[i + 1]}"
    return None


def _cert_names(c: Dict[str, Any]) -> Tuple[Optional[str], Optional[str]]:
    """``(what, residual update)`` a certificate names: its forward failure's segment, else the fp16 value nearest
    ``M``.  The update: from a module path (``layers.2.mixer``), a graph segment (``m.stack#7`` -> ``blocks.7``), else
    the segment's index in a stack of blocks (``blocks.<index>``)."""
    if "error" in c:
        return None, None
    f = c.get("failure")
    if f is not None and f["kind"] == "forward":
        what, name, index = f["name"], f["name"], f["index"]
    elif c.get("nearest_fp16") is not None:
        n = c["nearest_fp16"]
        what, name, index = f"{n['name']}: {n['what']}", n["name"], n["segment"]
    else:
        return None, None
    m = re.search(r"#(\d+)$", name)
    block = _block_of(f"x.{name}.y") or (f"blocks.{m.group(1)}" if m else f"blocks.{index}")
    return what, block


def verdict(r: Dict[str, Any]) -> Dict[str, Any]:
    """Per run: observed overflow (kind, step, tensor) and what the certificate and the monitor said before it."""
    ov = r["overflow"]
    end = ov["step"] if ov is not None else math.inf
    if ov is not None and ov["kind"] == "scaler":  # from the first skip of the dense run of skips that ends there
        sk = [k for k in r.get("skipped_steps", []) if k <= ov["step"]]
        i = len(sk) - 1
        while i > 0 and sk[i] - sk[i - 1] <= 2:
            i -= 1
        end = sk[i] if sk else end
    out: Dict[str, Any] = {"overflowed": ov is not None, "kind": None if ov is None else ov["kind"],
                           "step": None if ov is None else end,
                           "observed": None if ov is None or not ov.get("observed") else
                           ov["observed"]["module"] + (" (gradient)" if ov["kind"] == "scaler" else "")}
    for which in ("spine", "graph"):
        cs = [c for c in r["certs"] if which in c and "error" not in c[which]]
        if not cs:
            continue
        first = cs[0][which]
        before = [c for c in cs if c["step"] < end]
        refused_fwd = next((c for c in before if c[which]["forward_refused"]), None)
        out[which] = {"init_ok": first["ok"], "init_forward_refused": first["forward_refused"],
                      "init_certified_depth": first["certified_depth"], "depth": first["depth"],
                      "init_max_loss_scale": first["max_loss_scale"],
                      "init_failure": None if first["failure"] is None else
                      f"{first['failure']['kind']} at {first['failure']['name']}",
                      "forward_refused_before": None if refused_fwd is None else refused_fwd["step"]}
        named, block = _cert_names((refused_fwd or (before[-1] if before else cs[0]))[which])
        out[which].update(named=named, named_update=block)
    warned = [x for x in r["monitor_alerts"] if x["step"] < end]  # a check on the overflowing forward is not before
    fwd = [x for x in warned if alert_side(x) == "forward"]
    out["monitor_warned"] = warned[0]["step"] if warned else None
    out["monitor_warned_forward"] = fwd[0]["step"] if fwd else None
    first = (fwd or warned or [None])[0]
    out["monitor_named"] = None if first is None else f"{first['update']} ({alert_side(first)})"
    obs_block = _block_of(out["observed"])
    for which in ("spine", "graph"):
        if which in out:
            out[which]["named_observed"] = bool(obs_block and out[which]["named_update"] == obs_block)
    out["monitor_named_observed"] = bool(first is not None and obs_block and
                                         _block_of("x." + first["update"] + ".y") == obs_block)
    return out


def alert_side(alert: Dict[str, Any]) -> str:
    """``"forward"`` when an on-data alert's measured forward headroom is below 1 nat (a value near its dtype's
    ``M``), ``"backward"`` when only the backward one is (the costates of the scaled backward: the GradScaler's scale
    is in them), else the alert's quantity."""
    m = re.search(r"measured: forward ([-+0-9.einf]+), backward ([-+0-9.einf]+)", alert.get("message", ""))
    if m is None:
        return str(alert.get("quantity"))
    return "forward" if float(m.group(1)) < lrs.ALERT_NATS else "backward"


def _pr(pred: List[bool], obs: List[bool]) -> Dict[str, Any]:
    tp = sum(p and o for p, o in zip(pred, obs))
    fp = sum(p and not o for p, o in zip(pred, obs))
    fn = sum(o and not p for p, o in zip(pred, obs))
    return {"tp": tp, "fp": fp, "fn": fn, "tn": len(pred) - tp - fp - fn,
            "precision": tp / (tp + fp) if tp + fp else None, "recall": tp / (tp + fn) if tp + fn else None}


def summarize(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Cells (dataset, variant, multiplier) and the precision/recall of each predictor against observed overflow."""
    cells: Dict[Tuple, List[Dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault((r["dataset"], r["variant"], r["multiplier"]), []).append(r)
    rows = []
    for (ds, v, m), rs in cells.items():
        vs = [verdict(r) for r in sorted(rs, key=lambda r: r["seed"])]
        rows.append({"dataset": ds, "variant": v, "multiplier": m, "lr": rs[0]["lr"],
                     "seeds": [r["seed"] for r in sorted(rs, key=lambda r: r["seed"])], "verdicts": vs,
                     "skipped": [len(r["skipped_steps"]) for r in sorted(rs, key=lambda r: r["seed"])],
                     "divergence": [bool(r["reason"]) and r["overflow"] is None for r in
                                    sorted(rs, key=lambda r: r["seed"])]})
    order = [(d, v) for d in lrs.VARIANTS for v in lrs.VARIANTS[d]]
    rows.sort(key=lambda x: (order.index((x["dataset"], x["variant"])), x["multiplier"]))
    scores: Dict[str, Dict[str, Any]] = {}
    for ds in sorted({r["dataset"] for r in runs}):
        vs = [verdict(r) for r in runs if r["dataset"] == ds]
        obs = [v["overflowed"] for v in vs]
        preds: Dict[str, List[bool]] = {}
        for which in ("spine", "graph"):
            if all(which in v for v in vs):
                preds[f"{which}: refused at init"] = [not v[which]["init_ok"] for v in vs]
                preds[f"{which}: forward refused at init"] = [v[which]["init_forward_refused"] for v in vs]
                preds[f"{which}: forward refused at a check before the overflow"] = [
                    v[which]["forward_refused_before"] is not None for v in vs]
        preds["monitor warned before the overflow"] = [v["monitor_warned"] is not None for v in vs]
        preds["monitor warned before the overflow, forward side"] = [v["monitor_warned_forward"] is not None
                                                                     for v in vs]
        scores[ds] = {k: _pr(p, obs) for k, p in preds.items()}
        named = [v for v in vs if v["overflowed"] and v["observed"]]
        scores[ds]["monitor named the observed update"] = {
            "runs": len(named), "warned": sum(v["monitor_warned"] is not None for v in named),
            "warned_forward": sum(v["monitor_warned_forward"] is not None for v in named),
            "same_update": sum(v["monitor_named_observed"] for v in named),
            **{f"{w}_same_update": sum(v[w]["named_observed"] for v in named) if all(w in v for v in named) else None
               for w in ("spine", "graph")}}
    return {"rows": rows, "scores": scores}


def _fmt_seeds(vs: List[Dict[str, Any]], f: Any) -> str:
    return " / ".join(f(v) for v in vs)


def table(s: Dict[str, Any]) -> str:
    """Markdown tables: per dataset, variant x multiplier; then the scores."""
    out: List[str] = []
    for ds in [d for d in lrs.VARIANTS if any(r["dataset"] == d for r in s["rows"])]:
        graph = any("graph" in v for r in s["rows"] if r["dataset"] == ds for v in r["verdicts"])
        cols = ["variant", "lr", "overflow (seeds: step, kind)", "skipped steps", "spine at init (cert. depth)",
                "spine fwd refused before"] + (["graph at init (depth, S*)", "graph fwd refused before"] if graph
                                               else []) + ["monitor warned (step)", "tensor observed",
                                                           "monitor named", "certificate named"]
        out += [f"### {ds}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in (x for x in s["rows"] if x["dataset"] == ds):
            vs = r["verdicts"]
            ov = _fmt_seeds(vs, lambda v: f"{v['step']} {v['kind']}" if v["overflowed"] else "-")
            div = sum(r["divergence"])
            if div:
                ov += f" (+{div} divergence)"
            cells = [r["variant"], f"{r['lr']:.3g}", ov, "/".join(map(str, r["skipped"])),
                     _fmt_seeds(vs, lambda v: "?" if "spine" not in v else
                                f"{'ok' if v['spine']['init_ok'] else 'refused'} ({v['spine']['init_certified_depth']}/"
                                f"{v['spine']['depth']})"),
                     _fmt_seeds(vs, lambda v: "?" if "spine" not in v else str(v["spine"]["forward_refused_before"]
                                                                              if v["spine"]["forward_refused_before"]
                                                                              is not None else "-"))]
            if graph:
                cells += [_fmt_seeds(vs, lambda v: "?" if "graph" not in v else
                                     f"{'ok' if v['graph']['init_ok'] else 'refused'} ("
                                     f"{v['graph']['init_certified_depth']}, {_g(v['graph']['init_max_loss_scale'])})"),
                          _fmt_seeds(vs, lambda v: "?" if "graph" not in v else
                                     str(v["graph"]["forward_refused_before"])
                                     if v["graph"]["forward_refused_before"] is not None else "-")]
            named_cert = {v.get("graph", v.get("spine", {})).get("named") for v in vs} - {None}
            cells += [_fmt_seeds(vs, lambda v: (str(v["monitor_warned"]) if v["monitor_warned"] is not None else "-")
                                 + (f" (fwd {v['monitor_warned_forward']})" if v["monitor_warned_forward"]
                                    not in (None, v["monitor_warned"]) else "")),
                      ", ".join(sorted({v["observed"] for v in vs if v["observed"]})) or "-",
                      ", ".join(sorted({v["monitor_named"] for v in vs if v["monitor_named"]})) or "-",
                      "; ".join(sorted(named_cert))[:160] or "-"]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    out += ["| dataset | predictor | TP | FP | FN | TN | precision | recall |", "|---|---|---|---|---|---|---|---|"]
    for ds, sc in s["scores"].items():
        for k, v in sc.items():
            if "tp" in v:
                out.append(f"| {ds} | {k} | {v['tp']} | {v['fp']} | {v['fn']} | {v['tn']} | {_g(v['precision'])} | "
                           f"{_g(v['recall'])} |")
    for ds, sc in s["scores"].items():
        n = sc["monitor named the observed update"]
        out.append(f"\n{ds}: of {n['runs']} overflows with a named tensor, the monitor warned before {n['warned']} "
                   f"({n['warned_forward']} on the forward side), naming the update the tensor lies in "
                   f"{n['same_update']}; the certificate named that update in {_g(n['spine_same_update'])} (spine) "
                   f"and {_g(n['graph_same_update'])} (graph)")
    return "\n".join(out)


def _g(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3g}"


# -- main -----------------------------------------------------------------------------------------------------
def _key(r: Dict[str, Any]) -> Tuple:
    return (r["dataset"], r["variant"], r["multiplier"], r["seed"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="multipliers 1 and 100, seed 0, 6 steps (a smoke test)")
    p.add_argument("--datasets", nargs="*", default=list(lrs.VARIANTS), choices=list(lrs.VARIANTS))
    p.add_argument("--variants", nargs="*", default=None, help="default: every variant of the datasets")
    p.add_argument("--multipliers", type=float, nargs="*", default=None,
                   help=f"learning rates as multiples of the default (default {list(lrs.MULTIPLIERS)})")
    p.add_argument("--lr", type=float, nargs=2, metavar=("ETTH1", "BYTES"), default=None)
    p.add_argument("--seeds", type=int, nargs="*", default=None)
    p.add_argument("--data", default=default_data_path())
    for name, default, what in lrs.INT_OPTIONS:
        p.add_argument(f"--{name}", type=int, default=default,
                       help=what if default is None else f"{what} (default {default})")
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--cert-steps", type=int, nargs="*", default=None,
                   help=f"steps (0-based) before which the certificates are computed (default {list(CERT_STEPS)})")
    p.add_argument("--monitor-every", type=int, default=2, help="monitor check every n steps (0: no monitor)")
    p.add_argument("--stuck", type=int, default=10, help="an overflow when the last n steps were all skipped")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--report-only", action="store_true",
                   help="summarize the runs of the log made with these settings, train none (implies --resume)")
    p.add_argument("--tag", default=None, help="output name suffix (default quick / full)")
    p.add_argument("--out", default=lrs.OUT_DIR)
    a = p.parse_args(argv)
    q = a.quick
    a.steps = a.steps or (6 if q else 64)
    a.byte_steps = a.byte_steps or (6 if q else 150)
    a.cert_steps = set(a.cert_steps if a.cert_steps is not None else ([0, 2] if q else CERT_STEPS))
    mults = a.multipliers or ([1.0, 100.0] if q else list(lrs.MULTIPLIERS))
    seeds = a.seeds if a.seeds is not None else ([0] if q else [0, 1, 2])
    base = dict(zip(("etth1", "bytes"), a.lr)) if a.lr else dict(lrs.DEFAULT_LR)
    for name in [o[0] for o in lrs.INT_OPTIONS] + ["threads", "stuck"]:
        if getattr(a, name.replace("-", "_")) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name.replace('-', '_'))}")
    if a.monitor_every < 0 or any(s < 0 for s in a.cert_steps):
        p.error(f"--monitor-every and --cert-steps must be >= 0, got {a.monitor_every}, {sorted(a.cert_steps)}")
    if not mults or any(not (m > 0 and math.isfinite(m)) for m in mults) or not seeds:
        p.error("--multipliers must be finite numbers > 0 and --seeds non-empty")
    if any(not (x > 0 and math.isfinite(x)) for x in base.values()):
        p.error(f"--lr must be finite numbers > 0, got {a.lr}")
    for v in a.variants or []:
        if not any(v in lrs.VARIANTS[d] for d in a.datasets):
            p.error(f"unknown variant {v!r} for datasets {a.datasets}")
    plan = [(d, v) for d in a.datasets for v in lrs.VARIANTS[d] if a.variants is None or v in a.variants]
    torch.set_num_threads(a.threads)
    os.makedirs(a.out, exist_ok=True)
    tag = a.tag or ("quick" if q else "full")
    log_path = os.path.join(a.out, f"amp_grid_{tag}.jsonl")
    settings = {k: getattr(a, k) for k in [o[0].replace("-", "_") for o in lrs.INT_OPTIONS] +
                ["corpus_bytes", "clip", "monitor_every", "stuck"]}
    settings.update(data=os.path.abspath(a.data), lr=base, cert_steps=sorted(a.cert_steps))
    done: Dict[Tuple, Dict[str, Any]] = {}
    a.resume = a.resume or a.report_only
    if a.resume and os.path.exists(log_path):
        with open(log_path) as f:
            done = {_key(r): r for r in map(json.loads, filter(str.strip, f)) if r.get("settings") == settings}
    elif os.path.exists(log_path):
        os.remove(log_path)
    data = {} if a.report_only else lrs.load_data([d for d, _ in plan], a)
    # seed-major: a grid stopped early has every cell at the first seeds
    grid = [(ds, v, m, seed) for seed in seeds for ds, v in plan for m in mults]
    _log(f"amp_grid ({tag}): {len(grid)} runs = {plan} x multipliers {mults} of {base} x seeds {seeds}, {POLICY}; "
         f"{a.threads} thread(s)" + (f"; {len(done)} resumed" if done else ""))
    runs: List[Dict[str, Any]] = []
    t_all = time.time()
    for i, key in enumerate(grid, 1):
        if key in done:
            runs.append(done[key])
            continue
        if a.report_only:
            continue
        ds, v, m, seed = key
        lr = base[ds] * m
        res = (run_etth1 if ds == "etth1" else run_bytes)(v, lr, seed, data[ds], a)
        run = {"dataset": ds, "variant": v, "q": lrs.VARIANTS[ds][v], "precision": POLICY, "multiplier": m,
               "lr": lr, "seed": seed, "settings": settings, **res}
        runs.append(run)
        with open(log_path, "a") as f:
            f.write(json.dumps(run, default=str) + "\n")
        vd = verdict(run)
        what = f"OVERFLOW {vd['kind']} at {vd['step']} {vd['observed']}" if vd["overflowed"] else "no overflow"
        _log(f"[{i}/{len(grid)}] {ds} {v} lr={lr:.3g} seed={seed}: {what}"
             f"{' (' + res['reason'] + ')' if res['reason'] else ''}, skipped {len(res['skipped_steps'])}, "
             f"monitor warned {vd['monitor_warned']} ({vd['monitor_named']}), {res['seconds']:.1f} s "
             f"(total {time.time() - t_all:.0f} s)")
    s = summarize(runs)
    cmd = "python benchmarks/experiments/amp_grid.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"command": cmd, "mode": tag, **settings, "multipliers": mults, "seeds": seeds, "policy": POLICY,
            "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
                       f"{torch.get_num_threads()} threads",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": round(time.time() - t_all, 1),
            "runs": len(runs), "planned": len(grid), "run_seconds": round(sum(r["seconds"] for r in runs), 1)}
    path = os.path.join(a.out, f"amp_grid_{tag}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, **s}, f, indent=1, default=str)
    print(table(s))
    print(f"\n{len(runs)} runs in {meta['seconds']:.0f} s; JSON {path}; log {log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
