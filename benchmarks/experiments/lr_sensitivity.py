"""Learning-rate sensitivity: does q <= 1 raise the critical learning rate? (Wortsman et al. 2023's method)

Final loss against learning rate on a log grid (``default x {1, 2.5, 6.3, 16, 40, 100}``), 3 seeds, fp16
(``torch.autocast`` + ``GradScaler``) and bf16 (autocast), for variants of growth exponent q > 1, q = 1 and
q = 0 on two datasets:

=========  ===============  ===  ======================================================================
dataset    variant          q    model
=========  ===============  ===  ======================================================================
etth1      mamba_free       5    ``mamba_forecaster_free`` (``benchmarks/experiments/stability.py``'s protocol)
etth1      mamba_lg         1    ``mamba_forecaster_lg`` (LinearGrowthMamba)
etth1      mamba_preln      0    ``mamba_forecaster_preln``
bytes      swiglu_noln      2    QK-norm attention (RMS) + SwiGLU (``GatedMLP(gate="silu")``), no norms
bytes      sigmoid_noln     1    QK-norm attention (RMS) + sigmoid GLU (``GatedMLP(gate="sigmoid")``)
bytes      qknorm_noln      1    QK-norm attention (RMS) + GELU MLP
bytes      preln            0    Pre-LN (``NormedUpdate(LayerNorm, .)``) attention + GELU MLP
=========  ===============  ===  ======================================================================

ETTh1 (``/work/shared/data/ETTh1.csv`` by default, ``--data``): ``stability.py``'s quick budget and loop
(``train_run``): 3 layers, horizon 96, width 64, 64 Adam steps of 16 windows, test MSE (standardized targets)
on every 8th test window, default learning rate 1e-3 (the protocol's); a run blows up when a training loss is
non-finite or the final test MSE is non-finite or above 10.

Bytes (the Python standard library's sources, ``monitor_gpt.stdlib_bytes``, the last 10% held out): a byte GPT
like ``monitor_gpt.ByteGPT`` (embedding + certblocks stack + final LayerNorm + tied head; the final LayerNorm is
kept in every variant, "no norms" means none in the residual stream) of 4 layers, width 128, 4 heads, 64-token
windows, batch 8, 150 AdamW steps (betas 0.9/0.95, no weight decay, gradient clipping at 1 as in
``monitor_gpt``, constant learning rate, no warm-up), default learning rate 1e-3 (a usual AdamW rate for a model
of this size; ``monitor_gpt``'s diverging setting, 6e-3, lies inside the grid); final loss in bits per byte on
64 fixed held-out windows. Both GLUs have hidden width ``4 x width`` (``fc1`` maps to twice that): 1.09 M
parameters against 0.83 M for the GELU-MLP variants. A run blows up when a training loss is non-finite or the
final held-out loss is non-finite or above 8 bits/byte (worse than uniform). QK-norm is the default RMS form:
its fused backward now runs under CPU autocast (fp16 and bf16), so the ``qk_norm="layer"`` work-around of
``monitor_gpt`` is not needed.

Figures, per (dataset, variant, precision):

* critical learning rate: the smallest grid learning rate at which a majority of the seeds (2 of 3) blow up,
  and the first at which any seed does; "none" when no run blows up on the grid (critical > the largest).
* LR sensitivity (Wortsman et al., section 2): with ``l0_s`` the final-loss metric of seed ``s`` at
  initialization (the same evaluation before training), ``l_s(eta) = min(l_final_s(eta), l0_s)``, and
  ``l_s(eta) = l0_s`` for a run that blew up; ``L(eta) = mean_s l_s(eta)``; then
  ``sensitivity = mean_eta L(eta) - min_eta L(eta)`` (the expectation over the grid's learning rates, uniform
  on the log grid).  The same formula per seed gives ``sensitivity_s`` (its mean and sd are printed, and the
  per-seed values are what the Welch test of sensitivities compares).
* Welch's t-test (``scipy.stats.ttest_ind(equal_var=False)``) of the final losses of the surviving seeds,
  each q <= 1 variant against its q > 1 peer of the same dataset (``PEERS``), at each learning rate where both
  have at least 2 surviving seeds; and of the per-seed sensitivities.
* on-data headroom (``--headroom-steps``, default before steps 0, 1, 4, 16, 64, 128: dense early, where the
  largest learning rates blow up; fp16 runs only, ``--headroom-precisions``: bf16's headroom is about 87 of its
  88.7 nats and never comes near 0): ``certblocks.trajectory(model, batch, dtype, steps=4, certified=False,
  logit_samples=2)`` on the first 2 samples of the step's training batch (``--headroom-samples``; for ETTh1 2
  windows, i.e. 14 channel series), under the run's autocast, before that step's update; the Mamba mixers run
  the reference scan during the check (see :func:`reference_scan`). For each run: the smallest headroom before
  its first non-finite loss (or over the run), and whether a check before it went below 1 nat (the monitor's
  default threshold): a check on the very forward that overflows does not count. The table counts the blow-ups
  so predicted, and the surviving runs with such a check (false alarms). A blow-up by an absurd final loss is a
  divergence, not an overflow: it is counted with the rest, and the JSON says which kind each run's was
  (``reason``).

Cost (one run per variant at the default learning rate, seed 0, 1 thread, on this project's 2-core x86_64
machine with other jobs running; wall time, CPU time alike but for mamba_free fp16's 20.5 s): ETTh1 fp16 25.4 /
19.5 / 20.2 s (mamba_free / mamba_lg / mamba_preln; the 4 headroom checks are about 1.5 s each of that: the
reference scan), bf16 13.6 / 14.0 / 13.4 s; bytes fp16 17.1 / 14.6 / 12.9 / 11.8 s (swiglu_noln / sigmoid_noln /
qknorm_noln / preln; 6 checks of about 0.5 s), bf16 8.1 / 9.4 / 9.1 / 8.5 s. The default grid is 108 ETTh1 runs
+ 144 byte runs = 252 runs: at most about 59 min (ETTh1 20 + 12 min, bytes 17 + 11 min), less as the blown-up
runs stop at their first non-finite loss; ``--headroom-steps`` with no value saves about 9 min.

Outputs: ``benchmarks/out/lr_sensitivity_{quick,full}.jsonl`` (a line per finished run, ``--resume``
continues), ``lr_sensitivity_{mode}.json`` (summary), ``lr_sensitivity_{mode}.png`` (final loss vs learning
rate, one panel per dataset x precision, blow-ups marked) and a printed table.

Usage::

    python benchmarks/experiments/lr_sensitivity.py --threads 1          # the full grid: 252 runs
    python benchmarks/experiments/lr_sensitivity.py --quick              # 2 learning rates, 1 seed, fp16, a few steps
    python benchmarks/experiments/lr_sensitivity.py --resume             # continue from the .jsonl log
    python benchmarks/experiments/lr_sensitivity.py --datasets bytes --multipliers 1 10 100 --precisions bf16
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
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ett import default_data_path, load_ett, make_loaders
from monitor_gpt import ByteGPT, stdlib_bytes
from stability import BLOWUP_MSE, _autocast, build_model, evaluate, train_run, width_overrides

OUT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out")

#: dataset -> variant -> q of the variant (its largest update exponent)
VARIANTS: Dict[str, Dict[str, int]] = {
    "etth1": {"mamba_free": 5, "mamba_lg": 1, "mamba_preln": 0},
    "bytes": {"swiglu_noln": 2, "sigmoid_noln": 1, "qknorm_noln": 1, "preln": 0},
}
#: (q <= 1 variant, its q > 1 peer) compared by Welch's t-test
PEERS: Dict[str, List[Tuple[str, str]]] = {
    "etth1": [("mamba_lg", "mamba_free"), ("mamba_preln", "mamba_free")],
    "bytes": [("sigmoid_noln", "swiglu_noln"), ("qknorm_noln", "swiglu_noln"), ("preln", "swiglu_noln")],
}
DEFAULT_LR = {"etth1": 1e-3, "bytes": 1e-3}
MULTIPLIERS = (1.0, 2.5, 6.3, 16.0, 40.0, 100.0)
PRECISIONS = ("fp16", "bf16")
BLOWUP_BITS = 8.0
ALERT_NATS = 1.0
#: steps before which the on-data headroom is computed (dense early: the largest learning rates blow up first)
HEADROOM_STEPS = (0, 1, 4, 16, 64, 128)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- headroom checks -------------------------------------------------------------------------------------------
def headroom(model: nn.Module, args: Any, loss: Callable, precision: str) -> Tuple[Optional[float], Optional[float]]:
    """``certblocks.trajectory(...)``'s headroom in nats (cheap settings): ``(estimate, measured)``, the (T) bound's
    and the measured costates' (``None`` where it cannot be computed)."""
    from certblocks import trajectory

    try:
        with _autocast(precision, "cpu"):
            rep = trajectory(model, args, precision, loss=loss, steps=4, certified=False, logit_samples=2)
    except Exception as e:  # a failed check is recorded as missing, the run goes on
        _log(f"headroom check failed: {type(e).__name__}: {e}")
        return None, None
    finite = lambda h: None if h is None else h if math.isfinite(h) else (-1e30 if h < 0 or math.isnan(h) else 1e30)
    return finite(float(rep.headroom)), finite(rep.headroom_measured)


