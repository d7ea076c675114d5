"""Proven bounds on the entries of a tensor, read from the graph: the minimum of a denominator (``1/d`` is bounded
when every entry of ``d`` is ``>= m > 0``) and the maximum that rules out a case.

:func:`lower_bound` proves a number ``m`` with every entry ``>= m`` for every input, from the node's producers:

* constants (their smallest entry), values with a proven sign ``"+"`` (0), values whose entry bound does not grow
  with the input (``-max |entry|``);
* sums ``a + alpha b`` (``alpha >= 0``), sums over a dimension (``k`` times the minimum), clamps and maxima from below,
  products of nonnegative factors, means, and the ops that only move or copy entries;
* **the mass of the top ``k`` of a probability vector** (a mixture-of-experts router: ``topk(softmax(z), k)`` summed
  over the experts): the mean of the ``k`` largest of ``E`` probabilities is at least their mean ``1/E``, so the sum
  is ``>= k/E``;
* **a pair of max-shifted exponentials** (RWKV's WKV recurrence): ``exp(a - M) S + exp(b - M) T`` with
  ``M = maximum(a, b)``: ``M`` is one of its operands exactly, so one of the two exponentials is ``exp(0) = 1``
  and the sum is ``>= min(min S, min T)`` when ``S, T >= 0`` (a case that the operands' bounds rule out is left
  out: ``a <= -1e38 < b`` makes ``M = b``);
* **columns of a product of nonnegative matrices** (linear attention's ``Q (K^T [V | 1])``: its last column is
  ``Q K^T 1 >= 0`` although the other columns have no sign): a slice of the last dimension is bounded by the
  columns of the right factor it reads, through a padding with a constant.

Every minimum is carried through the rounding of the node that computes it: round to nearest is monotone, so a
value ``>= m`` computed or cast into a dtype is ``>=`` the largest number of that dtype below ``m``
(:func:`~.common.floor_in`; an ``eps`` that a cast to float16 rounds to 0 proves nothing), and a sum of ``k``
entries loses at most ``k + 1`` roundings (docs/theory.md section 2).  Results are kept per interpreter, so a
recurrence over ``L`` steps is read once per step.

:func:`upper_bound` is the mirror image for the few forms a case analysis needs (constants, signs, bounded entries).
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import torch

from ..nodes import IDENTITY_OPS, VIEW_OPS, bind_args, strip_exact_casts, target_name
from ..values import AValue
from .common import floor_in, same_computation, unit_roundoff
from .normalizations import _unit_alpha

if TYPE_CHECKING:
    from ..interp import VelocityInterpreter

__all__ = ["lower_bound", "upper_bound", "columns_lower_bound"]

#: Ops whose entries are entries of their first argument (a lower bound of those bounds theirs); ``copy`` and
#: ``fill_`` return their second argument's values.
_ENTRY_OPS = (IDENTITY_OPS - {"aten.copy", "aten.fill_"}) | VIEW_OPS | frozenset({
    "aten.expand", "aten.expand_as", "aten.broadcast_to", "aten.permute", "aten.transpose", "aten.t",
    "aten.slice", "aten.select", "aten.narrow", "aten.index_select", "aten.repeat", "aten.flip", "aten.roll",
    "aten.amax", "aten.amin",
})
#: Ops that keep every row (last dimension) whole: a bound on some columns of their input bounds the same columns.
_COLUMN_MOVES = (IDENTITY_OPS - {"aten.copy", "aten.fill_"}) | frozenset({"aten.expand", "aten.clone"})
#: The entrywise maxima that return one of their operands exactly.
_MAXIMA = ("aten.maximum", "aten.fmax", "aten.max")
#: How deep :func:`lower_bound` follows a denominator's producers.
_DEPTH = 24

# interpreter -> node name -> (bound or None, the depth budget it was computed with)
_MEMO: weakref.WeakKeyDictionary[Any, Dict[str, Tuple[Optional[float], int]]] = weakref.WeakKeyDictionary()


def _const_min(v: AValue) -> Optional[float]:
    """The smallest entry of a real constant (``None`` for a complex or empty one)."""
    t = v.value
    if t is None or t.is_complex() or t.numel() == 0:
        return None
    return float(t.double().min())


def _const_max(v: AValue) -> Optional[float]:
    t = v.value
    if t is None or t.is_complex() or t.numel() == 0:
        return None
    return float(t.double().max())


def _bounded_entries(av: Any) -> Optional[float]:
    """``E`` with every entry ``|t| <= E`` whatever the input (an entry bound that does not grow), else ``None``."""
    if not isinstance(av, AValue):
        return None
    e = av.entry_bound()
    if e is None or not e.is_finite() or e.degree > 0:
        return None
    return e(0.0)


def lower_bound(it: VelocityInterpreter, n: Any, depth: int = 0) -> Optional[float]:
    """A number ``m`` with every entry of ``n`` ``>= m`` for every input (``None``: none is proven).

    Args:
        it: the interpreter (abstract values of the nodes before ``n`` are known).
        n: a node argument (a node or a Python number).
        depth: the recursion depth (the search stops at a fixed depth).
    """
    if isinstance(n, (int, float)) and not isinstance(n, bool):
        return float(n)
    if not isinstance(n, torch.fx.Node) or depth > _DEPTH:
        return None
    memo = _MEMO.setdefault(it, {})
    budget = _DEPTH - depth
    hit = memo.get(n.name)
    if hit is not None and (hit[0] is not None or hit[1] >= budget):
        return hit[0]
    found = _lower_bound(it, n, depth)
    memo[n.name] = (found, budget)
    return found


def _lower_bound(it: VelocityInterpreter, n: torch.fx.Node, depth: int) -> Optional[float]:
    av = it.value(n)
    if isinstance(av, AValue) and av.const:
        return _const_min(av)
    t = target_name(n)
    b = bind_args(n) or {}
    cands = []
    if t == "aten.add":
        alpha = 1 if b.get("alpha") is None else b["alpha"]
        if isinstance(alpha, (int, float)) and alpha >= 0:
            lo, hi = lower_bound(it, b.get("self"), depth + 1), lower_bound(it, b.get("other"), depth + 1)
            cands.append(None if lo is None or hi is None else lo + float(alpha) * hi)
        cands.append(_shifted_exponentials(it, n, depth))
    elif t in ("aten.clamp", "aten.clamp_min", "aten.maximum", "aten.fmax", "aten.max"):
        # max(a, m) >= m and >= min(a): the largest bound proven for one of the operands
        arg = b.get("min") if t in ("aten.clamp", "aten.clamp_min") else b.get("other")
        found = [lower_bound(it, v, depth + 1) for v in (b.get("self"), arg) if v is not None]
        found = [c for c in found if c is not None]
        best = max(found) if found else None
        if t == "aten.clamp" and b.get("max") is not None and best is not None:
            top = lower_bound(it, b["max"], depth + 1)  # clamp returns max where max < min
            best = None if top is None else min(best, top)
        cands.append(best)
    elif t == "aten.mul":
        lo, hi = lower_bound(it, b.get("self"), depth + 1), lower_bound(it, b.get("other"), depth + 1)
        if lo is not None and hi is not None and lo >= 0 and hi >= 0:
            cands.append(lo * hi)  # a product of entries >= lo >= 0 and >= hi >= 0
    elif t == "aten.sqrt" and n.args:  # monotone: sqrt(y) >= sqrt(m) for y >= m >= 0 (IEEE sqrt rounds correctly)
        lo = lower_bound(it, n.args[0], depth + 1)
        if lo is not None and lo >= 0:
            cands.append(math.sqrt(lo) * (1.0 - 2.0 ** -52))  # below the float64 rounding of the exact root
    elif t in ("aten.copy", "aten.fill_"):
        cands.append(lower_bound(it, b.get("src", b.get("value")), depth + 1))
    elif t in ("aten.mean", "aten.sum") and n.args:
        cands += [_reduced(it, n, t, depth), _top_mass(it, n, b)]
    elif t in ("aten.slice", "aten.select", "aten.narrow") and n.args:
        cands += [lower_bound(it, n.args[0], depth + 1), _sliced_columns(it, n, b, depth)]
    elif t in _ENTRY_OPS and n.args:
        cands.append(lower_bound(it, n.args[0], depth + 1))
    sign = av.sign if isinstance(av, AValue) else None
    if sign in ("+", "0"):
        cands.append(0.0)
    e = _bounded_entries(av)
    if e is not None:
        cands.append(-e)
    cands = [c for c in cands if c is not None and not math.isnan(c)]
    if not cands:
        return None
    found = max(cands)
    out = it.g.env.get(n.name)
    if isinstance(out, torch.Tensor):
        found = floor_in(found, out.dtype)  # the node's own rounding (a cast, or the op computed in its dtype)
    return found


def upper_bound(it: VelocityInterpreter, n: Any) -> Optional[float]:
    """A number ``M`` with every entry of ``n`` ``<= M`` for every input (constants, nonpositive values, entries that
    do not grow with the input); ``None`` when none is known."""
    if isinstance(n, (int, float)) and not isinstance(n, bool):
        return float(n)
    if not isinstance(n, torch.fx.Node):
        return None
    av = it.value(n)
    if isinstance(av, AValue) and av.const:
        return _const_max(av)
    found = [0.0] if isinstance(av, AValue) and av.sign in ("-", "0") else []
    e = _bounded_entries(av)
    if e is not None:
        found.append(e)
    return min(found) if found else None


def _reduced(it: VelocityInterpreter, n: torch.fx.Node, t: str, depth: int) -> Optional[float]:
    """A mean, or a sum of ``k`` entries, of values ``>= m``: ``>= m`` (``k m`` for the sum), less ``k + 1``
    roundings of relative size ``u`` (the sums and the division)."""
    found = lower_bound(it, n.args[0], depth + 1)
    src, out = it.g.env.get(getattr(n.args[0], "name", "")), it.g.env.get(n.name)
    if found is None or not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    k = max(src.numel() // max(out.numel(), 1), 1)
    slack = (k + 1) * unit_roundoff(out.dtype)
    found = found * k if t == "aten.sum" else found
    return found * (1 - slack) if found > 0 else found * (1 + slack)


def _top_mass(it: VelocityInterpreter, n: torch.fx.Node, b: Dict[str, Any]) -> Optional[float]:
    """The sum over a dimension of the ``k`` largest entries of probability vectors along it: ``>= k / E``.

    The ``k`` largest of ``E`` numbers have a mean at least the mean of all, ``1/E`` for a probability vector.  In
    floating point a softmax computes ``p_i = fl(e_i fl(1/s))`` (or ``fl(e_i / s)``) with ``s = fl(sum_j e_j) <=
    (1 + u)^(E-1) sum_j e_j`` whatever the rounding of each ``e_j``, and the top ``k`` of the ``p`` are the top ``k``
    of the ``e``: their exact sum is ``>= (k/E) (1 - u)^2 / (1 + u)^(E-1)``, and their computed sum loses ``k - 1``
    more roundings; ``(1 - (E + k + 4) u)`` covers all of them.
    """
    if target_name(n) != "aten.sum":
        return None
    src = strip_exact_casts(n.args[0], it.g.env)
    if target_name(src) != "getitem" or src.args[1] != 0 or target_name(src.args[0]) != "aten.topk":
        return None
    top = src.args[0]
    tb = bind_args(top) or {}
    probs = it.value(tb.get("self"))
    if not isinstance(probs, AValue) or probs.stochastic_dim is None or probs.sign != "+" or not tb.get("largest"):
        return None
    nd = max(probs.ndim, 1)
    dim = int(tb.get("dim", -1)) % nd
    dims = b.get("dim")
    if dim != probs.stochastic_dim % nd or not isinstance(dims, (list, tuple)) or len(dims) != 1 or \
            int(dims[0]) % nd != dim or b.get("dtype") is not None:
        return None
    k, size = int(tb["k"]), probs.shape[dim]
    u = max(unit_roundoff(it.g.env[top.args[0].name].dtype), unit_roundoff(it.g.env[n.name].dtype))
    return (k / size) * (1.0 - (size + k + 4) * u)


def _exp_shift(it: VelocityInterpreter, n: Any) -> Optional[Tuple[Any, torch.fx.Node]]:
    """``(a, M)`` when ``n`` is ``exp(a - M)`` (``alpha = 1``) with ``M`` an entrywise maximum, else ``None``."""
    e = strip_exact_casts(n, it.g.env)
    if target_name(e) != "aten.exp":
        return None
    s = strip_exact_casts(e.args[0], it.g.env)
    if target_name(s) != "aten.sub" or not _unit_alpha(s) or len(s.args) < 2:
        return None
    m = strip_exact_casts(s.args[1], it.g.env)
    if target_name(m) not in _MAXIMA or len(m.args) != 2 or not all(isinstance(v, torch.fx.Node) for v in m.args):
        return None
    return s.args[0], m


def _weighted_exp(it: VelocityInterpreter, n: Any, depth: int) -> Optional[Tuple[Any, torch.fx.Node, float]]:
    """``(a, M, min S)`` when ``n`` is ``exp(a - M) * S`` with ``S >= 0`` proven, or ``exp(a - M)`` (``S = 1``)."""
    found = _exp_shift(it, n)
    if found is not None:
        return found[0], found[1], 1.0
    m = strip_exact_casts(n, it.g.env)
    if target_name(m) != "aten.mul" or len(m.args) != 2:
        return None
    for e, s in ((m.args[0], m.args[1]), (m.args[1], m.args[0])):
        found = _exp_shift(it, e)
        if found is not None:
            lo = lower_bound(it, s, depth + 1)
            return (found[0], found[1], lo) if lo is not None and lo >= 0 else None
    return None


def _shifted_exponentials(it: VelocityInterpreter, n: torch.fx.Node, depth: int) -> Optional[float]:
    """``exp(a - M) S + exp(b - M) T`` with ``M = maximum(a, b)`` and ``S, T >= 0``: ``>= min S`` where ``M = a``
    (``exp(0) = 1`` times ``S``, plus a term ``>= 0``), ``>= min T`` where ``M = b``; a case is left out when the
    bounds of ``a`` and ``b`` rule it out.  ``(1 - 4u)`` allows an ``exp(0)`` a few roundings below 1."""
    if not _unit_alpha(n) or len(n.args) < 2:
        return None
    left, right = _weighted_exp(it, n.args[0], depth), _weighted_exp(it, n.args[1], depth)
    if left is None or right is None:
        return None
    (a, m, s_min), (c, m2, t_min) = left, right
    env = it.g.env
    if not same_computation(m, m2, env):
        return None
    x, y = m.args
    if same_computation(a, x, env) and same_computation(c, y, env):
        pass
    elif same_computation(a, y, env) and same_computation(c, x, env):
        x, y = y, x
    else:
        return None
    cases = []
    ub_a, lb_c = upper_bound(it, a), lower_bound(it, c, depth + 1)
    if ub_a is None or lb_c is None or not ub_a < lb_c:
        cases.append(s_min)  # M = a is possible
    ub_c, lb_a = upper_bound(it, c), lower_bound(it, a, depth + 1)
    if ub_c is None or lb_a is None or not ub_c < lb_a:
        cases.append(t_min)  # M = b is possible
    if not cases:
        return None
    out = it.g.env.get(n.name)
    u = unit_roundoff(out.dtype) if isinstance(out, torch.Tensor) else 0.0
    return min(cases) * (1.0 - 4.0 * u)


def _sliced_columns(it: VelocityInterpreter, n: torch.fx.Node, b: Dict[str, Any], depth: int) -> Optional[float]:
    """A slice, narrow or select of the last dimension: the bound of those columns of its input."""
    src = it.g.env.get(getattr(n.args[0], "name", ""))
    if not isinstance(src, torch.Tensor) or src.dim() == 0:
        return None
    width = src.shape[-1]
    if int(b.get("dim", 0) or 0) % src.dim() != src.dim() - 1:
        return None
    t = target_name(n)
    if t == "aten.select":
        cols = range(width)[int(b["index"])]
        return columns_lower_bound(it, n.args[0], range(cols, cols + 1), depth + 1)
    if t == "aten.narrow":
        start = int(b["start"]) % width if width else 0
        return columns_lower_bound(it, n.args[0], range(start, start + int(b["length"])), depth + 1)
    start, end, step = b.get("start"), b.get("end"), b.get("step")
    return columns_lower_bound(it, n.args[0], range(width)[slice(start, end, step or 1)], depth + 1)


def columns_lower_bound(it: VelocityInterpreter, n: Any, cols: range, depth: int = 0) -> Optional[float]:
    """A lower bound of ``n[..., cols]``: through a product ``A @ B`` with ``A >= 0`` (every column of ``A @ B`` is
    ``A`` times that column of ``B``), a constant padding of the last dimension, and ops that keep rows whole; else
    the bound of the whole tensor."""
    whole = lower_bound(it, n, depth)
    if not isinstance(n, torch.fx.Node) or depth > _DEPTH or not len(cols):
        return whole
    t = target_name(n)
    b = bind_args(n) or {}
    found: Optional[float] = None
    right_value = it.g.env.get(getattr(n.args[1], "name", "")) if len(n.args) == 2 else None
    if t in ("aten.matmul", "aten.mm", "aten.bmm") and isinstance(right_value, torch.Tensor) and \
            right_value.dim() >= 2:  # (a vector on the right: the last dimension is the left factor's rows)
        left = lower_bound(it, n.args[0], depth + 1)
        right = columns_lower_bound(it, n.args[1], cols, depth + 1)
        if left is not None and right is not None and left >= 0 and right >= 0:
            found = 0.0  # sums of products of nonnegative numbers (rounded to nearest: still >= 0)
    elif t in ("aten.pad", "aten.constant_pad_nd") and b.get("mode", "constant") == "constant":
        found = _padded_columns(it, n, b, cols, depth)
    elif t in _COLUMN_MOVES or (t in ("aten.transpose", "aten.permute") and _keeps_last(it, n, b)):
        found = columns_lower_bound(it, n.args[0], cols, depth + 1)
    if found is not None:
        out = it.g.env.get(n.name)
        found = floor_in(found, out.dtype) if isinstance(out, torch.Tensor) else found
    return found if whole is None else max(whole, found) if found is not None else whole


def _keeps_last(it: VelocityInterpreter, n: torch.fx.Node, b: Dict[str, Any]) -> bool:
    out = it.g.env.get(n.name)
    if not isinstance(out, torch.Tensor) or out.dim() == 0:
        return False
    nd = out.dim()
    if target_name(n) == "aten.transpose":
        return nd - 1 not in (int(b["dim0"]) % nd, int(b["dim1"]) % nd)
    return int(list(b["dims"])[-1]) % nd == nd - 1


def _padded_columns(it: VelocityInterpreter, n: torch.fx.Node, b: Dict[str, Any], cols: range,
                    depth: int) -> Optional[float]:
    """Columns of a constant padding of the last dimension: the padding value where they fall in it, the input's
    columns elsewhere."""
    pad = list(b.get("pad") or [])
    src = it.g.env.get(getattr(n.args[0], "name", ""))
    if len(pad) < 2 or min(int(pad[0]), int(pad[1])) < 0 or not isinstance(src, torch.Tensor) or src.dim() == 0:
        return None  # a negative padding crops
    left, width = int(pad[0]), src.shape[-1]
    value = float(b.get("value") or 0.0)
    inner = [c - left for c in cols if 0 <= c - left < width]
    parts = [value] if len(inner) < len(cols) else []
    if inner:
        parts.append(columns_lower_bound(it, n.args[0], range(min(inner), max(inner) + 1), depth + 1))
    return None if any(p is None for p in parts) else min(parts)
