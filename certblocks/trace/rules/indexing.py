"""Indexing rules: reads by an index tensor (``gather``, ``index_select``, ``index``) and writes into a slice
(``slice_scatter``, ``select_scatter``: ``out[..., :k] = src`` after ``torch.export``).

Every entry of a read is an entry of the source, so the exponents are the source's.  The row norm can grow
when a row of the result collects entries of several source rows, or repeats entries of one row: with a
constant index the rule counts both from the concrete index tensor (``sqrt`` of the count is the factor, for
the values and for the Jacobian alike).  An index that depends on the input selects entries by a piecewise-constant
function of it: the bounds hold for every index in range (a row of the result is a row of the source, or is made of
its entries), and so does the Jacobian bound, since the derivative autograd takes is the source's, read at the
selected entries, for whatever index (docs/theory.md section 1.1); the map jumps where the index changes.

A write ``slice_scatter(base, src)`` is ``base`` with some entries replaced by ``src``'s: a row of the result
is a row of ``base`` or of ``src`` (written along another dimension), or the two parts of one row (along the
last dimension, where the squared norms add: ``N(out) <= N(base) + N(src)``, and so do the Jacobians).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ... import exponents as E
from ...bounds.poly import psum
from ..nodes import op_name
from ..values import AValue
from .common import pmax, scaled, sqrt_last, unknown
from .registry import register_rule

__all__ = ["data_dependent_read", "join_sign"]

Args = Dict[str, Any]
Shape = Tuple[int, ...]


def join_sign(signs: Sequence[Optional[str]]) -> Optional[str]:
    """Sign of a tensor whose entries are entries of tensors with these signs."""
    kinds = {s for s in signs if s != "0"}
    if not kinds:
        return "0"
    return kinds.pop() if len(kinds) == 1 and None not in kinds else None


def _row_counts(index: torch.Tensor, size: int) -> torch.Tensor:
    """``counts[r, v]``: how often the value ``v`` occurs in row ``r`` of ``index`` (rows along the last dim)."""
    idx = index.long() % max(size, 1)
    rows = idx.reshape(-1, idx.shape[-1]) if idx.dim() else idx.reshape(1, 1)
    counts = torch.zeros(rows.shape[0], max(size, 1), dtype=torch.long)
    return counts.scatter_add_(1, rows, torch.ones_like(rows))


def repeat_factor(index: torch.Tensor, size: int) -> float:
    """``sqrt`` of the largest number of times one entry occurs in a row of ``index`` (indices into a row)."""
    if index.numel() == 0:
        return 1.0
    return math.sqrt(float(_row_counts(index, size).max()))


def distinct_factor(index: torch.Tensor, size: int) -> float:
    """``sqrt`` of the largest number of distinct values in a row of ``index`` (indices of source rows)."""
    if index.numel() == 0:
        return 1.0
    return math.sqrt(float((_row_counts(index, size) > 0).sum(-1).max()))


def data_dependent_read(x: AValue, shape: Shape, rows_kept: bool, what: str) -> AValue:
    """Entries of ``x`` selected by an input-dependent index, bounded over every index in range.

    ``rows_kept``: every row of the result is a whole row of ``x`` (the last dimension is not indexed), so its row norm
    and that of its derivative along any tangent are at most ``x``'s; otherwise every entry of a row is some entry of
    ``x`` (of ``J_x v``), at most ``x``'s entry bound (``N(J_x v)``), a factor ``sqrt`` of the row's length.  The
    derivative is autograd's: the index itself has none (docs/theory.md section 1.1).
    """
    return scaled(x, shape, 1.0 if rows_kept else sqrt_last(shape), entry_factor=1.0, via_entries=not rows_kept,
                  rule=f"{what} by an input-dependent index (entries of the source for every index in range; "
                       "piecewise)")


def _last(dim: int, ndim: int) -> bool:
    return ndim == 0 or dim % ndim == ndim - 1


@register_rule("aten.gather", reads=("self", "dim", "index", "sparse_grad"))
def gather(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``out[i, j, k] = x[i, index[i, j, k], k]`` (``dim=1``).

    Along the last dimension a row of the result repeats entries of one row of ``x``: its squared norm is at
    most the largest repetition count times the row's.  Along another dimension a row of the result takes its
    ``k``-th entry from row ``index[..., k]`` of ``x``: at most the number of distinct rows times the square.
    """
    x, idx = a["self"], a["index"]
    dim = int(a["dim"])
    last = _last(dim, x.ndim)
    if not idx.const:
        return data_dependent_read(x, shape, False, "gather")
    size = x.shape[dim] if x.ndim else 1
    f = repeat_factor(idx.value, size) if last else distinct_factor(idx.value, size)
    return scaled(x, shape, f, entry_factor=1.0, rule=f"gather with a constant index (row factor {f:.3g})")


