"""Bounds of every intermediate's gradient, and the largest safe static loss scale (docs/theory.md section 7).

The forward certificate bounds every value a model computes; this module bounds every gradient its backward
computes, node by node, so that each can be checked against the ``M`` of the dtype it is held in.  Under a static
loss scale ``S`` a gradient held in fp16 carries ``S`` times the costate, so the largest safe scale is

    S* = min over fp16 gradient tensors of M_16 / (bound of that gradient's entries)     (docs/theory.md section 7)

**The norm.**  The forward bounds use the row norm ``N(t)``: the largest Euclidean norm of ``t`` along its last
dimension (docs/theory.md section 1), and a Jacobian bound is an operator norm induced by row norms.  The adjoint of
a linear map has the same operator norm between the dual norms, and the dual of ``N`` is ``N*(g)``, the *sum* over
the rows of their Euclidean norms.  So a local derivative bound ``||du/dt|| <= L`` of the forward gives
``N*(dL/dt) <= L N*(dL/du)`` for the backward, and reverse-mode propagation over the users ``u`` of ``t``

    N*(dL/dt) <= sum_u ||du/dt|| N*(dL/du)

bounds every gradient from the costate at a segment's output.  This is the costate norm of the chain
(docs/theory.md sections 3.3 and 6.1: cross-entropy with mean reduction gives ``N*(dL/dlogits) <= sqrt(2)``, and
``Lip(G)`` and the factors ``log(1 + dt L_k(R_k))`` are forward operator norms).  A second bound, ``rows``, follows
the largest row norm through the ops that map each row of their output back to one row of their input (pointwise
ops, linear maps of the last dimension, normalizations and softmax over it, views and permutes that keep it, and an
attention's queries); elsewhere a row is at most the sum of all rows.  Every entry of a gradient is at most its
largest row norm.

**The local derivatives** are read from the rules of :mod:`certblocks.trace.rules` themselves: a rule computes a
node's Jacobian bound by the chain rule, ``J_u = sum_t L_ut(bounds of u's arguments) J_t``, so the rule evaluated
with a unit Jacobian on one argument and zero on the others returns ``L_ut`` at the forward bounds (a linear map by a
constant: ``||W||_op``; add: 1 with broadcast factors; mul: the other factor's entry bound; activations: their
Lipschitz constants; softmax: 1/2; normalizations: ``||gamma|| / sqrt(eps)``; views and permutes: the row factors of
the forward; the table below).  Where a rule reads a whole pattern (a normalization or a
softmax written out), a module atom, or a module with its own certificate, the pattern is a *group*: the gradient of
its input is the smaller of the sum over its ops and the group's own Jacobian bound times the gradient of its output
(for a certified module, its certificate's ``l1 R^sigma + l0``); the gradients of the nodes inside come from the
rules applied op by op (the module traced without its own certificate).  Autograd's backward of an op that the
forward calls discontinuous is bounded all the same: ``where`` and ``masked_fill`` pass a masked gradient (at most 1),
rounding and sign ops pass zero, ``detach`` stops it.

**Parameters.**  A gradient also reaches every parameter and the tensors computed from parameters alone (casts,
transposes); their entries are bounded at the op that uses them with the activation they multiply (a Linear's
weight: ``|dW_ij| <= max|x| N*(g)``; a bias: ``N*(g)``; a normalization's scale: ``sqrt(n) N*(g)``).  Under autocast
an op that runs in a lower precision than its argument casts the argument inside the op: the gradient of that hidden
cast is held in the op's dtype (``kind="hidden"``), the one a GradScaler sees overflow in a Linear's fp16 weight
gradient.

**A model** (:func:`model_gradient_bounds`) is cut into its chain of segments (docs/theory.md section 6.1); the
costate at each segment boundary is bounded by the chain's certificate, ``Lip(G)`` times the product of the later
segments' backward factors (:func:`certblocks.certificate.certify_stack` computes them), and the op-by-op bound
starts from it at the segment's output and is itself capped by it at the segment's input.  Unknown is never zero: a
gradient that no bound reaches is ``inf`` with the op that stops it named, and the loss scale is then not certified.

The bounds are of the gradient autograd computes, in exact arithmetic; :data:`ROUNDING_MARGIN` covers the roundings
of the backward's own low-precision arithmetic.

=====================================================  ===========================================================
op                                                     local bound ``||du/dt||`` (the rules' chain-rule factors)
=====================================================  ===========================================================
linear / matmul / conv by a constant                   ``||W||_op`` (conv: the largest row sum of ``|W|``, times the
                                                       ``sqrt`` of the output's last dim)
matmul of two activations ``A @ B``                    in ``A``: ``sqrt(k) N(B)``; in ``B``: ``sqrt(k) N(A)`` (rows
                                                       of a softmax: 1)
add / sub / where / masked_fill                        ``|alpha|`` times the broadcast factor (``sqrt(d)`` for a
                                                       broadcast last dim); a switch's mask passes at most 1
mul ``x * y``                                          the other factor's entry bound (times the broadcast factor)
div by a denominator ``>= m > 0``                      ``1/m`` in the numerator, ``max|x| / m^2`` in the denominator
Lipschitz and saturating activations                   their Lipschitz constant (``bounds.activations``)
exp of a nonpositive argument; ``x^p``, ``p >= 1``     1; ``p max|x|^(p-1)``
rsqrt / reciprocal of ``z >= m > 0``                   ``m^(-3/2) / 2``; ``1 / m^2``
softmax (last dim); log_softmax                        1/2; ``1 + sqrt(k)``
layer_norm / rms_norm / group_norm                     ``max|gamma| / sqrt(eps)``-type constants (``bounds.
                                                       normalization``)
normalization or softmax written out (recognized)      the group's bound (1/sqrt(eps), 1/2), min with the ops inside
scaled_dot_product_attention                           in V: 1; in Q: ``|s| N(K) spread(V)``; in K: ``|s| N(Q)
                                                       spread(V)``
views / permutes / selects / cat / expand              the forward's row factors (1 when rows are kept; ``sqrt(d)``
                                                       for a broadcast last dim)
sum / mean / amax / pools; casts                       the rules' factors; ``1 + u`` for a rounding cast
module atom / module with its own certificate          ``l1 max(R, 1)^sigma + l0`` at its input's bound, min with
                                                       the ops inside
round / sign / detach                                  0 (autograd passes no gradient)
a parameter of linear / matmul / conv                  ``|dW_ij| <= max|x| N*(g)`` (conv: times ``sqrt`` of the
                                                       output's last dim)
a bias, an added parameter; a normalization's scale    ``N*(g)`` (``sqrt(d) N*(g)`` broadcast along the last dim);
                                                       ``sqrt(n) N*(g)``
an embedding table                                     ``N*(g)``
an op without a rule                                   unknown: every gradient upstream is unbounded, the op named
=====================================================  ===========================================================

**Where it lives.**  This module holds the model-level bound (:func:`model_gradient_bounds`), the loss scale
(:func:`loss_scale_from`, :func:`max_loss_scale`) and the measurement against autograd (:func:`autograd_gradients`,
:func:`gradient_violations`); :mod:`certblocks.trace._backward_segment` the bound of one segment
(:func:`segment_gradients`), :mod:`certblocks.trace._backward_results` the result types and
:mod:`certblocks.trace._backward_ops` the op tables and graph readers they share.  Every name is importable from here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

from ..certificate import StackCertificate
from ._backward_ops import _COPIES, _INF, _MOVES, _NO_GRADIENT, _dtype, _op, _positions, _rows, _shape, needs_grad
from ._backward_results import (
    GRAD_SCALER_INIT,
    ROUNDING_MARGIN,
    GradBound,
    LossScale,
    ModelGradients,
    NodeGradient,
    SegmentGradients,
)
from ._backward_results import ZERO as ZERO  # re-exported: importable from here as before the split
from ._backward_segment import _SegmentPass as _SegmentPass  # certblocks.fp8 reads a segment's forward bounds
from ._backward_segment import segment_gradients
from .capture import CapturedGraph
from .chain import model_chain, segment_name
from .nodes import bind_args
from .residual import find_residual_updates
from .rules.common import rounding_factor

__all__ = ["GradBound", "NodeGradient", "SegmentGradients", "ModelGradients", "LossScale", "ROUNDING_MARGIN",
           "GRAD_SCALER_INIT", "segment_gradients", "model_gradient_bounds", "max_loss_scale", "loss_scale_from",
           "autograd_gradients", "gradient_violations", "needs_grad"]


def _up(v: float) -> float:
    return math.nextafter(v, _INF) if math.isfinite(v) else _INF


def _chain_costates(stack: StackCertificate) -> List[float]:
    """``P_j`` for ``j = 0..n``: the bound on ``N*`` of the costate at the input of segment ``j`` (``P_n`` at the
    head's input: ``Lip(G)``), ``Lip(G)`` times the product of the later segments' backward factors."""
    n = len(stack.updates)
    P = [_INF] * (n + 1)
    P[n] = float(stack.lip_g)
    for j in reversed(range(n)):
        lf = stack.log_factors[j] if j < len(stack.log_factors) else math.nan
        f = math.exp(lf) if math.isfinite(lf) else (0.0 if lf == -_INF else _INF)
        P[j] = _up(_up(f) * P[j + 1]) if math.isfinite(P[j + 1]) and math.isfinite(f) else _INF
    return P


def model_gradient_bounds(g: CapturedGraph, stack: StackCertificate, *, loss: Union[None, str, float] = "cross_entropy",
                          loss_rows: Optional[int] = None, dtypes: Optional[Mapping[str, torch.dtype]] = None,
                          inputs: bool = False) -> ModelGradients:
    """Bound the gradient of every tensor of a model's backward from its chain's certificate.

    Args:
        g: the captured graph (under the precision policy: each node's dtype is read from it unless ``dtypes``).
        stack: the chain's certificate (:meth:`ModelCertificate.stack` of the same graph): its radii, backward factors,
            ``Lip(G)`` and loss gradient.
        loss: the loss the stack was certified with; ``"cross_entropy"`` or ``"mse"`` (mean reduction) bound each row
            of the output's gradient by the stack's loss gradient over the number of rows (``loss_rows``).
        loss_rows: the number of rows the mean runs over (default: every row of the output; targets ignored by the
            loss make it smaller: pass the smallest count).
        dtypes: node name -> dtype (a hidden cast takes its op's).
        inputs: count the gradient of a floating model input too (it requires grad).

    Returns:
        The :class:`ModelGradients`: a :class:`NodeGradient` per activation, parameter and hidden cast.

    Raises:
        ValueError: the graph is not one chain, or the stack does not have its segments.
    """
    chain = model_chain(g, find_residual_updates(g))
    if chain is None or not chain.segments:
        why = chain.notes[0] if chain is not None and chain.notes else "it has no residual update"
        raise ValueError(f"the graph is not one chain of segments ({why}): its gradients are not bounded")
    segs = list(chain.segments)
    head = segs.pop() if segs[-1].kind == "head" else None
    if len(segs) != len(stack.updates) or (head is None) != (stack.head is None):
        raise ValueError(f"the stack has {len(stack.updates)} segments{' and a head' if stack.head else ''}, the "
                         f"graph's chain {len(segs)}{' and a head' if head else ''}: certify the same graph")
    n = len(segs)
    P = _chain_costates(stack)
    grad = needs_grad(g, inputs=inputs)
    dep = g.depends_on_input()
    notes: List[str] = []
    out_total = float(stack.loss_grad) if head is not None else P[n]
    out_rows = out_total
    out_node = head.end if head is not None else segs[-1].end
    if loss in ("cross_entropy", "ce", "mse"):
        rows = loss_rows if loss_rows is not None else _rows(_shape(g, out_node))
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"loss_rows must be an integer >= 1, got {loss_rows!r}")
        out_rows = _up(out_total / rows)
    order = ([("head", head, len(segs))] if head is not None else []) + \
        [(s.kind, s, j) for j, s in reversed(list(enumerate(segs)))]
    g_next = GradBound.of(out_total, out_rows)
    found: Dict[str, NodeGradient] = {}
    acc: Dict[str, Tuple[float, str]] = {}
    hidden: List[NodeGradient] = []
    for kind, seg, j in order:
        radius = float(stack.radii[j]) if j < len(stack.radii) else _INF
        label = f"{kind} {segment_name(g, seg)}"
        cap = GradBound.of(P[j], why=f"the chain's costate at the input of segment {j} ({label}) is not bounded")
        if not math.isfinite(g_next.total) and not g_next.why:
            g_next = dataclasses.replace(g_next, why=f"the chain's costate at the output of {label} is not bounded")
        if not math.isfinite(radius):
            notes.append(f"{label}: the forward radius is not finite: its local derivatives are not bounded")
        sp = _SegmentPass(g, seg.start, seg.end, radius, grad, None, dtypes)
        res = sp.run(g_next, cap)
        for name, gb in res.bounds.items():
            base, _, k = name.partition("#")
            node = g.nodes[g.index[base]]
            dt = _dtype(g, node, dtypes)
            conc = g.env.get(base)
            if k and isinstance(conc, (tuple, list)) and int(k) < len(conc) and isinstance(conc[int(k)], torch.Tensor):
                dt = conc[int(k)].dtype
            ng = NodeGradient(name, _op(node), g.module_path(node), label, dt, gb)
            if name not in found or gb.entry < found[name].entry:
                found[name] = ng
        for a, (e, why) in res.parameters.items():
            old = acc.get(a, (0.0, ""))
            acc[a] = (old[0] + e, old[1] or why)
        for u, a, dt, e, why in res.hidden:
            node = g.nodes[g.index[u]]
            hidden.append(NodeGradient(f"{u}:{a}", _op(node), g.module_path(node), label, dt,
                                       GradBound(_INF, _INF, e, why if not math.isfinite(e) else ""), "hidden"))
        g_next = res.bounds.get(seg.start.name, cap)
    params = _parameter_pass(g, grad, dep, acc, dtypes)
    every = list(found.values()) + params + hidden
    every.sort(key=lambda ng: g.index.get(ng.name.partition("#")[0].partition(":")[0], -1))
    return ModelGradients(every, P, notes + [str(x) for x in chain.notes])


def _parameter_pass(g: CapturedGraph, grad: Set[str], dep: Set[str], acc: Dict[str, Tuple[float, str]],
                    dtypes: Optional[Mapping[str, torch.dtype]]) -> List[NodeGradient]:
    """The gradients of the parameters and of the tensors computed from them alone, from the bounds the segments
    left at their uses, back through the parameter side's casts, views and copies."""
    out: List[NodeGradient] = []
    side = [n for n in g.nodes if n.name in grad and n.name not in dep]
    for n in reversed(side):
        e, why = acc.get(n.name, (0.0, ""))
        module = g.params.get(n.name, "") or g.module_path(n)
        out.append(NodeGradient(n.name, _op(n), module, "", _dtype(g, n, dtypes),
                                GradBound(_INF, _INF, e, why if not math.isfinite(e) else ""), "parameter"))
        if n.op != "call_function" or e == 0.0:
            continue
        for a in dict.fromkeys(n.all_input_nodes):
            if a.name not in grad or a.name in dep:
                continue
            c, cwhy = _parameter_local(g, n, a, e, dtypes)
            old = acc.get(a.name, (0.0, ""))
            acc[a.name] = (old[0] + c, old[1] or cwhy or (why if not math.isfinite(c) else ""))
    return out


def _parameter_local(g: CapturedGraph, n: torch.fx.Node, a: torch.fx.Node, e: float,
                     dtypes: Optional[Mapping[str, torch.dtype]]) -> Tuple[float, str]:
    """The entry bound reaching ``a`` from an entry bound ``e`` of the gradient of ``n``, both of the parameter side."""
    name = _op(n)
    if not math.isfinite(e):
        return _INF, ""
    so, sa = _shape(g, n), _shape(g, a)
    copies = math.prod(so) / max(math.prod(sa), 1) if sa else float(max(math.prod(so), 1))
    copies = max(copies, 1.0)
    b = bind_args(n) or {}
    pos = _positions(n, a)
    if name in _NO_GRADIENT:
        return 0.0, ""
    if name in _MOVES:
        return e * rounding_factor(_dtype(g, n, dtypes), _dtype(g, a, dtypes)), ""
    if name in _COPIES:
        return e * copies, ""
    if name in ("aten.mul", "aten.multiply", "aten.div", "aten.divide", "aten.true_divide") and len(pos) == 1:
        other = b.get("other") if pos[0] == "self" else b.get("self")
        ov = g.env.get(other.name) if isinstance(other, torch.fx.Node) else other
        if isinstance(ov, torch.Tensor):
            ov = ov.detach().double()
            if name.startswith("aten.div") and pos[0] == "self":
                if bool((ov == 0).any()):
                    return _INF, f"{name} ({n.name}): division by a tensor with zeros"
                m = float((1.0 / ov).abs().max())
            elif name.startswith("aten.div"):
                return _INF, f"{name} ({n.name}): no bound of the gradient of its denominator {a.name}"
            else:
                m = float(ov.abs().max()) if ov.numel() else 0.0
        elif isinstance(ov, (int, float)):
            m = abs(float(ov)) if not name.startswith("aten.div") else (1.0 / abs(float(ov)) if ov else _INF)
        else:
            return _INF, f"{name} ({n.name}): no bound of the gradient of {a.name}"
        return e * copies * m, ""
    if name in ("aten.add", "aten.sub", "aten.subtract", "aten.rsub") and len(pos) == 1:
        alpha = b.get("alpha", 1)
        scaled_pos = "other" if name != "aten.rsub" else "self"
        f = abs(float(alpha)) if pos[0] == scaled_pos and isinstance(alpha, (int, float)) else 1.0
        return e * copies * f, ""
    if name == "aten.embedding" and pos == ["weight"]:
        idx = g.env.get(b["indices"].name) if isinstance(b.get("indices"), torch.fx.Node) else None
        if isinstance(idx, torch.Tensor) and idx.numel():
            return e * float(torch.bincount(idx.reshape(-1).long().clamp_min(0)).max()), ""
    return _INF, f"{name} ({n.name}): no bound of the gradient of its parameter-side argument {a.name}"


def loss_scale_from(gradients: ModelGradients, low: torch.dtype = torch.float16) -> LossScale:
    """``S*``: the largest static loss scale with which no gradient held in ``low`` overflows.

    Args:
        gradients: the model's gradient bounds (:func:`model_gradient_bounds`).
        low: the low-precision dtype (fp16: ``M = 65504``).

    Returns:
        The :class:`LossScale`: ``M / ((1 + ROUNDING_MARGIN) max entry bound)`` over the gradients held in ``low``,
        the node that sets it; ``0.0`` (not certified) when one of them is not bounded.
    """
    if not isinstance(low, torch.dtype) or not low.is_floating_point:
        raise TypeError(f"low must be a floating torch.dtype, got {low!r}")
    M = float(torch.finfo(low).max)
    held = [ng for ng in gradients.gradients if ng.dtype == low]
    every = tuple(gradients.gradients)
    lname = str(low).replace("torch.", "")
    unknown = [ng for ng in held if not math.isfinite(ng.entry)]
    if unknown:
        ng = unknown[-1]
        why = ng.bound.why or "its bound is not derived"
        return LossScale(0.0, ng.name, ng.module, low, False, False, True,
                         f"no loss scale is certified: the {lname} gradient of {ng.name} ({ng.module or ng.op}) is not "
                         f"bounded: {why}", every, _INF)
    if not held or max(ng.entry for ng in held) == 0.0:
        return LossScale(_INF, "", "", low, True, True, False,
                         f"no gradient is held in {lname}: any loss scale is safe", every, 0.0)
    ng = max(held, key=lambda x: x.entry)
    value = M / _up(ng.entry * (1.0 + ROUNDING_MARGIN))
    above = GRAD_SCALER_INIT > value
    reason = (f"S* = {value:.4g}: set by the {lname} gradient of {ng.name} ({ng.module or ng.op}, {ng.kind}), entries "
              f"<= {ng.entry:.4g}; " + ("an unscaled step cannot overflow" if value >= 1 else
                                         "even an unscaled step may overflow") +
              (f"; a GradScaler starting at {GRAD_SCALER_INIT:g} is above it and skips steps until it comes down"
               if above else f"; a GradScaler starting at {GRAD_SCALER_INIT:g} is below it"))
    return LossScale(value, ng.name, ng.module, low, True, value >= 1.0, above, reason, every, ng.entry)


def max_loss_scale(model: nn.Module, example_input: Any, *, r0: Optional[float] = None,
                   loss: Union[None, str, float] = "cross_entropy", loss_rows: Optional[int] = None,
                   autocast_dtype: Optional[torch.dtype] = torch.float16, device_type: str = "cpu",
                   low: torch.dtype = torch.float16, dtypes: Optional[Mapping[str, torch.dtype]] = None,
                   target_radius: float = 0.0) -> LossScale:
    """The largest static loss scale of a model under autocast (docs/theory.md section 7).

    Captures the model under ``torch.autocast(device_type, autocast_dtype)`` (each node's dtype is the one that
    autocast gives it on that device), certifies its chain, bounds every gradient (:func:`model_gradient_bounds`) and
    returns :func:`loss_scale_from`.

    Args:
        model: the model (in eval mode: dropout off).
        example_input: a batch (tensor, tuple of arguments or dict of keyword arguments); the bounds hold for inputs
            of its shapes.
        r0: the bound on the input's per-token norm, the Euclidean norm along its last dimension (not needed for token
            ids; a zoo model's ``input_radius()`` is the bound after its stem, not this one).
        loss: ``"cross_entropy"``, ``"mse"``, ``None`` or a number (as :meth:`ModelCertificate.stack`).
        loss_rows: the number of rows the loss's mean runs over (default: every row of the output).
        autocast_dtype: the autocast dtype (``None``: no autocast, each tensor in its own dtype).
        device_type: the autocast device type (``"cpu"``, ``"cuda"``): its lists decide each op's dtype.
        low: the dtype whose ``M`` the gradients are checked against.
        dtypes: node name -> dtype, overriding the captured run's.
        target_radius: bound on the targets' per-token norm, for ``loss="mse"``.

    Raises:
        ValueError: a float input without ``r0``; the model is not one chain.
    """
    import contextlib

    from ..model import as_args
    from .api import _certify_chain
    from .capture import capture

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    args, kw = as_args(example_input)
    ctx = torch.autocast(device_type, autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    with ctx:
        g = capture(model, args, kw)
    chain = model_chain(g, find_residual_updates(g))
    if chain is None or not chain.segments:
        raise ValueError(f"{type(model).__name__} is not one chain of segments: its gradients are not bounded")
    mc = _certify_chain(g, chain, type(model).__name__)
    if r0 is None:
        if not mc.integer_input:
            raise ValueError(f"r0 is needed for {type(model).__name__}: a bound on its input's per-token norm (the "
                             "Euclidean norm along the input's last dimension; token ids need none)")
        r0 = 1.0
    stack = mc.stack("fp32", r0=r0, loss=loss, target_radius=target_radius)
    grads = model_gradient_bounds(g, stack, loss=loss if isinstance(loss, str) or loss is None else None,
                                  loss_rows=loss_rows, dtypes=dtypes)
    return loss_scale_from(grads, low)


# ---------------------------------------------------------------------------------------------------- measurement
def autograd_gradients(g: CapturedGraph, args: Sequence[Any], cotangent: Union[torch.Tensor, Callable[[Any], Any]], *,
                       autocast_dtype: Optional[torch.dtype] = None, device_type: str = "cpu",
                       inputs_require_grad: bool = False) -> Dict[str, torch.Tensor]:
    """The gradient autograd computes for every node of a captured graph (for the searches against the bounds).

    Runs the exported program on ``args`` (optionally under autocast) with fresh copies of the parameters that
    require grad, keeps the gradient of every floating node and parameter, and back-propagates ``cotangent`` from
    the first output (a tensor: ``sum(out * cotangent)``; a callable: ``cotangent(out)`` is the loss).

    Returns:
        node name -> its gradient (``None`` gradients are left out).
    """
    import contextlib

    ep = g.ep
    params = dict(g.root.named_parameters(remove_duplicate=False))
    specs = list(ep.graph_signature.input_specs)
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    state = ep.state_dict
    consts = getattr(ep, "constants", {}) or {}
    user = iter(args)
    vals: List[Any] = []
    leaves: Dict[str, torch.Tensor] = {}
    for ph, spec in zip(placeholders, specs):
        if spec.kind.name == "USER_INPUT":
            v = next(user)
            if inputs_require_grad and isinstance(v, torch.Tensor) and v.is_floating_point():
                v = v.detach().clone().requires_grad_(True)
                leaves[ph.name] = v
            vals.append(v)
            continue
        v = state[spec.target] if spec.target in state else consts.get(spec.target)
        p = params.get(g.params.get(ph.name, ""))
        if p is not None and p.requires_grad and v is not None:
            v = v.detach().clone().requires_grad_(True)
            leaves[ph.name] = v
        vals.append(v)
    kept: Dict[str, torch.Tensor] = {}

    class _Keep(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            r = super().run_node(n)
            if isinstance(r, torch.Tensor) and r.requires_grad and r.is_floating_point() and n.op != "placeholder":
                r.retain_grad()
                kept[n.name] = r
            return r

    ctx = torch.autocast(device_type, autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    with torch.enable_grad(), ctx:
        outs = _Keep(ep.graph_module, garbage_collect_values=False).run(*vals)
    out0 = outs[0] if isinstance(outs, (tuple, list)) else outs
    loss = cotangent(out0) if callable(cotangent) else (out0.double() * cotangent.double()).sum()
    loss.backward()
    res = {k: v.grad for k, v in kept.items() if v.grad is not None}
    res.update({k: v.grad for k, v in leaves.items() if v.grad is not None})
    return res


def gradient_violations(bounds: Mapping[str, GradBound], grads: Mapping[str, torch.Tensor], *,
                        rtol: float = 1e-6) -> List[str]:
    """Where a measured gradient exceeds its bound: ``N*``, the largest row or the largest entry.

    Args:
        bounds: node name -> :class:`GradBound`.
        grads: node name -> measured gradient (:func:`autograd_gradients`).
        rtol: relative tolerance for the measurement's own rounding.

    Returns:
        One line per violation (empty when every measured gradient is within its bound).
    """
    out = []
    for name, gb in bounds.items():
        t = grads.get(name)
        if t is None or t.numel() == 0:
            continue
        t = t.detach().double()
        rows = t.reshape(-1, t.shape[-1]) if t.dim() >= 1 else t.reshape(1, 1)
        norms = torch.linalg.vector_norm(rows, dim=-1)
        measured = (float(norms.sum()), float(norms.max()), float(t.abs().max()))
        for what, m, b in zip(("N*", "row", "entry"), measured, (gb.total, gb.rows, gb.entry)):
            if not math.isfinite(m):
                out.append(f"{name}: measured {what} is {m}")
            elif m > b * (1 + rtol) + 1e-300:
                out.append(f"{name}: measured {what} {m:.6g} > bound {b:.6g}")
    return out
