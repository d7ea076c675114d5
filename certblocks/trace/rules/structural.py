"""Structural rules: ops that move, copy, select or pad values (copies, casts, views, permutes, cat, ...).

They keep the input's exponents; the row-norm bound changes by a factor that follows from the shapes
(a row split into several keeps its norm, rows joined into one add up, a transposed last dimension is
bounded through the entries).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Sequence, Tuple

import torch

from ... import exponents as E
from ...bounds.poly import Poly, psum
from ..nodes import IDENTITY_OPS, VIEW_OPS, op_name
from ..values import AValue, max_abs
from .common import broadcast_factor, first_tensor, pmax, scaled, sqrt_last, switched, unknown, view_factor
from .registry import register_rule

Args = Dict[str, Any]
Shape = Tuple[int, ...]


def _written(n: torch.fx.Node, a: Args) -> Any:
    """The tensor whose values an identity op returns: ``copy(self, src)`` returns ``src`` (broadcast to
    ``self``'s shape), ``fill_(self, value)`` a tensor ``value``; the others their first tensor."""
    name = op_name(n.target)
    if name == "aten.copy":
        return a["src"]
    if name == "aten.fill_" and isinstance(a.get("value"), AValue):
        return a["value"]
    return first_tensor(a)


@register_rule(*sorted(IDENTITY_OPS))
def identity(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x = _written(n, a)
    if x is None:
        return unknown(shape, "no tensor argument")
    same = tuple(x.shape) == tuple(shape)
    fac, via = (1.0, False) if same else view_factor(x.shape, shape)
    out = scaled(x, shape, fac, via_entries=via, rule="structural (preserves)")
    out.stochastic_dim = x.stochastic_dim if same else None
    return out


@register_rule("aten.dropout", "aten.feature_dropout", "aten.alpha_dropout", "aten.native_dropout")
def dropout(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> Any:
    x = a.get("input", a.get("self"))
    p, train = a.get("p", 0.0), a.get("train", False)
    f = 1.0 / (1.0 - p) if (train and p < 1) else 1.0
    out = scaled(x, shape, f, rule="dropout" + (" (train: scale 1/(1-p))" if train else " (eval: identity)"))
    out.stochastic_dim = None if train and p > 0 else x.stochastic_dim
    if op_name(n.target) == "aten.native_dropout":
        return [out, AValue.constant(torch.ones(shape, dtype=torch.bool))]
    return out


@register_rule(*sorted(VIEW_OPS), "aten.view_as_real", "aten.view_as_complex", "aten.real", "aten.imag")
def reshape(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x = first_tensor(a)
    fac, via = view_factor(x.shape, shape)
    out = scaled(x, shape, fac, via_entries=via, rule="structural (reshape)")
    if (tuple(x.shape[-1:]) == tuple(shape[-1:]) and x.stochastic_dim is not None
            and x.stochastic_dim in (-1, len(x.shape) - 1)):
        out.stochastic_dim = -1
    return out


@register_rule("aten.expand", "aten.expand_as", "aten.broadcast_to")
def expand(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x = first_tensor(a)
    fac = broadcast_factor(x.shape, shape)
    return scaled(x, shape, fac, via_entries=fac != 1.0, rule="structural (expand)")


def _perm_keeps_last(perm: Sequence[int], ndim: int) -> bool:
    return not perm or (perm[-1] % ndim) == ndim - 1


@register_rule("aten.permute")
def permute(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x = a["self"]
    keep = _perm_keeps_last(list(a["dims"]), max(x.ndim, 1))
    f = 1.0 if keep else sqrt_last(shape)
    return scaled(x, shape, f, via_entries=not keep, rule="structural (permute)")


@register_rule("aten.transpose", "aten.t", "aten.swapaxes", "aten.swapdims", "aten.movedim", "aten.numpy_T",
               "aten.mT")
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
    out = scaled(x, shape, f, via_entries=touches, rule="structural (transpose)")
    if not touches:
        out.stochastic_dim = x.stochastic_dim
    return out


@register_rule("aten.slice", "aten.narrow", "aten.select", "aten.split", "aten.chunk",
               "aten.unbind", "aten.split_with_sizes", "aten.tensor_split", "aten.unsafe_split", "aten.diagonal",
               "aten.roll", "aten.flip", "aten.repeat", "aten.tile", "aten.repeat_interleave")
def select(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> Any:
    x = first_tensor(a)
    name = op_name(n.target)
    conc = it.g.env.get(n.name)
    shapes = [tuple(c.shape) for c in conc] if isinstance(conc, (list, tuple)) else [tuple(shape)]
    nd = max(x.ndim, 1)
    dim = a.get("dim", 0)
    if dim is None:
        dim = 0
    if isinstance(dim, (list, tuple)):
        dim = dim[0] if dim else 0
    last_touched = (dim % nd) == nd - 1 if isinstance(dim, int) else True
    outs = []
    for s in shapes:
        if name in ("aten.repeat", "aten.tile"):
            reps = list(a.get("repeats", a.get("dims", [])))
            f, via = math.sqrt(reps[-1] if reps else 1), False
        elif name == "aten.repeat_interleave":
            f, via = sqrt_last(s), True
        elif name in ("aten.select", "aten.unbind", "aten.diagonal") and last_touched:
            f, via = sqrt_last(s), True
        elif name == "aten.diagonal":
            f, via = sqrt_last(s), True  # a row of the diagonal collects entries of several rows
        else:
            f, via = 1.0, False  # a subset (or permutation) of rows, or of each row
        o = scaled(x, s, f, via_entries=via, rule=f"structural ({name.split('.')[-1]})")
        if not last_touched and name not in ("aten.repeat", "aten.tile"):
            o.stochastic_dim = x.stochastic_dim
        outs.append(o)
    if isinstance(conc, (list, tuple)):
        return outs
    return outs[0]


@register_rule("aten.cat", "aten.concat", "aten.concatenate", "aten.stack", "aten.hstack", "aten.vstack")
def cat(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    name = op_name(n.target)
    dim = a.get("dim", 0) or 0
    nd_out = max(len(shape), 1)
    acts = [p for p in a["tensors"] if isinstance(p, AValue)]
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


@register_rule("aten.constant_pad_nd", "aten.pad")
def pad(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x = a.get("self", a.get("input"))
    value = a.get("value") or 0.0
    if a.get("mode", "constant") not in (None, "constant"):
        # reflect/replicate/circular copy entries: bound the rows through their entries
        return scaled(x, shape, sqrt_last(shape), via_entries=True, rule="structural (pad)")
    add = abs(value) * math.sqrt(shape[-1]) if value else 0.0
    return scaled(x, shape, 1.0, rule="structural (pad)", add=add, sign=x.sign if value == 0 else None)


@register_rule("aten.masked_fill")
def masked_fill(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """Every entry is the input's or ``value``: ``|out_i| <= max(|x_i|, |value|)`` whatever the mask.  A mask that
    depends on the input switches discontinuously: q is kept, sigma is not derived."""
    x, mask, value = a["self"], a["mask"], a["value"]
    if isinstance(value, AValue):
        if not value.const:
            return unknown(shape, "masked_fill with a value that depends on the input")
        value = max_abs(value.value)
    v = abs(float(value))
    out = scaled(x, shape, broadcast_factor(x.shape, shape), rule="masked_fill (constant)",
                 add=v * sqrt_last(shape) if v else 0.0, sign=None)
    if math.isinf(v):
        out.growth = Poly.const(math.inf)
        out.max_abs = Poly.const(math.inf)
    if isinstance(mask, AValue) and not mask.const:
        return switched(out, "masked_fill with a mask that depends on the input (a discontinuous switch)")
    return out


@register_rule("aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.empty_like", "aten.new_zeros",
               "aten.new_ones", "aten.new_full", "aten.new_empty", "aten.rand_like", "aten.randn_like",
               "aten.scalar_tensor", "aten.sym_size", "aten.sym_numel", "aten.size")
def shape_only(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    conc = it.g.env.get(n.name)
    if isinstance(conc, torch.Tensor):
        if op_name(n.target) in ("aten.rand_like", "aten.randn_like"):
            return unknown(shape, "random tensor")
        return AValue.constant(conc, "constant (depends only on the shape)")
    return unknown(shape, "shape query")


@register_rule("aten.embedding")
def embedding(it: Any, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """A lookup ``W[idx]`` of a constant table at an input-dependent index: every row of the result is a row
    of ``W``, so its row norm is at most ``W``'s largest row norm whatever the index (q = 0); the lookup is
    not differentiable in the index (sigma unknown; a model's stem reads token ids and no gradient flows
    into them)."""
    w = a.get("weight")
    if not isinstance(w, AValue) or not w.const or w.value is None or w.value.dim() != 2:
        return unknown(shape, "embedding lookup in an input-dependent table")
    rows = torch.linalg.vector_norm(w.value.detach().double(), dim=-1)
    return AValue(exps=E.Exponents(0.0, None), shape=tuple(shape), growth=Poly.const(float(rows.max())),
                  max_abs=Poly.const(float(w.value.detach().double().abs().max())), sign=w.sign,
                  rule="embedding (largest row of the table)",
                  bad="embedding lookup: not differentiable in its index")
