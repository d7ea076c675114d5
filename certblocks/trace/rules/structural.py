"""Structural rules: ops that move, copy, select or pad values (copies, casts, views, permutes, cat, ...).

They keep the input's exponents; the row-norm bound changes by a factor that follows from the shapes
(a row split into several keeps its norm, rows joined into one add up, a transposed last dimension is
bounded through the entries).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from ... import exponents as E
from ...bounds.poly import Poly, psum
from ..nodes import IDENTITY_OPS, VIEW_OPS, bind_args, op_name
from ..values import AValue, max_abs
from .common import (
    broadcast_factor,
    first_tensor,
    piecewise_constant,
    pmax,
    rounding_factor,
    scaled,
    sqrt_last,
    unknown,
    view_factor,
)
from .registry import register_rule

Args = Dict[str, Any]
Shape = Tuple[int, ...]


def _written(n: torch.fx.Node, a: Args) -> Tuple[Any, Any]:
    """The tensor whose values an identity op returns and its graph node: ``copy(self, src)`` returns ``src``
    (broadcast to ``self``'s shape, cast to its dtype); the others their first tensor."""
    b = bind_args(n) or {}
    if op_name(n.target) == "aten.copy":
        return a["src"], b.get("src")
    names = [k for k, v in a.items() if isinstance(v, AValue)]
    return (a[names[0]], b.get(names[0])) if names else (None, None)


def cast_value(it: Any, x: AValue, src: Any, n: torch.fx.Node, shape: Shape, rule: str) -> AValue:
    """``x`` (graph node ``src``) cast to the dtype of ``n``'s output and broadcast to ``shape``.

    A cast to a coarser float rounds every entry to nearest, ``|fl(v)| <= (1 + u) |v|``: the row norm, the entries
    and the Jacobian (its tangents are rounded alike) grow by ``1 + u``.  A cast to a signed integer keeps
    ``|out| <= |v|`` (truncation, or a value in range when ``v`` is out of it); to an unsigned one a negative value
    wraps up to the type's largest.  A cast of a float to an integer truncates (``|trunc(v)| <= |v|``) and jumps:
    autograd passes no gradient through it, so its derivative is 0 (docs/theory.md section 1.1: the certificate bounds
    the derivative autograd computes).  A cast to bool is 0 or 1 whatever the magnitude, derivative 0 too.
    """
    src_v, out_v = it.g.env.get(getattr(src, "name", "")), it.g.env.get(n.name)
    src_dtype = src_v.dtype if isinstance(src_v, torch.Tensor) else None
    dst_dtype = out_v.dtype if isinstance(out_v, torch.Tensor) else None
    if dst_dtype == torch.bool and src_dtype not in (None, torch.bool):
        return piecewise_constant(shape, 1.0, "cast to bool (0 or 1; piecewise constant: it jumps at 0)")
    same = tuple(x.shape) == tuple(shape)
    fac, via = (1.0, False) if same else view_factor(x.shape, shape)
    rf = rounding_factor(src_dtype, dst_dtype)
    out = scaled(x, shape, fac * rf, entry_factor=rf, via_entries=via, rule=rule)  # the cotangents round too
    if same and x.stochastic_dim is not None:  # rounded probabilities sum to at most (1 + u) times their sum
        out.stochastic_dim, out.row_sum = x.stochastic_dim, x.row_sum * rf
    if dst_dtype is not None and not (dst_dtype.is_floating_point or dst_dtype.is_complex):
        if src_dtype is not None and (src_dtype.is_floating_point or src_dtype.is_complex):
            # truncation: piecewise constant, autograd's derivative is 0 (the values stay within |v|)
            out.exps, out.jacobian = E.Exponents(x.exps.q, 0.0), Poly.ZERO
            out.rule = f"{rule}: cast to an integer dtype (truncates; piecewise constant, derivative 0)"
        if not dst_dtype.is_signed and x.sign not in ("+", "0"):  # a negative value wraps around: up to the max
            top = float(torch.iinfo(dst_dtype).max)
            out.growth = None if out.growth is None else out.growth + Poly.const(top * sqrt_last(shape))
            out.max_abs = None if out.max_abs is None else out.max_abs + Poly.const(top)
            out.sign = "+"
    return out


@register_rule(*sorted(IDENTITY_OPS - {"aten.fill_", "aten.to", "aten._assert_tensor_metadata"}),
               reads=("self", "src", "other", "dtype"))
@register_rule("aten.to", overloads=("device", "dtype", "other", "dtype_layout", "prim_Device", "prim_dtype",
                                     "prim_other"), reads=("self", "dtype", "other", "copy"))
def identity(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """Copies, aliases and casts: the values of their input (``copy``: of ``src``), cast to the output's dtype
    (:func:`cast_value`)."""
    x, src = _written(n, a)
    if x is None:
        return unknown(shape, "no tensor argument")
    return cast_value(it, x, src, n, shape, "structural (preserves)")


@register_rule("aten._assert_tensor_metadata", overloads=("default",), reads=("a", "size", "stride", "dtype"))
def assert_metadata(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """A check of a tensor's metadata: it returns nothing (its value is the tensor's, unused)."""
    return scaled(a["a"], a["a"].shape, 1.0, entry_factor=1.0, rule="metadata check")


@register_rule("aten.fill", "aten.fill_", overloads=("Scalar", "Tensor"), reads=("self", "value"))
def fill(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``self``'s shape filled with ``value``: a constant for a number (it does not read ``self``'s values), every
    entry equal to a 0-d ``value`` tensor otherwise."""
    value = a["value"]
    if not isinstance(value, AValue):
        conc = it.g.env.get(n.name)
        return AValue.constant(conc, "constant (fill with a number: depends only on the shape)")
    return scaled(value, shape, sqrt_last(shape), entry_factor=1.0, via_entries=True, rule="fill with a tensor")


@register_rule("aten.dropout", "aten.feature_dropout", "aten.alpha_dropout", "aten.feature_alpha_dropout",
               "aten.native_dropout", reads=("input", "p", "train"))
def dropout(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> Any:
    """Eval mode (or ``p = 0``): the identity.  Training: every entry is 0 or ``x / (1 - p)`` (each of the row norm,
    the entries and the Jacobian grows by ``1 / (1 - p)``; the kept mask is random, 0 or 1, and does not depend on
    the input).  Alpha dropout in training is an affine map of other constants: refused."""
    name = op_name(n.target)
    x = a["input"]
    p = float(a.get("p") or 0.0)
    train = a.get("train")
    train = True if train is None else bool(train)  # native_dropout: train=None is training
    active = train and p > 0
    if active and "alpha" in name:
        return unknown(shape, f"{name.split('.')[-1]} in training (p={p:g}): an affine map of the kept entries")
    f = 1.0 / (1.0 - p) if active and p < 1 else 1.0
    native = name == "aten.native_dropout"
    if native:  # (output, mask): the node's own shape is not a tensor's
        shape = tuple(x.shape)
    out = scaled(x, shape, f, entry_factor=f, rule="dropout" + (" (train: scale 1/(1-p))" if active else " (identity)"))
    out.stochastic_dim = None if active else x.stochastic_dim
    if native:
        if not active:
            return [out, AValue.constant(torch.ones(shape, dtype=torch.bool))]
        # a fresh random draw at every call: 0 or 1 entrywise, not a function of the input (sigma not derived)
        mask = AValue(exps=E.Exponents(0.0, None), shape=tuple(shape), growth=Poly.const(sqrt_last(shape)),
                      max_abs=Poly.const(1.0), sign="+", rule="dropout mask (random, 0 or 1)")
        return [out, mask]
    return out


@register_rule(*sorted(VIEW_OPS - {"aten.view"}), "aten.view_as_real", "aten.view_as_complex", "aten.real",
               "aten.imag", reads=("self",),
               via_shape=("size", "shape", "other", "start_dim", "end_dim", "dim", "sizes"))
@register_rule("aten.view", overloads=("default",), reads=("self",), via_shape=("size",))
def reshape(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """A row-major reshape: the entries are kept, the rows regrouped (:func:`~.common.view_factor`).  A complex view
    of pairs holds one entry per pair: its modulus is at most the pair's norm, a row norm of the input."""
    x = first_tensor(a)
    if op_name(n.target) == "aten.view_as_complex":
        d = sqrt_last(shape)
        return AValue(exps=x.exps, shape=tuple(shape), growth=None if x.growth is None else x.growth.scale(d),
                      max_abs=x.growth, jacobian=None if x.jacobian is None else x.jacobian.scale(d),
                      rule="structural (view_as_complex: an entry is a pair of the input)")
    fac, via = view_factor(x.shape, shape)
    out = scaled(x, shape, fac, entry_factor=1.0, via_entries=via, rule="structural (reshape)")
    if (tuple(x.shape[-1:]) == tuple(shape[-1:]) and x.stochastic_dim is not None
            and x.stochastic_dim in (-1, len(x.shape) - 1)):
        out.stochastic_dim = -1
    return out


@register_rule("aten.expand", "aten.expand_as", "aten.broadcast_to", reads=("self", "implicit"),
               via_shape=("size", "other"))
def expand(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x = first_tensor(a)
    fac = broadcast_factor(x.shape, shape)
    return scaled(x, shape, fac, entry_factor=1.0, via_entries=fac != 1.0, rule="structural (expand)")


def _perm_keeps_last(perm: Sequence[int], ndim: int) -> bool:
    return not perm or (perm[-1] % ndim) == ndim - 1


def _row_stochastic(x: AValue) -> Optional[int]:
    """``-1`` when ``x``'s rows (last dimension) are probability vectors, else ``None``: ops that keep every row
    whole keep that property (a stochastic dimension elsewhere is not tracked through moves)."""
    nd = max(x.ndim, 1)
    return -1 if x.stochastic_dim is not None and x.stochastic_dim % nd == nd - 1 else None


@register_rule("aten.permute", reads=("self", "dims"))
def permute(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x = a["self"]
    keep = _perm_keeps_last(list(a["dims"]), max(x.ndim, 1))
    f = 1.0 if keep else sqrt_last(shape)
    out = scaled(x, shape, f, entry_factor=1.0, via_entries=not keep, rule="structural (permute)")
    out.stochastic_dim = _row_stochastic(x) if keep else None
    return out


@register_rule("aten.transpose", "aten.t", "aten.swapaxes", "aten.swapdims", "aten.numpy_T", "aten.mT",
               reads=("self", "dim0", "dim1", "axis0", "axis1"))
@register_rule("aten.movedim", overloads=("int", "intlist"), reads=("self", "source", "destination"))
def transpose(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x = first_tensor(a)
    nd = max(x.ndim, 1)
    if op_name(n.target) in ("aten.transpose", "aten.swapaxes", "aten.swapdims"):
        d0, d1 = [a.get(k) for k in ("dim0", "dim1")] if "dim0" in a else (a.get("axis0"), a.get("axis1"))
        touches = nd - 1 in ((d0 or 0) % nd, (d1 or 0) % nd)
    else:
        touches = nd >= 2
    if tuple(x.shape) == tuple(shape) and x.ndim <= 1:
        touches = False
    f = sqrt_last(shape) if touches else 1.0
    out = scaled(x, shape, f, entry_factor=1.0, via_entries=touches, rule="structural (transpose)")
    out.stochastic_dim = None if touches else _row_stochastic(x)
    return out


@register_rule("aten.slice", overloads=("Tensor",), reads=("self", "dim", "start", "end", "step"))
@register_rule("aten.narrow", overloads=("default",), reads=("self", "dim", "start", "length"))
@register_rule("aten.select", overloads=("int",), reads=("self", "dim", "index"))
@register_rule("aten.split", "aten.unsafe_split", "aten.split_with_sizes", "aten.chunk", "aten.unbind",
               overloads=None, reads=("self", "split_size", "split_sizes", "chunks", "dim"))
@register_rule("aten.tensor_split", overloads=("sections", "indices"), reads=("self", "sections", "indices", "dim"))
@register_rule("aten.diagonal", reads=("self", "offset", "dim1", "dim2"))
@register_rule("aten.roll", "aten.flip", reads=("self", "shifts", "dims"))
@register_rule("aten.repeat", "aten.tile", reads=("self", "repeats", "dims"))
@register_rule("aten.repeat_interleave", overloads=("self_Tensor", "self_int"), reads=("self", "repeats", "dim"),
               via_shape=("output_size",))
def select(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> Any:
    """Ops that select, split, permute or repeat entries: a row of the result is (part of) a row of the input, a
    permutation of one, or collects entries of several rows (a factor ``sqrt`` of their number, or the entries)."""
    x = first_tensor(a)
    name = op_name(n.target)
    conc = it.g.env.get(n.name)
    shapes = [tuple(c.shape) for c in conc] if isinstance(conc, (list, tuple)) else [tuple(shape)]
    nd = max(x.ndim, 1)
    dim = a.get("dim", 0)
    if dim is None:
        dim = nd - 1 if name == "aten.repeat_interleave" else 0  # repeat_interleave without dim flattens
    last_touched = (dim % nd) == nd - 1 if isinstance(dim, int) else True
    rows_kept = not last_touched
    outs = []
    for s in shapes:
        if name in ("aten.repeat", "aten.tile"):
            reps = list(a.get("repeats", a.get("dims", [])))
            f, via = math.sqrt(reps[-1] if reps else 1), False
            rows_kept = False
        elif name == "aten.repeat_interleave":
            f, via = (1.0, False) if rows_kept else (sqrt_last(s), True)
        elif name in ("aten.select", "aten.unbind") and last_touched:
            f, via = sqrt_last(s), True
        elif name == "aten.diagonal":
            f, via = sqrt_last(s), True  # a row of the diagonal collects entries of several rows
            rows_kept = False
        elif name == "aten.roll" and not list(a.get("dims") or []):
            f, via = math.sqrt(2.0), False  # rolled flat: a row is the end of one row and the start of the next
            rows_kept = False
        else:
            f, via = 1.0, False  # a subset (or permutation) of rows, or of each row
        o = scaled(x, s, f, entry_factor=1.0, via_entries=via, rule=f"structural ({name.split('.')[-1]})")
        o.stochastic_dim = _row_stochastic(x) if rows_kept or name in ("aten.roll", "aten.flip") and f == 1.0 \
            else None
        outs.append(o)
    if isinstance(conc, (list, tuple)):
        return outs
    return outs[0]


@register_rule("aten.cat", "aten.concat", "aten.concatenate", "aten.stack", "aten.hstack", "aten.vstack",
               reads=("tensors", "dim"))
def cat(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """Concatenation: along the last dimension a row joins rows of the parts (their norms add), along another each
    row is a row of one part (the largest bound); ``stack`` along a new last dimension makes rows of entries."""
    name = op_name(n.target)
    acts = [p for p in a["tensors"] if isinstance(p, AValue)]
    if name == "aten.hstack":  # cat along dim 1, or 0 for 1-D tensors
        dim = 1 if acts and acts[0].ndim >= 2 else 0
    elif name == "aten.vstack":  # cat along dim 0 of the tensors made at least 2-D
        dim = 0
    else:
        dim = a.get("dim") or 0
    nd_out = max(len(shape), 1)
    along_last = (dim % nd_out) == nd_out - 1
    if name == "aten.stack" and along_last:  # a new last dimension: rows of entries
        f = math.sqrt(shape[-1])
        entries, jac = pmax([p.entry_bound() for p in acts]), pmax([p.jacobian for p in acts])
        growth = None if entries is None else entries.scale(f)
        jacobian = None if jac is None else jac.scale(f)
    elif along_last:
        growth, jacobian = psum([p.growth for p in acts]), psum([p.jacobian for p in acts])
    else:
        growth, jacobian = pmax([p.growth for p in acts]), pmax([p.jacobian for p in acts])
    signs = {p.sign for p in acts}
    return AValue(exps=E.add(*[p.exps for p in acts]), shape=shape, growth=growth,
                  max_abs=pmax([p.entry_bound() for p in acts]), jacobian=jacobian,
                  sign=signs.pop() if len(signs) == 1 else None, rule=f"structural ({name.split('.')[-1]})")


@register_rule("aten.constant_pad_nd", "aten.pad", reads=("self", "pad", "value", "mode"))
def pad(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """Padding: a constant ``value`` adds entries of at most ``|value|`` (rows of them along other dims);
    reflect/replicate/circular copy entries, and a row then collects entries of the row (bounded through them)."""
    x = a["self"]
    value = a.get("value") or 0.0
    v = abs(value)
    if a.get("mode", "constant") not in (None, "constant"):
        return scaled(x, shape, sqrt_last(shape), entry_factor=1.0, via_entries=True, rule="structural (pad)")
    return scaled(x, shape, 1.0, entry_factor=1.0, rule="structural (pad)", add=v * sqrt_last(shape), add_entry=v,
                  sign=x.sign if value == 0 else None)


@register_rule("aten.masked_fill", overloads=("Scalar", "Tensor"), reads=("self", "mask", "value"))
def masked_fill(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """Every entry is the input's or ``value``: ``|out_i| <= max(|x_i|, |value|)`` whatever the mask.  A mask that
    depends on the input switches between the two (a piecewise map): the derivative autograd takes is ``x``'s on the
    entries kept and 0 on the filled ones, whatever the mask, so ``x``'s Jacobian bound holds for every mask pattern
    (docs/theory.md section 1.1); the map jumps where the mask changes."""
    x, mask, value = a["self"], a["mask"], a["value"]
    if isinstance(value, AValue):
        if not value.const:
            return unknown(shape, "masked_fill with a value that depends on the input")
        value = max_abs(value.value)
    v = abs(value)
    fb = broadcast_factor(x.shape, shape)
    out = scaled(x, shape, fb, entry_factor=1.0, via_entries=fb != 1.0, rule="masked_fill (constant)",
                 add=v * sqrt_last(shape) if v else 0.0, add_entry=v, sign=None)
    if math.isinf(v):
        out.growth = Poly.const(math.inf)
        out.max_abs = Poly.const(math.inf)
    if isinstance(mask, AValue) and not mask.const:
        out.rule = "masked_fill with an input-dependent mask (piecewise: every mask pattern)"
    return out


@register_rule("aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.empty_like", "aten.new_zeros",
               "aten.new_ones", "aten.new_full", "aten.new_empty", "aten.rand_like", "aten.randn_like",
               reads=("self", "fill_value", "dtype", "generator"), via_shape=("size",))
@register_rule("aten.scalar_tensor", overloads=("default",), reads=("s", "dtype"))
def shape_only(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """Tensors made from a shape: constants (they do not read the input's values), random ones unknown.  An empty
    tensor's entries are whatever memory held: read at the example, and noted."""
    conc = it.g.env.get(n.name)
    name = op_name(n.target)
    if name in ("aten.rand_like", "aten.randn_like"):
        return unknown(shape, "random tensor")
    if "empty" in name:
        it.note(f"{n.name} ({name}): the entries of an uninitialized tensor are read at their example value")
    return AValue.constant(conc, "constant (depends only on the shape)")


@register_rule("aten.sym_size", "aten.size", overloads=("int", "default"), reads=("self", "dim"))
@register_rule("aten.sym_numel", overloads=("default",), reads=("self",))
def shape_query(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """A size (an integer, not a tensor): no bound is derived for it."""
    return unknown(shape, "shape query")


@register_rule("aten.embedding", reads=("weight", "indices", "padding_idx", "scale_grad_by_freq", "sparse"))
def embedding(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """A lookup ``W[idx]`` of a constant table at an input-dependent index: every row of the result is a row
    of ``W``, so its row norm is at most ``W``'s largest row norm whatever the index (q = 0); autograd passes no
    gradient into an index, so the derivative of the lookup is 0 for every index (docs/theory.md section 1.1; a
    model's stem reads token ids, and an index computed from a float input is piecewise constant).  ``padding_idx``,
    ``scale_grad_by_freq`` and ``sparse`` change only the gradient of ``W``."""
    w = a.get("weight")
    if not isinstance(w, AValue) or not w.const or w.value is None or w.value.dim() != 2:
        return unknown(shape, "embedding lookup in an input-dependent table")
    table = w.value.detach()
    rows = top = 0.0
    for part in table.split(max(1, (1 << 22) // max(table.shape[1], 1))):  # a float64 copy of a whole large table
        rows = max(rows, float(torch.linalg.vector_norm(part.double(), dim=-1).max()))  # is twice its size: by rows
        top = max(top, float(part.abs().max()))  # |w| and the largest are exact in any dtype
    return AValue(exps=E.CONSTANT, shape=tuple(shape), growth=Poly.const(rows), max_abs=Poly.const(top),
                  jacobian=Poly.ZERO, sign=w.sign,
                  rule="embedding (largest row of the table; derivative 0 in the index)")
