"""The on-data part of :class:`~certblocks.CertificateMonitor`: the trajectory of the checked batch, its record
entries and its two alerts (headroom below a threshold; headroom trending to zero within a horizon)."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .._validation import check_choice, check_int
from ..budget import float_max
from ..testing.record import _peaks_of, _Recorder
from .api import _head, _per_sample_max, _update, eval_mode, evaluate, trajectory_of_call
from .report import BASES, TrajectoryReport, UpdateTrajectory
from .sources import Call, Head, Peaks, Source, Step, calls_steps, named_peaks, token_norm_max, tokens_of

__all__ = ["OnDataWatch", "StepRecorder", "StepFigures", "autocast_state", "restored_autocast", "batch_of"]

AutocastState = Optional[Tuple[str, torch.dtype]]


def autocast_state(device_type: str) -> AutocastState:
    """``(device type, dtype)`` of the autocast active now on ``device_type``, or ``None``."""
    try:
        if torch.is_autocast_enabled(device_type):
            return device_type, torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, AttributeError):  # a device type autocast does not know
        return None
    return None


@contextlib.contextmanager
def restored_autocast(state: AutocastState) -> Iterator[None]:
    """Autocast as captured (``None``: as it is now)."""
    if state is None:
        yield
        return
    with torch.autocast(state[0], dtype=state[1]):
        yield


def _num(x: Any) -> Any:
    return None if x is None else float(x)


class StepRecorder(_Recorder):
    """The intermediate recorder of :mod:`certblocks.testing.record` run inside the training forward of a checked
    step, on one update's call: the same tensors (every floating output of a torch function that autograd reaches
    ``X_k`` from), the same figure (largest ``|entry|``, masked-logit sentinels ``<= finfo.min / 4`` left out), read
    in the tensor's own dtype by one ``aminmax`` (exact: the largest magnitude is the larger of ``|min|`` and
    ``|max|``; a tensor holding a sentinel is masked first) instead of a float64 copy of every intermediate, and
    without the per-sample maxima the searches read.  On a GPU the sentinel test synchronizes once per recorded
    tensor (checked steps only)."""

    def __init__(self, x: Tensor) -> None:
        super().__init__(x, differentiable=False)

    def _add(self, t: Tensor) -> None:
        lo, hi = torch.aminmax(t)
        if bool(lo > torch.finfo(t.dtype).min / 4):  # no sentinel (NaN compares False: the masked path keeps it)
            top = torch.maximum(lo.abs(), hi.abs())
        else:
            top = t.masked_fill(t <= torch.finfo(t.dtype).min / 4, 0.0).abs().amax()
        self.values.append(top.to(torch.float64))
        self.dtypes.append(t.dtype)

    def peaks(self) -> Tuple[float, Peaks]:
        """``(largest |entry|, per dtype by name)`` of the recorded tensors (NaN counts as ``inf``)."""
        val, by_dtype = _peaks_of(self)
        return val, named_peaks(by_dtype)


class StepFigures:
    """What a checked training step measured of one update (:meth:`OnDataWatch.from_measured`): the largest
    intermediates (``peak``, ``peaks`` per dtype, :class:`StepRecorder`), the largest attention logit on the
    attention's own input, and the costate ``p_k = dL/dX_k`` the user's backward delivered (a tensor hook on
    ``X_k``)."""

    def __init__(self) -> None:
        self.peak: Optional[float] = None
        self.peaks: Peaks = {}
        self.max_logit: Optional[float] = None
        self.costate: Optional[Tensor] = None
        self.attention = False  # the update has an attention (its kappa is read)
        self.logit_input: Optional[Tensor] = None  # the attention's input in the training forward

    @property
    def complete(self) -> bool:
        return self.peak is not None and self.costate is not None


def _kappa_of(kappas: Dict[int, float], k: int) -> Callable[[], float]:
    """``Step.kappa`` of update ``k``: the monitor's figure (NaN where it has none)."""
    return lambda: kappas.get(k, math.nan)


def _not_evaluated(x: Tensor) -> Tensor:
    raise RuntimeError("a segment measured in the training step is not evaluated again")


