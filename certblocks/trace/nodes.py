"""Reading the nodes of a captured (aten) graph: op names, bound arguments, casts to see through.

Shared by the interpreter, the rules, the residual discovery and the diagnosis.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, FrozenSet, Optional

import torch

__all__ = [
    "IDENTITY_OPS",
    "VIEW_OPS",
    "CASTS",
    "PASS_THROUGH_OPS",
    "op_name",
    "target_name",
    "bind_args",
    "strip_casts",
    "is_same",
]

#: Ops that return their input's values unchanged (copies, dtype casts, aliases, metadata checks).
IDENTITY_OPS: FrozenSet[str] = frozenset({
    "aten.clone", "aten.contiguous", "aten.alias", "aten.detach", "aten.to", "aten._to_copy", "aten.type_as",
    "aten.lift_fresh_copy", "aten.fill_", "aten._assert_tensor_metadata", "aten.lift_fresh",
    "aten.copy", "aten.resolve_conj", "aten.resolve_neg", "aten.conj", "aten.conj_physical",
})
#: Reshapes: the values are kept, the rows regrouped.
VIEW_OPS: FrozenSet[str] = frozenset({
    "aten.view", "aten.reshape", "aten._unsafe_view", "aten.flatten", "aten.unflatten", "aten.squeeze",
    "aten.unsqueeze", "aten.view_as", "aten.reshape_as",
})
#: Ops followed back to the tensor they copy or broadcast (a cast of the residual stream is the same tensor).
CASTS: FrozenSet[str] = IDENTITY_OPS | {"aten.expand", "aten.expand_as"}
#: Ops that only move values around: followed through when naming a node's producer or describing it.
PASS_THROUGH_OPS: FrozenSet[str] = CASTS | {
    "aten.dropout", "aten.view", "aten.reshape", "aten._unsafe_view", "getitem", "aten.transpose", "aten.permute",
    "aten.flatten", "aten.unflatten", "aten.squeeze", "aten.unsqueeze", "aten.contiguous", "aten.clone", "aten.to",
    "aten.slice", "aten.select", "aten.split", "aten.split_with_sizes", "aten.chunk", "aten.unbind", "aten.narrow",
    "aten.expand",
}


def op_name(target: Any) -> str:
    """An op's name without its overload.

    ``aten.linear.default`` -> ``aten.linear``; ``operator.getitem`` -> ``getitem``.
    """
    if target is operator.getitem:
        return "getitem"
    s = str(target)
    if hasattr(target, "_schema") or hasattr(target, "overloadpacket"):
        parts = s.split(".")
        if len(parts) >= 3:
            return ".".join(parts[:-1])
    return s


def target_name(n: Any) -> str:
    """:func:`op_name` of a ``call_function`` node; ``""`` for anything else."""
    return op_name(n.target) if isinstance(n, torch.fx.Node) and n.op == "call_function" else ""


def bind_args(node: torch.fx.Node) -> Optional[Dict[str, Any]]:
    """Map a node's arguments to the op schema's argument names (defaults filled in); ``None`` without a schema."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    out: Dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = None
    return out


def strip_casts(n: Any) -> Any:
    """Follow :data:`CASTS` back to the tensor they copy (anything that is not such a node is returned as is).

    ``copy(self, src)`` and ``fill_(self, value)`` hold the values of their second argument, not of ``self``: they
    are followed to it (a ``fill_`` with a number is a constant and stops the walk)."""
    while isinstance(n, torch.fx.Node) and n.op == "call_function" and op_name(n.target) in CASTS and n.args:
        k = 1 if op_name(n.target) in ("aten.copy", "aten.fill_") else 0
        if len(n.args) <= k or not isinstance(n.args[k], torch.fx.Node):
            break
        n = n.args[k]
    return n


def is_same(n1: Any, n2: Any) -> bool:
    """Whether two node arguments are the same tensor up to casts."""
    return isinstance(n1, torch.fx.Node) and isinstance(n2, torch.fx.Node) and strip_casts(n1) is strip_casts(n2)
