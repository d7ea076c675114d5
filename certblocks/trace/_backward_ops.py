"""What autograd's backward does with each op, as tables of op names (no gradient, entry by entry, selects, copies,
...), and the graph readers the backward bound shares: a node's shape, dtype, op and argument positions, and the nodes
that carry a gradient (:func:`needs_grad`), how a gradient sums over broadcast copies.  The bounds themselves:
:mod:`certblocks.trace.backward`."""

from __future__ import annotations

import math
from typing import Any, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from .capture import CapturedGraph
from .nodes import IDENTITY_OPS, VIEW_OPS, bind_args, op_name

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


# ---------------------------------------------------------------------------------------------------- graph readers
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


def _node_names(v: Any) -> Set[str]:
    if isinstance(v, torch.fx.Node):
        return {v.name}
    if isinstance(v, (list, tuple)):
        return {e.name for e in v if isinstance(e, torch.fx.Node)}
    return set()
