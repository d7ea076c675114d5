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
    "strip_exact_casts",
    "is_same",
    "is_same_value",
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


#: Significand bits (with the implicit one) of the float dtypes.
_MANTISSA = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


def _exact_cast(src: Any, dst: Any) -> bool:
    """Whether a cast from the concrete value ``src`` to ``dst`` keeps every value exactly (the same dtype, or a
    float dtype at least as fine; an integer or boolean into any dtype that holds it)."""
    if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
        return False
    a, b = src.dtype, dst.dtype
    if a == b:
        return True
    if a == torch.bool:
        return True
    if b.is_floating_point and a.is_floating_point:
        fa, fb = torch.finfo(a), torch.finfo(b)
        return fb.eps <= fa.eps and fb.max >= fa.max and fb.tiny <= fa.tiny
    if b.is_floating_point and not a.is_floating_point and not a.is_complex:
        return torch.iinfo(a).bits <= _MANTISSA.get(b, 0)  # every integer of the type is a float of b
    return False


def strip_exact_casts(n: Any, env: Dict[str, Any]) -> Any:
    """Like :func:`strip_casts`, but only through casts that keep every value exactly (``env`` holds the concrete
    values, whose dtypes tell): a recognizer that relies on two tensors being equal entrywise (``x - max(x) <= 0``,
    ``x / sqrt(mean(x^2))``) must not see through a rounding cast."""
    while isinstance(n, torch.fx.Node) and n.op == "call_function" and op_name(n.target) in CASTS and n.args:
        k = 1 if op_name(n.target) in ("aten.copy", "aten.fill_") else 0
        if len(n.args) <= k or not isinstance(arg := n.args[k], torch.fx.Node):
            break
        if not _exact_cast(env.get(arg.name), env.get(n.name)):
            break
        n = arg
    return n


def is_same_value(n1: Any, n2: Any, env: Dict[str, Any]) -> bool:
    """Whether two node arguments hold the same values up to exact casts (:func:`strip_exact_casts`)."""
    return isinstance(n1, torch.fx.Node) and isinstance(n2, torch.fx.Node) and \
        strip_exact_casts(n1, env) is strip_exact_casts(n2, env)


def is_same(n1: Any, n2: Any) -> bool:
    """Whether two node arguments are the same tensor up to casts."""
    return isinstance(n1, torch.fx.Node) and isinstance(n2, torch.fx.Node) and strip_casts(n1) is strip_casts(n2)
