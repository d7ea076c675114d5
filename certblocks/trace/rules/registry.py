"""The rule registry: one rule per aten op (or custom op), registered with :func:`register_rule`.

A rule computes the abstract value of one node from the abstract values of its arguments::

    @register_rule("aten.relu", "aten.gelu")
    def lipschitz_activation(it, node, args, shape):
        ...

``it`` is the :class:`~certblocks.trace.interp.VelocityInterpreter` (its ``values``, the captured graph
``it.g`` with the concrete tensors ``it.g.env``), ``node`` the ``torch.fx`` node, ``args`` the op's
arguments by schema name with every node replaced by its abstract value, ``shape`` the output's shape.
A rule returns an :class:`~certblocks.trace.values.AValue`, or a list of them for an op with several
outputs.  Ops are keyed by name without the overload: ``"aten.linear"``, ``"certblocks.selective_scan"``
(``"certblocks::selective_scan"`` and op objects are accepted and normalized).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple, Union

import torch

from ..nodes import op_name

if TYPE_CHECKING:
    from ..interp import VelocityInterpreter

__all__ = ["Rule", "register_rule", "rule_for", "registered_rules"]

Rule = Callable[["VelocityInterpreter", torch.fx.Node, Dict[str, Any], Tuple[int, ...]], Any]

_RULES: Dict[str, Rule] = {}


def _key(op: Union[str, Any]) -> str:
    return op.replace("::", ".") if isinstance(op, str) else op_name(op)


def register_rule(*ops: Union[str, Any]) -> Callable[[Rule], Rule]:
    """Decorator registering a rule for one or more ops.

    Args:
        ops: op names (``"aten.linear"``, ``"mylib::op"``) or op objects (``torch.ops.aten.linear``).

    Raises:
        ValueError: an op that already has a rule (each op has exactly one).
    """
    keys = [_key(op) for op in ops]
    if not keys:
        raise ValueError("register_rule needs at least one op")

    def decorate(fn: Rule) -> Rule:
        for key in keys:
            if key in _RULES and _RULES[key] is not fn:
                raise ValueError(f"{key} already has a rule ({_RULES[key].__qualname__})")
            _RULES[key] = fn
        return fn

    return decorate


def rule_for(op: Union[str, Any]) -> Optional[Rule]:
    """The rule registered for an op, or ``None``."""
    return _RULES.get(_key(op))


def registered_rules() -> Dict[str, Rule]:
    """Every registered rule by op name (a copy)."""
    return dict(_RULES)
