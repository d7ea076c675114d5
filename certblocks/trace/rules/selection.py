"""Selection rules: order statistics (``topk``, ``sort``, ``cummax``/``cummin``) and entrywise extrema
(``maximum``/``minimum``, ``fmax``/``fmin``, a clamp between tensors).

Their values are 1-Lipschitz selections of their inputs' entries (exponents ``(q, sigma)`` kept):

* sorting a row is 1-Lipschitz in the Euclidean norm, and the top ``k`` are a projection of the sorted row,
  so along the last dimension the row norm and the Jacobian keep their bounds; along another dimension an
  output row takes each entry from some row of the input (the ``j``-th largest of a column is within
  ``max_r |a_rc - b_rc|`` of the other input's), a factor ``sqrt(n)`` for ``n`` rows;
* a running maximum is 1-Lipschitz in the max norm only: ``|cummax(a)_j - cummax(b)_j| <= max_i |a_i - b_i|``,
  a factor ``sqrt(n)`` in a row of ``n`` entries;
* ``|max(a, b)| <= max(|a|, |b|)`` and ``|d max(a, b)| <= max(|da|, |db|)`` entrywise, so the row norms and the
  Jacobians of the operands add.

Their indices are piecewise-constant functions of the input (an index jumps where two entries swap order): bounded
integers with derivative 0 (:func:`~.common.piecewise_constant`: the certificate bounds the derivative autograd
computes, docs/theory.md section 1.1); what they select is bounded over every index in range (:mod:`.indexing`), and the
map is noted as piecewise.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import torch

from ... import exponents as E
from ...bounds.poly import psum
from ..nodes import op_name
from ..values import AValue
from .arithmetic import as_value, sum_term
from .common import broadcast_factor, piecewise_constant, pmax, scaled
from .registry import register_rule

if TYPE_CHECKING:
    from ..interp import VelocityInterpreter

__all__ = ["extremum", "clamp_between"]

Args = Dict[str, Any]
Shape = Tuple[int, ...]

#: What the indices of an order statistic are (the rule of their node: piecewise constant, derivative 0).
INDEX_RULES = {
    "topk": "topk indices (in range; piecewise constant: they jump where two entries swap order)",
    "sort": "sort indices (in range; piecewise constant: they jump where two entries swap order)",
    "cummax": "cummax indices (in range; piecewise constant: they jump where a new maximum appears)",
    "cummin": "cummin indices (in range; piecewise constant: they jump where a new minimum appears)",
}


def _order_values(x: AValue, out_shape: Shape, dim: int, name: str) -> AValue:
    """The values of ``sort``/``topk`` along ``dim`` (1-Lipschitz; see the module docstring)."""
    nd = max(x.ndim, 1)
    along_last = x.ndim == 0 or dim % nd == nd - 1
    f = 1.0 if along_last else math.sqrt(x.shape[dim])
    out = scaled(x, out_shape, f, entry_factor=1.0,
                 rule=f"{name} values (1-Lipschitz" + (")" if along_last else f", rows x{f:.3g})"))
    out.exps = E.compose(E.LIPSCHITZ, x.exps)
    return out


def _with_indices(conc: Any, x: AValue, values: AValue, dim: int, name: str) -> list:
    """``[values, indices]`` of an order statistic (``conc`` its concrete outputs); the indices are bounded by the
    size of ``dim``."""
    size = x.shape[dim] if x.ndim else 1
    return [values, piecewise_constant(tuple(conc[1].shape), float(max(size - 1, 0)), INDEX_RULES[name])]


@register_rule("aten.topk", reads=("self", "k", "dim", "largest", "sorted"))
@register_rule("aten.sort", overloads=("default", "stable"), reads=("self", "stable", "dim", "descending"))
def order_statistics(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> list:
    x = a["self"]
    name = op_name(n.target).split(".")[-1]
    dim = int(a.get("dim", -1))
    conc = it.g.env[n.name]
    return _with_indices(conc, x, _order_values(x, tuple(conc[0].shape), dim, name), dim, name)


@register_rule("aten.cummax", "aten.cummin", reads=("self", "dim"))
def running_extremum(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> list:
    """Running max/min along ``dim``: each entry within ``max |a_i - b_i|`` of the other input's (a factor
    ``sqrt(n)`` for ``n`` entries along ``dim``, through the entries along the last dimension)."""
    x = a["self"]
    name = op_name(n.target).split(".")[-1]
    dim = int(a["dim"])
    nd = max(x.ndim, 1)
    along_last = x.ndim == 0 or dim % nd == nd - 1
    k = x.shape[dim] if x.ndim else 1
    conc = it.g.env[n.name]
    values = scaled(x, tuple(conc[0].shape), math.sqrt(k), entry_factor=1.0, via_entries=along_last,
                    rule=f"{name} values (1-Lipschitz in the max norm, x{math.sqrt(k):.3g})")
    values.exps = E.compose(E.LIPSCHITZ, x.exps)
    return _with_indices(conc, x, values, dim, name)


def _extremum_sign(signs: Tuple[Optional[str], ...], kind: str) -> Optional[str]:
    """Sign of ``max(a, b)`` (``kind="max"``) or ``min(a, b)``: one nonnegative operand makes a max nonnegative."""
    low, high = ("+", "-") if kind == "max" else ("-", "+")
    if any(s in (low, "0") for s in signs):
        return low
    if all(s == high for s in signs):
        return high
    return None


def extremum(x: Any, y: Any, shape: Shape, kind: str) -> AValue:
    """``max(x, y)`` (``kind="max"``) or ``min(x, y)`` entrywise, with broadcasting (numbers are constants)."""
    xs = (as_value(x), as_value(y))
    acts = [v for v in xs if not v.const]
    if not acts:
        fn = torch.maximum if kind == "max" else torch.minimum
        return AValue.constant(fn(xs[0].value, xs[1].value))
    factors = [broadcast_factor(v.shape, shape) for v in xs]
    return AValue(exps=E.add(*[v.exps for v in acts]), shape=tuple(shape),
                  growth=psum([sum_term(v, f) for v, f in zip(xs, factors)]),
                  max_abs=pmax([v.entry_bound() for v in xs]),
                  jacobian=psum([None if v.jacobian is None else v.jacobian.scale(f) for v, f in zip(xs, factors)]),
                  sign=_extremum_sign(tuple(v.sign for v in xs), kind),
                  rule=f"entrywise {kind} (1-Lipschitz in each operand)")


@register_rule("aten.maximum", "aten.minimum", "aten.fmax", "aten.fmin", reads=("self", "other"))
def entrywise_extremum(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    kind = "max" if op_name(n.target) in ("aten.maximum", "aten.fmax") else "min"
    return extremum(a["self"], a["other"], shape, kind)


def clamp_between(x: AValue, lo: Any, hi: Any, shape: Shape) -> AValue:
    """``clamp(x, lo, hi) = min(max(x, lo), hi)`` with bounds that may depend on the input (``None``: no bound)."""
    out = x if lo is None else extremum(x, lo, shape, "max")
    out = out if hi is None else extremum(out, hi, shape, "min")
    out.rule = "clamp between tensors (1-Lipschitz in each operand)"
    return out