@register_rule("aten.index_select", reads=("self", "dim", "index"))
def index_select(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """Rows of ``x`` (another dimension: the same row norms), or entries of each row (the last: repetitions)."""
    x, idx = a["self"], a["index"]
    dim = int(a["dim"])
    last = _last(dim, x.ndim)
    if not idx.const:
        return data_dependent_read(x, shape, not last, "index_select")
    f = repeat_factor(idx.value.reshape(1, -1), x.shape[dim] if x.ndim else 1) if last else 1.0
    out = scaled(x, shape, f, entry_factor=1.0, rule="structural (index_select)")
    out.stochastic_dim = None if last or x.stochastic_dim is None or x.stochastic_dim % max(x.ndim, 1) != x.ndim - 1 \
        else -1
    return out


@register_rule("aten.index", overloads=("Tensor", "Tensor_hacked_twin"), reads=("self", "indices"))
def index(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``x[i0, i1, ...]`` with index tensors (advanced indexing; ``None`` is a full slice).

    With the last dimension not indexed every row of the result is a row of ``x``.  With only the last
    dimension indexed by integers (``x[..., idx]``) a row of the result repeats entries of one row of ``x``; any
    other pattern (a boolean mask, which stands for as many dims as it has) is bounded through the entries.
    """
    x = a["self"]
    indices: List[Any] = list(a["indices"])
    tensors = [i for i in indices if isinstance(i, AValue)]
    masks = [i for i in tensors if i.const and i.value is not None and i.value.dtype == torch.bool]
    consumed = sum(i.ndim if any(i is m for m in masks) else 1 for i in indices)
    last_indexed = bool(masks) or (consumed == max(x.ndim, 1) and indices[-1] is not None)
    if not all(i.const for i in tensors):
        return data_dependent_read(x, shape, not last_indexed, "index")
    if not last_indexed:
        return scaled(x, shape, 1.0, entry_factor=1.0, rule="index (rows of the source)")
    only_last = not masks and all(i is None for i in indices[:-1])
    if only_last and indices[-1].ndim >= 1:
        f = repeat_factor(indices[-1].value, x.shape[-1])
        return scaled(x, shape, f, entry_factor=1.0, rule=f"index of the last dimension (row factor {f:.3g})")
    return scaled(x, shape, sqrt_last(shape), entry_factor=1.0, via_entries=True, rule="index (entries of the source)")


@register_rule("aten.slice_scatter", "aten.select_scatter",
               reads=("self", "src", "dim", "start", "end", "step", "index"))
def scatter_into(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``base`` with a slice (or a selected index) of ``dim`` replaced by ``src``.

    The written entries are disjoint from the kept ones: along the last dimension a row of the result has
    ``||row||^2 = ||kept part||^2 + ||written part||^2``, so the row norms and the Jacobians add (a selected
    index contributes one entry of ``src``, at most ``src``'s entry bound); along another dimension each row of
    the result is a row of ``base`` or of ``src``, so their coefficientwise maximum bounds it.
    """
    base, src = a["self"], a["src"]
    select = op_name(n.target) == "aten.select_scatter"
    last = _last(int(a["dim"]), len(shape))
    if last:
        written = src.entry_bound() if select else src.growth
        growth, jacobian = psum([base.growth, written]), psum([base.jacobian, src.jacobian])
    else:
        growth, jacobian = pmax([base.growth, src.growth]), pmax([base.jacobian, src.jacobian])
    acts = [v.exps for v in (base, src) if not v.const]
    if not acts:
        return unknown(shape, "scatter of constants")
    return AValue(exps=E.add(*acts), shape=shape, growth=growth, max_abs=pmax([base.entry_bound(), src.entry_bound()]),
                  jacobian=jacobian, sign=join_sign([base.sign, src.sign]),
                  rule="write into a slice (" + ("sum" if last else "max") + " of the parts' bounds)")