class CheckedBatches:
    """Re-iterable wrapper of ``loader`` that calls ``check(step, batch)`` before handing out the batches of ``at``.

    ``stability.train_run`` consumes one batch per step (0-based here), so the check sees the model as it is
    before that step's update.
    """

    def __init__(self, loader: Any, at: Sequence[int], check: Callable[[int, Any], None]) -> None:
        self.loader, self.at, self.check, self.step = loader, set(at), check, 0

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            if self.step in self.at:
                self.check(self.step, batch)
            self.step += 1
            yield batch


@contextlib.contextmanager
def reference_scan(model: nn.Module) -> Iterator[None]:
    """Run the selective scans of ``model`` on the plain reference backend inside the block.

    The fast scan's custom op has no forward-mode rule: ``torch.func.jvp`` through it returns zeros, and the
    trajectory's Lanczos estimate of a Mamba mixer's Jacobian comes out infinite.  The reference scan is plain
    torch, so its Jacobian-vector products are exact.
    """
    mixers = [m for m in model.modules() if hasattr(m, "backend") and hasattr(m, "A_log")]
    saved = [m.backend for m in mixers]
    for m in mixers:
        m.backend = "reference"
    try:
        yield
    finally:
        for m, b in zip(mixers, saved):
            m.backend = b