class OnDataWatch:
    """Computes the on-data certificate at a monitor's checks and decides its alerts.

    Args:
        dtype: the dtype's canonical name.
        threshold: alert when the headroom (nats) is below this (``None``: never).
        horizon: alert when the least-squares line through the last ``window`` headrooms reaches 0 within this
            many steps (``None``: never).
        window: checks in the trend line (at least 3 before a trend alert).
        steps, tol: Lanczos steps and tolerance per Jacobian (warm-started from the previous check).
        logit_samples: samples used for attention logits.
        basis: the headroom the alerts read (:meth:`TrajectoryReport.headroom_on`): ``"measured"`` (the batch's
            own costates where the training backward gave ``p_D``, else the estimate), ``"estimate"`` (the (T)
            bound with Lanczos factors) or ``"certified"``.
        estimate_every: the Lanczos estimates (the ``"estimate"`` figures) at every this many checks; ``None``:
            only where :attr:`basis` needs them (``"estimate"``, ``"certified"``, or no exact ``p_D``).
    """

    def __init__(self, dtype: str, *, threshold: Optional[float], horizon: Optional[int], window: int, steps: int,
                 tol: float, logit_samples: int, basis: str = "measured", estimate_every: Optional[int] = None
                 ) -> None:
        check_choice("headroom_basis", basis, BASES)
        check_int("estimate_every", estimate_every, optional=True)
        self.basis, self.estimate_every, self.checks = basis, estimate_every, 0
        self.exported: Dict[Any, Any] = {}  # a model without certified blocks: its exported graph across checks
        self.dtype = dtype
        self.threshold, self.horizon, self.window = threshold, horizon, window
        self.steps, self.tol, self.logit_samples = steps, tol, logit_samples
        self.warm: Dict[str, Tensor] = {}
        self.history: List[Tuple[int, float]] = []
        self.last: Optional[TrajectoryReport] = None

    # -- computing --------------------------------------------------------------------------------------------
    def measured_next(self) -> bool:
        """Whether the next check reads only measured figures (the ``"measured"`` basis, no Lanczos estimate due):
        then the training step can measure them itself (:meth:`from_measured`)."""
        due = self.estimate_every is not None and self.checks % self.estimate_every == 0
        return self.basis == "measured" and not due

    def _jacobians(self) -> Optional[bool]:
        """``evaluate``'s ``jacobians`` at this check: ``True``, or ``None`` (only without an exact ``p_D``)."""
        self.checks += 1
        every = self.estimate_every is not None and (self.checks - 1) % self.estimate_every == 0
        return True if self.basis != "measured" or every else None

    def from_calls(self, calls: Sequence[Call], *, dt: float, certs: Optional[Sequence[Any]], p_d: Optional[Tensor],
                   lip_g: float, kappas: Dict[int, float], state: AutocastState, model: str) -> TrajectoryReport:
        """The report of velocity calls captured in the training forward (``p_d``: the measured costate at
        ``X_D`` from the user's backward, else ``lip_g`` stands in)."""
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            for c in calls:
                stack.enter_context(eval_mode(c.module))
            stack.enter_context(restored_autocast(state))
            steps = calls_steps(calls, dt, certs, self.logit_samples,
                                kappa=lambda k, m: kappas.get(k, math.nan))
            last = calls[-1]
            x_d = (last.x + dt * last.out.to(last.x.dtype)).detach() if last.out is not None else last.x.detach()
            if p_d is not None:
                head = Head(x_d, p=p_d, detail="the costate at X_D from the training backward (measured)")
            else:
                head = Head(x_d, lip_g=lip_g, detail="Lip(G) of the certificate (no backward seen for this batch)")
            src = Source(steps, head, token_norm_max(calls[0].x))
            rep = evaluate(src, self.dtype, model=model, steps=self.steps, tol=self.tol, dense_max=0, warm=self.warm,
                           jacobians=self._jacobians())
        rep.seconds = time.perf_counter() - t0
        self.last = rep
        return rep

    def from_measured(self, calls: Sequence[Call], figures: Sequence[StepFigures], *, dt: float,
                      certs: Optional[Sequence[Any]], p_d: Tensor, kappas: Dict[int, float], model: str
                      ) -> TrajectoryReport:
        """The measured report from what the checked training step measured itself (no pass here): per update the
        captured ``X_k`` and ``v(X_k)``, the :class:`StepFigures` (intermediates, logit, the costate ``p_k`` from the
        user's backward) and ``p_d`` (the costate at ``X_D``).  The same figures as :meth:`from_calls` on the
        measured basis (``jacobians=False``), read off the training step instead of recomputed: costates by the
        user's backward instead of vector-Jacobian products, in the step's own mode (training-mode dropout
        included)."""
        t0 = time.perf_counter()
        self.checks += 1
        ups: List[UpdateTrajectory] = []
        for k, (c, f) in enumerate(zip(calls, figures)):
            assert c.out is not None and f.peak is not None and f.costate is not None  # checked by the caller
            x = c.x.detach()
            cert = None if certs is None else certs[k]
            st = Step(c.name, "update", x, _not_evaluated, token_norm_max(x + dt * c.out.detach().to(x.dtype)), dt=dt,
                      cert=cert, kappa=_kappa_of(kappas, k) if f.attention else None, key=c.name)
            u = _update(st, x, c.out, (f.peak, f.max_logit, f.peaks), self.steps, self.tol, 0, None, False, None)
            u.costate_norm = _per_sample_max(f.costate)
            ups.append(u)
        last = calls[-1]
        assert last.out is not None
        x_d = (last.x + dt * last.out.to(last.x.dtype)).detach()
        head, _ = _head(Head(x_d, p=p_d, detail="the costate at X_D from the training backward (measured)"),
                        self.steps, self.tol, 0, None)
        x0 = calls[0].x
        rep = TrajectoryReport(model, self.dtype, math.log(float_max(self.dtype)), ups, head, int(x0.shape[0]),
                               tokens_of(x0), notes=["measured in the training step: intermediates recorded in its "
                                                     "forward, costates from its backward (no pass of the check)"],
                               input_norm=token_norm_max(x0))
        rep.seconds = time.perf_counter() - t0
        self.last = rep
        return rep

    def from_batch(self, model: nn.Module, batch: Tuple[Tuple[Any, ...], Dict[str, Any]], state: AutocastState
                   ) -> TrajectoryReport:
        """The report of a whole model on a captured call (a model without certified blocks: its graph)."""
        with restored_autocast(state):
            rep = trajectory_of_call(model, batch[0], batch[1], self.dtype, certified=False, steps=self.steps,
                                     tol=self.tol, logit_samples=self.logit_samples, warm=self.warm,
                                     jacobians=self._jacobians(), capture_cache=self.exported)
        self.last = rep
        return rep

    # -- records and alerts -----------------------------------------------------------------------------------
    def figures(self, rep: TrajectoryReport) -> Dict[str, Any]:
        """Record entries: ``data/...`` for the whole, ``<update>/<figure>`` per update."""
        h, used = rep.headroom_on(self.basis)
        name, qty, nats = rep.worst(used)
        out: Dict[str, Any] = {
            "data/alert_headroom": h, "data/alert_basis": used,
            "data/headroom": rep.headroom, "data/forward_headroom": rep.forward_headroom,
            "data/backward_headroom": rep.backward_headroom, "data/headroom_certified": _num(rep.headroom_certified),
            "data/log_grad_bound": rep.log_gradient_bound,
            "data/log_grad_bound_certified": _num(rep.log_gradient_bound_certified),
            "data/headroom_measured": _num(rep.headroom_measured),
            "data/forward_headroom_measured": rep.forward_headroom_measured,
            "data/backward_headroom_measured": _num(rep.backward_headroom_measured),
            "data/log_grad_measured": _num(rep.log_gradient_measured),
            "data/forward_max": rep.forward_max, "data/head_norm": rep.head.norm, "data/head_source": rep.head.source,
            "data/converged": rep.converged, "data/worst_update": name, "data/worst_quantity": qty}
        for u in rep.updates:
            out.update({f"{u.name}/jacobian_norm": u.jacobian_norm, f"{u.name}/jacobian_bound": u.jacobian_bound,
                        f"{u.name}/jacobian_steps": u.steps, f"{u.name}/peak": u.peak,
                        f"{u.name}/data_log_factor": u.log_factor, f"{u.name}/data_state_norm": u.state_norm,
                        f"{u.name}/data_costate_norm": u.costate_norm})
            if u.max_logit is not None:
                out[f"{u.name}/data_max_logit"] = u.max_logit
        return out

    def alerts(self, step: int, rep: TrajectoryReport) -> List[Dict[str, Any]]:
        """The on-data alerts of this check (threshold, then trend), each a monitor alert dict; they read the
        headroom on :attr:`basis`."""
        forward, backward, used = rep.sides_on(self.basis)
        h = min(forward, backward)
        below, zero = self.observe(step, h)
        out = []
        name, qty, nats = rep.worst(used)
        cause = self._cause(rep, name, qty, nats)
        if below:
            out.append({"step": step, "update": name, "quantity": "headroom", "cause": qty, "value": h,
                        "threshold": self.threshold, "basis": used,
                        "message": f"step {step}: on-data headroom {h:.4g} nats below {self.threshold:g} "
                                   f"({rep.dtype}, {used}: forward {forward:.4g}, backward "
                                   f"{backward:.4g}): {cause}"})
        if zero is not None:
            out.append({"step": step, "update": name, "quantity": "headroom trend", "cause": qty, "value": h,
                        "threshold": float(self.horizon or 0), "basis": used,  # a trend alert needs a horizon
                        "message": f"step {step}: on-data headroom {h:.4g} nats falls by "
                                   f"{-self._slope():.3g} nats/step and reaches 0 near step {zero:.0f}, within "
                                   f"the horizon {self.horizon} ({rep.dtype}, {used}): {cause}"})
        return out

    def observe(self, step: int, h: float) -> Tuple[bool, Optional[float]]:
        """Add the headroom ``h`` of ``step`` to the trend and decide: ``(below the threshold, the step the trend
        reaches 0 when that is within the horizon, else None)``."""
        self.history.append((step, h))
        self.history = self.history[-self.window:]
        below = self.threshold is not None and (math.isnan(h) or h < self.threshold)
        zero = None
        if self.horizon is not None and len(self.history) >= 3 and math.isfinite(h):
            z = self._zero_step()
            zero = z if z is not None and z - step <= self.horizon else None
        return below, zero

    def _slope(self) -> float:
        pts = [(s, h) for s, h in self.history if math.isfinite(h)]
        n = len(pts)
        ms = sum(s for s, _ in pts) / n
        mh = sum(h for _, h in pts) / n
        den = sum((s - ms) ** 2 for s, _ in pts)
        return sum((s - ms) * (h - mh) for s, h in pts) / den if den > 0 else 0.0

    def _zero_step(self) -> Optional[float]:
        pts = [(s, h) for s, h in self.history if math.isfinite(h)]
        if len(pts) < 3:
            return None
        slope = self._slope()
        if slope >= 0:
            return None
        s_last, h_last = pts[-1]
        return s_last + max(h_last, 0.0) / -slope

    @staticmethod
    def _cause(rep: TrajectoryReport, name: str, qty: str, nats: float) -> str:
        u = next((u for u in rep.updates if u.name == name), None)
        text = f"update {name!r} consumes the most ({qty}"
        if u is not None:
            if qty == "Jacobian":
                text += f" ||Dv|| ~ {u.jacobian_norm:.4g} at state norm {u.state_norm:.4g}, {nats:.3g} nats"
            else:
                text = f"update {name!r} consumes the most ({rep.describe(qty, nats)}"
            if u.kappa is not None:
                text += f"; kappa {u.kappa:.4g}"
            if u.max_logit is not None:
                text += f"; largest logit {u.max_logit:.4g}"
        else:
            text = f"{name!r} consumes the most ({rep.describe(qty, nats)}"
        return text + ")"


def batch_of(args: tuple, kwargs: dict) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """A model call's arguments, detached (the batch the monitor checks)."""
    det = lambda a: a.detach() if isinstance(a, Tensor) else a
    return tuple(det(a) for a in args), {k: det(v) for k, v in kwargs.items()}
