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
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

from ..bounds.norms import rounded_up
from ..bounds.poly import Poly
from ..certificate import StackCertificate
from .capture import CapturedGraph
from .chain import model_chain, segment_name
from .interp import VelocityInterpreter, strict_rules
from .nodes import IDENTITY_OPS, VIEW_OPS, bind_args, op_name
from .own import call_bounds, rules_only
from .residual import find_residual_updates
from .rules import rule_for
from .rules.arithmetic import linear_sum, multiply
from .rules.common import rounding_factor
from .values import AValue, max_abs

__all__ = ["GradBound", "NodeGradient", "SegmentGradients", "ModelGradients", "LossScale", "ROUNDING_MARGIN",
           "GRAD_SCALER_INIT", "segment_gradients", "model_gradient_bounds", "max_loss_scale", "loss_scale_from",
           "autograd_gradients", "gradient_violations", "needs_grad"]

#: Relative margin on ``S*`` for the roundings of the backward's low-precision arithmetic (the bounds are exact).
ROUNDING_MARGIN = 2.0 ** -8
#: ``torch.amp.GradScaler``'s default initial scale.
GRAD_SCALER_INIT = 65536.0

_INF = math.inf
#: Ops whose autograd backward passes no gradient to any argument.
_NO_GRADIENT = frozenset({"aten.detach", "aten.round", "aten.floor", "aten.ceil", "aten.trunc", "aten.sign",
                          "aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.empty_like", "aten.rand_like",
                          "aten.randn_like", "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.new_empty",
                          "aten.sym_size", "aten.size", "aten.sym_numel", "aten._assert_tensor_metadata"})
#: Ops that act entry by entry (an argument of the output's shape maps each output row back to one row of it).
_POINTWISE = frozenset({
    "aten.relu", "aten.gelu", "aten.silu", "aten.mish", "aten.hardswish", "aten.abs", "aten.neg", "aten.positive",
    "aten.sigmoid", "aten.tanh", "aten.hardsigmoid", "aten.sin", "aten.cos", "aten.erf", "aten.softplus", "aten.elu",
    "aten.celu", "aten.selu", "aten.leaky_relu", "aten.rrelu", "aten.prelu", "aten.hardtanh", "aten.relu6",
    "aten.clamp", "aten.clip", "aten.clamp_min", "aten.clamp_max", "aten.exp", "aten.exp2", "aten.pow", "aten.square",
    "aten.reciprocal", "aten.rsqrt", "aten.add", "aten.sub", "aten.subtract", "aten.rsub", "aten.mul",
    "aten.multiply", "aten.div", "aten.divide", "aten.true_divide", "aten.where", "aten.masked_fill",
    "aten.maximum", "aten.minimum", "aten.fmax", "aten.fmin", "aten.addcmul", "aten.addcdiv", "aten.lerp",
    "aten.dropout", "aten.feature_dropout", "aten.alpha_dropout", "aten.feature_alpha_dropout", "aten.native_dropout",
}) | IDENTITY_OPS
#: Ops that move entries and keep every row's entries in one row of the result, in the same order.
_SELECTS = frozenset({"aten.select", "aten.slice", "aten.narrow", "aten.split", "aten.split_with_sizes",
                      "aten.unsafe_split", "aten.chunk", "aten.unbind", "aten.tensor_split"})
_CATS = frozenset({"aten.cat", "aten.concat", "aten.concatenate", "aten.stack"})
_MATMULS = frozenset({"aten.matmul", "aten.mm", "aten.bmm"})
_ATTENTION = frozenset({"aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
                        "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_flash_attention",
                        "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_attention_math",
                        "aten._scaled_dot_product_fused_attention_overrideable"})
_CONVS = frozenset({"aten.conv1d", "aten.conv2d", "aten.conv3d", "aten.convolution", "aten._convolution",
                    "aten.conv_transpose1d", "aten.conv_transpose2d", "aten.conv_transpose3d"})
#: Ops that copy or move a parameter's entries (the parameter side of the graph: casts, views, transposes).
_MOVES = (IDENTITY_OPS - {"aten.detach"}) | VIEW_OPS | _SELECTS | _CATS | frozenset({
    "aten.permute", "aten.transpose", "aten.t", "aten.swapaxes", "aten.swapdims", "aten.movedim", "aten.mT",
    "aten.numpy_T", "getitem", "aten.dropout"})
_COPIES = frozenset({"aten.expand", "aten.expand_as", "aten.broadcast_to", "aten.repeat", "aten.tile"})


