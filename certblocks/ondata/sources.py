"""Where the trajectory comes from: a model's own updates (module hooks) or its captured graph.

Both give the same thing, a list of :class:`Step` (the input state ``X_k`` of each segment on the batch and the
segment as a function of that state alone, every other input held at its value on the batch) and a
:class:`Head` (the map from the last state to the output, or the costate ``p_D``):

* :func:`module_steps` -- a :class:`~certblocks.CertifiedStack` or a zoo model: one forward on the batch with
  hooks on the velocities (:func:`certblocks.model.as_certified`); a velocity is called again on its
  captured input (where the forward passed it: positionally or as a keyword); the head is the model's forward with
  the last update's output replaced so that the last state is the argument;
* :func:`calls_steps` -- the same from calls the :class:`~certblocks.CertificateMonitor`'s hooks captured in the
  training forward (no forward here);
* :func:`~certblocks.ondata.graph.graph_steps` -- any other module, from its graph (:mod:`certblocks.ondata.graph`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .._calls import Where, replace_output, state_of, velocity_output, with_state
from .._calls import without_state as _without_state
from ..budget import dtype_name
from ..certificate import BlockCertificate
from ..model import CertifiedModel, attention_module
from ..testing.record import recorded_call

__all__ = ["Step", "Head", "Call", "Source", "Peaks", "module_steps", "calls_steps", "token_norm_max", "tokens_of",
           "attention_module", "named_peaks"]

Fn = Callable[[Tensor], Tensor]


# ------------------------------------------------------------------------------------------------ small helpers
def token_norm_max(t: Optional[Tensor]) -> float:
    """Largest per-token norm (Euclidean over the last dimension) of ``t``; NaN counts as ``inf``."""
    if t is None or t.numel() == 0:
        return 0.0
    n = torch.linalg.vector_norm(t.detach().to(torch.float64), dim=-1)
    if torch.isnan(n).any():
        return math.inf
    return float(n.max())


def tokens_of(t: Tensor) -> int:
    """Tokens per sample of a state ``(B, ..., d)``: the product of the middle dimensions (1 for ``(B, d)``)."""
    return max(1, math.prod(t.shape[1:-1])) if t.ndim >= 2 else 1


def _abs_max(t: Any) -> float:
    """Largest ``|entry|`` of a floating tensor, masked-logit sentinels (``<= finfo.min / 4``, ``-inf``) left out."""
    if not isinstance(t, Tensor) or not t.is_floating_point() or t.numel() == 0:
        return 0.0
    t = t.detach()
    t = t.masked_fill(t <= torch.finfo(t.dtype).min / 4, 0.0)
    a = t.abs().to(torch.float64)
    return math.inf if torch.isnan(a).any() else float(a.max())


# ------------------------------------------------------------------------------------------------ what is evaluated
#: The largest ``|entry|`` per dtype (canonical names: ``"fp16"``, ``"fp32"``...).
Peaks = Dict[str, float]


@dataclass
class Step:
    """One segment on the batch: ``fn`` maps its input state ``x`` to the velocity (an update) or the next state.

    ``fn64`` is its float64 twin (``None``: none), ``peak()`` returns ``(largest intermediate, largest attention
    logit or None, largest intermediate per dtype)``, ``kappa()`` the attention's query-key coefficient (``None``:
    not an attention update).  ``record(x)``, where there is one, runs ``fn`` on ``x`` (requiring grad) under the
    recorder and returns ``(fn(x) with its graph, peak()'s figures)``: one forward for both.
    """

    name: str
    kind: str
    x: Tensor
    fn: Fn
    out_norm: float
    dt: float = 1.0
    fn64: Optional[Fn] = None
    cert: Optional[BlockCertificate] = None
    peak: Callable[[], Tuple[float, Optional[float], Peaks]] = lambda: (0.0, None, {})
    kappa: Optional[Callable[[], float]] = None
    key: str = ""
    record: Optional[Callable[[Tensor], Tuple[Tensor, Tuple[float, Optional[float], Peaks]]]] = None


@dataclass
class Head:
    """The last state ``x`` and how the costate there is obtained.

    ``loss_fn`` maps the last state to a scalar loss (``p_D`` by autograd, exact); else ``fn`` maps it to the
    output (``||DG||`` by Lanczos, times ``loss_gradient``); else ``p`` is the measured costate; else ``lip_g``.
    ``record(x)``, where there is one, computes ``loss_fn(x)`` (else ``fn(x)``) with its graph under the recorder
    and returns it with ``peak()``'s figures: one forward for both.
    """

    x: Tensor
    fn: Optional[Fn] = None
    loss_fn: Optional[Fn] = None
    p: Optional[Tensor] = None
    lip_g: Optional[float] = None
    loss_gradient: float = 1.0
    cert: Optional[BlockCertificate] = None
    fn64: Optional[Fn] = None
    peak: Callable[[], Tuple[float, Peaks]] = lambda: (0.0, {})
    detail: str = ""
    record: Optional[Callable[[Tensor], Tuple[Tensor, Tuple[float, Peaks]]]] = None


@dataclass
class Source:
    """What :func:`module_steps` / :func:`graph_steps` return."""

    steps: List[Step]
    head: Head
    input_norm: float
    stem_peak: float = 0.0
    notes: List[str] = field(default_factory=list)
    stem_peaks: Peaks = field(default_factory=dict)


def _floating_outputs(out: Any) -> List[Tensor]:
    from ..trace.capture import _flatten_output

    return [t for t in _flatten_output(out) if isinstance(t, Tensor) and t.is_floating_point()]


def split_output(out: Any) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """``(main output, scalar loss)`` of a model's output: the first floating tensor that is not a scalar, and
    the first floating scalar (a loss the model computed from its targets), each ``None`` when absent."""
    ts = _floating_outputs(out)
    main = next((t for t in ts if t.ndim > 0), None)
    loss = next((t for t in ts if t.ndim == 0), None)
    return main, loss


# ------------------------------------------------------------------------------------------------ module path
@dataclass
class Call:
    """One captured call of a velocity: the module, its input state, the other arguments (without the state and
    without KV caches), its output, and where the state was passed (``0``: first positional argument; a name: that
    keyword, as HF decoder layers pass ``hidden_states=``)."""

    name: str
    module: nn.Module
    x: Tensor
    args: Tuple[Any, ...] = ()
    kwargs: Dict[str, Any] = field(default_factory=dict)
    out: Optional[Tensor] = None
    where: Where = 0


def _output(module: nn.Module, out: Any) -> Tensor:
    y = velocity_output(out)
    if y is None:
        raise TypeError(f"{type(module).__name__} returned {type(out).__name__}, not a velocity tensor (or a tuple "
                        "starting with one)")
    return y


def _call_fn(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], where: Where = 0) -> Fn:
    """The velocity as a function of its input (placed where the forward passed it; the velocity is the first
    element of a tuple output); a fused QK-norm (a custom autograd function without forward-mode or
    double-backward rules) runs as its plain composition during the call (same values up to rounding)."""
    fused = [m for m in module.modules() if getattr(m, "fused_qk_norm", None) is True]

    def f(x: Tensor) -> Tensor:
        for m in fused:
            m.fused_qk_norm = False
        try:
            a, kw = with_state(args, kwargs, where, x)
            return _output(module, module(*a, **kw))
        finally:
            for m in fused:
                m.fused_qk_norm = True
    return f


def _cast64(a: Any) -> Any:
    """Floating tensors in float64, inside tuples and lists too (HF's ``position_embeddings = (cos, sin)``)."""
    if isinstance(a, Tensor):
        return a.to(torch.float64) if a.is_floating_point() else a
    if isinstance(a, (tuple, list)):
        return type(a)(_cast64(v) for v in a)
    return a


def _call_fn64(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], where: Where = 0) -> Fn:
    """The velocity in float64: parameters and buffers cast (``functional_call``), no autocast."""
    params = {k: (v.detach().to(torch.float64) if v.is_floating_point() else v)
              for k, v in list(module.named_parameters()) + list(module.named_buffers())}
    args64 = tuple(_cast64(a) for a in args)
    kwargs64 = {k: _cast64(v) for k, v in kwargs.items()}

    def f(x: Tensor) -> Tensor:
        a, kw = with_state(args64, kwargs64, where, x)
        with torch.autocast(x.device.type, enabled=False):
            return _output(module, torch.func.functional_call(module, params, a, kw))
    return f


def _recorded_fn(fn: Fn, attn: Optional[nn.Module], samples: int
                 ) -> Callable[[Tensor], Tuple[Tensor, Tuple[float, Optional[float], Peaks]]]:
    """``Step.record``: ``fn`` under the recorder (and the attention's input hooked for its logits)."""
    recording = _recording(fn)

    def record(x: Tensor) -> Tuple[Tensor, Tuple[float, Optional[float], Peaks]]:
        seen: List[Tensor] = []
        handle = None
        if attn is not None:
            def keep(mod: nn.Module, args: tuple, kwargs: dict) -> None:
                found = state_of(mod, args, kwargs)
                if found is not None:
                    seen.append(found[0])
            handle = attn.register_forward_pre_hook(keep, with_kwargs=True)
        try:
            out, (val, peaks) = recording(x)
        finally:
            if handle is not None:
                handle.remove()
        logit = attn.attention_stats(seen[0], samples=samples, kappa=False)["max_logit"] \
            if attn is not None and seen else None
        return out, (val, logit, peaks)
    return record


def calls_steps(calls: Sequence[Call], dt: float, certs: Optional[Sequence[Optional[BlockCertificate]]] = None,
                logit_samples: int = 8, kappa: Optional[Callable[[int, nn.Module], float]] = None) -> List[Step]:
    """Steps from captured velocity calls (in depth order, ``X_{k+1} = X_k + dt v_k(X_k)``)."""
    steps = []
    for k, c in enumerate(calls):
        x = c.x.detach()
        fn = _call_fn(c.module, c.args, c.kwargs, c.where)
        out = c.out.detach() if c.out is not None else None
        if out is None:
            with torch.no_grad():
                out = fn(x)
        attn = attention_module(c.module)  # capability: the first submodule with attention_stats()
        kap = None
        if attn is not None:
            kap = (lambda a=attn, k=k: kappa(k, a)) if kappa is not None else \
                (lambda a=attn: a.attention_stats()["kappa"])
        record = _recorded_fn(fn, attn, logit_samples)
        steps.append(Step(c.name, "update", x, fn, token_norm_max(x + dt * out.to(x.dtype)), dt=dt,
                          fn64=_call_fn64(c.module, c.args, c.kwargs, c.where),
                          cert=None if certs is None else certs[k],
                          peak=lambda r=record, x=x: r(x.detach().requires_grad_(True))[1], kappa=kap, key=c.name,
                          record=record))
    return steps


def _velocity_hooks(cm: CertifiedModel, calls: Dict[int, Call],
                    replace_last: Optional[Callable[[Tensor], Tensor]] = None) -> List[Any]:
    """Hooks capturing each velocity's call (an update whose entry and exit differ, a gained branch: the entry's
    input, the exit's output; the view is then called with the state first)."""
    handles = []
    last = len(cm.modules) - 1

    def pre(k: int, view: bool) -> Callable:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            found = state_of(mod, args, kwargs) if k not in calls else None
            if found is not None:
                rest_args, rest_kwargs = _without_state(args, kwargs, found[1])
                calls[k] = Call(cm.names[k], cm.modules[k], found[0], rest_args, rest_kwargs,
                                where=0 if view else found[1])
        return hook

    def post(k: int) -> Callable:
        def hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            y = velocity_output(output)
            if k in calls and calls[k].out is None and y is not None:
                calls[k].out = y
            if k == last and replace_last is not None and y is not None:
                return replace_output(output, replace_last(y))
            return None
        return hook

    for k in range(len(cm.modules)):
        entry, exit_ = cm.io(k)
        handles.append(entry.register_forward_pre_hook(pre(k, entry is not cm.modules[k]), with_kwargs=True))
        handles.append(exit_.register_forward_hook(post(k), with_kwargs=True))
    return handles


def module_steps(model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], ups: CertifiedModel, *,
                 loss: Optional[Callable[[Tensor], Tensor]], loss_gradient: Optional[float],
                 certs: Optional[Sequence[Optional[BlockCertificate]]], head_cert: Optional[BlockCertificate],
                 logit_samples: int) -> Source:
    """The steps of a model whose forward is the chain of its updates (``ups.stack_forward``: a
    :class:`~certblocks.CertifiedStack`, a zoo model) on ``args``/``kwargs`` (module docstring)."""
    calls: Dict[int, Call] = {}
    handles = _velocity_hooks(ups, calls)
    try:
        with torch.no_grad():
            output = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    missing = [ups.names[k] for k in range(len(ups.modules)) if k not in calls or calls[k].out is None]
    if missing:
        raise ValueError(f"the forward of {type(model).__name__} on the batch did not call the velocities "
                         f"{missing[:3]}{' ...' if len(missing) > 3 else ''}: not a residual stack of its updates")
    dt = ups.dt
    ordered = [calls[k] for k in range(len(ups.modules))]
    steps = calls_steps(ordered, dt, certs, logit_samples)
    last = ordered[-1]
    x_d = (last.x + dt * last.out.to(last.x.dtype)).detach()
    main, scalar = split_output(output)
    notes: List[str] = []
    if ups.kind == "stack":  # the output is the last state
        if loss is not None:
            head = Head(x_d, loss_fn=loss, detail="the loss's gradient at X_D (autograd)")
        else:
            head = Head(x_d, lip_g=ups.lip_g, detail="the stack's declared Lip(G) (its output is its last state)")
        return Source(steps, head, token_norm_max(ordered[0].x), notes=notes)

    x_prev = last.x.detach()
    params = {k: v.detach() for k, v in list(model.named_parameters()) + list(model.named_buffers())}

    def run_with_state(x: Tensor) -> Any:
        """The model's forward with the last velocity's output replaced so that the last state is ``x``."""
        hs = _velocity_hooks(ups, {}, replace_last=lambda y: ((x - x_prev) / dt).to(y.dtype))
        try:
            return torch.func.functional_call(model, params, args, kwargs)
        finally:
            for h in hs:
                h.remove()

    def out_fn(x: Tensor) -> Tensor:
        m, _ = split_output(run_with_state(x))
        if m is None:
            raise ValueError(f"{type(model).__name__} returned no floating-point output to differentiate")
        return m

    lg = float(getattr(model, "loss_gradient", 1.0)) if loss_gradient is None else float(loss_gradient)
    record_out = _recording(out_fn)
    if loss is not None:
        def record_loss(x: Tensor) -> Tuple[Tensor, Tuple[float, Peaks]]:
            out, figures = record_out(x)  # the head's output is recorded, not the loss's internals
            with torch.enable_grad():
                return loss(out), figures
        head = Head(x_d, loss_fn=lambda x: loss(out_fn(x)), detail="the loss's gradient at X_D (autograd)",
                    record=record_loss)
    elif scalar is not None:
        own_loss = lambda x: split_output(run_with_state(x))[1]  # noqa: E731 - the forward of the logits gives it
        head = Head(x_d, loss_fn=own_loss, record=_recording(own_loss),
                    detail="the model's own loss output, its gradient at X_D (autograd)")
    else:
        head = Head(x_d, fn=out_fn, loss_gradient=lg, cert=head_cert, record=record_out,
                    detail=f"||DG(X_D)|| (Lanczos) x loss gradient bound {lg:.4g}")
        if main is None:
            raise ValueError(f"{type(model).__name__} returned no floating-point output")
    return Source(steps, head, token_norm_max(ordered[0].x), notes=notes)


def _recording(fn: Fn) -> Callable[[Tensor], Tuple[Tensor, Tuple[float, Peaks]]]:
    """``Head.record`` of ``fn``: its output with the graph, and its peaks (one recorded forward)."""
    def record(x: Tensor) -> Tuple[Tensor, Tuple[float, Peaks]]:
        out, val, by_dtype = recorded_call(fn, x)
        return out, (val, named_peaks(by_dtype))
    return record


def named_peaks(by_dtype: Dict[torch.dtype, float]) -> Peaks:
    """Per-dtype peaks keyed by the dtype's canonical name (dtypes certblocks has no name for are left out)."""
    out: Peaks = {}
    for dt, v in by_dtype.items():
        try:
            name = dtype_name(dt)
        except (TypeError, ValueError):
            continue
        out[name] = max(out.get(name, 0.0), v)
    return out
