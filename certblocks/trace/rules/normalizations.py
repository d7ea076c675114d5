"""Normalization rules: layer/RMS/group/batch norm, and the recognizer of normalizations written out.

A normalization is a primitive at ``(0, 0)`` (docs/theory.md section 2): ``N o B`` is at ``(0, sigma_B)``
whatever ``B``'s growth.  LayerNorm and RMSNorm read their output and Jacobian bounds from
:func:`certblocks.bounds.normalization.norm_bounds`.  :func:`recognize_norm` finds the same map written
with elementary ops (``x * rsqrt(mean(x^2) + eps)``, ``x / sqrt(var + eps)`` after centring,
``x / max(||x||, eps)``, ``x / ||x||``), which the product and division rules would otherwise read as
outside the class.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from ... import exponents as E
from ...bounds.normalization import norm_bounds
from ...bounds.poly import Poly
from ..nodes import bind_args, op_name, strip_exact_casts, target_name
from ..values import AValue, max_abs
from .common import floor_in, same_computation, sqrt_last, unknown
from .registry import register_rule

if TYPE_CHECKING:
    from ..interp import VelocityInterpreter

__all__ = ["norm_value", "recognize_norm"]

Args = Dict[str, Any]
Shape = Tuple[int, ...]


def norm_value(x: AValue, shape: Sequence[int], bound: float, jac: float, name: str,
               deps: Tuple[str, ...] = ()) -> AValue:
    """A normalization of ``x``: every row norm below ``bound``, Jacobian ``jac`` times ``x``'s."""
    return AValue(exps=E.normalize(x.exps), shape=shape, growth=Poly.const(bound), max_abs=Poly.const(bound),
                  jacobian=None if x.jacobian is None else x.jacobian.scale(jac), rule=f"normalization {name}",
                  deps=tuple(deps))


def _worst_row(t: torch.Tensor) -> torch.Tensor:
    """The row (last dimension) of ``t`` with the largest Euclidean norm."""
    if t.dim() <= 1:
        return t
    rows = t.reshape(-1, t.shape[-1])
    return rows[int(torch.linalg.vector_norm(rows.double(), dim=-1).argmax())]


@register_rule("aten.layer_norm", "aten.native_layer_norm",
               reads=("input", "normalized_shape", "weight", "bias", "eps"))