# ---------------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class GradBound:
    """A bound of one gradient tensor ``g`` (``inf``: not bounded; ``why`` names what stops the bound).

    Attributes:
        total: ``N*(g)``, the sum over its rows of their Euclidean norms (the costate norm of the chain).
        rows: the largest Euclidean norm of a row (``<= total``).
        entry: every ``|g_i|`` (``<= rows`` for an activation; a parameter's may be bounded directly).
        why: why a bound is ``inf`` (the op or segment that stops it), ``""`` when finite.
    """

    total: float
    rows: float
    entry: float
    why: str = ""

    @classmethod
    def of(cls, total: float, rows: Optional[float] = None, why: str = "") -> GradBound:
        """The bound of a gradient with ``N* <= total`` and rows ``<= rows`` (default ``total``)."""
        r = total if rows is None else min(rows, total)
        return cls(total, r, r, why if not math.isfinite(r) else "")

    @property
    def known(self) -> bool:
        return math.isfinite(self.entry)


ZERO = GradBound(0.0, 0.0, 0.0)


@dataclass(frozen=True)
class NodeGradient:
    """The bound of one gradient tensor of a model's backward.

    Attributes:
        name: the node (``"u:a"`` for a hidden cast: the argument ``a`` cast inside the op ``u``).
        op: the node's op (``"placeholder"`` for a parameter).
        module: the module path of the node (a parameter: its name).
        segment: the segment it belongs to (``""``: the parameter side, shared by segments).
        dtype: the dtype the gradient is held in (the tensor's; a hidden cast: the op's).
        bound: its :class:`GradBound`.
        kind: ``"activation"``, ``"parameter"`` (a parameter or a tensor computed from parameters alone) or
            ``"hidden"`` (an autocast cast inside an op).
    """

    name: str
    op: str
    module: str
    segment: str
    dtype: Optional[torch.dtype]
    bound: GradBound
    kind: str = "activation"

    @property
    def entry(self) -> float:
        return self.bound.entry


@dataclass
class SegmentGradients:
    """The gradient bounds of one segment (:func:`segment_gradients`).

    Attributes:
        bounds: node name -> :class:`GradBound` for every node of the segment that carries a gradient (an op with
            several outputs: ``"name#k"`` per output).
        parameters: node name -> entry bound of the gradient reaching each parameter-side argument from this
            segment (summed over its uses here), with why when ``inf``.
        hidden: ``(op node, argument node, dtype, entry bound, why)`` for every argument cast inside an op to a
            dtype other than its own.
        radius: the radius at which the forward bounds were read.
    """

    bounds: Dict[str, GradBound] = field(default_factory=dict)
    parameters: Dict[str, Tuple[float, str]] = field(default_factory=dict)
    hidden: List[Tuple[str, str, Optional[torch.dtype], float, str]] = field(default_factory=list)
    radius: float = 0.0


@dataclass
class ModelGradients:
    """Every gradient bound of a model (:func:`model_gradient_bounds`): a :class:`NodeGradient` per tensor."""

    gradients: List[NodeGradient]
    costates: List[float]
    notes: List[str] = field(default_factory=list)

    def by_name(self) -> Dict[str, NodeGradient]:
        return {ng.name: ng for ng in self.gradients}


@dataclass(frozen=True)
class LossScale:
    """The largest static loss scale with which no gradient held in ``dtype`` can overflow (docs/theory.md section 7).

    Attributes:
        value: ``S* = min M / (entry bound)`` over the gradients held in ``dtype`` (divided by ``1 + ROUNDING_MARGIN``);
            ``inf`` when no gradient is held in it; ``0.0`` when one of them is not bounded (no scale is certified).
        node: the gradient that sets it (or the first one not bounded).
        module: that node's module path.
        dtype: the low-precision dtype checked (fp16).
        certified: every gradient held in ``dtype`` is bounded.
        safe_unscaled: ``value >= 1``: a step without a loss scale cannot overflow.
        grad_scaler_above: a GradScaler's initial scale (:data:`GRAD_SCALER_INIT`) is above ``value``: it skips steps
            until it has come down.
        reason: one line that says it.
        gradients: every bound (all dtypes), for reports.
        entry: the entry bound of ``node``'s gradient.
    """

    value: float
    node: str
    module: str
    dtype: torch.dtype
    certified: bool
    safe_unscaled: bool
    grad_scaler_above: bool
    reason: str
    gradients: Tuple[NodeGradient, ...] = ()
    entry: float = math.nan

    def __str__(self) -> str:
        return self.reason


# ---------------------------------------------------------------------------------------------------- helpers
def _eval(p: Optional[Poly], r: float) -> Optional[float]:
    """``p(r)`` rounded up; ``None`` when not derived or not finite."""
    if p is None or not math.isfinite(r):
        return None
    try:
        v = p(r)
    except (OverflowError, ValueError):
        return None
    v = rounded_up(v, max(len(p.terms), 1) + 2)
    return v if math.isfinite(v) else None


