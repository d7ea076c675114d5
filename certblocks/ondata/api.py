"""``trajectory(model, batch, dtype)``: the on-data certificate of one batch (:class:`TrajectoryReport`)."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .._validation import check_int
from ..budget import dtype_name, float_max
from .graph import graph_steps
from .power import LinearizedMap, dense_jacobian_norm, jacobian_spectral_norm
from .report import HeadTrajectory, TrajectoryReport, UpdateTrajectory
from .sources import Head, Source, Step, module_steps, token_norm_max, tokens_of

__all__ = ["trajectory", "trajectory_of_call", "evaluate", "costate_norms", "unwrap", "as_args", "eval_mode"]

LossArg = Union[None, Callable[[Tensor], Tensor]]


def unwrap(model: Any) -> Any:
    """The module inside ``DistributedDataParallel`` / ``DataParallel`` (and nested wrappers)."""
    while type(model).__name__ in ("DistributedDataParallel", "DataParallel") and isinstance(
            getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def as_args(batch: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """A batch as the model's arguments: a tensor, a tuple/list of positional arguments or a dict of keywords."""
    if isinstance(batch, Tensor):
        return (batch,), {}
    if isinstance(batch, dict) or (hasattr(batch, "keys") and hasattr(batch, "__getitem__")):
        return (), {k: batch[k] for k in batch.keys()}
    if isinstance(batch, (list, tuple)):
        return tuple(batch), {}
    raise TypeError(f"batch must be a tensor, a tuple of positional arguments or a dict of keyword arguments, "
                    f"got {type(batch).__name__}")


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


def _is_zoo(model: Any) -> bool:
    return all(callable(getattr(model, a, None)) for a in ("residual_updates", "input_radius",
                                                            "certificate_seq_len"))


def trajectory(model: nn.Module, batch: Any, dtype: Union[str, torch.dtype], *, dt: Optional[float] = None,
               loss: LossArg = None, loss_gradient: Optional[float] = None, steps: int = 12, tol: float = 1e-2,
               certified: bool = True, dense_max: int = 256, logit_samples: int = 8,
               warm: Optional[Dict[str, Tensor]] = None) -> TrajectoryReport:
    """The on-data certificate of ``batch``: the paper's trajectory bound (T) and the headroom to ``dtype``'s limit.

    One forward of ``model`` on ``batch`` (in eval mode: dropout off; in the caller's autocast and device) gives
    the states ``X_k``; at each, the spectral norm of the velocity's Jacobian (one sample's whole state, the largest
    over the batch) is estimated by Golub-Kahan-Lanczos with ``torch.func`` products (from below: the figures
    reached, their steps and convergence are reported), and bounded where possible (``certified``); the recorder
    of :mod:`certblocks.testing.record` gives the largest intermediate of each update.  See
    :class:`~certblocks.ondata.TrajectoryReport` for the figures.

    The residual updates are a :class:`~certblocks.CertifiedStack`'s blocks, a zoo model's
    ``residual_updates()``, or, for any other module, the updates, maps, stem and head that
    :func:`certblocks.certify` finds in its graph (captured on ``batch``).  A ``DistributedDataParallel`` /
    ``DataParallel`` wrapper is unwrapped (no collective is issued).

    Args:
        model: the model.
        batch: its input: a tensor, a tuple of positional arguments, or a dict of keyword arguments (with the
            targets, a model that returns its loss gives the exact costate ``p_D``).
        dtype: the dtype whose largest finite value ``M`` the headroom refers to (``"fp16"``, ``torch.bfloat16``...).
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

    Returns:
        A :class:`~certblocks.ondata.TrajectoryReport`.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``batch`` is not a tensor, tuple or dict.
        ValueError: ``dt`` differs from the model's step, or the model has no residual update on one path.
    """
    args, kwargs = as_args(batch)
    return trajectory_of_call(model, args, kwargs, dtype, dt=dt, loss=loss, loss_gradient=loss_gradient, steps=steps,
                              tol=tol, certified=certified, dense_max=dense_max, logit_samples=logit_samples,
                              warm=warm)