# -- ETTh1 ----------------------------------------------------------------------------------------------------
def run_etth1(variant: str, precision: str, lr: float, seed: int, data: Any, a: argparse.Namespace,
              label: str = "") -> Dict[str, Any]:
    """One ETTh1 run through ``stability.train_run``: init and final test MSE, blow-up, headroom checks."""
    train, _, test = make_loaders(data, a.batch_size, seed=seed)
    model = build_model(variant, a.depth, a.pred_len, seed, **width_overrides("mamba", a.width))
    torch.manual_seed(seed)
    init = evaluate(model, test, precision)
    checks: List[Tuple[int, Optional[float]]] = []
    measured: List[Tuple[int, Optional[float]]] = []

    def check(step: int, batch: Any) -> None:
        x, y = (t[:a.headroom_samples] for t in batch)
        with reference_scan(model):
            est, meas = headroom(model, x, lambda out: F.mse_loss(out.float(), y), precision)
        checks.append((step, est))
        measured.append((step, meas))

    at = a.headroom_steps if precision in a.headroom_precisions else []
    res = train_run(model, CheckedBatches(train, at, check), test, precision=precision,
                    steps=a.steps, lr=lr, log_every=a.steps, label=label)
    nonfinite = res.steps_done - 1 if res.reason.startswith("non-finite loss") else None  # 0-based step
    return {"init_loss": init, "final_loss": res.test_mse, "blew_up": res.blew_up, "reason": res.reason,
            "nonfinite_step": nonfinite, "steps_done": res.steps_done, "seconds": res.seconds, "headroom": checks,
            "headroom_measured": measured}


# -- bytes ----------------------------------------------------------------------------------------------------
class ByteLM(ByteGPT):
    """``monitor_gpt.ByteGPT`` (same embedding, final LayerNorm, tied head, init, forward) with this script's stacks."""

    def __init__(self, variant: str, layers: int, width: int, heads: int, block: int) -> None:
        blocks = [b for _ in range(layers) for b in byte_blocks(variant, width, heads)]
        super().__init__("noln", 1, width, heads, block)  # its one-layer stack is replaced below
        from certblocks.stack import build_stack

        self.stack = build_stack(blocks, "fp16", seq_len=block, certify=False)
        with torch.no_grad():
            for name, p in self.stack.named_parameters():
                if p.ndim == 2:
                    p.normal_(0.0, 0.02)
                elif name.endswith("bias"):
                    p.zero_()
        self.stack.r0 = self.radius()

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, 256), targets.reshape(-1))


def byte_blocks(variant: str, width: int, heads: int) -> List[nn.Module]:
    """The two updates (attention, MLP) of one layer of ``variant``."""
    from certblocks.zoo._layers import NormedUpdate

    from certblocks.blocks import MLP, Attention, GatedMLP, QKNormAttention

    if variant == "preln":
        return [NormedUpdate(Attention(width, heads), width, "layer"),
                NormedUpdate(MLP(width, 4 * width), width, "layer")]
    mlp = {"swiglu_noln": lambda: GatedMLP(width, 4 * width, gate="silu"),
           "sigmoid_noln": lambda: GatedMLP(width, 4 * width, gate="sigmoid"),
           "qknorm_noln": lambda: MLP(width, 4 * width)}
    if variant not in mlp:
        raise ValueError(f"variant must be one of {sorted(VARIANTS['bytes'])}, got {variant!r}")
    return [QKNormAttention(width, heads), mlp[variant]()]