def _shape(g: CapturedGraph, n: Any) -> Tuple[int, ...]:
    v = g.env.get(n.name) if isinstance(n, torch.fx.Node) else None
    if isinstance(v, (tuple, list)):
        v = next((e for e in v if isinstance(e, torch.Tensor)), None)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _dtype(g: CapturedGraph, n: Any, dtypes: Optional[Mapping[str, torch.dtype]] = None) -> Optional[torch.dtype]:
    if dtypes is not None and isinstance(n, torch.fx.Node) and n.name in dtypes:
        return dtypes[n.name]
    v = g.env.get(n.name) if isinstance(n, torch.fx.Node) else None
    if isinstance(v, (tuple, list)):
        v = next((e for e in v if isinstance(e, torch.Tensor)), None)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _floating(v: Any) -> bool:
    if isinstance(v, (tuple, list)):
        return any(_floating(e) for e in v)
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _rows(shape: Sequence[int]) -> int:
    """The number of rows of a tensor of ``shape`` (1 for a 0-d or 1-d one)."""
    return max(math.prod(shape[:-1]), 1) if len(shape) >= 1 else 1


def _op(n: torch.fx.Node) -> str:
    return op_name(n.target) if n.op == "call_function" else n.op


def _positions(n: torch.fx.Node, a: torch.fx.Node) -> List[str]:
    """The schema names of the arguments of ``n`` that are ``a`` (in a list: the list's name)."""
    b = bind_args(n) or {}
    out = []
    for k, v in b.items():
        if v is a or (isinstance(v, (list, tuple)) and any(e is a for e in v)):
            out.append(k)
    return out


def needs_grad(g: CapturedGraph, *, inputs: bool = False) -> Set[str]:
    """The nodes whose gradient autograd computes: floating tensors computed from a parameter that requires grad
    (``inputs``: or from a floating model input), not through ``detach``."""
    params = dict(g.root.named_parameters(remove_duplicate=False)) if isinstance(g.root, nn.Module) else {}
    out: Set[str] = set()
    for n in g.nodes:
        if n.op == "placeholder":
            p = params.get(g.params.get(n.name, ""))
            if (p is not None and p.requires_grad) or (inputs and n in g.user_inputs and _floating(g.env.get(n.name))):
                out.add(n.name)
            continue
        if n.op != "call_function" or _op(n) in _NO_GRADIENT:
            continue
        if _floating(g.env.get(n.name)) and any(a.name in out for a in n.all_input_nodes):
            out.add(n.name)
    return out


class _Generic(VelocityInterpreter):
    """The interpreter with every module atom traced op by op (run inside :func:`rules_only`: no own certificates):
    the values of the nodes a collapsed call hides."""

    def _find_module_atoms(self, sub: Set[str]) -> Set[str]:
        self.atom_failures = {}
        return set()


@dataclass
class _Group:
    """A sub-graph whose input's gradient is also bounded by the group's Jacobian times its output's gradient."""

    input: str
    output: str
    members: Set[str]
    jacobian: Optional[float]
    row_local: bool
    label: str

    @property
    def scope(self) -> Set[str]:
        return self.members | {self.output}


