"""Reduction rules: sum/mean, max/min/logsumexp, the Euclidean norm, cumsum, pooling.

Sums and means are linear (exponents kept); max, min, logsumexp, norms and max pooling are 1-Lipschitz
(``q`` kept, ``sigma`` as a Lipschitz map's).  A reduction over the last dimension bounds the result's
entries, and its rows through them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from ... import exponents as E
from ...bounds.poly import Poly
from ..nodes import op_name
from ..values import AValue
from .common import flip_sign, piecewise_constant, rounding_factor, scaled, sqrt_last, unit_roundoff, unknown
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


def _dtype_factor(x: AValue, it: VelocityInterpreter, n: torch.fx.Node, a: Args, count: int) -> Optional[float]:
    """The factor on the magnitude of a reduction of ``count`` entries computed in the ``dtype`` it is given: 1 in a
    dtype at least as fine as the input's, ``1 + (count + 1) u`` in a coarser float (each of the ``count`` additions
    and the final rounding loses at most ``u`` of the partial sums); ``None`` for a dtype that is not a float."""
    dtype = a.get("dtype")
    if dtype is None:
        return 1.0
    if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype.is_complex):
        return None
    src = it.g.env.get(getattr(n.args[0], "name", "")) if n.args else None
    src_dtype = src.dtype if isinstance(src, torch.Tensor) else None
    return 1.0 if rounding_factor(src_dtype, dtype) == 1.0 else 1.0 + (count + 1) * unit_roundoff(dtype)


@register_rule("aten.mean", "aten.sum", "aten.nansum", "aten.nanmean", reads=("self", "dim", "dtype"),
               via_shape=("keepdim",))
def sum_or_mean(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """A sum (or mean) of ``count`` entries over ``dim`` (every dim when none): linear, exponents kept.  Over other
    dims than the last, a row of the result sums ``count`` rows and an entry ``count`` entries (mean: 1); over the
    last dim an entry is at most ``sqrt(d)`` times a row norm per row summed."""
    x = a["self"]
    dims = _reduce_dims(a, x.ndim)
    count = _count(x, dims)
    mean = "mean" in op_name(n.target)
    rf = _dtype_factor(x, it, n, a, count)
    if rf is None:
        return unknown(shape, f"{op_name(n.target)} with dtype={a.get('dtype')} (not a floating-point dtype)")
    if max(x.ndim, 1) - 1 not in dims:
        f = (1.0 if mean else float(count)) * rf
        return scaled(x, shape, f, entry_factor=f, rule="reduction (linear)")
    d_last = x.shape[-1] if x.ndim else 1
    other = count // max(d_last, 1)
    # an entry of the result is a (mean of) sum over `other` rows' sums: |row sum| <= sqrt(d) N
    per_entry = ((1.0 / math.sqrt(d_last)) if mean else (other * math.sqrt(d_last))) * rf
    dd = sqrt_last(shape)
    m = None if x.growth is None else x.growth.scale(per_entry)
    return AValue(exps=x.exps, shape=shape, growth=None if m is None else m.scale(dd), max_abs=m,
                  jacobian=None if x.jacobian is None else x.jacobian.scale(per_entry * dd), sign=x.sign,
                  rule="reduction (linear)")


#: The rule of the index output of a reduction (piecewise constant, derivative 0: :func:`~.common.piecewise_constant`).
_INDEX_RULE = "{} indices (in range; piecewise constant: they jump where two entries swap order)"


@register_rule("aten.amax", "aten.amin", "aten.max", "aten.min", "aten.logsumexp", reads=("self", "other", "dim"),
               via_shape=("keepdim",))
def max_or_min(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> Any:
    """Max, min and logsumexp over dims: 1-Lipschitz in the largest entry (logsumexp within ``log(count)`` of the
    max); the entrywise max/min of two tensors goes to :func:`~.selection.extremum`.  The indices of ``max``/``min``
    along a dim are integers in ``[0, size)`` computed from the input: bounded by ``size - 1``, never read at
    their example."""
    x = a["self"]
    name = op_name(n.target)
    if "other" in a:  # elementwise max/min of two tensors: 1-Lipschitz in each
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
        short = name.split(".")[-1]
        return [out, piecewise_constant(tuple(conc[1].shape), float(max(count - 1, 0)), _INDEX_RULE.format(short))]
    return out


@register_rule("aten.linalg_vector_norm", "aten.norm", "aten.frobenius_norm",
               reads=("self", "ord", "p", "dim", "dtype"), via_shape=("keepdim",))
def norm(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """The Euclidean norm over ``dim`` (every dim when none): 1-Lipschitz, ``|out| <= sqrt(count) N`` (one row:
    ``N``).  Other orders are refused."""
    x = a["self"]
    p = a.get("ord", a.get("p", 2))
    if p is None:
        p = 2
    if isinstance(p, complex) or float(p) != 2.0:
        return unknown(shape, f"vector norm of order {p} has no rule")
    dims = _reduce_dims(a, x.ndim)
    rf = _dtype_factor(x, it, n, a, _count(x, dims))
    if rf is None:
        return unknown(shape, f"{op_name(n.target)} with dtype={a.get('dtype')} (not a floating-point dtype)")
    f = (1.0 if dims == [max(x.ndim, 1) - 1] else math.sqrt(_count(x, dims))) * rf
    dd = sqrt_last(shape)
    m = None if x.growth is None else x.growth.scale(f)
    return AValue(exps=E.compose(E.LIPSCHITZ, x.exps), shape=shape, growth=None if m is None else m.scale(dd),
                  max_abs=m, jacobian=None if x.jacobian is None else x.jacobian.scale(f * dd),
                  sign="+", rule="Euclidean norm (1-Lipschitz)")


@register_rule("aten.var", "aten.std", reads=("self", "dim", "unbiased", "correction"), via_shape=("keepdim",))
def var(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """The standard deviation over ``dim`` of ``k`` entries with correction ``c`` is ``||P x|| / sqrt(k - c)``, ``P``
    the centering (an orthogonal projection): the Euclidean norm's bounds (:func:`norm`) times ``1 / sqrt(k - c)``,
    1-Lipschitz up to that factor.  The variance is its square (the entrywise power 2 of the standard deviation:
    ``|var| <= s^2``, slope ``2 s`` times the standard deviation's).  ``k - c <= 0`` (an inf or NaN output) is
    refused."""
    x = a["self"]
    dims = _reduce_dims(a, x.ndim)
    k = _count(x, dims)
    corr = a.get("correction")
    c = float(corr) if corr is not None else (1.0 if a.get("unbiased", True) else 0.0)
    name = op_name(n.target)
    if not k - c > 0:
        return unknown(shape, f"{name} of {k} entries with correction {c:g} (k - c <= 0: inf or NaN)")
    f = (1.0 if dims == [max(x.ndim, 1) - 1] else math.sqrt(k)) / math.sqrt(k - c)
    dd = sqrt_last(shape)
    m = None if x.growth is None else x.growth.scale(f)
    jac = None if x.jacobian is None else x.jacobian.scale(f)  # the standard deviation's slope, per entry
    if name == "aten.std":
        return AValue(exps=E.compose(E.LIPSCHITZ, x.exps), shape=shape, growth=None if m is None else m.scale(dd),
                      max_abs=m, jacobian=None if jac is None else jac.scale(dd), sign="+",
                      rule="standard deviation (a centered Euclidean norm / sqrt(k - c))")
    return AValue(exps=E.compose(E.power(2.0), E.compose(E.LIPSCHITZ, x.exps)), shape=shape,
                  growth=None if m is None else (m * m).scale(dd), max_abs=None if m is None else m * m,
                  jacobian=None if m is None or jac is None else (m * jac).scale(2.0 * dd), sign="+",
                  rule="variance (the square of a centered Euclidean norm / sqrt(k - c))")


@register_rule("aten.cumsum", reads=("self", "dim", "dtype"))
def cumsum(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """Running sums of ``k`` entries along ``dim``: an entry is at most ``sqrt(k)`` times a row norm (along the
    last dim) or ``k`` times an entry; a row sums up to ``k`` rows (along another dim)."""
    x = a["self"]
    dim = int(a["dim"]) % max(x.ndim, 1)
    k = x.shape[dim] if x.ndim else 1
    rf = _dtype_factor(x, it, n, a, k)
    if rf is None:
        return unknown(shape, f"cumsum with dtype={a.get('dtype')} (not a floating-point dtype)")
    if dim == x.ndim - 1:
        dd = math.sqrt(shape[-1])
        m = None if x.growth is None else x.growth.scale(math.sqrt(k) * rf)
        return AValue(exps=x.exps, shape=shape, growth=None if m is None else m.scale(dd), max_abs=m,
                      jacobian=None if x.jacobian is None else x.jacobian.scale(math.sqrt(k) * dd * rf), sign=x.sign,
                      rule="linear (cumsum)")
    return scaled(x, shape, float(k) * rf, entry_factor=float(k) * rf, rule="linear (cumsum)")


def _spatial(name: str) -> int:
    """The number of spatial dims of a pooling op (its ``1d``/``2d``/``3d``)."""
    return next((int(c) for c in ("1", "2", "3") if f"{c}d" in name), 1)


@register_rule("aten.max_pool1d", "aten.max_pool2d", "aten.max_pool3d", "aten.max_pool1d_with_indices",
               "aten.max_pool2d_with_indices", "aten.max_pool3d_with_indices",
               "aten.adaptive_max_pool1d", "aten.adaptive_max_pool2d",
               reads=("self", "kernel_size", "stride", "padding", "dilation", "ceil_mode"), via_shape=("output_size",))
def max_pool(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> Any:
    """Max pooling: every output entry is the largest of some input entries (the padding never wins), whatever the
    window's size, stride, padding, dilation or rounding: 1-Lipschitz in the largest entry.  The indices are
    integers in ``[0, numel of a spatial plane)`` computed from the input: bounded by their range, piecewise constant
    (derivative 0)."""
    return _pool(it, n, a, 1.0, linear=False)


@register_rule("aten.avg_pool1d", "aten.avg_pool2d", "aten.avg_pool3d", "aten.adaptive_avg_pool1d",
               "aten.adaptive_avg_pool2d", "aten.adaptive_avg_pool3d", "aten._adaptive_avg_pool2d",
               reads=("self", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"),
               via_shape=("output_size",))
def avg_pool(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> Any:
    """Average pooling: every output entry is a sum of at most ``prod(kernel_size)`` input entries divided by their
    number, or by a window size counting the padding (``count_include_pad``), or by ``divisor_override``: at most
    ``max(1, prod(kernel_size) / |divisor_override|)`` times the largest entry."""
    override = a.get("divisor_override")
    f = 1.0
    if override is not None:
        if override == 0:
            return unknown(shape, "avg_pool with divisor_override=0")
        nsp = _spatial(op_name(n.target))
        k = [int(v) for v in a["kernel_size"]]
        taps = math.prod(k) if len(k) == nsp else k[0] ** nsp
        f = max(1.0, taps / abs(float(override)))
    out = _pool(it, n, a, f, linear=True)
    if override is not None and override < 0:
        out.sign = flip_sign(out.sign)
    return out


def _pool(it: VelocityInterpreter, n: torch.fx.Node, a: Args, f: float, linear: bool) -> Any:
    """Pooling whose every output entry is at most ``f`` times the largest input entry over a window (and moves by
    at most ``f`` times the largest change there)."""
    x = a["self"]
    conc = it.g.env.get(n.name)
    out_shape = tuple(conc[0].shape) if isinstance(conc, (tuple, list)) else tuple(conc.shape)
    d = sqrt_last(out_shape)
    entries = x.entry_bound()
    out = AValue(exps=x.exps if linear else E.compose(E.LIPSCHITZ, x.exps), shape=out_shape,
                 growth=None if entries is None else entries.scale(d * f),
                 max_abs=None if entries is None else entries.scale(f),
                 jacobian=None if x.jacobian is None else x.jacobian.scale(d * f), sign=x.sign,
                 rule="linear (average pooling)" if linear else "max pooling (1-Lipschitz)")
    if isinstance(conc, (tuple, list)):
        nsp = _spatial(op_name(n.target))
        plane = math.prod(x.shape[-nsp:]) if x.ndim else 1
        return [out] + [piecewise_constant(tuple(c.shape), float(max(plane - 1, 0)), _INDEX_RULE.format("max pooling"))
                        for c in conc[1:]]
    return out