def trajectory_of_call(model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], dtype: Union[str, torch.dtype],
                       *, dt: Optional[float] = None, loss: LossArg = None, loss_gradient: Optional[float] = None,
                       steps: int = 12, tol: float = 1e-2, certified: bool = True, dense_max: int = 256,
                       logit_samples: int = 8, warm: Optional[Dict[str, Tensor]] = None) -> TrajectoryReport:
    """:func:`trajectory` on the call ``model(*args, **kwargs)``."""
    t0 = time.perf_counter()
    inner = unwrap(model)
    if not isinstance(inner, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    name = dtype_name(dtype)
    _check_options(loss, loss_gradient, steps, tol, dense_max, logit_samples)
    from ..stack import CertifiedStack

    with eval_mode(inner):
        if isinstance(inner, CertifiedStack) or _is_zoo(inner):
            from ..monitor import residual_updates

            ups = residual_updates(inner)
            _check_dt(dt, ups.dt, type(inner).__name__)
            certs, head_cert, notes = _module_certificates(inner, ups, args, certified)
            src = module_steps(inner, args, kwargs, ups, loss=loss, loss_gradient=loss_gradient, certs=certs,
                               head_cert=head_cert, logit_samples=logit_samples)
            src.notes += notes
        else:
            _check_dt(dt, 1.0, type(inner).__name__)
            src = graph_steps(inner, args, kwargs, loss=loss, loss_gradient=loss_gradient, certified=certified,
                              logit_samples=logit_samples)
        rep = evaluate(src, name, model=type(inner).__name__, steps=steps, tol=tol,
                       dense_max=dense_max if certified else 0, warm=warm)
    rep.seconds = time.perf_counter() - t0
    return rep


def _check_options(loss: Any, loss_gradient: Any, steps: Any, tol: Any, dense_max: Any, logit_samples: Any) -> None:
    if loss is not None and not callable(loss):
        raise TypeError(f"loss must be a callable loss(output) -> scalar tensor, or None, got {type(loss).__name__}")
    if loss_gradient is not None and (isinstance(loss_gradient, bool) or not isinstance(loss_gradient, (int, float))
                                      or not math.isfinite(loss_gradient) or loss_gradient <= 0):
        raise ValueError(f"loss_gradient must be a finite number > 0 or None, got {loss_gradient!r}")
    check_int("steps", steps)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (tol >= 0):
        raise ValueError(f"tol must be a number >= 0, got {tol!r}")
    check_int("dense_max", dense_max, 0)
    check_int("logit_samples", logit_samples)


def _check_dt(dt: Any, own: float, model: str) -> None:
    if dt is None:
        return
    if isinstance(dt, bool) or not isinstance(dt, (int, float)) or not math.isfinite(dt) or dt <= 0:
        raise ValueError(f"dt must be a finite number > 0 or None, got {dt!r}")
    if float(dt) != own:
        raise ValueError(f"dt={dt!r} differs from the step {own:g} of {model}'s updates (the bound is for the "
                         "model as it runs): leave dt=None")


def _module_certificates(model: nn.Module, ups: Any, args: Tuple[Any, ...], certified: bool
                         ) -> Tuple[Optional[List[Any]], Optional[Any], List[str]]:
    if not certified:
        return None, None, []
    try:
        certs = list(model.update_certificates()) if _is_zoo(model) else ups.certificates()
        head = model.head_certificate() if _is_zoo(model) else None
    except (ValueError, TypeError) as exc:  # e.g. a non-finite weight: no certified factors, say why
        return None, None, [f"no certificates: {exc}"]
    return certs, head, []


def _per_sample_max(t: Tensor) -> float:
    n = torch.linalg.vector_norm(t.detach().reshape(t.shape[0], -1).to(torch.float64), dim=1)
    return math.inf if not torch.isfinite(n).all() else float(n.max())


def _estimate(fn: Callable[[Tensor], Tensor], x: Tensor, key: str, steps: int, tol: float,
              warm: Optional[Dict[str, Tensor]], jvp: str = "auto") -> Any:
    lin = LinearizedMap(fn, x, jvp)
    est = jacobian_spectral_norm(lin, steps=steps, tol=tol, v0=None if warm is None else warm.get(key))
    if warm is not None:
        warm[key] = est.vector
    return est, tokens_of(lin.out)


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


def evaluate(src: Source, dtype: str, *, model: str = "", steps: int = 12, tol: float = 1e-2, dense_max: int = 256,
             warm: Optional[Dict[str, Tensor]] = None) -> TrajectoryReport:
    """The report of a :class:`~certblocks.ondata.sources.Source` (:func:`trajectory`'s work after the forward)."""
    ups: List[UpdateTrajectory] = []
    for st in src.steps:
        ups.append(_update(st, steps, tol, dense_max, warm))
    head, p_d = _head(src.head, steps, tol, dense_max, warm)
    notes = list(src.notes)
    if p_d is not None:
        try:
            for u, n in zip(ups, costate_norms(src.steps, p_d)):
                u.costate_norm = n
        except (RuntimeError, NotImplementedError, TypeError) as exc:  # a segment autograd cannot differentiate
            notes.append(f"no measured costates: {type(exc).__name__}: {exc}")
    x0 = src.steps[0].x
    return TrajectoryReport(model, dtype, math.log(float_max(dtype)), ups, head, int(x0.shape[0]), tokens_of(x0),
                            notes=notes, input_norm=src.input_norm, stem_peak=src.stem_peak,
                            stem_peaks=dict(src.stem_peaks))


def costate_norms(steps: List[Step], p_d: Tensor) -> List[float]:
    """The costates ``p_k`` at each segment's input from ``p_D``, backwards by vector-Jacobian products
    (an update: ``p_k = p_{k+1} + dt Dv_k(X_k)^T p_{k+1}``; a map or block: ``Dm_k(X_k)^T p_{k+1}``), as their
    largest per-sample norm (``inf`` once one is not finite).  One backward of every segment."""
    norms: List[float] = []
    p = p_d.detach()
    for st in reversed(steps):
        x = st.x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = st.fn(x)
            g = torch.autograd.grad(out, x, p.to(out.dtype).reshape(out.shape), allow_unused=True)[0]
        g = torch.zeros_like(x) if g is None else g
        p = (p.to(g.dtype).reshape(g.shape) + st.dt * g) if st.kind == "update" else g
        norms.append(_per_sample_max(p))
    return norms[::-1]


def _update(st: Step, steps: int, tol: float, dense_max: int, warm: Optional[Dict[str, Tensor]]) -> UpdateTrajectory:
    est, out_tokens = _estimate(st.fn, st.x, st.key or st.name, steps, tol, warm)
    jn = float(est.values.max())
    bound, source = _certified_bound(st.cert, st.x, out_tokens, _dense(st.fn64, st.x, dense_max))
    peak, logit, peaks = st.peak()
    return UpdateTrajectory(st.name, st.kind, token_norm_max(st.x), st.out_norm, jn, bound, source, est.steps,
                            est.converged, est.change, est.jvp, peak, st.dt,
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


def _head(h: Head, steps: int, tol: float, dense_max: int, warm: Optional[Dict[str, Tensor]]
          ) -> Tuple[HeadTrajectory, Optional[Tensor]]:
    """The head's figures, and the exact costate ``p_D`` where there is one (the loss's gradient, or given)."""
    peak, peaks = h.peak()
    head, p = _head_costate(h, peak, steps, tol, dense_max, warm)
    head.peaks, head.state_max, head.state_dtype = peaks, _entry_max(h.x), _dtype_label(h.x.dtype)
    return head, p


def _head_costate(h: Head, peak: float, steps: int, tol: float, dense_max: int, warm: Optional[Dict[str, Tensor]]
                  ) -> Tuple[HeadTrajectory, Optional[Tensor]]:
    x = h.x.detach()
    rd = token_norm_max(x)
    if h.loss_fn is not None:
        xg = x.clone().requires_grad_(True)
        with torch.enable_grad():
            val = h.loss_fn(xg)
            if not isinstance(val, Tensor) or val.numel() != 1:
                raise ValueError(f"the loss must be a scalar tensor, got {type(val).__name__} "
                                 f"{tuple(getattr(val, 'shape', ()))}")
            p = torch.autograd.grad(val.reshape(()), xg, allow_unused=True)[0]
        n = 0.0 if p is None else _per_sample_max(p)
        if not torch.isfinite(val.detach()).all():
            n = math.inf
        return HeadTrajectory("loss", n, n, rd, peak, detail=h.detail), None if p is None else p.detach()
    if h.p is not None:
        n = _per_sample_max(h.p)
        return HeadTrajectory("loss", n, n, rd, peak, detail=h.detail), h.p.detach()
    if h.fn is not None:
        try:
            est, out_tokens = _estimate(h.fn, x, "head", steps, tol, warm, jvp="double")
        except (RuntimeError, NotImplementedError, TypeError):
            est, out_tokens = _estimate(h.fn, x, "head", steps, tol, warm)
        bound, _ = _certified_bound(h.cert, x, out_tokens, _dense(h.fn64, x, dense_max))
        lg = h.loss_gradient
        detail = h.detail + ("" if est.converged else f" (not converged: {est.steps} steps, change {est.change:.2g})")
        return HeadTrajectory("jacobian", float(est.values.max()) * lg, None if bound is None else bound * lg, rd, peak,
                              loss_gradient=lg, detail=detail), None
    lip = 1.0 if h.lip_g is None else float(h.lip_g)
    return HeadTrajectory("lip_g", lip, lip, rd, peak, detail=h.detail), None