# ---------------------------------------------------------------------------------------------------- one segment
class _SegmentPass:
    """The backward bound of one segment ``start -> end`` (see :func:`segment_gradients`)."""

    def __init__(self, g: CapturedGraph, start: torch.fx.Node, end: torch.fx.Node, radius: float,
                 grad: Set[str], it: Optional[VelocityInterpreter] = None,
                 dtypes: Optional[Mapping[str, torch.dtype]] = None) -> None:
        self.g, self.start, self.end, self.radius, self.grad, self.dtypes = g, start, end, radius, grad, dtypes
        if it is None:
            it = VelocityInterpreter(g, start, end)
            it.run()
        self.it = it
        self.generic: Optional[VelocityInterpreter] = None
        if it.certified_calls or it.atom_groups:
            gen = _Generic(g, start, end)
            with rules_only():
                gen.run()
            self.generic = gen
        sub = g.between(start, end)
        self.order = [n for n in g.nodes if n.name in sub]
        self.inside = sub
        self.values = self._merged()
        self.groups = self._groups()
        self._bounds_so_far: Dict[str, Any] = {}

    # forward bounds at the radius ---------------------------------------------------------------------------
    def _merged(self) -> Dict[str, Any]:
        """Node name -> the abstract value with its bounds evaluated at the radius (the smaller of the collapsed and
        the op-by-op interpretations, both sound), Jacobian zero: what the rules read to give local derivatives."""
        out: Dict[str, Any] = {k: v for k, v in self.it.values.items() if k not in self.inside}  # constants
        srcs = [self.it.values] + ([self.generic.values] if self.generic is not None else [])
        for n in self.order:
            cands = [s.get(n.name) for s in srcs if s.get(n.name) is not None]
            if not cands:
                continue
            if isinstance(cands[0], (list, tuple)):
                k = len(cands[0])
                out[n.name] = [self._merge([c[i] for c in cands if isinstance(c, (list, tuple)) and len(c) == k])
                               for i in range(k)]
            else:
                out[n.name] = self._merge([c for c in cands if isinstance(c, AValue)])
        for o, (call, cert) in self.it.certified_calls.items():  # every entry inside a call is within its peak
            y = out.get(call.input.name)
            inner = call_bounds(cert, y.growth, Poly.const(1.0)).inner if isinstance(y, AValue) else None
            top = _eval(inner, self.radius)
            if top is None:
                continue
            for m in call.members - {o}:
                v = out.get(m)
                if isinstance(v, AValue) and not v.const:
                    e = _eval(v.entry_bound(), self.radius)
                    if e is None or top < e:
                        out[m] = dataclasses.replace(v, max_abs=Poly.const(top))
        return out

    def _merge(self, avs: List[Any]) -> Any:
        avs = [a for a in avs if isinstance(a, AValue)]
        if not avs:
            return None
        for a in avs:
            if a.const:
                return a
        r = self.radius
        gs = [v for v in (_eval(a.growth, r) for a in avs) if v is not None]
        es = [v for v in (_eval(a.entry_bound(), r) for a in avs) if v is not None]
        grow = min(gs) if gs else None
        ent = min(es + ([grow] if grow is not None else [])) if (es or grow is not None) else None
        base = avs[0]
        stoch = next((a for a in avs if a.stochastic_dim is not None), None)
        sign = next((a.sign for a in avs if a.sign is not None), None)
        return dataclasses.replace(
            base, growth=None if grow is None else Poly.const(grow), max_abs=None if ent is None else Poly.const(ent),
            jacobian=Poly.ZERO, sign=sign, stochastic_dim=None if stoch is None else stoch.stochastic_dim,
            row_sum=1.0 if stoch is None else stoch.row_sum)

    def entry_of(self, a: Any) -> Optional[float]:
        """A bound of every entry of an argument at the radius (a number: its modulus)."""
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return abs(float(a))
        if not isinstance(a, torch.fx.Node):
            return None
        v = self.values.get(a.name)
        if isinstance(v, AValue):
            if v.const and v.value is not None:
                return max_abs(v.value)
            return _eval(v.entry_bound(), self.radius)
        conc = self.g.env.get(a.name)
        if a.name not in self.inside and isinstance(conc, torch.Tensor):
            return max_abs(conc)  # a constant of the segment (a parameter, a mask)
        return None

    # groups ------------------------------------------------------------------------------------------------
    def _groups(self) -> List[_Group]:
        out: List[_Group] = []
        it = self.it
        for o, (call, cert) in it.certified_calls.items():
            y = self.values.get(call.input.name)
            jac = None
            if isinstance(y, AValue) and y.growth is not None:
                b = call_bounds(cert, y.growth, Poly.const(1.0))
                jac = _eval(b.jacobian, self.radius)
            out.append(_Group(call.input.name, o, set(call.members) - {o}, jac, False,
                              f"own certificate of {type(call.module).__name__} ({call.path})"))
        for o, atom_grp in it.atom_groups.items():
            y = self.values.get(atom_grp.input.name)
            jac = None
            if isinstance(y, AValue):
                unit = dataclasses.replace(y, jacobian=Poly.const(1.0))
                av = it._apply_atom(atom_grp.atom, unit, self.g.get_module(atom_grp.path),
                                    _shape(self.g, atom_grp.output), "", ())
                jac = _eval(av.jacobian, self.radius)
            out.append(_Group(atom_grp.input.name, o, {m.name for m in atom_grp.members} - {o}, jac, False,
                              f"atom {atom_grp.atom.name} ({atom_grp.path})"))
        for n in self.order:
            grp = self._recognized(n)
            if grp is not None:
                out.append(grp)
        return out

    def _recognized(self, n: torch.fx.Node) -> Optional[_Group]:
        """A normalization or softmax written out that a rule recognized at ``n``: a group from its input."""
        av = self.values.get(n.name)
        if not isinstance(av, AValue) or "recognized" not in av.rule or not av.deps or n.op != "call_function":
            return None
        base = self.g.nodes[self.g.index[av.deps[0]]] if av.deps[0] in self.g.index else None
        if base is None or base.name not in self.inside or base is n:
            return None
        members = self.g.between(base, n) - {base.name, n.name}
        if any(u.name not in members and u is not n for m in members for u in self.g.nodes[self.g.index[m]].users):
            return None  # an op inside is used outside the pattern: no shortcut
        res = self._rule_with_unit(n, base.name, recognize=True)
        jac = None if res is None or not isinstance(res, AValue) else _eval(res.jacobian, self.radius)
        name = op_name(n.target)
        row_local = "along dim" not in av.rule and (av.stochastic_dim is None or av.stochastic_dim == -1)
        return _Group(base.name, n.name, members, jac, row_local, f"{av.rule} at {n.name} ({name})")

    # local derivatives -------------------------------------------------------------------------------------
    def _rule_with_unit(self, n: torch.fx.Node, target: str, *, recognize: bool = False) -> Any:
        """The rule of ``n`` evaluated with a unit Jacobian on ``target`` and zero on every other input-dependent
        node: its Jacobian is the local derivative bound of ``n`` in ``target`` (module docstring)."""
        it = self.it
        vals = dict(self.values)
        tv = vals.get(target)
        if not isinstance(tv, AValue) or tv.const:
            return None
        vals[target] = dataclasses.replace(tv, jacobian=Poly.const(1.0))
        proxy = copy.copy(it)
        proxy.values = vals
        proxy.notes = list(it.notes)
        name = op_name(n.target)
        shape = _shape(self.g, n) if not isinstance(self.g.env.get(n.name), (tuple, list)) else ()
        bound = bind_args(n)
        if bound is None:
            return None
        args = {k: proxy.value(v) for k, v in bound.items()}
        if name in ("aten.mul", "aten.multiply") and not recognize:
            return multiply(n, args["self"], args["other"], shape)
        if name in ("aten.div", "aten.divide", "aten.true_divide") and not recognize:
            return _divide(proxy, n, args, shape)
        if name == "aten.where":
            cond = args["condition"]
            if isinstance(cond, AValue) and not cond.const:  # autograd masks the gradient: each branch at most 1
                return linear_sum(_as_value(args["self"]), _as_value(args["other"]), 1.0, shape, "where (masked)")
        if name == "aten.masked_fill":
            mask = args.get("mask")
            if isinstance(mask, AValue) and not mask.const and target in _node_names(bound.get("self")):
                x = args["self"]
                f = 1.0 if tuple(x.shape) == tuple(shape) else math.sqrt(max(shape[-1] if shape else 1, 1))
                return dataclasses.replace(x, jacobian=x.jacobian.scale(f))
        from .atoms import lookup_op_atom

        atom = lookup_op_atom(name)
        if atom is not None:
            acts = [v for v in args.values() if isinstance(v, AValue) and not v.const]
            if len(acts) == 1:
                return proxy._apply_atom(atom, acts[0], n, shape, "", ())
        rule = rule_for(name)
        if rule is None:
            return None
        return rule(proxy, n, args, shape)

    def local(self, n: torch.fx.Node, a: torch.fx.Node) -> Tuple[List[Optional[float]], str]:
        """``||dn/da||`` per output of ``n`` at the radius (``None``: not bounded) and why not."""
        name = _op(n)
        conc = self.g.env.get(n.name)
        k = len(conc) if isinstance(conc, (tuple, list)) else 1
        if name in _NO_GRADIENT:
            return [0.0] * k, ""
        try:
            res = self._rule_with_unit(n, a.name)
        except Exception as exc:  # a rule that raises on a unit Jacobian: not bounded (strict mode: a bug)
            if strict_rules():
                raise
            return [None] * k, f"{name}: its rule raised {type(exc).__name__} ({exc}) on the local derivative"
        if res is None:
            return [None] * k, f"{name}: no rule gives its local derivative in {a.name}"
        res_list = list(res) if isinstance(res, (list, tuple)) else [res]
        out: List[Optional[float]] = []
        for r in res_list:
            out.append(_eval(r.jacobian, self.radius) if isinstance(r, AValue) and r.jacobian is not None else None)
        if any(v is None for v in out):
            why = next((r.bad for r in res_list if isinstance(r, AValue) and r.bad), "")
            return out, f"{name} ({n.name}): no local derivative bound in {a.name}" + (f": {why}" if why else "")
        return out, ""

    def row_factor(self, n: torch.fx.Node, a: torch.fx.Node) -> Union[None, str, float, Tuple[str, float]]:
        """How the largest row of ``a``'s gradient follows from ``n``'s (module docstring): ``"local"`` when the
        backward of ``n`` maps each row of its output gradient to one row of ``a``'s by a map bounded by the local
        derivative; a number when a row of ``a``'s gradient is part of one output row (1) or joins ``k`` of them
        (``sqrt(k)``); ``("sum", k)`` when a row collects at most ``k`` output rows each through the local derivative
        (an attention's keys and values: ``k`` queries); ``None`` when a row may collect any number of rows (it is then
        bounded by ``N*``)."""
        name = _op(n)
        pos = _positions(n, a)
        sa, so = _shape(self.g, a), _shape(self.g, n)
        b = bind_args(n) or {}
        nd = len(so)
        if name in _POINTWISE:
            return "local" if sa == so else None
        if not sa or not so:
            return None
        if name == "aten.linear":
            return "local" if pos == ["input"] and sa[:-1] == so[:-1] else None
        if name in _MATMULS:
            return "local" if pos == ["self"] and len(sa) >= 2 and sa[:-1] == so[:-1] else None
        if name in ("aten.layer_norm", "aten.native_layer_norm", "aten.rms_norm"):
            ok = pos == ["input"] and len(b.get("normalized_shape") or ()) == 1 and sa == so
            return "local" if ok else None
        if name in ("aten.softmax", "aten._softmax", "aten.special_softmax", "aten.log_softmax", "aten._log_softmax"):
            return "local" if sa == so and int(b.get("dim", -1)) % max(nd, 1) == nd - 1 else None
        if name in _ATTENTION:
            if pos == ["query"] and sa[:-1] == so[:-1]:
                return "local"
            # a key's or value's gradient sums the contributions of the queries: sum_i P_ij ... <= (queries) x local
            return ("sum", float(so[-2])) if len(so) >= 2 and set(pos) <= {"key", "value"} else None
        if name in VIEW_OPS:
            if math.prod(sa) != math.prod(so) or not sa[-1] or not so[-1]:
                return None
            if so[-1] % sa[-1] == 0:
                return 1.0  # a row of the input lies in one row of the output
            if sa[-1] % so[-1] == 0:
                return math.sqrt(sa[-1] // so[-1])  # a row of the input joins sa/so rows of the output
            return None
        if name == "aten.permute":
            dims = [int(d) % len(sa) for d in b.get("dims", ())]
            return "local" if dims and dims[-1] == len(sa) - 1 else None
        if name in ("aten.transpose", "aten.swapaxes", "aten.swapdims"):
            d0 = b.get("dim0", b.get("axis0"))
            d1 = b.get("dim1", b.get("axis1"))
            ok = d0 is not None and d1 is not None and len(sa) - 1 not in (int(d0) % len(sa), int(d1) % len(sa))
            return "local" if ok else None
        if name in _SELECTS or name in _CATS:
            d = int(b.get("dim", 0) or 0)
            return "local" if (d % max(len(sa), 1)) != len(sa) - 1 and sa[-1] == so[-1] else None
        return None

    # parameters ---------------------------------------------------------------------------------------------
    def parameter_entry(self, n: torch.fx.Node, a: torch.fx.Node, gu: GradBound) -> Tuple[float, str]:
        """A bound of every entry of the gradient reaching the parameter-side argument ``a`` of ``n``."""
        name = _op(n)
        b = bind_args(n) or {}
        pos = _positions(n, a)
        so, sa = _shape(self.g, n), _shape(self.g, a)
        t, rows = gu.total, gu.rows
        nrows = _rows(so)
        col = min(t, nrows * rows)  # sum over the rows of one column of g
        bcast = _broadcast_sum(sa, so, t, rows)  # sum over the copies of one entry of a broadcast argument
        why = f"{name} ({n.name}): no bound of the gradient of its parameter argument {a.name}"
        if not gu.known:
            return _INF, gu.why or why
        if len(pos) != 1:
            return _INF, why
        p = pos[0]
        other = None
        if name == "aten.linear":
            if p == "weight":
                other = self.entry_of(b.get("input"))
                return (_INF, why) if other is None else (other * col, "")
            if p == "bias":
                return col, ""
        if name in _MATMULS:
            left, right = b.get("self"), b.get("other", b.get("mat2"))
            if p in ("other", "mat2"):
                e = self.entry_of(left)
                return (_INF, why) if e is None else (e * col, "")
            if p == "self" and len(so) >= 1:
                e = self.entry_of(right)
                return (_INF, why) if e is None else (e * math.sqrt(max(so[-1], 1)) * t, "")
        if name == "aten.addmm":  # beta self + alpha mat1 @ mat2 (HF's Conv1D: the bias, the input, the weight)
            beta, alpha = b.get("beta", 1), b.get("alpha", 1)
            if not isinstance(beta, (int, float)) or not isinstance(alpha, (int, float)):
                return _INF, why
            if p == "self":
                return abs(float(beta)) * bcast, ""
            if p == "mat2":
                e = self.entry_of(b.get("mat1"))
                return (_INF, why) if e is None else (abs(float(alpha)) * e * col, "")
            if p == "mat1" and len(so) >= 1:
                e = self.entry_of(b.get("mat2"))
                return (_INF, why) if e is None else (abs(float(alpha)) * e * math.sqrt(max(so[-1], 1)) * t, "")
        if name in ("aten.mul", "aten.multiply"):
            other = b.get("other") if p == "self" else b.get("self")
            e = self.entry_of(other)
            return (_INF, why) if e is None else (e * bcast, "")
        if name in ("aten.add", "aten.sub", "aten.subtract", "aten.rsub"):
            alpha = b.get("alpha", 1)
            scaled_pos = "other" if name != "aten.rsub" else "self"
            f = abs(float(alpha)) if p == scaled_pos and isinstance(alpha, (int, float)) else 1.0
            return f * bcast, ""
        if name in ("aten.layer_norm", "aten.native_layer_norm", "aten.rms_norm"):
            numel = math.prod(b.get("normalized_shape") or (1,))
            if p == "weight":  # the normalized entries are at most sqrt(numel) (their squares sum to numel)
                return math.sqrt(numel) * bcast, ""
            if p == "bias":
                return bcast, ""
        if name == "aten.embedding" and p == "weight":
            return t, ""  # dW[v] sums the gradient's rows at the positions of token v
        if name in _CONVS and p in ("weight", "bias") and so:
            across = math.sqrt(max(so[-1], 1)) * t  # sum over every output position of one channel of g
            if p == "bias":
                return across, ""
            e = self.entry_of(b.get("input"))
            return (_INF, why) if e is None else (e * across, "")
        if name in _CATS:
            return rows, ""
        if name == "aten.where" and p in ("self", "other"):
            return bcast, ""
        return _INF, why

    # the pass ----------------------------------------------------------------------------------------------
    def run(self, g_out: GradBound, cap_in: Optional[GradBound] = None) -> SegmentGradients:
        """Propagate ``g_out`` (the gradient bound at ``end``) back to ``start`` (capped by ``cap_in``)."""
        res = SegmentGradients(radius=self.radius)
        contrib: Dict[str, List[Tuple[str, float, float, str]]] = {}
        slots: Dict[str, Dict[int, List[Tuple[str, float, float, str]]]] = {}
        bounds: Dict[str, Any] = {}
        self._bounds_so_far = bounds
        params: Dict[str, Tuple[float, str]] = {}
        for n in reversed(self.order):
            if n is self.end:
                gb: Any = g_out
            elif isinstance(self.g.env.get(n.name), (tuple, list)):
                gb = {k: self._finish(n.name, items) for k, items in slots.get(n.name, {}).items()}
            else:
                gb = self._finish(n.name, contrib.get(n.name, []))
            if n is self.start and cap_in is not None:
                gb = GradBound.of(min(gb.total, cap_in.total), min(gb.rows, cap_in.rows),
                                  gb.why if not math.isfinite(cap_in.total) else "")
            bounds[n.name] = gb
            if n is self.start or n.name not in self.grad or n.op != "call_function":
                continue
            self._propagate(n, gb, contrib, slots, params, res)
        for name, gb in bounds.items():
            if isinstance(gb, dict):
                for k, v in gb.items():
                    res.bounds[f"{name}#{k}"] = v
            elif name in self.grad:
                res.bounds[name] = gb
        res.parameters = params
        return res

    def _propagate(self, n: torch.fx.Node, gb: Any, contrib: Dict[str, List[Tuple[str, float, float, str]]],
                   slots: Dict[str, Dict[int, List[Tuple[str, float, float, str]]]],
                   params: Dict[str, Tuple[float, str]], res: SegmentGradients) -> None:
        name = _op(n)
        if name == "getitem":
            src, k = n.args[0], n.args[1]
            if isinstance(src, torch.fx.Node) and isinstance(k, int) and src.name in self.grad:
                slots.setdefault(src.name, {}).setdefault(k, []).append((n.name, gb.total, gb.rows, gb.why))
            return
        outs: Dict[int, GradBound] = gb if isinstance(gb, dict) else {0: gb}
        if not outs:
            return
        lead = outs.get(0, ZERO)
        n_dtype = _dtype(self.g, n, self.dtypes)
        for a in dict.fromkeys(n.all_input_nodes):
            if a.name not in self.grad:
                continue
            if a.name in self.inside:
                local, why = self.local(n, a)
                total, rows_, whys = 0.0, 0.0, []
                rf = self.row_factor(n, a)
                for k, gk in outs.items():
                    lk = local[k] if k < len(local) else None
                    if gk.total == 0.0 and gk.rows == 0.0:
                        continue
                    if lk is None:
                        total, rows_ = _INF, _INF
                        whys.append(why)
                        continue
                    total += lk * gk.total
                    if rf == "local":
                        rows_ += lk * gk.rows
                    elif isinstance(rf, tuple):
                        rows_ += min(rf[1] * lk * gk.rows, lk * gk.total)
                    elif isinstance(rf, (int, float)):
                        rows_ += rf * gk.rows
                    else:
                        rows_ += lk * gk.total
                    if gk.why:
                        whys.append(gk.why)
                c_why = next((w for w in whys if w), "")
                contrib.setdefault(a.name, []).append((n.name, total, min(rows_, total), c_why))
                hidden_entry, hidden_why = min(rows_, total), c_why
            else:
                e, why = self.parameter_entry(n, a, lead)
                old = params.get(a.name, (0.0, ""))
                params[a.name] = (old[0] + e, old[1] or why)
                hidden_entry, hidden_why = e, why
            a_dtype = _dtype(self.g, a, self.dtypes)
            if (name not in IDENTITY_OPS and n_dtype is not None and a_dtype is not None and n_dtype != a_dtype
                    and n_dtype.is_floating_point and a_dtype.is_floating_point):
                res.hidden.append((n.name, a.name, n_dtype, hidden_entry, hidden_why))

    def _finish(self, name: str, items: List[Tuple[str, float, float, str]]) -> GradBound:
        """The gradient bound of a node from its users' contributions, through the groups it is the input of."""
        groups = sorted((gr for gr in self.groups if gr.input == name), key=lambda gr: len(gr.members))
        if not groups:
            return _sum(items)
        assigned: Dict[int, List[Tuple[str, float, float, str]]] = {i: [] for i in range(len(groups))}
        free: List[Tuple[str, float, float, str]] = []

        def place(item: Tuple[str, float, float, str], start: int = 0) -> None:
            for i in range(start, len(groups)):
                if item[0] in groups[i].scope:
                    assigned[i].append(item)
                    return
            free.append(item)

        for item in items:
            place(item)
        for i, gr in enumerate(groups):
            s = _sum(assigned[i])
            out = self._out_bound(gr.output)
            total, rows, why = s.total, s.rows, s.why
            if gr.jacobian is not None and out is not None and out.known:
                cap = gr.jacobian * out.total
                if cap < total:
                    total, why = cap, ""
                    rows = min(rows, gr.jacobian * out.rows if gr.row_local else cap)
            place((gr.output, total, min(rows, total), why), i + 1)
        return _sum(free)

    def _out_bound(self, name: str) -> Optional[GradBound]:
        b = self._bounds_so_far.get(name)
        return b if isinstance(b, GradBound) else None


def _sum(items: Iterable[Tuple[str, float, float, str]]) -> GradBound:
    total = rows = 0.0
    why = ""
    for _, t, r, w in items:
        total += t
        rows += r
        if w and not why:
            why = w
    return GradBound.of(total, rows, why)


def _broadcast_sum(sa: Sequence[int], so: Sequence[int], total: float, rows: float) -> float:
    """A bound of the sum of ``|g|`` over the copies of one entry of an argument of shape ``sa`` broadcast to ``so``:
    one entry (no broadcast), a column (copies along the leading dims), or a whole row's entries too."""
    sa, so = tuple(sa), tuple(so)
    if sa == so:
        return rows
    copies = math.prod(so) / max(math.prod(sa), 1) if sa else float(math.prod(so) or 1)
    last_broadcast = len(so) >= 1 and (len(sa) == 0 or sa[-1] == 1) and so[-1] > 1
    if last_broadcast:
        return min(math.sqrt(so[-1]) * total, copies * rows)
    return min(total, copies * rows)


def _as_value(v: Any) -> AValue:
    return v if isinstance(v, AValue) else AValue.constant(torch.as_tensor(v))


def _node_names(v: Any) -> Set[str]:
    if isinstance(v, torch.fx.Node):
        return {v.name}
    if isinstance(v, (list, tuple)):
        return {e.name for e in v if isinstance(e, torch.fx.Node)}
    return set()


def _divide(it: Any, n: torch.fx.Node, args: Dict[str, Any], shape: Tuple[int, ...]) -> Optional[AValue]:
    """``self / other`` as a product with the reciprocal (the div rule without its recognizers)."""
    from .rules.division import _inverse  # the div rule's reciprocal of a denominator with a proven minimum

    x, y = args["self"], args["other"]
    inv = _inverse(it, n.args[1], y)
    if isinstance(inv, str):
        return AValue.unknown(tuple(shape), "div", inv)
    if not isinstance(y, AValue):
        return multiply(n, x, 1.0 / y, shape)
    return multiply(n, x, inv, shape)


# ---------------------------------------------------------------------------------------------------- public API
def segment_gradients(g: CapturedGraph, start: torch.fx.Node, end: torch.fx.Node, radius: float,
                      g_out: Union[float, GradBound], *, it: Optional[VelocityInterpreter] = None,
                      cap_in: Union[None, float, GradBound] = None,
                      dtypes: Optional[Mapping[str, torch.dtype]] = None,
                      grad: Optional[Set[str]] = None) -> SegmentGradients:
    """Bound the gradient of every node of one segment ``start -> end`` of a captured graph.

    Args:
        g: the captured graph.
        start: the segment's input node (a velocity's ``x``).
        end: its output node.
        radius: the bound ``R`` on the input's row norm at which the forward bounds are read.
        g_out: the bound on the costate at ``end``: a number bounds ``N*`` (the sum over its rows of their Euclidean
            norms), a :class:`GradBound` also its largest row.
        it: the segment's interpreter, already run (default: one is run here).
        cap_in: a bound already known for the gradient at ``start`` (the chain's costate there).
        dtypes: node name -> the dtype its tensor is held in (default: the captured run's).
        grad: the nodes that carry a gradient (default: computed from parameters, :func:`needs_grad`, plus the
            segment's input when it is a floating input of the model).

    Returns:
        The :class:`SegmentGradients`.

    Raises:
        ValueError: ``radius`` or ``g_out`` negative or NaN.
    """
    if not isinstance(radius, (int, float)) or not radius >= 0:
        raise ValueError(f"radius must be a number >= 0, got {radius!r}")
    gb = GradBound.of(float(g_out)) if isinstance(g_out, (int, float)) else g_out
    if not isinstance(gb, GradBound) or not gb.total >= 0:
        raise ValueError(f"g_out must be a number >= 0 or a GradBound, got {g_out!r}")
    cap = GradBound.of(float(cap_in)) if isinstance(cap_in, (int, float)) else cap_in
    if grad is None:
        grad = needs_grad(g, inputs=True)
    return _SegmentPass(g, start, end, float(radius), grad, it, dtypes).run(gb, cap)


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
