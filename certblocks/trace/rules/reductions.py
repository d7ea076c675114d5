"""Reduction rules: sum/mean, max/min/logsumexp, the Euclidean norm, cumsum, pooling.

Sums and means are linear (exponents kept); max, min, logsumexp, norms and max pooling are 1-Lipschitz
(``q`` kept, ``sigma`` as a Lipschitz map's).  A reduction over the last dimension bounds the result's
entries, and its rows through them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

import torch

from ... import exponents as E
from ...bounds.poly import Poly
from ..nodes import op_name
from ..values import AValue
from .common import scaled, sqrt_last, unknown
from .registry import register_rule
from .selection import extremum

if TYPE_CHECKING:
    from ..interp import VelocityInterpreter

Args = Dict[str, Any]
Shape = Tuple[int, ...]


def _reduce_dims(a: Args, ndim: int) -> List[int]:
    d = a.get("dim")
    if d is None or (isinstance(d, (list, tuple)) and len(d) == 0):
        return list(range(ndim))
    if isinstance(d, int):
        d = [d]
    return sorted({int(v) % max(ndim, 1) for v in d})


def _count(x: AValue, dims: List[int]) -> int:
    """Number of entries reduced into one."""
    count = 1
    for d in dims:
        count *= x.shape[d] if x.ndim else 1
    return count


@register_rule("aten.mean", "aten.sum", "aten.nansum", "aten.nanmean")
def sum_or_mean(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x = a.get("self", a.get("input"))
    dims = _reduce_dims(a, x.ndim)
    count = _count(x, dims)
    mean = "mean" in op_name(n.target)
    if max(x.ndim, 1) - 1 not in dims:
        f = 1.0 if mean else float(count)
        out = scaled(x, shape, f, rule="reduction (linear)")
        out.max_abs = None if x.entry_bound() is None else x.entry_bound().scale(f)
        return out
    d_last = x.shape[-1] if x.ndim else 1
    other = count // max(d_last, 1)
    # an entry of the result is a (mean of) sum over `other` rows' sums: |row sum| <= sqrt(d) N
    per_entry = (1.0 / math.sqrt(d_last)) if mean else (other * math.sqrt(d_last))
    dd = sqrt_last(shape)
    m = None if x.growth is None else x.growth.scale(per_entry)
    return AValue(exps=x.exps, shape=shape, growth=None if m is None else m.scale(dd), max_abs=m,
                  jacobian=None if x.jacobian is None else x.jacobian.scale(per_entry * dd), sign=x.sign,
                  rule="reduction (linear)")


@register_rule("aten.amax", "aten.amin", "aten.max", "aten.min", "aten.logsumexp")
def max_or_min(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> Any:
    x = a.get("self")
    name = op_name(n.target)
    if isinstance(a.get("other"), AValue):  # elementwise max/min of two tensors: 1-Lipschitz in each
        return extremum(x, a["other"], shape, "max" if name == "aten.max" else "min")
    conc = it.g.env.get(n.name)
    dims = _reduce_dims(a, x.ndim)
    count = _count(x, dims)
    out_shape = tuple(conc[0].shape) if isinstance(conc, (tuple, list)) else shape
    dd = sqrt_last(out_shape)
    extra = math.log(max(count, 1)) if name == "aten.logsumexp" else 0.0  # logsumexp <= max + log(count)
    entries = x.entry_bound()
    if max(x.ndim, 1) - 1 in dims:
        m = None if entries is None else entries + Poly.const(extra)
        growth = None if m is None else m.scale(dd)
        jacobian = None if x.jacobian is None else x.jacobian.scale(dd)
    else:
        growth = None if x.growth is None else x.growth.scale(math.sqrt(count)) + Poly.const(extra * dd)
        m = None if entries is None else entries + Poly.const(extra)
        jacobian = None if x.jacobian is None else x.jacobian.scale(math.sqrt(count))
    out = AValue(exps=E.compose(E.LIPSCHITZ, x.exps), shape=out_shape, growth=growth, max_abs=m, jacobian=jacobian,
                 sign=x.sign if not extra else None, rule=f"{name.split('.')[-1]} (1-Lipschitz)")
    if isinstance(conc, (tuple, list)):
        return [out, AValue.constant(conc[1])]
    return out


@register_rule("aten.linalg_vector_norm", "aten.norm", "aten.frobenius_norm")
def norm(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x = a.get("self", a.get("input"))
    p = a.get("ord", a.get("p", 2))
    if p is None:
        p = 2
    if float(p) != 2.0:
        return unknown(shape, f"vector norm of order {p} has no rule")
    dims = _reduce_dims(a, x.ndim)
    f = 1.0 if dims == [max(x.ndim, 1) - 1] else math.sqrt(_count(x, dims))
    dd = sqrt_last(shape)
    m = None if x.growth is None else x.growth.scale(f)
    return AValue(exps=E.compose(E.LIPSCHITZ, x.exps), shape=shape, growth=None if m is None else m.scale(dd),
                  max_abs=m, jacobian=None if x.jacobian is None else x.jacobian.scale(f * dd),
                  sign="+", rule="Euclidean norm (1-Lipschitz)")


@register_rule("aten.var", "aten.std")
def var(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    return unknown(shape, f"{op_name(n.target)} outside a recognized normalization has no rule")


@register_rule("aten.cumsum")
def cumsum(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x = a["self"]
    dim = int(a["dim"]) % max(x.ndim, 1)
    k = x.shape[dim]
    if dim == x.ndim - 1:
        dd = math.sqrt(shape[-1])
        m = None if x.growth is None else x.growth.scale(math.sqrt(k))
        return AValue(exps=x.exps, shape=shape, growth=None if m is None else m.scale(dd), max_abs=m,
                      jacobian=None if x.jacobian is None else x.jacobian.scale(math.sqrt(k) * dd), sign=x.sign,
                      rule="linear (cumsum)")
    return scaled(x, shape, float(k), rule="linear (cumsum)")


@register_rule("aten.max_pool1d", "aten.max_pool2d", "aten.max_pool3d", "aten.max_pool1d_with_indices",
               "aten.max_pool2d_with_indices", "aten.max_pool3d_with_indices", "aten.avg_pool1d", "aten.avg_pool2d",
               "aten.avg_pool3d", "aten.adaptive_avg_pool1d", "aten.adaptive_avg_pool2d", "aten.adaptive_avg_pool3d",
               "aten.adaptive_max_pool1d", "aten.adaptive_max_pool2d", "aten._adaptive_avg_pool2d")
def pool(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> Any:
    """Pooling: every output entry is a max or a mean of input entries (1-Lipschitz in max-abs).

    A mean over fewer entries at a border (``count_include_pad=False``) is still a mean: ``|out| <= max|x|``.
    """
    x = a.get("self", a.get("input"))
    linear = "avg" in op_name(n.target)
    conc = it.g.env.get(n.name)
    out_shape = tuple(conc[0].shape) if isinstance(conc, (tuple, list)) else shape
    d = sqrt_last(out_shape)
    entries = x.entry_bound()
    out = AValue(exps=x.exps if linear else E.compose(E.LIPSCHITZ, x.exps), shape=out_shape,
                 growth=None if entries is None else entries.scale(d), max_abs=entries,
                 jacobian=None if x.jacobian is None else x.jacobian.scale(d), sign=x.sign,
                 rule="linear (average pooling)" if linear else "max pooling (1-Lipschitz)")
    if isinstance(conc, (tuple, list)):
        return [out] + [AValue.constant(c) for c in conc[1:]]
    return out
