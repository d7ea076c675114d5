"""``trajectory(model, batch, dtype)``: the on-data certificate of one batch (:class:`TrajectoryReport`)."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .._validation import check_bool, check_int, check_real
from ..budget import dtype_name, float_max
from ..model import as_args, as_certified, envelope_paused, underlying, unwrap
from ..precision import Precision, as_precision
from ..trace.capture import torch_dtype
from .graph import graph_steps
from .power import LinearizedMap, dense_jacobian_norm, jacobian_spectral_norm
from .report import HeadTrajectory, TrajectoryReport, UpdateTrajectory
from .sources import Head, Source, Step, module_steps, token_norm_max, tokens_of

# unwrap and as_args are the spine's (certblocks.model), importable from here as before
__all__ = ["trajectory", "trajectory_of_call", "evaluate", "unwrap", "as_args", "eval_mode"]

LossArg = Union[None, Callable[[Tensor], Tensor]]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model.eval()`` inside the block; every submodule's ``training`` flag restored after."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, t in flags:
            m.training = t


def trajectory(model: nn.Module, batch: Any, dtype: Union[str, torch.dtype, Precision], *, dt: Optional[float] = None,
               loss: LossArg = None, loss_gradient: Optional[float] = None, steps: int = 12, tol: float = 1e-2,
               certified: bool = True, dense_max: int = 256, logit_samples: int = 8,
               warm: Optional[Dict[str, Tensor]] = None, jacobians: bool = True) -> TrajectoryReport:
    """The on-data certificate of ``batch``: the paper's trajectory bound (T) and the headroom to ``dtype``'s limit.

    One forward of ``model`` on ``batch`` (in eval mode: dropout off; in the caller's autocast and device) gives
    the states ``X_k``; at each, the spectral norm of the velocity's Jacobian (one sample's whole state, the largest
    over the batch) is estimated by Golub-Kahan-Lanczos with ``torch.func`` products (from below: the figures
    reached, their steps and convergence are reported), and bounded where possible (``certified``); the recorder
    of :mod:`certblocks.testing.record` gives the largest intermediate of each update.  See
    :class:`~certblocks.ondata.TrajectoryReport` for the figures.

    The residual updates are what :func:`certblocks.model.as_certified` reads: a :class:`~certblocks.CertifiedStack`'s
    blocks, a zoo model's ``residual_updates()``, or, for any other module (a converted one too), the updates,
    maps, stem and head that :func:`certblocks.certify` finds in its graph (captured on ``batch``).  A
    ``DistributedDataParallel`` / ``DataParallel`` / FSDP / ``torch.compile`` wrapper is unwrapped (no collective
    is issued).

    Args:
        model: the model.
        batch: its input: a tensor, a tuple of positional arguments, or a mapping of keyword arguments (a dict, HF
            ``BatchEncoding``; with the targets, a model that returns its loss gives the exact costate ``p_D``).
        dtype: the dtype whose largest finite value ``M`` the headroom refers to (``"fp16"``, ``torch.bfloat16``...),
            or a precision policy (:func:`certblocks.precision.as_precision`): with autocast (``"amp-fp16"``) the
            forward runs under ``torch.autocast(device_type, dtype)`` of the policy unless the caller's autocast is
            already on, and each recorded value counts against its own dtype's ``M`` (a float32 stream against
            float32's, float16 matmul outputs against 65504), the backward against the policy's narrowest dtype;
            the report's ``dtype`` is that narrowest dtype and its notes name the policy.
        dt: the residual step; ``None`` (default): the model's own (a ``CertifiedStack``'s ``dt``; 1 for a zoo model
            and for updates found in a graph, whose velocity already holds any step).  A different value raises.
        loss: ``loss(output) -> scalar``, ``output`` the model's main output (its first floating-point tensor
            that is not a scalar; a ``CertifiedStack``'s last state): ``p_D`` is then its gradient at ``X_D``,
            exact.  ``None``: the model's own scalar loss output if it returns one, else ``||DG(X_D)||`` times
            ``loss_gradient`` (a ``CertifiedStack``: its declared ``lip_g``).
        loss_gradient: bound on the loss gradient in the main output used with ``||DG(X_D)||`` (default: the
            model's ``loss_gradient`` attribute, e.g. ``sqrt(2)`` for the zoo's cross-entropy models, else 1).
        steps: Lanczos steps per Jacobian at most (each one Jacobian-vector and one vector-Jacobian product).
        tol: relative change below which a Jacobian's estimate counts as converged.
        certified: also compute certified upper bounds of each factor (the block certificates, or the tracer's
            for a graph; ``dense_max``); ``False`` skips them (the certified figures are then ``None``).
        dense_max: a segment whose sample has at most this many entries gets the whole float64 Jacobian's
            rigorous spectral norm bound as its certified bound (0: never).
        logit_samples: samples used for the largest attention logit.
        warm: a dict the Lanczos start vectors are read from and written to (warm starts across calls).
        jacobians: estimate every ``||Dv_k||`` by Lanczos (the ``"estimate"`` basis: :attr:`~TrajectoryReport.headroom`
            and the (T) bound).  ``False`` skips them: the report has the forward figures and the measured costates
            only (``headroom_measured``; ``headroom`` and ``log_gradient_bound`` are ``None``), at a few
            forward+backward passes (``benchmarks/RESULTS.md``, "Cost of a trajectory()"); it needs the exact
            costate ``p_D`` (``loss=``, or a model that returns its loss from the batch's targets).

    Returns:
        A :class:`~certblocks.ondata.TrajectoryReport`.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``batch`` is not a tensor, tuple or dict.
        ValueError: ``dt`` differs from the model's step, the model has no residual update on one path, or
            ``jacobians=False`` without an exact ``p_D``.
    """
    args, kwargs = as_args(batch)
    return trajectory_of_call(model, args, kwargs, dtype, dt=dt, loss=loss, loss_gradient=loss_gradient, steps=steps,
                              tol=tol, certified=certified, dense_max=dense_max, logit_samples=logit_samples,
                              warm=warm, jacobians=jacobians)


def trajectory_of_call(model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                       dtype: Union[str, torch.dtype, Precision],
                       *, dt: Optional[float] = None, loss: LossArg = None, loss_gradient: Optional[float] = None,
                       steps: int = 12, tol: float = 1e-2, certified: bool = True, dense_max: int = 256,
                       logit_samples: int = 8, warm: Optional[Dict[str, Tensor]] = None,
                       jacobians: Optional[bool] = True, capture_cache: Optional[Dict[Any, Any]] = None
                       ) -> TrajectoryReport:
    """:func:`trajectory` on the call ``model(*args, **kwargs)`` (``jacobians=None``: the estimates only where
    there is no exact ``p_D``; ``capture_cache``: exported graphs kept across calls, see
    :func:`certblocks.trace.capture.capture`)."""
    t0 = time.perf_counter()
    if not isinstance(underlying(model), nn.Module):
        raise TypeError(f"model must be an nn.Module (or a wrapper or ConversionReport of one), got "
                        f"{type(model).__name__}")
    cm = as_certified(model)
    inner = cm.module
    assert inner is not None
    prec = as_precision(dtype)
    name = prec.narrowest  # the pure dtype's; a policy's narrowest: each value is read against its own dtype's M
    _check_options(loss, loss_gradient, steps, tol, dense_max, logit_samples)
    check_bool("jacobians", jacobians, optional=True)
    run, note = _policy_run(prec, inner, args, kwargs)
    with envelope_paused(), eval_mode(inner), run:
        if cm.stack_forward:
            _check_dt(dt, cm.dt, type(inner).__name__)
            certs, head_cert, notes = _module_certificates(cm, certified)
            src = module_steps(inner, args, kwargs, cm, loss=loss, loss_gradient=loss_gradient, certs=certs,
                               head_cert=head_cert, logit_samples=logit_samples)
            src.notes += notes
        else:
            _check_dt(dt, 1.0, type(inner).__name__)
            src = graph_steps(inner, args, kwargs, loss=loss, loss_gradient=loss_gradient, certified=certified,
                              logit_samples=logit_samples, capture_cache=capture_cache)
        rep = evaluate(src, name, model=type(inner).__name__, steps=steps, tol=tol,
                       dense_max=dense_max if certified else 0, warm=warm, jacobians=jacobians)
    rep.seconds = time.perf_counter() - t0
    if note:
        rep.notes.append(note)
    return rep


def _policy_run(prec: Precision, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                ) -> Tuple[Any, str]:
    """The context a trajectory under ``prec`` runs in (its autocast, unless the caller's is on), and a note naming
    the policy (``""`` for a pure dtype)."""
    if prec.pure:
        return contextlib.nullcontext(), ""
    device = next((t.device.type for t in (*module.parameters(), *module.buffers())), None) or next(
        (a.device.type for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), "cpu")
    if prec.autocast_dtype is None:
        return contextlib.nullcontext(), (f"precision {prec.describe()}: the batch ran as given (its parameters and "
                                          "inputs are not cast here); each value is read against its own dtype's M")
    low = torch_dtype(prec.autocast_dtype)
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == low:
        return contextlib.nullcontext(), (f"precision {prec.describe()}: ran under the caller's autocast; each value "
                                          "is read against its own dtype's M")
    return torch.autocast(device, dtype=low), (f"precision {prec.describe()}: ran under torch.autocast({device!r}, "
                                               f"{low}); each value is read against its own dtype's M")


def _check_options(loss: Any, loss_gradient: Any, steps: Any, tol: Any, dense_max: Any, logit_samples: Any) -> None:
    if loss is not None and not callable(loss):
        raise TypeError(f"loss must be a callable loss(output) -> scalar tensor, or None, got {type(loss).__name__}")
    check_real("loss_gradient", loss_gradient, gt=0.0, optional=True)
    check_int("steps", steps)
    check_real("tol", tol, ge=0.0)
    check_int("dense_max", dense_max, 0)
    check_int("logit_samples", logit_samples)


def _check_dt(dt: Any, own: float, model: str) -> None:
    if dt is None:
        return
    check_real("dt", dt, gt=0.0, optional=True)
    if float(dt) != own:
        raise ValueError(f"dt={dt!r} differs from the step {own:g} of {model}'s updates (the bound is for the "
                         "model as it runs): leave dt=None")


def _module_certificates(cm: Any, certified: bool) -> Tuple[Optional[List[Any]], Optional[Any], List[str]]:
    if not certified:
        return None, None, []
    try:
        certs, head = cm.certificates(), cm.head_certificate()
    except (ValueError, TypeError) as exc:  # e.g. a non-finite weight: no certified factors, say why
        return None, None, [f"no certificates: {exc}"]
    return certs, head, []


def _per_sample_max(t: Tensor) -> float:
    n = torch.linalg.vector_norm(t.detach().reshape(t.shape[0], -1).to(torch.float64), dim=1)
    return math.inf if not torch.isfinite(n).all() else float(n.max())


def _estimate(lin: LinearizedMap, key: str, steps: int, tol: float, warm: Optional[Dict[str, Tensor]],
              start: Optional[Tensor] = None) -> Any:
    """Lanczos on ``lin`` from the warm vector of ``key``, else ``start``, else a random vector."""
    v0 = warm.get(key) if warm is not None else None
    est = jacobian_spectral_norm(lin, steps=steps, tol=tol, v0=start if v0 is None else v0)
    if warm is not None:
        warm[key] = est.vector
    return est


def _dense(fn64: Optional[Callable[[Tensor], Tensor]], x: Tensor, dense_max: int) -> Optional[float]:
    if fn64 is None or dense_max <= 0 or x[0].numel() > dense_max or not torch.isfinite(x).all():
        return None
    try:
        return float(dense_jacobian_norm(fn64, x).max())
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return None


def _certified_bound(step_cert: Any, x: Tensor, out_tokens: int, dense: Optional[float]
                     ) -> Tuple[Optional[float], str]:
    if dense is not None:
        return dense, "dense"
    if step_cert is None or step_cert.sigma is None:
        return None, ""
    r = token_norm_max(x)
    if not math.isfinite(r):
        return math.inf, "certificate"
    return math.sqrt(out_tokens) * step_cert.jacobian_bound(r), "certificate"


Graph = Tuple[Tensor, Tensor, Tuple[float, Optional[float], Dict[str, float]]]


def evaluate(src: Source, dtype: str, *, model: str = "", steps: int = 12, tol: float = 1e-2, dense_max: int = 256,
             warm: Optional[Dict[str, Tensor]] = None, jacobians: Optional[bool] = True) -> TrajectoryReport:
    """The report of a :class:`~certblocks.ondata.sources.Source` (:func:`trajectory`'s work after the forward).

    One recorded forward of every segment with its graph kept (the peaks), the head (``p_D``), then from the last
    segment to the first: the costate through the segment's graph, the Lanczos estimate on the same graph (with
    ``jacobians``; ``None``: only when there is no exact ``p_D``), and the graph is released."""
    exact = src.head.loss_fn is not None or src.head.p is not None
    if jacobians is None:
        jacobians = not exact
    if not jacobians and not exact:
        raise ValueError("jacobians=False needs the exact costate p_D at the last state (pass loss=, or the targets "
                         "of a model that returns its loss): without it the backward side is the Lanczos estimate")
    graphs: List[Optional[Graph]] = [_forward(st) for st in src.steps]
    head, p = _head(src.head, steps, tol, dense_max, warm)
    notes = list(src.notes)
    ups: List[Optional[UpdateTrajectory]] = [None] * len(src.steps)
    for k in reversed(range(len(src.steps))):
        st, (x, out, figures) = src.steps[k], graphs[k]  # type: ignore[misc]
        graphs[k] = None
        costate, start = None, None
        if p is not None:
            try:
                g = _vjp(out, x, p, retain=jacobians)
                start = g if bool(torch.isfinite(g).all()) and bool(g.any()) else None
                p = (p.to(g.dtype).reshape(g.shape) + st.dt * g) if st.kind == "update" else g
                costate = _per_sample_max(p)
            except (RuntimeError, NotImplementedError, TypeError) as exc:  # a segment autograd cannot differentiate
                notes.append(f"no measured costates: {type(exc).__name__}: {exc}")
                p = None
        ups[k] = _update(st, x, out, figures, steps, tol, dense_max, warm, jacobians, start)
        ups[k].costate_norm = costate  # type: ignore[union-attr]
    if any(u.costate_norm is None for u in ups):  # type: ignore[union-attr]
        for u in ups:
            u.costate_norm = None  # type: ignore[union-attr]
    x0 = src.steps[0].x
    return TrajectoryReport(model, dtype, math.log(float_max(dtype)), ups, head, int(x0.shape[0]),  # type: ignore[arg-type]
                            tokens_of(x0), notes=notes, input_norm=src.input_norm, stem_peak=src.stem_peak,
                            stem_peaks=dict(src.stem_peaks))


def _forward(st: Step) -> Graph:
    """The segment on its input with the graph kept: ``(x, out, peak figures)`` (one recorded forward)."""
    x = st.x.detach().requires_grad_(True)
    if st.record is not None:
        out, figures = st.record(x)
        return x, out, figures
    with torch.enable_grad():
        out = st.fn(x)
    return x, out, st.peak()


def _vjp(out: Tensor, x: Tensor, p: Tensor, *, retain: bool) -> Tensor:
    g = torch.autograd.grad(out, x, p.to(out.dtype).reshape(out.shape), allow_unused=True, retain_graph=retain)[0]
    return torch.zeros_like(x) if g is None else g


def _update(st: Step, x: Tensor, out: Tensor, figures: Tuple[float, Optional[float], Dict[str, float]], steps: int,
            tol: float, dense_max: int, warm: Optional[Dict[str, Tensor]], jacobians: bool,
            start: Optional[Tensor]) -> UpdateTrajectory:
    out_tokens = tokens_of(out)
    jn: Optional[float] = None
    n_steps, converged, change, jvp = 0, True, 0.0, ""
    if jacobians:
        est = _estimate(LinearizedMap(st.fn, x, graph=out), st.key or st.name, steps, tol, warm, start)
        jn, n_steps, converged, change, jvp = float(est.values.max()), est.steps, est.converged, est.change, est.jvp
    bound, source = _certified_bound(st.cert, st.x, out_tokens, _dense(st.fn64, st.x, dense_max))
    peak, logit, peaks = figures
    return UpdateTrajectory(st.name, st.kind, token_norm_max(st.x), st.out_norm, jn, bound, source, n_steps,
                            converged, change, jvp, peak, st.dt,
                            kappa=None if st.kappa is None else st.kappa(), max_logit=logit, peaks=peaks,
                            state_max=_entry_max(st.x), state_dtype=_dtype_label(st.x.dtype))


def _dtype_label(dtype: torch.dtype) -> str:
    """The dtype's canonical name, or ``""`` for one certblocks has no name for."""
    try:
        return dtype_name(dtype)
    except (TypeError, ValueError):
        return ""


def _entry_max(t: Tensor) -> float:
    """Largest ``|entry|`` (NaN counts as ``inf``)."""
    if t.numel() == 0:
        return 0.0
    v = float(t.detach().abs().max().to(torch.float64))
    return math.inf if math.isnan(v) else v


def _head_forward(h: Head, fn: Callable[[Tensor], Tensor], x: Tensor) -> Tuple[Tensor, float, Dict[str, float]]:
    """``fn(x)`` with its graph and the head's peaks: one recorded forward where the head can record."""
    if h.record is not None:
        out, (peak, peaks) = h.record(x)
        return out, peak, peaks
    with torch.enable_grad():
        out = fn(x)
    return (out, *h.peak())


def _head(h: Head, steps: int, tol: float, dense_max: int, warm: Optional[Dict[str, Tensor]]
          ) -> Tuple[HeadTrajectory, Optional[Tensor]]:
    """The head's figures, and the exact costate ``p_D`` where there is one (the loss's gradient, or given)."""
    x = h.x.detach()
    rd = token_norm_max(x)
    xg = x.clone().requires_grad_(True)
    if h.loss_fn is not None:
        val, peak, peaks = _head_forward(h, h.loss_fn, xg)
        if not isinstance(val, Tensor) or val.numel() != 1:
            raise ValueError(f"the loss must be a scalar tensor, got {type(val).__name__} "
                             f"{tuple(getattr(val, 'shape', ()))}")
        with torch.enable_grad():
            p = torch.autograd.grad(val.reshape(()), xg, allow_unused=True)[0]
        n = 0.0 if p is None else _per_sample_max(p)
        if not torch.isfinite(val.detach()).all():
            n = math.inf
        head, p_d = HeadTrajectory("loss", n, n, rd, peak, detail=h.detail), None if p is None else p.detach()
    elif h.p is not None:
        peak, peaks = h.peak()
        n = _per_sample_max(h.p)
        head, p_d = HeadTrajectory("loss", n, n, rd, peak, detail=h.detail), h.p.detach()
    elif h.fn is not None:  # ||DG(X_D)|| by Lanczos (needed whatever ``jacobians``: there is no exact p_D)
        out, peak, peaks = _head_forward(h, h.fn, xg)
        try:
            est = _estimate(LinearizedMap(h.fn, xg, "double", graph=out), "head", steps, tol, warm)
        except (RuntimeError, NotImplementedError, TypeError):
            est = _estimate(LinearizedMap(h.fn, x), "head", steps, tol, warm)
        bound, _ = _certified_bound(h.cert, x, tokens_of(out), _dense(h.fn64, x, dense_max))
        lg = h.loss_gradient
        detail = h.detail + ("" if est.converged else f" (not converged: {est.steps} steps, change {est.change:.2g})")
        head, p_d = HeadTrajectory("jacobian", float(est.values.max()) * lg, None if bound is None else bound * lg, rd,
                                   peak, loss_gradient=lg, detail=detail), None
    else:
        peak, peaks = h.peak()
        lip = 1.0 if h.lip_g is None else float(h.lip_g)
        head, p_d = HeadTrajectory("lip_g", lip, lip, rd, peak, detail=h.detail), None
    head.peaks, head.state_max, head.state_dtype = peaks, _entry_max(h.x), _dtype_label(h.x.dtype)
    return head, p_d
