"""The on-data certificate of one batch: per update figures, the trajectory bound and the headroom.

Figures (``M`` the dtype's largest finite value, logs natural: headroom in nats):

* forward: the largest per-token norm of every state ``X_0 .. X_D`` and the largest ``|entry|`` of every
  intermediate (:attr:`UpdateTrajectory.peak`); ``forward_headroom = log M - log(max of them)``;
* backward, the member (T) of the paper's chain (docs/theory.md section 6), per sample ``s`` and maximized over the
  batch factor by factor: ``log ||p_0|| <= log ||p_D|| + sum_k log(||P_k|| + dt ||Dv_k(X_k)||)`` (a map: ``log
  ||Dm_k(X_k)||``); ``backward_headroom = log M - log_gradient_bound``;
* ``headroom = min(forward_headroom, backward_headroom)``: negative when the batch overflows the dtype;
* measured, where the costate ``p_D`` is exact (the loss's gradient, or the training backward's): the costates
  ``p_k`` themselves, propagated back through the segments by vector-Jacobian products (``p_k = p_{k+1} + dt
  Dv_k(X_k)^T p_{k+1}``): ``log_gradient_measured = log max_k ||p_k||`` and ``headroom_measured``.  Not a bound
  of other batches, but the gradient this batch has; the (T) bound is above it (the product of the factors' norms
  ignores that their top singular directions do not line up) and can be far above (15 nats on a 12-update
  GPT in ``benchmarks/RESULTS.md``).

Two versions of the backward side: :attr:`TrajectoryReport.log_gradient_bound` uses the Lanczos estimates of
``||Dv_k||`` (from below: an **estimate** of the bound, reported with its convergence);
:attr:`TrajectoryReport.log_gradient_bound_certified` uses certified upper bounds of every factor (``None``
where one has none) and is a bound of ``||p_0||`` for every sample of the batch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .._format import fmt_num, render_table
from .._validation import check_choice
from ..budget import float_max

__all__ = ["UpdateTrajectory", "HeadTrajectory", "TrajectoryReport", "QUANTITIES", "BASES"]

#: The quantities an on-data alert can name.
QUANTITIES = ("state norm", "state", "logits", "intermediate", "Jacobian", "head", "gradient growth")

#: The bases an on-data headroom can be read on (:meth:`TrajectoryReport.headroom_on`).
BASES = ("measured", "estimate", "certified")


def _log(x: Optional[float]) -> float:
    if x is None or math.isnan(x) or x == math.inf:
        return math.inf
    return math.log(x) if x > 0 else -math.inf


@dataclass
class UpdateTrajectory:
    """One segment of the trajectory: a residual update ``X + dt v(X)`` or a map ``m(X)``, on the batch.

    Attributes:
        name: the update's name (module path, as :func:`certblocks.certify` or the model names it).
        kind: ``"update"``, ``"block"`` (a residual block with a projection shortcut, as one map) or ``"map"``.
        state_norm: largest per-token norm of the input state ``X_k`` on the batch.
        out_norm: largest per-token norm of the state after the segment.
        jacobian_norm: the Lanczos estimate (from below) of ``max_s ||Dv_k(X_k^s)||_2`` (whole-sample spectral
            norm; for a map, of ``Dm_k``); ``inf`` when the Jacobian overflows; ``None`` when not estimated
            (``trajectory(..., jacobians=False)``).
        jacobian_bound: a certified upper bound of the same norm, or ``None``.
        bound_source: where :attr:`jacobian_bound` comes from: ``"dense"`` (the whole float64 Jacobian of each
            sample, rigorous spectral norm bound) or ``"certificate"`` (``sqrt(n) L_k(R)``: the block's Jacobian
            bound in the per-token norm at the batch's radius ``R``, ``n`` tokens), or ``""``.
        steps: Lanczos steps run (0: not estimated); ``converged`` and ``change`` (relative change over the last
            step) tell how far.
        jvp: the Jacobian-vector product used (``forward``, ``double`` or ``central``; ``""``: none).
        peak: largest ``|entry|`` of every intermediate the segment computes on the batch, its output included.
        dt: the residual step (``P = I``); 0 for a map.
        log_factor: ``log(1 + dt jacobian_norm)`` (a map or block: ``log jacobian_norm``), nats of backward
            headroom used (``None`` when not estimated).
        log_factor_certified: the same with :attr:`jacobian_bound`, or ``None``.
        kappa: ``max_h ||W_Q^{hT} W_K^h||`` of an attention update (estimate from below), else ``None``.
        max_logit: largest ``|logit|`` of an attention update on the batch, else ``None``.
        costate_norm: the measured costate ``p_k`` at the segment's input, largest per-sample norm (the gradient
            this batch's backward has there, by vector-Jacobian products from an exact ``p_D``), else ``None``.
        peaks: :attr:`peak` per dtype of the intermediates (``{"fp16": ..., "fp32": ...}``).
        state_max, state_dtype: largest ``|entry|`` of the input state ``X_k`` and its dtype.
    """

    name: str
    kind: str
    state_norm: float
    out_norm: float
    jacobian_norm: Optional[float]
    jacobian_bound: Optional[float]
    bound_source: str
    steps: int
    converged: bool
    change: float
    jvp: str
    peak: float
    dt: float
    kappa: Optional[float] = None
    max_logit: Optional[float] = None
    costate_norm: Optional[float] = None
    peaks: Dict[str, float] = field(default_factory=dict)
    state_max: float = 0.0
    state_dtype: str = ""

    @property
    def log_factor(self) -> Optional[float]:
        return None if self.jacobian_norm is None else _factor(self.kind, self.dt, self.jacobian_norm)

    @property
    def log_factor_certified(self) -> Optional[float]:
        return None if self.jacobian_bound is None else _factor(self.kind, self.dt, self.jacobian_bound)

    @property
    def forward_max(self) -> float:
        """The largest forward quantity of the segment: its output state's norm or its peak (NaN counts as inf)."""
        vals = [self.out_norm, self.peak]
        return math.inf if any(math.isnan(v) for v in vals) else max(vals)

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d.update(log_factor=self.log_factor, log_factor_certified=self.log_factor_certified)
        return d


def _opt(x: Optional[float]) -> str:
    return "-" if x is None else fmt_num(x)


def _nan_up(x: float) -> float:
    return math.inf if math.isnan(x) else x


def _factor(kind: str, dt: float, norm: float) -> float:
    if math.isnan(norm):
        return math.inf
    if kind != "update":  # a map, or a block certified as one map (its shortcut inside): no "1 +"
        return _log(norm)
    return math.log1p(dt * norm) if norm != math.inf else math.inf


@dataclass
class HeadTrajectory:
    """The costate entering the last state, ``||p_D||`` (largest over the batch's samples).

    Attributes:
        source: ``"loss"`` (the loss's gradient at ``X_D`` by autograd: exact on the batch), ``"jacobian"``
            (``||DG(X_D)||`` by Lanczos times :attr:`loss_gradient`) or ``"lip_g"`` (the certificate's
            ``Lip(G)``: the head could not be evaluated, e.g. a :class:`~certblocks.CertifiedStack` whose output
            is its last state).
        norm: ``||p_D||`` (``source="loss"``) or the bound used for it.
        norm_certified: a certified bound of ``||p_D||``, or ``None``.
        state_norm: largest per-token norm of ``X_D``.
        peak: largest ``|entry|`` of the head's intermediates (0 when not evaluated).
        loss_gradient: the bound on the loss gradient in the head's output used with ``"jacobian"``.
        detail: how :attr:`norm` was obtained, in words.
        peaks, state_max, state_dtype: as for :class:`UpdateTrajectory` (the head's intermediates, ``X_D``).
    """

    source: str
    norm: float
    norm_certified: Optional[float]
    state_norm: float
    peak: float
    loss_gradient: float = 1.0
    detail: str = ""
    peaks: Dict[str, float] = field(default_factory=dict)
    state_max: float = 0.0
    state_dtype: str = ""

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass
class TrajectoryReport:
    """The on-data certificate of a batch (module docstring): :func:`certblocks.trajectory` returns it.

    Attributes:
        model: the model's class name.
        dtype: the dtype whose largest finite value ``M`` the headroom refers to.
        updates: one :class:`UpdateTrajectory` per segment, in depth order.
        head: the costate at the last state.
        batch_size, tokens: samples in the batch, tokens per sample (of the state).
        notes: what the figures assumed.
        seconds: wall time of the computation.
    """

    model: str
    dtype: str
    log_max: float
    updates: List[UpdateTrajectory]
    head: HeadTrajectory
    batch_size: int
    tokens: int
    notes: List[str] = field(default_factory=list)
    seconds: float = 0.0
    input_norm: float = 0.0
    stem_peak: float = 0.0
    stem_peaks: Dict[str, float] = field(default_factory=dict)

    # -- the whole ------------------------------------------------------------------------------------------
    @property
    def estimated(self) -> bool:
        """Whether every ``||Dv_k||`` was estimated (``trajectory(..., jacobians=True)``, the default)."""
        return all(u.jacobian_norm is not None for u in self.updates)

    @property
    def log_gradient_bound(self) -> Optional[float]:
        """``log ||p_D|| + sum_k log_factor``: the (T) bound with the Lanczos estimates (an estimate); ``inf`` when a
        factor is infinite and ``p_D`` is 0 (``0 * inf``: a costate that underflowed is not taken as a zero);
        ``None`` when not :attr:`estimated`."""
        if not self.estimated:
            return None
        return _nan_up(_log(self.head.norm) + sum(u.log_factor for u in self.updates))  # type: ignore[misc]

    @property
    def log_gradient_bound_certified(self) -> Optional[float]:
        """The (T) bound with certified factors, or ``None`` when a factor (or the head) has no certified bound."""
        if self.head.norm_certified is None or any(u.log_factor_certified is None for u in self.updates):
            return None
        return _nan_up(_log(self.head.norm_certified)
                       + sum(u.log_factor_certified for u in self.updates))  # type: ignore[misc]

    @property
    def forward_max(self) -> float:
        """Largest state norm or intermediate on the trajectory (the stem's output ``X_0`` and the head included)."""
        vals = [self.input_norm, self.stem_peak, self.head.state_norm, self.head.peak]
        vals += [u.forward_max for u in self.updates]
        return math.inf if any(math.isnan(v) for v in vals) else max(vals)

    @property
    def forward_headroom(self) -> float:
        return self.log_max - _log(self.forward_max)

    @property
    def backward_headroom(self) -> Optional[float]:
        b = self.log_gradient_bound
        return None if b is None else self.log_max - b

    @property
    def backward_headroom_certified(self) -> Optional[float]:
        b = self.log_gradient_bound_certified
        return None if b is None else self.log_max - b

    @property
    def headroom(self) -> Optional[float]:
        """``min(forward, backward)`` headroom in nats (estimate on the backward side); negative: overflow;
        ``None`` when not :attr:`estimated` (see :attr:`headroom_measured`)."""
        b = self.backward_headroom
        return None if b is None else min(self.forward_headroom, b)

    @property
    def headroom_certified(self) -> Optional[float]:
        """The headroom with the certified backward bound (``None`` without one)."""
        b = self.backward_headroom_certified
        return None if b is None else min(self.forward_headroom, b)

    @property
    def log_gradient_measured(self) -> Optional[float]:
        """``log max_k ||p_k||`` of the measured costates (``p_D`` included), or ``None`` when not measured."""
        norms = [u.costate_norm for u in self.updates]
        if self.head.source != "loss" or any(n is None for n in norms):
            return None
        return _nan_up(max(_log(n) for n in norms + [self.head.norm]))

    def measured_forward_items(self) -> List[Tuple[float, str, str, float]]:
        """``(headroom, where, quantity, largest |entry|)`` of every forward tensor group as the batch ran: each
        update's input state and its intermediates per dtype, the stem's and the head's.  Where some tensor ran
        in the report's dtype (autocast, or a model cast to it), each group counts against its own dtype's ``M``
        (a float32 residual stream under float16 autocast is float32); else (a float32 run asked about float16)
        every group counts against the report's ``M``."""
        groups: List[Tuple[float, str, str, str]] = []  # (value, dtype, where, quantity)
        for u in self.updates:
            groups.append((u.state_max, u.state_dtype, u.name, "state"))
            groups += [(v, dt, u.name, "logits" if u.max_logit is not None and u.max_logit >= 0.5 * v
                        else "intermediate") for dt, v in u.peaks.items()]
        h = self.head
        groups.append((h.state_max, h.state_dtype, "head", "state"))
        groups += [(v, dt, "head", "logits") for dt, v in h.peaks.items()]
        groups += [(v, dt, "stem", "intermediate") for dt, v in self.stem_peaks.items()]
        as_run = any(dt == self.dtype for _, dt, _, _ in groups)
        out = []
        for v, dt, where, qty in groups:
            log_m = math.log(float_max(dt)) if as_run and dt else self.log_max
            out.append((log_m - _log(v), where, qty, v))
        return out

    @property
    def forward_headroom_measured(self) -> float:
        """The forward headroom as the batch ran (:meth:`measured_forward_items`): the largest ``|entry|`` of every
        state and intermediate against its dtype's ``M``.  At least :attr:`forward_headroom` when nothing ran in a
        wider dtype (entries instead of per-token norms)."""
        return min((h for h, _, _, _ in self.measured_forward_items()), default=math.inf)

    @property
    def backward_headroom_measured(self) -> Optional[float]:
        m = self.log_gradient_measured
        return None if m is None else self.log_max - m

    @property
    def headroom_measured(self) -> Optional[float]:
        """``min(measured forward, measured backward)`` headroom in nats (``None`` without measured costates)."""
        b = self.backward_headroom_measured
        return None if b is None else min(self.forward_headroom_measured, b)

    def sides_on(self, basis: str) -> Tuple[float, float, str]:
        """``(forward headroom, backward headroom, basis used)`` on ``basis``: ``"measured"`` (both sides as the
        batch ran), ``"estimate"`` or ``"certified"`` (the certified backward bound).  A basis the report has no
        figure for falls back to ``"estimate"``, and without estimates (``jacobians=False``) to ``"measured"``."""
        check_choice("basis", basis, BASES)
        for b in (basis, "estimate", "measured", "certified"):
            sides = self._sides(b)
            if sides is not None:
                return sides[0], sides[1], b
        raise ValueError("the report has no backward figure (neither estimates nor measured costates)")

    def _sides(self, basis: str) -> Optional[Tuple[float, float]]:
        if basis == "measured":
            m = self.backward_headroom_measured
            return None if m is None else (self.forward_headroom_measured, m)
        b = self.backward_headroom_certified if basis == "certified" else self.backward_headroom
        return None if b is None else (self.forward_headroom, b)

    def headroom_on(self, basis: str) -> Tuple[float, str]:
        """``(headroom, basis used)`` on ``basis`` (:meth:`sides_on`): the smaller side."""
        forward, backward, used = self.sides_on(basis)
        return min(forward, backward), used

    @property
    def ok(self) -> bool:
        """The batch stays below ``M`` on both sides (estimated headroom > 0; without estimates, the measured)."""
        return self.headroom_on("estimate")[0] > 0

    @property
    def converged(self) -> bool:
        """Every Lanczos estimate converged (``True`` when none was run)."""
        return all(u.converged for u in self.updates)

    def worst(self, basis: str = "estimate") -> Tuple[str, str, float]:
        """``(update, quantity, nats)``: what consumes the most headroom on the binding side (``nats``: the log of the
        forward quantity, or the backward factor).

        Forward side binding: the segment with the largest forward quantity (``"state norm"``, ``"logits"`` when
        its peak is an attention logit or the head's output, else ``"intermediate"``).  Backward side: the segment
        with the largest factor (``"Jacobian"``), or the head (``"head"``) when ``log ||p_D||`` is larger; on the
        ``"measured"`` basis the segment across which the measured costate grows most (``"gradient growth"``,
        ``log ||p_k|| - log ||p_{k+1}||``).
        """
        forward, backward, used = self.sides_on(basis)
        if used == "measured" and forward <= backward:
            _, name, qty, value = min(self.measured_forward_items(), key=lambda c: c[0])
            return name, qty, _log(value)
        if used == "measured":
            after = [u.costate_norm for u in self.updates[1:]] + [self.head.norm]
            growth = [(_log(u.costate_norm) - _log(n), u.name, "gradient growth")
                      for u, n in zip(self.updates, after)]
            growth.append((_log(self.head.norm), "head", "head"))
            val3, name, qty = max(growth, key=lambda c: -math.inf if math.isnan(c[0]) else c[0])
            return name, qty, val3
        if forward <= backward:
            cands = [(u.forward_max, u.name, self._fwd_quantity(u)) for u in self.updates]
            cands.append((max(self.head.state_norm, self.head.peak), "head",
                          "state norm" if self.head.state_norm >= self.head.peak else "logits"))
            cands.append((max(self.input_norm, self.stem_peak), "stem",
                          "state norm" if self.input_norm >= self.stem_peak else "intermediate"))
            val, name, qty = max(cands, key=lambda c: c[0])
            return name, qty, _log(val)
        certified = used == "certified"
        cands2 = [(u.log_factor_certified if certified else u.log_factor, u.name, "Jacobian")
                  for u in self.updates]  # every factor is there: sides_on fell back otherwise
        cands2.append((_log(self.head.norm_certified if certified else self.head.norm), "head", "head"))
        val2, name, qty = max(cands2, key=lambda c: c[0])  # type: ignore[arg-type, return-value]  # no None here
        return name, qty, val2  # type: ignore[return-value]

    @staticmethod
    def describe(quantity: str, nats: float) -> str:
        """``worst()``'s quantity and value in words: a forward quantity by its size, a factor in nats."""
        if quantity in ("Jacobian", "head", "gradient growth"):
            return f"{quantity}, {nats:.4g} nats"
        return f"{quantity} {fmt_num(math.exp(nats) if nats < 700 else math.inf)}"

    @staticmethod
    def _fwd_quantity(u: UpdateTrajectory) -> str:
        if u.out_norm >= u.peak:
            return "state norm"
        if u.max_logit is not None and u.max_logit >= 0.5 * u.peak:
            return "logits"
        return "intermediate"

    # -- rendering ------------------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        name, qty, nats = self.worst()
        return {"model": self.model, "dtype": self.dtype, "log_max": self.log_max, "batch_size": self.batch_size,
                "tokens": self.tokens, "input_norm": self.input_norm, "stem_peak": self.stem_peak,
                "updates": [u.to_dict() for u in self.updates],
                "head": self.head.to_dict(), "log_gradient_bound": self.log_gradient_bound,
                "log_gradient_bound_certified": self.log_gradient_bound_certified,
                "forward_max": self.forward_max, "forward_headroom": self.forward_headroom,
                "backward_headroom": self.backward_headroom, "headroom": self.headroom,
                "headroom_certified": self.headroom_certified, "log_gradient_measured": self.log_gradient_measured,
                "backward_headroom_measured": self.backward_headroom_measured,
                "forward_headroom_measured": self.forward_headroom_measured,
                "headroom_measured": self.headroom_measured, "ok": self.ok, "estimated": self.estimated,
                "converged": self.converged,
                "worst": {"update": name, "quantity": qty, "nats": nats}, "notes": list(self.notes),
                "seconds": self.seconds}

    def explain(self) -> str:
        """A table per segment, then the bound, the headroom and what consumes it."""
        lines = [f"on-data certificate of {self.model} on a batch of {self.batch_size} x {self.tokens} tokens, "
                 f"{self.dtype} (log M = {self.log_max:.4g} nats)"]
        head = ("update", "kind", "|X_k|", "peak", "|Dv| est", "steps", "|Dv| cert", "log factor", "|p_k|", "kappa",
                "logit")
        rows = []
        for u in self.updates:
            rows.append((u.name, u.kind, fmt_num(u.state_norm), fmt_num(u.peak), _opt(u.jacobian_norm),
                         f"{u.steps}{'' if u.converged else '*'}",
                         "-" if u.jacobian_bound is None else f"{fmt_num(u.jacobian_bound)} ({u.bound_source})",
                         _opt(u.log_factor), _opt(u.costate_norm),
                         "-" if u.kappa is None else fmt_num(u.kappa),
                         "-" if u.max_logit is None else fmt_num(u.max_logit)))
        lines.append(render_table(head, rows, align="ll" + "r" * (len(head) - 2), rule=False, indent="  "))
        if not self.converged:
            lines.append("  * not converged (relative change above the tolerance): the estimate may be low")
        h = self.head
        lines.append(f"head: ||p_D|| {'=' if h.source == 'loss' else '<='} {fmt_num(h.norm)} ({h.source}: {h.detail})"
                     + ("" if h.norm_certified is None or h.source == "loss"
                        else f", certified {fmt_num(h.norm_certified)}"))
        cert = self.log_gradient_bound_certified
        bound = self.log_gradient_bound
        lines.append(("log ||p_0|| <= not estimated (jacobians=False)" if bound is None else
                      f"log ||p_0|| <= {bound:.4g} (estimate: Lanczos factors, from below)")
                     + (f"; certified: {cert:.4g}" if cert is not None else "; certified: none (a factor has no "
                        "certified bound)"))
        measured = self.log_gradient_measured
        if measured is not None:
            above = "" if bound is None else f"; the bound is {bound - measured:.3g} nats above"
            lines.append(f"measured: log max_k ||p_k|| = {measured:.4g} (the costates of this batch, |p_k| "
                         f"above{above}); forward headroom as run {self.forward_headroom_measured:.4g} (entries "
                         "against their dtype's M)")
        lines.append(f"forward: largest state norm or intermediate {fmt_num(self.forward_max)}")
        name, qty, nats = self.worst()
        h_est, used = self.headroom_on("estimate")
        verdict = "ok" if self.ok else "OVERFLOWS" if h_est < 0 else "at the limit"
        hc = self.headroom_certified
        if self.headroom is None:
            text = (f"headroom (measured) {h_est:.4g} nats (forward {self.forward_headroom_measured:.4g}, backward "
                    f"{self.backward_headroom_measured:.4g}; not estimated)")
        else:
            text = (f"headroom {self.headroom:.4g} nats (forward {self.forward_headroom:.4g}, backward "
                    f"{self.backward_headroom:.4g}{'' if hc is None else f'; certified {hc:.4g}'}"
                    f"{'' if measured is None else f'; measured {self.headroom_measured:.4g}'})")
        lines.append(f"{text}: {verdict}; most consumed by {name!r} ({self.describe(qty, nats)})")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()