def layer_norm(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> Any:
    x, w, b, eps = a["input"], a.get("weight"), a.get("bias"), float(a.get("eps", 1e-5))
    native = op_name(n.target) == "aten.native_layer_norm"
    conc = it.g.env[n.name] if native else None
    if native:
        shape = tuple(conc[0].shape)  # (output, mean, rstd): the node's own shape is not a tensor's
    for p in (w, b):
        if isinstance(p, AValue) and not p.const:
            return unknown(shape, "layer_norm with input-dependent affine parameters")
    if eps <= 0:
        return unknown(shape, "layer_norm with eps <= 0 (Jacobian unbounded)")
    # a row of the output is part of one normalized group: its norm is at most g sqrt(numel) plus its bias row
    bound, jac = norm_bounds("layer", w.value if isinstance(w, AValue) else None,
                             _worst_row(b.value) if isinstance(b, AValue) else None, eps,
                             numel=math.prod(a["normalized_shape"]), d=shape[-1])
    out = norm_value(x, shape, bound, jac, "(LayerNorm)")
    if native:
        return [out, *_layer_norm_statistics(x, tuple(conc[1].shape), tuple(conc[2].shape), eps)]
    return out


#: ``max_v sqrt(v) / (v + eps)^(3/2) = c / eps`` (at ``v = eps / 2``), rounded up.
_RSTD_SLOPE = 0.3850


def _layer_norm_statistics(x: AValue, mean_shape: Shape, rstd_shape: Shape, eps: float) -> List[AValue]:
    """``native_layer_norm``'s saved mean and ``rstd = 1 / sqrt(var + eps)`` (their last dim is 1: a row norm is an
    entry).  The mean of a group is at most its largest entry and moves by at most the largest moved entry.
    ``0 < rstd <= 1 / sqrt(eps)``; ``|d var| <= 2 sqrt(var) ||dx||_2 / sqrt(n)`` over the group of ``n`` entries
    (centring is a projection), ``||dx||_2 <= sqrt(n) N(dx)`` (at most ``n`` rows), so
    ``|d rstd| <= sqrt(var) (var + eps)^(-3/2) N(dx) <= 0.385 / eps N(dx)`` (docs/theory.md section 2).  Both are
    bounded by a rounding allowance of the low-precision dtypes (``1 + 2^-7``)."""
    slack = 1.0 + 2.0 ** -7
    entries = x.entry_bound()
    mean = AValue(exps=x.exps, shape=mean_shape, growth=None if entries is None else entries.scale(slack),
                  max_abs=None if entries is None else entries.scale(slack),
                  jacobian=None if x.jacobian is None else x.jacobian.scale(slack), rule="layer_norm mean (linear)")
    top = slack / math.sqrt(eps)
    rstd = AValue(exps=E.normalize(x.exps), shape=rstd_shape, growth=Poly.const(top), max_abs=Poly.const(top),
                  jacobian=None if x.jacobian is None else x.jacobian.scale(slack * _RSTD_SLOPE / eps), sign="+",
                  rule="layer_norm rstd (0 < rstd <= 1/sqrt(eps))")
    return [mean, rstd]


@register_rule("aten.rms_norm", reads=("input", "normalized_shape", "weight", "eps"))
def rms_norm(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x, w, eps = a["input"], a.get("weight"), a.get("eps")
    if isinstance(w, AValue) and not w.const:
        return unknown(shape, "rms_norm with an input-dependent weight")
    if eps is None:
        eps = torch.finfo(it.g.env[n.name].dtype).eps
    eps = float(eps)
    if eps <= 0:
        return unknown(shape, "rms_norm with eps <= 0")
    bound, jac = norm_bounds("rms", w.value if isinstance(w, AValue) else None, None, eps,
                             numel=math.prod(a["normalized_shape"]), d=shape[-1])
    return norm_value(x, shape, bound, jac, "(RMSNorm)")


@register_rule("aten.group_norm", reads=("input", "num_groups", "weight", "bias", "eps"))
def group_norm(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """GroupNorm over ``num_groups`` groups of channels (dim 1) and the spatial dims, with a constant per-channel
    affine map: a group's normalized entries have squared sum at most its size, a row (spatial last dim, or the
    channels of a 2-D input) lies in one group or spans all of them."""
    x, w, b = a["input"], a.get("weight"), a.get("bias")
    for p in (w, b):
        if isinstance(p, AValue) and not p.const:
            return unknown(shape, "group_norm with input-dependent affine parameters")
    groups, eps = int(a["num_groups"]), float(a.get("eps", 1e-5))
    if eps <= 0:
        return unknown(shape, f"group_norm with eps={eps:g} (Jacobian unbounded)")
    channels = x.shape[1]
    group_numel = (channels // groups) * math.prod(x.shape[2:])
    gmax = max_abs(w.value) if isinstance(w, AValue) else 1.0
    bmax = max_abs(b.value) if isinstance(b, AValue) else 0.0
    bound = gmax * math.sqrt(groups * group_numel) + bmax * math.sqrt(shape[-1])
    jac = gmax / math.sqrt(eps) * math.sqrt(groups * group_numel)
    return norm_value(x, shape, bound, jac, "(GroupNorm)")


@register_rule("aten.batch_norm", "aten._native_batch_norm_legit_no_training", "aten.native_batch_norm",
               "aten._native_batch_norm_legit", "aten.instance_norm", overloads=("default",),
               reads=("input", "weight", "bias", "running_mean", "running_var", "training", "use_input_stats",
                      "momentum", "eps"))
def batch_norm(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> Any:
    """In eval mode batch_norm uses running statistics: an affine map per channel, not a normalization
    (``momentum`` only updates the running statistics in training).  With batch statistics it is refused."""
    x = a["input"]
    training = a.get("training", a.get("use_input_stats", False))
    name = op_name(n.target)
    if name == "aten._native_batch_norm_legit_no_training":
        training = False
    if training:
        return unknown(shape, f"{name} with batch statistics: normalizes over the batch, not per sample")
    w, b, rm, rv = a.get("weight"), a.get("bias"), a.get("running_mean"), a.get("running_var")
    eps = float(a.get("eps", 1e-5))
    for p in (w, b, rm, rv):
        if isinstance(p, AValue) and not p.const:
            return unknown(shape, "batch_norm with input-dependent statistics")
    if not isinstance(rv, AValue) or not isinstance(rm, AValue):
        return unknown(shape, f"{name} in eval mode without running statistics")
    channels = x.shape[1]
    ones, zeros = torch.ones(channels, dtype=torch.float64), torch.zeros(channels, dtype=torch.float64)
    var, mean = rv.value.double(), rm.value.double()
    g = w.value.double() if isinstance(w, AValue) else ones
    beta = b.value.double() if isinstance(b, AValue) else zeros
    if not bool((var + eps > 0).all()):
        return unknown(shape, f"{name} with running_var + eps <= 0")
    scale = g / torch.sqrt(var + eps)
    shift = beta - mean * scale
    s = float(scale.abs().max()) * (1 + 1e-9)
    sh = float(shift.abs().max()) * (1 + 1e-9)
    conc = it.g.env.get(n.name)
    if isinstance(conc, (tuple, list)):
        shape = tuple(conc[0].shape)
    entries = x.entry_bound()
    growth = None if x.growth is None else x.growth.scale(s) + Poly.const(sh * sqrt_last(shape))
    out = AValue(exps=x.exps, shape=shape, growth=growth,
                 max_abs=None if entries is None else entries.scale(s) + Poly.const(sh),
                 jacobian=None if x.jacobian is None else x.jacobian.scale(s),
                 rule="affine (batch_norm in eval mode uses running statistics: an affine map, not a normalization)")
    if isinstance(conc, (tuple, list)):
        # the saved statistics: empty in eval mode (a constant); anything else is not derived
        return [out] + [AValue.constant(c) if isinstance(c, torch.Tensor) and c.numel() == 0
                        else AValue.unknown(tuple(getattr(c, "shape", ())), "batch_norm statistics")
                        for c in conc[1:]]
    return out


# ------------------------------------------------------------------------------------------ recognizer
def _const_scalar(it: VelocityInterpreter, x: Any) -> Optional[float]:
    """The value of a Python number or of a constant tensor whose entries are all equal (``None`` otherwise)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, torch.fx.Node):
        v = it.values.get(x.name)
        if v is not None and not v.const:
            return None
        c = it.example(x)
        if isinstance(c, torch.Tensor) and c.numel() >= 1:
            if bool((c == c.reshape(-1)[0]).all()):
                return float(c.reshape(-1)[0])
    return None


def _strip(it: VelocityInterpreter, n: Any) -> Any:
    """``n`` behind the casts that keep its values exactly (a recognizer must not see through a rounding cast)."""
    return strip_exact_casts(n, it.g.env)


def _same(it: VelocityInterpreter, n1: Any, n2: Any) -> bool:
    """Two node arguments hold the same values: one node up to exact casts, or the same computation done twice
    (``(x - mean)`` written once for the variance and once for the numerator)."""
    return isinstance(n1, torch.fx.Node) and isinstance(n2, torch.fx.Node) and same_computation(n1, n2, it.g.env)


def _unit_alpha(n: torch.fx.Node) -> bool:
    """An ``add``/``sub`` node with ``alpha = 1`` (its second operand not scaled)."""
    alpha = (bind_args(n) or {}).get("alpha")
    return alpha is None or (isinstance(alpha, (int, float)) and float(alpha) == 1.0)


def _plus_eps(it: VelocityInterpreter, n: Any) -> Optional[Tuple[Any, float]]:
    """``(s, eps)`` when ``n`` is ``s + eps`` (``alpha = 1``) with a constant ``eps > 0`` as it is rounded into the
    sum's dtype (:func:`~.common.floor_in`: ``s + eps >= fl(eps)`` for ``s >= 0``; an ``eps`` that rounds to 0
    there gives ``None``)."""
    if target_name(n) != "aten.add" or not _unit_alpha(n) or len(n.args) < 2:
        return None
    for s, e in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
        eps = _const_scalar(it, e)
        if eps is not None and eps > 0:
            out = it.g.env.get(n.name)
            eps = floor_in(eps, out.dtype) if isinstance(out, torch.Tensor) else eps
            return (s, eps) if eps > 0 else None
    return None


def _sum_of_squares(it: VelocityInterpreter, n: Any, a: Any, any_dim: bool = False) -> Optional[float]:
    """If ``n`` is mean/sum over the last dim (keepdim) of a^2, return 1/d or 1 (the k in k |a|^2).

    With ``any_dim`` the reduction may run over any single dimension; :func:`_norm_dim` tells which.
    """
    n = _strip(it, n)
    t = target_name(n)
    if t not in ("aten.mean", "aten.sum"):
        return None
    sq = _strip(it, n.args[0])
    st = target_name(sq)
    ok = (st in ("aten.pow",) and len(sq.args) > 1 and sq.args[1] == 2 and _same(it, sq.args[0], a)) or \
         (st == "aten.square" and _same(it, sq.args[0], a)) or \
         (st == "aten.mul" and _same(it, sq.args[0], a) and _same(it, sq.args[1], a))
    if not ok:
        return None
    base = _strip(it, a)
    aval = it.g.env[base.name] if isinstance(base, torch.fx.Node) else None
    if aval is None:
        return None
    nd = aval.dim()
    b = bind_args(n) or {}
    dims, keep = b.get("dim"), b.get("keepdim", False)
    if dims is None or len(dims) != 1 or not keep or (not any_dim and int(dims[0]) % nd != nd - 1):
        return None
    return 1.0 / aval.shape[int(dims[0]) % nd] if t == "aten.mean" else 1.0


def _norm_dim(it: VelocityInterpreter, den: Any, a: Any) -> Optional[int]:
    """The dimension a recognized ``rsqrt(k |a|^2 + eps)`` denominator reduces over (None if not that form)."""
    den = _strip(it, den)
    if target_name(den) != "aten.rsqrt":
        return None
    parts = _plus_eps(it, _strip(it, den.args[0]))
    if parts is None:
        return None
    s = _strip(it, parts[0])
    if isinstance(s, torch.fx.Node) and _sum_of_squares(it, s, a, any_dim=True) is not None:
        dims = (bind_args(s) or {}).get("dim")
        return int(dims[0]) % it.g.env[_strip(it, a).name].dim()
    return None


def _var_of(it: VelocityInterpreter, n: Any, a: Any) -> Optional[float]:
    """var(y, last, keepdim) where a = y - mean(y, last, keepdim): returns 1/(d - correction) (k |a|^2)."""
    n = _strip(it, n)
    if target_name(n) != "aten.var":
        return None
    a = _strip(it, a)
    if target_name(a) != "aten.sub" or not _unit_alpha(a):
        return None
    y, m = a.args[0], _strip(it, a.args[1])
    if target_name(m) != "aten.mean" or not _same(it, m.args[0], y) or not _same(it, n.args[0], y):
        return None
    mb = bind_args(m) or {}
    yv = it.g.env[_strip(it, y).name]
    nd = yv.dim()
    if mb.get("dim") is None or [int(d) % nd for d in mb["dim"]] != [nd - 1] or not mb.get("keepdim", False):
        return None  # the centring must be over the normalized (last) dimension
    b = bind_args(n) or {}
    corr = b.get("correction")
    unbiased = b.get("unbiased")
    dims = b.get("dim")
    if dims is None or [int(d) % nd for d in dims] != [nd - 1] or not b.get("keepdim", False):
        return None
    d = yv.shape[-1]
    if corr is not None:
        c = float(corr)
    elif unbiased is None or unbiased:
        c = 1.0
    else:
        c = 0.0
    if d - c <= 0:
        return None
    return 1.0 / (d - c)


def _is_last_dim_l2_norm(it: VelocityInterpreter, n: Any, a: Any) -> bool:
    """``n`` is ``||a||_2`` over the last dimension with ``keepdim``."""
    if target_name(n) not in ("aten.linalg_vector_norm", "aten.norm") or not _same(it, n.args[0], a):
        return False
    b = bind_args(n) or {}
    ordv = b.get("ord", b.get("p", 2))
    nd = it.g.env[_strip(it, a).name].dim()
    dims = b.get("dim")
    return (ordv in (None, 2, 2.0)) and dims is not None and [int(d) % nd for d in dims] == [nd - 1] \
        and bool(b.get("keepdim", False))


def _denominator_k_eps(it: VelocityInterpreter, den: Any, a: Any,
                       inverse: bool) -> Optional[Tuple[float, float, bool]]:
    """Recognize a denominator sqrt(k |a|^2 + eps) (or ||a|| + eps, max(||a||, eps)).

    Returns (k, eps, sqrt_form) or None.  ``inverse`` asks for rsqrt(...) (a multiplier).  ``eps`` is the one the
    graph computes with (rounded into the dtype of the op that adds it or clamps by it).
    """
    den = _strip(it, den)
    t = target_name(den)
    if inverse:
        if t == "aten.reciprocal":
            return _denominator_k_eps(it, den.args[0], a, False)
        if t != "aten.rsqrt":
            return None
        inner = _strip(it, den.args[0])
    elif t in ("aten.linalg_vector_norm", "aten.norm"):
        return (1.0, 0.0, False) if _is_last_dim_l2_norm(it, den, a) else None  # x / ||x|| without eps
    elif t == "aten.sqrt":
        inner = _strip(it, den.args[0])
    elif t in ("aten.clamp_min", "aten.clamp", "aten.maximum"):
        db = bind_args(den) or {}
        if t == "aten.clamp" and db.get("max") is not None:
            return None  # clamped from above too: x / M for ||x|| > M is not bounded
        eps = _const_scalar(it, db.get("min", db.get("other")))
        out = it.g.env.get(den.name)
        eps = floor_in(eps, out.dtype) if eps is not None and isinstance(out, torch.Tensor) else eps
        if eps is None or eps <= 0:
            return None
        return (1.0, eps, False) if _is_last_dim_l2_norm(it, _strip(it, den.args[0]), a) else None
    elif t == "aten.add":
        parts = _plus_eps(it, den)
        if parts is None:
            return None
        base, eps = _strip(it, parts[0]), parts[1]
        if _is_last_dim_l2_norm(it, base, a):
            return (1.0, eps, False)
        if target_name(base) == "aten.sqrt":
            k = _sum_of_squares(it, base.args[0], a)
            if k is not None:
                return (k, eps, False)
        return None
    else:
        return None
    parts = _plus_eps(it, inner)
    if parts is None:
        return None
    s, eps = parts
    k = _sum_of_squares(it, s, a, any_dim=inverse)
    if k is None:
        k = _var_of(it, s, a)
    if k is None:
        return None
    return (k, eps, True)


def _candidates(it: VelocityInterpreter, pairs: Sequence[Tuple[Any, Any]]) -> list:
    """``(numerator, denominator, scale)`` triples: each pair, and ``(a, den, |c|)`` for a numerator ``c * a``."""
    out = []
    for a, den in pairs:
        out.append((a, den, 1.0))
        # (c * a) / N(a) with a constant c: the normalization of a, scaled by max|c|
        a0 = _strip(it, a)
        if target_name(a0) == "aten.mul":
            for i in (0, 1):
                c, other = a0.args[i], a0.args[1 - i]
                cv = _const_scalar(it, c) if not isinstance(c, torch.fx.Node) else None
                if isinstance(c, torch.fx.Node):
                    v = it.values.get(c.name)
                    conc = it.example(c) if v is None or v.const else None
                    if isinstance(conc, torch.Tensor):
                        cv = max_abs(conc)
                if cv is not None:
                    out.append((other, den, abs(cv)))
    return out


def recognize_norm(it: VelocityInterpreter, n: torch.fx.Node, shape: Sequence[int]) -> Optional[AValue]:
    """x * rsqrt(mean(x^2) + eps), x / sqrt(...), x / max(||x||, eps), centred variants -> (0, sigma_x)."""
    t = target_name(n)
    if t == "aten.mul":
        pairs, inverse = [(n.args[0], n.args[1]), (n.args[1], n.args[0])], True
    elif t == "aten.div":
        pairs, inverse = [(n.args[0], n.args[1])], False
    else:
        return None
    for a, den, cscale in _candidates(it, pairs):
        if not isinstance(a, torch.fx.Node) or not isinstance(den, torch.fx.Node):
            continue
        r = _denominator_k_eps(it, den, a, inverse)
        if r is None:
            continue
        base = _strip(it, a)
        if cscale != 1.0 and tuple(it.g.env[base.name].shape)[-1:] != tuple(shape[-1:]):
            continue
        k, eps, sqrt_form = r
        av = it.values.get(base.name) or it.value(a)
        if av.const:
            continue
        # |a / sqrt(k|a|^2 + eps)| <= 1/sqrt(k), Jacobian <= 1/sqrt(eps); |a/max(|a|,eps)| <= 1, Jac <= 1/eps
        bound = cscale / math.sqrt(k)
        if eps == 0:
            # x / ||x||: bounded (q = 0) but its Jacobian 1/||x|| is unbounded at 0 -- l0 is not derived
            out = norm_value(av, tuple(shape), bound, 1.0, "written out (x / ||x|| without eps, recognized; "
                             "Jacobian unbounded at 0: l0 not derived)", deps=(base.name,))
            out.jacobian = None
            return out
        jac = (1.0 / math.sqrt(eps) if sqrt_form else 1.0 / eps) * cscale
        nd = len(shape)
        dim = _norm_dim(it, den, a) if inverse else None
        if dim is not None and nd and dim != nd - 1:
            # Normalized along dim (not the last): every entry is <= bound, a row (last dim) is
            # <= sqrt(n_last) * bound; a perturbation's column along dim is <= sqrt(n_dim) times
            # its row norm, and the column map is 1/sqrt(eps)-Lipschitz.
            n_last, n_dim = shape[-1], shape[dim]
            out = norm_value(av, tuple(shape), bound * math.sqrt(n_last), jac * math.sqrt(n_dim * n_last),
                             f"written out (x / ||x|| along dim {dim}, recognized)", deps=(base.name,))
            out.max_abs = Poly.const(bound)
            return out
        return norm_value(av, tuple(shape), bound, jac, "written out (x / ||x|| form, recognized)",
                          deps=(base.name,))
    return None