def byte_eval(model: ByteLM, windows: torch.Tensor, precision: str) -> float:
    """Mean held-out loss in bits per byte over ``windows`` (``(n, block + 1)`` bytes)."""
    model.eval()
    total = 0.0
    with torch.no_grad():
        for chunk in windows.split(32):
            with _autocast(precision, "cpu"):
                total += float(model(chunk[:, :-1], chunk[:, 1:])) * len(chunk)
    model.train()
    return total / len(windows) / math.log(2)


def run_bytes(variant: str, precision: str, lr: float, seed: int, data: Tuple[torch.Tensor, torch.Tensor],
              a: argparse.Namespace, label: str = "") -> Dict[str, Any]:
    """One byte-LM run: AdamW, GradScaler in fp16, clipping; init and final held-out bits/byte, headroom checks."""
    train_bytes, windows = data
    torch.manual_seed(seed)
    model = ByteLM(variant, a.layers, a.byte_width, a.heads, a.block)
    init = byte_eval(model, windows, precision)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    g = torch.Generator().manual_seed(seed)
    checks: List[Tuple[int, Optional[float]]] = []
    measured: List[Tuple[int, Optional[float]]] = []
    at = set(a.headroom_steps) if precision in a.headroom_precisions else set()
    t0 = time.time()
    nonfinite = None
    loss_v = math.nan
    for step in range(a.byte_steps):
        x, y = byte_batch(train_bytes, a, g)
        if step in at:
            xs, ys = x[:a.headroom_samples], y[:a.headroom_samples]
            with torch.no_grad():
                h0 = model.embed(xs)
            est, meas = headroom(model.stack, h0, lambda out, y=ys: model.head_loss(out, y), precision)
            checks.append((step, est))
            measured.append((step, meas))
        with _autocast(precision, "cpu"):
            loss = model(x, y)
        loss_v = float(loss.detach())
        if not math.isfinite(loss_v):
            nonfinite = step
            break
        byte_step(model, opt, scaler, loss, a.clip)
    final = None if nonfinite is not None else byte_eval(model, windows, precision)
    if nonfinite is not None:
        reason = f"non-finite loss at step {nonfinite + 1}"
    elif not math.isfinite(final):
        reason = "non-finite held-out loss"
    elif final > BLOWUP_BITS:
        reason = f"held-out {final:.3g} bits/byte > {BLOWUP_BITS:g}"
    else:
        reason = ""
    _log(f"{label} final train loss {loss_v:.3f} nats")
    return {"init_loss": init, "final_loss": final if final is None or math.isfinite(final) else None,
            "blew_up": bool(reason), "reason": reason, "nonfinite_step": nonfinite,
            "steps_done": a.byte_steps if nonfinite is None else nonfinite + 1, "seconds": time.time() - t0,
            "headroom": checks, "headroom_measured": measured}


