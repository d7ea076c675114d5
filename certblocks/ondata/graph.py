"""The trajectory of any module from its captured graph (:func:`graph_steps`).

Its graph on the batch (:func:`certblocks.trace.capture`), as :func:`certblocks.certify` finds the updates, the maps
between them, the stem and the head; a segment is evaluated node by node from its input, the other nodes read at
their value on the batch.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .sources import (
    Fn,
    Head,
    Peaks,
    Source,
    Step,
    _abs_max,
    named_peaks,
    token_norm_max,
)

__all__ = ["graph_steps", "subgraph_fn"]

_DTYPE_KW = ("dtype",)


def subgraph_fn(g: Any, env: Dict[str, Any], start: torch.fx.Node, end: torch.fx.Node, *, f64: bool = False) -> Fn:
    """``end`` as a function of ``start``'s value: the nodes between them evaluated in order, the others read
    from ``env``.  ``f64``: floating values and dtype arguments in float64, no autocast (a float64 twin)."""
    names = g.between(start, end)
    nodes = [n for n in g.nodes if n.name in names and n is not start]
    cache: Dict[str, Any] = {}

    def const(name: str) -> Any:
        v = env[name]
        if not f64:
            return v
        if name not in cache:
            cache[name] = v.to(torch.float64) if isinstance(v, Tensor) and v.is_floating_point() else v
        return cache[name]

    def fn(x: Tensor) -> Tensor:
        local: Dict[str, Any] = {start.name: x}
        load = lambda a: local[a.name] if a.name in local else const(a.name)
        for n in nodes:
            a = torch.fx.node.map_arg(n.args, load)
            kw = dict(torch.fx.node.map_arg(n.kwargs, load))
            if f64:
                for key in _DTYPE_KW:
                    if isinstance(kw.get(key), torch.dtype) and kw[key].is_floating_point:
                        kw[key] = torch.float64
            local[n.name] = n.target(*a, **kw)
        return local[end.name]

    if not f64:
        return fn

    def fn64(x: Tensor) -> Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return fn(x.to(torch.float64))
    return fn64


def _graph_peak(g: Any, names: set, skip: str) -> float:
    vals = [_abs_max(g.env.get(n)) for n in names if n != skip]
    return max(vals, default=0.0)


def _graph_peaks(g: Any, names: set, skip: str) -> Peaks:
    """:func:`_graph_peak` per dtype."""
    by_dtype: Dict[torch.dtype, float] = {}
    for n in names:
        v = g.env.get(n)
        if n != skip and isinstance(v, Tensor) and v.is_floating_point() and v.numel():
            by_dtype[v.dtype] = max(by_dtype.get(v.dtype, 0.0), _abs_max(v))
    return named_peaks(by_dtype)


def _graph_logit(g: Any, names: set, samples: int) -> Optional[float]:
    """Largest ``|logit|`` entering a softmax or a fused attention among ``names`` (masked entries left out)."""
    from ..trace.nodes import op_name

    best: Optional[float] = None
    for n in g.nodes:
        if n.name not in names or n.op != "call_function":
            continue
        op = op_name(n.target)
        val: Optional[float] = None
        if op in ("aten.softmax", "aten._softmax", "aten.special_softmax", "aten._safe_softmax"):
            z = g.env.get(n.args[0].name) if isinstance(n.args[0], torch.fx.Node) else None
            val = _abs_max(z[:samples]) if isinstance(z, Tensor) else None
        elif "scaled_dot_product" in op and len(n.args) >= 2:
            val = _sdpa_logit(g, n, samples)
        if val is not None:
            best = val if best is None else max(best, val)
    return best


def _sdpa_logit(g: Any, n: torch.fx.Node, samples: int) -> Optional[float]:
    get = lambda a: g.env.get(a.name) if isinstance(a, torch.fx.Node) else a
    q, k = get(n.args[0]), get(n.args[1])
    if not isinstance(q, Tensor) or not isinstance(k, Tensor):
        return None
    params = list(getattr(n.target, "_schema", None).arguments) if hasattr(n.target, "_schema") else []
    a = {p.name: get(v) for p, v in zip(params, n.args)}
    a.update({key: get(v) for key, v in n.kwargs.items()})
    q, k = q[:samples].double(), k[:samples].double()
    if k.shape[-3] != q.shape[-3] and q.shape[-3] % k.shape[-3] == 0:  # grouped-query heads
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = a.get("scale") or 1.0 / math.sqrt(q.shape[-1])
    logits = (q @ k.transpose(-2, -1)) * scale
    mask = a.get("attn_mask")
    keep = torch.ones(logits.shape[-2:], dtype=torch.bool, device=logits.device)
    if a.get("is_causal"):
        keep = keep.tril()
    logits = logits.masked_fill(~keep, 0.0)
    if isinstance(mask, Tensor):
        mask = mask[:samples] if mask.ndim == 4 and mask.shape[0] > 1 else mask
        if mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, 0.0)
        else:  # an additive mask: its masking entries (-inf, or a finfo.min sentinel) remove the pair
            masked = mask <= torch.finfo(mask.dtype).min / 4 if mask.is_floating_point() else torch.zeros_like(
                mask, dtype=torch.bool)
            logits = (logits + mask.double()).masked_fill(masked, 0.0)
    return _abs_max(logits)


def _graph_attention(g: Any, names: set) -> Optional[nn.Module]:
    for n in g.nodes:
        if n.name in names:
            for path, _ in g.module_stack(n):
                m = g.get_module(path)
                if m is not None and callable(getattr(m, "attention_stats", None)):  # the capability
                    return m
    return None


def graph_steps(model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], *,
                loss: Optional[Callable[[Tensor], Tensor]], loss_gradient: Optional[float], certified: bool,
                logit_samples: int, capture_cache: Optional[Dict[Any, Any]] = None) -> Source:
    """The steps of any module from its graph on the batch (module docstring); ``capture_cache``: see
    :func:`certblocks.trace.capture.capture`'s ``cache``."""
    from ..trace.api import certify_velocity
    from ..trace.capture import capture
    from ..trace.chain import model_chain, segment_name
    from ..trace.residual import find_residual_updates, velocity_name

    g = capture(model, args, kwargs, cache=capture_cache)
    ups = find_residual_updates(g)
    if not ups:
        raise ValueError(f"{type(model).__name__} has no residual update X + f(X) in its graph: no trajectory")
    chain = model_chain(g, ups)
    if chain is None or not chain.segments:
        raise ValueError(f"the residual updates of {type(model).__name__} do not lie on one path from its input to "
                         "its output (chain notes: " + "; ".join(getattr(chain, "notes", []) or ["none"]) + ")")
    env = g.env
    notes = list(chain.notes)
    steps: List[Step] = []
    stem_peak, input_norm = 0.0, None
    stem_peaks: Peaks = {}
    head_seg = None
    used: Dict[str, int] = {}
    for k, seg in enumerate(chain.segments):
        if seg.kind == "stem":
            stem_peak = _graph_peak(g, g.between(seg.start, seg.end), seg.start.name)
            stem_peaks = _graph_peaks(g, g.between(seg.start, seg.end), seg.start.name)
            continue
        if seg.kind == "head":
            head_seg = seg
            continue
        x = env[seg.start.name]
        if input_norm is None:
            input_norm = token_norm_max(x)
        end = seg.velocity if seg.kind == "update" and seg.velocity is not None else seg.end
        name = (velocity_name(g, seg.velocity, seg.end) if seg.kind == "update" else segment_name(g, seg)) \
            or f"segment {k}"
        used[name] = used.get(name, 0) + 1
        if used[name] > 1:
            name = f"{name}#{used[name] - 1}"
        names = g.between(seg.start, end)
        cert = None
        if certified:
            try:
                cert = certify_velocity(g, seg.start, end, name).certificate
            except Exception as exc:  # a segment the tracer cannot certify: no certified factor, say why
                notes.append(f"{name}: no certificate ({type(exc).__name__}: {exc})")
        peak_val = _graph_peak(g, names, seg.start.name)
        peaks = _graph_peaks(g, names, seg.start.name)
        logit = _graph_logit(g, names, logit_samples)
        attn = _graph_attention(g, names)
        steps.append(Step(name, "update" if seg.kind == "update" else seg.kind, x, subgraph_fn(g, env, seg.start, end),
                          token_norm_max(env[seg.end.name]), dt=1.0 if seg.kind == "update" else 0.0,
                          fn64=subgraph_fn(g, env, seg.start, end, f64=True), cert=cert,
                          peak=lambda p=peak_val, lg=logit, ps=peaks: (p, lg, ps),
                          kappa=None if attn is None else (lambda a=attn: a.attention_stats()["kappa"]), key=name))
    if not steps:
        raise ValueError(f"{type(model).__name__}: the chain has no residual update")
    last = chain.segments[-1] if head_seg is None else head_seg
    xd_node = last.end if head_seg is None else head_seg.start
    x_d = env[xd_node.name]
    # the outputs that depend on the last state: a scalar (the model's loss) and the main output
    dep = [o for o in g.outputs if isinstance(env.get(o.name), Tensor) and env[o.name].is_floating_point()
           and g.is_ancestor(xd_node, o)]
    scalar = next((o for o in dep if env[o.name].ndim == 0), None)
    main = next((o for o in dep if env[o.name].ndim > 0), None)
    lg = float(getattr(model, "loss_gradient", 1.0)) if loss_gradient is None else float(loss_gradient)
    if main is None and scalar is None:
        raise ValueError(f"no floating-point output of {type(model).__name__} depends on its last state")
    head_names: set = set()
    if main is not None and main is not xd_node:
        out_fn = subgraph_fn(g, env, xd_node, main)
        head_names |= set(g.between(xd_node, main))
    else:
        out_fn = lambda x: x  # noqa: E731
    if scalar is not None:
        head_names |= set(g.between(xd_node, scalar))
    head_peak, head_peaks = _graph_peak(g, head_names, xd_node.name), _graph_peaks(g, head_names, xd_node.name)
    hp = lambda v=head_peak, ps=head_peaks: (v, ps)
    if loss is not None:
        head = Head(x_d, loss_fn=lambda x: loss(out_fn(x)), peak=hp, detail="the loss's gradient at X_D (autograd)")
    elif scalar is not None:
        head = Head(x_d, loss_fn=subgraph_fn(g, env, xd_node, scalar), peak=hp,
                    detail="the model's own loss output, its gradient at X_D (autograd)")
    else:
        hcert = None
        if certified and main is not xd_node:
            try:
                hcert = certify_velocity(g, xd_node, main, "head").certificate
            except Exception as exc:
                notes.append(f"head: no certificate ({type(exc).__name__}: {exc})")
        head = Head(x_d, fn=out_fn, loss_gradient=lg, cert=hcert, peak=hp,
                    fn64=None if main is xd_node else subgraph_fn(g, env, xd_node, main, f64=True),
                    detail=f"||DG(X_D)|| (Lanczos) x loss gradient bound {lg:.4g}")
    return Source(steps, head, input_norm or 0.0, stem_peak=stem_peak, notes=notes, stem_peaks=stem_peaks)