def byte_batch(train_bytes: torch.Tensor, a: argparse.Namespace, g: torch.Generator
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of ``a.byte_batch`` random windows of ``a.block`` bytes (drawn with ``g``)."""
    ix = torch.randint(0, train_bytes.numel() - a.block - 1, (a.byte_batch,), generator=g)
    w = torch.stack([train_bytes[i:i + a.block + 1] for i in ix])
    return w[:, :-1], w[:, 1:]


def byte_step(model: nn.Module, opt: torch.optim.Optimizer, scaler: Any, loss: torch.Tensor, clip: float) -> None:
    """One optimizer step from ``loss``: scaled backward, unscale, clip the gradient norm, step, scaler update."""
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(opt)
    scaler.update()


def byte_data(limit: int, block: int, n_eval: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(train bytes, (n_eval, block + 1) held-out windows)``: the last 10% of the corpus is held out."""
    data = stdlib_bytes(limit)
    cut = int(0.9 * data.numel())
    held = data[cut:]
    if held.numel() < block + 2 or cut < block + 2:
        raise ValueError(f"a corpus of {data.numel()} bytes is too small for windows of {block}")
    starts = torch.randint(0, held.numel() - block - 1, (n_eval,), generator=torch.Generator().manual_seed(1234))
    return data[:cut], torch.stack([held[i:i + block + 1] for i in starts])


# -- the figures ----------------------------------------------------------------------------------------------
def metric(r: Dict[str, Any]) -> float:
    """Wortsman et al.'s clipped final loss of a run: ``min(final, init)``, the init loss when the run blew up."""
    if r["blew_up"] or r["final_loss"] is None or not math.isfinite(r["final_loss"]):
        return float(r["init_loss"])
    return min(float(r["final_loss"]), float(r["init_loss"]))


def lr_sensitivity(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """LR sensitivity of one (dataset, variant, precision)'s runs (module docstring: the formula).

    Returns ``{"sensitivity", "per_seed" (seed -> value), "curve" (lr -> L(lr)), "best"}``.
    """
    by_lr: Dict[float, List[float]] = {}
    by_seed: Dict[int, Dict[float, float]] = {}
    for r in runs:
        by_lr.setdefault(r["lr"], []).append(metric(r))
        by_seed.setdefault(r["seed"], {})[r["lr"]] = metric(r)
    curve = {lr: statistics.fmean(v) for lr, v in sorted(by_lr.items())}
    per_seed = {s: statistics.fmean(d.values()) - min(d.values()) for s, d in sorted(by_seed.items())}
    return {"sensitivity": statistics.fmean(curve.values()) - min(curve.values()), "per_seed": per_seed,
            "curve": curve, "best": min(curve.values())}


def critical_lr(runs: List[Dict[str, Any]]) -> Tuple[Optional[float], Optional[float]]:
    """``(smallest lr where a majority of the seeds blew up, smallest lr where any did)``; ``None``: none."""
    maj = first = None
    for lr in sorted({r["lr"] for r in runs}):
        rs = [r for r in runs if r["lr"] == lr]
        blown = sum(r["blew_up"] for r in rs)
        if blown and first is None:
            first = lr
        if 2 * blown > len(rs) and maj is None:
            maj = lr
    return maj, first


def headroom_prediction(r: Dict[str, Any], key: str = "headroom") -> Dict[str, Any]:
    """Did a headroom check below ``ALERT_NATS`` come before the run's first non-finite loss?  ``key``:
    ``"headroom"`` (the (T) estimate) or ``"headroom_measured"``."""
    end = r["nonfinite_step"] if r["nonfinite_step"] is not None else math.inf
    before = [(s, h) for s, h in r.get(key, []) if s < end and h is not None]
    alerts = [s for s, h in before if h < ALERT_NATS]
    return {"checks": len(before), "min_headroom": min((h for _, h in before), default=None),
            "alert_step": alerts[0] if alerts else None,
            "steps_ahead": (r["nonfinite_step"] - alerts[0]) if alerts and r["nonfinite_step"] is not None else None}


def _measured_predictions(rs: List[Dict[str, Any]]) -> Dict[str, int]:
    """Blow-ups predicted and false alarms of the measured headroom (runs without measured checks: none)."""
    blown = [headroom_prediction(r, "headroom_measured") for r in rs if r["blew_up"]]
    survivors = [headroom_prediction(r, "headroom_measured") for r in rs if not r["blew_up"]]
    return {"blowups_checked_measured": sum(1 for p in blown if p["checks"]),
            "blowups_predicted_measured": sum(p["alert_step"] is not None for p in blown if p["checks"]),
            "false_alarms_measured": sum(p["alert_step"] is not None for p in survivors if p["checks"]),
            "survivors_checked_measured": sum(1 for p in survivors if p["checks"])}


def welch(a: Sequence[float], b: Sequence[float]) -> Optional[Dict[str, float]]:
    """Welch's t-test (``scipy.stats.ttest_ind``, ``equal_var=False``); ``None`` with fewer than 2 values a side."""
    if len(a) < 2 or len(b) < 2:
        return None
    from scipy.stats import ttest_ind

    t, p = ttest_ind(list(a), list(b), equal_var=False)
    return {"t": float(t), "p": float(p), "mean_a": statistics.fmean(a), "mean_b": statistics.fmean(b),
            "n_a": len(a), "n_b": len(b)}


def summarize(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Rows per (dataset, variant, precision), Welch tests against the q > 1 peers, and the plain verdicts."""
    groups: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["dataset"], r["variant"], r["precision"]), []).append(r)
    rows = []
    for (ds, v, prec), rs in groups.items():
        maj, first = critical_lr(rs)
        sens = lr_sensitivity(rs)
        blown = [r for r in rs if r["blew_up"]]
        preds = [headroom_prediction(r) for r in blown]
        checked = [p for p in preds if p["checks"]]
        survivors = [headroom_prediction(r) for r in rs if not r["blew_up"]]
        rows.append({"dataset": ds, "variant": v, "q": VARIANTS[ds][v], "precision": prec, "runs": len(rs),
                     "blowups": len(blown), "critical_lr": maj, "first_blowup_lr": first,
                     "sensitivity": sens["sensitivity"], "sensitivity_per_seed": sens["per_seed"],
                     "best_loss": sens["best"], "curve": sens["curve"],
                     "blowups_nonfinite": sum(r["nonfinite_step"] is not None for r in blown),
                     "blowups_checked": len(checked),
                     "blowups_predicted": sum(p["alert_step"] is not None for p in checked),
                     "false_alarms": sum(p["alert_step"] is not None for p in survivors if p["checks"]),
                     **_measured_predictions(rs),
                     "survivors_checked": sum(1 for p in survivors if p["checks"])})
    order = [(d, v) for d in VARIANTS for v in VARIANTS[d]]
    rows.sort(key=lambda x: (order.index((x["dataset"], x["variant"])), PRECISIONS.index(x["precision"])))
    tests, verdicts = [], []
    for ds, pairs in PEERS.items():
        for lo, hi in pairs:
            for prec in PRECISIONS:
                ra, rb = groups.get((ds, lo, prec)), groups.get((ds, hi, prec))
                if not ra or not rb:
                    continue
                for lr in sorted({r["lr"] for r in ra} & {r["lr"] for r in rb}):
                    a = [r["final_loss"] for r in ra if r["lr"] == lr and not r["blew_up"]]
                    b = [r["final_loss"] for r in rb if r["lr"] == lr and not r["blew_up"]]
                    tests.append({"dataset": ds, "variant": lo, "peer": hi, "precision": prec, "lr": lr,
                                  "n": [len(a), len(b)], "welch": welch(a, b)})
                sa, sb = lr_sensitivity(ra)["per_seed"], lr_sensitivity(rb)["per_seed"]
                tests.append({"dataset": ds, "variant": lo, "peer": hi, "precision": prec, "lr": "sensitivity",
                              "n": [len(sa), len(sb)], "welch": welch(list(sa.values()), list(sb.values()))})
                ca, cb = critical_lr(ra)[0], critical_lr(rb)[0]
                inf = math.inf
                ka, kb = (inf if ca is None else ca), (inf if cb is None else cb)
                word = "raises" if ka > kb else ("does not change" if ka == kb else "lowers")
                verdicts.append(f"{ds} {prec}: {lo} (q {VARIANTS[ds][lo]}) {word} the critical learning rate against "
                                f"{hi} (q {VARIANTS[ds][hi]}): {_lr(ca)} vs {_lr(cb)}")
    return {"rows": rows, "tests": tests, "verdicts": verdicts}


def _lr(x: Optional[float]) -> str:
    return "none on the grid" if x is None else f"{x:.3g}"


def table(s: Dict[str, Any]) -> str:
    out = ["| dataset | variant | q | precision | blow-ups | critical lr (majority) | first blow-up lr | "
           "LR sensitivity (seeds) | best loss | headroom < 1 nat before blow-up | false alarms |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        ps = list(r["sensitivity_per_seed"].values())
        sd = f" ± {statistics.stdev(ps):.3g}" if len(ps) > 1 else ""
        out.append(f"| {r['dataset']} | {r['variant']} | {r['q']} | {r['precision']} | {r['blowups']}/{r['runs']} | "
                   f"{_lr(r['critical_lr'])} | {_lr(r['first_blowup_lr'])} | {r['sensitivity']:.4g} "
                   f"({statistics.fmean(ps):.3g}{sd}) | {r['best_loss']:.4g} | "
                   f"{r['blowups_predicted']}/{r['blowups_checked']} | {r['false_alarms']}/{r['survivors_checked']} |")
    out += ["", "| dataset | variant vs peer | precision | lr | n (survivors) | mean | peer mean | t | p |",
            "|---|---|---|---|---|---|---|---|---|"]
    for t in s["tests"]:
        w = t["welch"]
        lr = t["lr"] if isinstance(t["lr"], str) else f"{t['lr']:.3g}"
        cells = ("-",) * 4 if w is None else (f"{w['mean_a']:.4g}", f"{w['mean_b']:.4g}", f"{w['t']:.3g}",
                                              f"{w['p']:.3g}")
        out.append(f"| {t['dataset']} | {t['variant']} vs {t['peer']} | {t['precision']} | {lr} | "
                   f"{t['n'][0]}, {t['n'][1]} | " + " | ".join(cells) + " |")
    return "\n".join(out + [""] + s["verdicts"])


def plot(runs: List[Dict[str, Any]], path: str) -> Optional[str]:
    """Final loss (``min(final, init)``) against learning rate; one panel per dataset x precision; x = blow-up."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        _log("matplotlib not installed: no plot")
        return None
    plt.switch_backend("Agg")
    panels = sorted({(r["dataset"], r["precision"]) for r in runs},
                    key=lambda k: (list(VARIANTS).index(k[0]), PRECISIONS.index(k[1])))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (ds, prec) in zip(axes[0], panels):
        for v in VARIANTS[ds]:
            rs = [r for r in runs if (r["dataset"], r["variant"], r["precision"]) == (ds, v, prec)]
            if not rs:
                continue
            curve = lr_sensitivity(rs)["curve"]
            line, = ax.plot(list(curve), list(curve.values()), "o-", ms=3, label=f"{v} (q {VARIANTS[ds][v]})")
            bl = [r for r in rs if r["blew_up"]]
            ax.scatter([r["lr"] for r in bl], [metric(r) for r in bl], marker="x", s=40, color=line.get_color())
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("test MSE" if ds == "etth1" else "held-out bits/byte")
        ax.set_title(f"{ds}, {prec} (x: blow-up, at its init loss)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- main -----------------------------------------------------------------------------------------------------
#: integer options: (name, default (None: set by the mode), what)
INT_OPTIONS = (("steps", None, "ETTh1 Adam steps (64; quick 6)"), ("depth", 3, "ETTh1 layers"),
               ("pred-len", 96, "ETTh1 horizon"), ("width", 64, "ETTh1 d_model"),
               ("batch-size", 16, "ETTh1 windows per batch (x 7 channels)"),
               ("test-stride", 8, "ETTh1: evaluate every n-th test window"),
               ("byte-steps", None, "byte-LM AdamW steps (150; quick 6)"), ("layers", 4, "byte-LM layers"),
               ("byte-width", 128, "byte-LM width"), ("heads", 4, "byte-LM heads"),
               ("block", 64, "byte-LM window (tokens)"), ("byte-batch", 8, "byte-LM windows per batch"),
               ("eval-windows", 64, "held-out byte windows"))


def load_data(datasets: Sequence[str], a: argparse.Namespace) -> Dict[str, Any]:
    """The data of each of ``datasets`` (``"etth1"``: ``a.data``'s windows; ``"bytes"``: the corpus and held-out
    windows), with ``a``'s settings."""
    data: Dict[str, Any] = {}
    if "etth1" in datasets:
        data["etth1"] = load_ett(a.data, pred_len=a.pred_len, test_stride=a.test_stride)
    if "bytes" in datasets:
        data["bytes"] = byte_data(a.corpus_bytes, a.block, a.eval_windows)
    return data


def _key(r: Dict[str, Any]) -> Tuple:
    return (r["dataset"], r["variant"], r["precision"], r["multiplier"], r["seed"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="multipliers 1 and 100, seed 0, fp16, 6 steps (a smoke test)")
    p.add_argument("--datasets", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--variants", nargs="*", default=None, help="default: every variant of the datasets")
    p.add_argument("--multipliers", type=float, nargs="*", default=None,
                   help=f"learning rates as multiples of the default (default {list(MULTIPLIERS)})")
    p.add_argument("--lr", type=float, nargs=2, metavar=("ETTH1", "BYTES"), default=None,
                   help=f"default learning rates (default {DEFAULT_LR['etth1']:g} {DEFAULT_LR['bytes']:g})")
    p.add_argument("--seeds", type=int, nargs="*", default=None)
    p.add_argument("--precisions", nargs="*", default=None, choices=PRECISIONS)
    p.add_argument("--data", default=default_data_path())
    for name, default, what in INT_OPTIONS:
        p.add_argument(f"--{name}", type=int, default=default,
                       help=what if default is None else f"{what} (default {default})")
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--headroom-steps", type=int, nargs="*", default=None,
                   help="steps (0-based) before which the on-data headroom is computed "
                        f"(default {list(HEADROOM_STEPS)}; none: off)")
    p.add_argument("--headroom-precisions", nargs="*", default=["fp16"], choices=PRECISIONS,
                   help="precisions whose runs get headroom checks (default fp16)")
    p.add_argument("--headroom-samples", type=int, default=2, help="samples of the batch the check uses (default 2)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--out", default=OUT_DIR)
    a = p.parse_args(argv)
    q = a.quick
    if a.steps is None:
        a.steps = 6 if q else 64
    if a.byte_steps is None:
        a.byte_steps = 6 if q else 150
    if a.headroom_steps is None:
        a.headroom_steps = [0, 1, 4] if q else list(HEADROOM_STEPS)
    mults = a.multipliers or ([1.0, 100.0] if q else list(MULTIPLIERS))
    seeds = a.seeds if a.seeds is not None else ([0] if q else [0, 1, 2])
    precs = a.precisions or (["fp16"] if q else list(PRECISIONS))
    base = dict(zip(("etth1", "bytes"), a.lr)) if a.lr else dict(DEFAULT_LR)
    for name in [o[0] for o in INT_OPTIONS] + ["headroom-samples", "threads"]:
        if getattr(a, name.replace("-", "_")) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name.replace('-', '_'))}")
    if any(s < 0 for s in a.headroom_steps):
        p.error(f"--headroom-steps must be >= 0, got {a.headroom_steps}")
    if not mults or any(not (m > 0 and math.isfinite(m)) for m in mults) or not seeds:
        p.error("--multipliers must be finite numbers > 0 and --seeds non-empty")
    if any(not (x > 0 and math.isfinite(x)) for x in base.values()):
        p.error(f"--lr must be finite numbers > 0, got {a.lr}")
    plan = [(d, v) for d in a.datasets for v in VARIANTS[d] if a.variants is None or v in a.variants]
    for v in a.variants or []:
        if not any(v in VARIANTS[d] for d in a.datasets):
            p.error(f"unknown variant {v!r} for datasets {a.datasets}: choose from "
                    f"{[x for d in a.datasets for x in VARIANTS[d]]}")
    torch.set_num_threads(a.threads)
    os.makedirs(a.out, exist_ok=True)
    tag = "quick" if q else "full"
    log_path = os.path.join(a.out, f"lr_sensitivity_{tag}.jsonl")
    settings = {k: getattr(a, k) for k in ("steps", "depth", "pred_len", "width", "batch_size", "test_stride",
                                          "byte_steps", "layers", "byte_width", "heads", "block", "byte_batch",
                                          "eval_windows", "corpus_bytes", "clip", "headroom_steps",
                                          "headroom_precisions", "headroom_samples")}
    settings.update(data=os.path.abspath(a.data), lr=base)
    done: Dict[Tuple, Dict[str, Any]] = {}
    if a.resume:
        done = {_key(r): r for r in _read_log(log_path, settings)}
    elif os.path.exists(log_path):
        os.remove(log_path)
    data = load_data([d for d, _ in plan], a)
    n_runs = len(plan) * len(precs) * len(mults) * len(seeds)
    _log(f"lr_sensitivity ({tag}): {n_runs} runs = {plan} x {precs} x lr multipliers {mults} of {base} x seeds "
         f"{seeds}; headroom before steps {a.headroom_steps} in {a.headroom_precisions}; {a.threads} thread(s)"
         + (f"; {len(done)} resumed from {log_path}" if done else ""))
    runs: List[Dict[str, Any]] = []
    t_all = time.time()
    grid = [(ds, v, prec, m, seed) for ds, v in plan for prec in precs for m in mults for seed in seeds]
    for i, key in enumerate(grid, 1):
        if key in done:
            runs.append(done[key])
            continue
        ds, v, prec, m, seed = key
        lr = base[ds] * m
        label = f"[{i}/{n_runs}] {ds} {v} {prec} lr={lr:.3g} seed={seed}"
        res = (run_etth1 if ds == "etth1" else run_bytes)(v, prec, lr, seed, data[ds], a, label)
        run = {"dataset": ds, "variant": v, "q": VARIANTS[ds][v], "precision": prec, "multiplier": m, "lr": lr,
               "seed": seed, "settings": settings, **res}
        runs.append(run)
        with open(log_path, "a") as f:
            f.write(json.dumps(run, default=str) + "\n")
        _log(f"{label}: {'BLOW-UP (' + res['reason'] + ')' if res['blew_up'] else 'ok'}, loss "
             f"{res['init_loss']:.4g} -> {res['final_loss']}, min headroom "
             f"{headroom_prediction(run)['min_headroom']}, {res['seconds']:.1f} s (total {time.time() - t_all:.0f} s)")
    s = summarize(runs)
    cmd = "python benchmarks/experiments/lr_sensitivity.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"command": cmd,
            "mode": tag, **settings, "multipliers": mults, "seeds": seeds, "precisions": precs,
            "blowup_mse": BLOWUP_MSE, "blowup_bits": BLOWUP_BITS, "alert_nats": ALERT_NATS,
            "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
                       f"{torch.get_num_threads()} threads",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": round(time.time() - t_all, 1)}
    path = os.path.join(a.out, f"lr_sensitivity_{tag}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, **s}, f, indent=1, default=str)
    png = plot(runs, os.path.join(a.out, f"lr_sensitivity_{tag}.png"))
    print(table(s))
    print(f"\n{len(runs)} runs in {meta['seconds']:.0f} s; JSON {path}; log {log_path}"
          + (f"; plot {png}" if png else ""))
    return 0


def _read_log(path: str, settings: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Runs of the JSONL log ``path`` made with the same ``settings`` (``--resume``)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rs = [json.loads(line) for line in f if line.strip()]
    return [r for r in rs if r.get("settings") == settings]


if __name__ == "__main__":
    sys.exit(main())
