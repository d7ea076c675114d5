"""The rule registry: one rule per op, each declaring which arguments of the op's schema it reads.

A rule computes the abstract value of one node from the abstract values of its arguments::

    @register_rule("aten.add", "aten.sub", overloads=("Tensor", "Scalar"), reads=("self", "other", "alpha"))
    def add(it, node, args, shape):
        ...

``it`` is the :class:`~certblocks.trace.interp.VelocityInterpreter` (its ``values``, the captured graph
``it.g`` with the concrete tensors ``it.g.env``), ``node`` the ``torch.fx`` node, ``args`` the op's
arguments by schema name with every node replaced by its abstract value, ``shape`` the output's shape.
A rule returns an :class:`~certblocks.trace.values.AValue`, or a list of them for an op with several
outputs.  Ops are keyed by name without the overload: ``"aten.linear"``, ``"certblocks.selective_scan"``
(``"certblocks::selective_scan"`` and op objects are accepted and normalized).

**What a rule reads.**  Every argument of every overload a rule accepts is, in its declaration, one of:

* *read* (``reads=``): the rule's bound accounts for the argument, whatever its value (it may refuse values
  it cannot bound, with the reason);
* *read through the output's shape* (``via_shape=``): the argument only decides the output's shape
  (``keepdim``, ``size``, ``output_size``) and the rule reads the concrete shape;
* *default-only* (``default_only=``): the rule is sound only for the argument's schema default (or for the
  value given in a mapping, for an argument without a default).  :func:`check_call` refuses any other value;
* *inert* (:data:`INERT_ARGUMENTS`, for every rule): memory layout, device placement and backend choices,
  which never change an op's values.

Before a rule runs, the interpreter calls :func:`check_call`: a call of an overload the rule does not accept,
or with a default-only argument away from its default, or with an argument the rule does not declare, is
refused (unknown growth, the argument and its value named as the reason).  ``overloads=`` lists the accepted
overloads; without it a rule accepts every functional overload of its ops that takes and returns tensors.

A rule registered without ``reads=`` (a user's rule written before declarations existed) is accepted with a
warning: its tensor arguments count as read, every other argument with a default as default-only, and an
argument without a default is refused until the rule declares it.

**Inspecting the declarations** (tests and tools): :func:`rule_spec` returns an op's :class:`RuleSpec`
(the rule, its accepted overloads, and per overload what it reads and what must stay at its default);
:func:`check_call` says why a node would be refused (``None`` when the rule may run);
:func:`registered_rules` maps every op name to its rule, :func:`rule_for` finds one.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Tuple, Union

import torch

from ..nodes import bind_args, op_name

if TYPE_CHECKING:
    from ..interp import VelocityInterpreter

__all__ = ["Rule", "RuleSpec", "INERT_ARGUMENTS", "register_rule", "rule_for", "rule_spec", "registered_rules",
           "check_call", "op_packet", "functional_overloads"]

Rule = Callable[["VelocityInterpreter", torch.fx.Node, Dict[str, Any], Tuple[int, ...]], Any]

#: Arguments that never change an op's values: memory layout, device placement, backend and kernel choices.
INERT_ARGUMENTS: FrozenSet[str] = frozenset({
    "memory_format", "non_blocking", "pin_memory", "layout", "device", "cudnn_enabled", "cudnn_enable",
    "benchmark", "deterministic", "allow_tf32",
})

#: The type strings of tensor arguments in a schema.
_TENSOR_TYPES = ("Tensor", "Optional[Tensor]", "List[Tensor]", "List[Optional[Tensor]]")

_MISSING = object()


def _key(op: Union[str, Any]) -> str:
    return op.replace("::", ".") if isinstance(op, str) else op_name(op)


def op_packet(op: str) -> Optional[Any]:
    """The ``torch.ops`` packet of an op name (``"aten.add"`` -> ``torch.ops.aten.add``); ``None`` if none exists."""
    ns, _, name = _key(op).partition(".")
    try:
        return getattr(getattr(torch.ops, ns), name)
    except (AttributeError, RuntimeError):
        return None


def _is_tensor_type(t: Any) -> bool:
    return str(t) in _TENSOR_TYPES


def functional_overloads(op: str) -> Tuple[str, ...]:
    """The overloads of ``op`` that take a tensor, return tensors and mutate nothing (what a captured graph holds)."""
    if op_packet(op) is None:
        return ()  # not known to torch (yet): nothing is accepted, nothing cached
    return _functional_overloads(op)


@functools.cache
def _functional_overloads(op: str) -> Tuple[str, ...]:
    packet = op_packet(op)
    out = []
    for ov in packet.overloads():
        schema = getattr(packet, ov)._schema
        if schema.is_mutable or not schema.returns:
            continue
        if any(_is_tensor_type(a.type) for a in schema.arguments) and \
                all(str(r.type) in ("Tensor", "List[Tensor]") for r in schema.returns):
            out.append(ov)
    return tuple(out)


@dataclass(frozen=True)
class RuleSpec:
    """What the rule of one op reads (see the module docstring).

    Attributes:
        op: the op's name (``"aten.add"``).
        fn: the rule.
        reads: the arguments the rule reads (by name, over all its overloads).
        via_shape: the arguments it reads only through the output's concrete shape.
        default_only: argument -> the one value the rule accepts (its schema default unless given).
        overloads: the accepted overloads as declared (``None``: every functional overload).
        declared: whether the rule declared ``reads=`` (a rule without declarations is read conservatively).
    """

    op: str
    fn: Rule
    reads: FrozenSet[str] = frozenset()
    via_shape: FrozenSet[str] = frozenset()
    default_only: Mapping[str, Any] = field(default_factory=dict)
    overloads: Optional[Tuple[str, ...]] = None
    declared: bool = True

    def accepted_overloads(self) -> Tuple[str, ...]:
        """The overloads the rule accepts (resolved against ``torch.ops`` when none were declared)."""
        return self.overloads if self.overloads is not None else functional_overloads(self.op)

    def schema(self, overload: str) -> Any:
        """The ``torch.FunctionSchema`` of one overload (``LookupError`` when the op or overload does not exist)."""
        return _schema(self.op, overload)

    def kind(self, overload: str, argument: str) -> str:
        """How the rule treats one argument of an overload: ``"read"``, ``"shape"`` (read through the output's
        shape), ``"inert"``, ``"default-only"`` or ``"undeclared"``."""
        if argument in self.reads:
            return "read"
        if argument in self.via_shape:
            return "shape"
        if argument in INERT_ARGUMENTS:
            return "inert"
        if argument in self.default_only:
            return "default-only"
        if not self.declared:
            arg = next((a for a in self.schema(overload).arguments if a.name == argument), None)
            if arg is not None and _is_tensor_type(arg.type):
                return "read"
            if arg is not None and arg.has_default_value():
                return "default-only"
        return "undeclared"

    def reads_of(self, overload: str) -> Tuple[str, ...]:
        """The arguments of ``overload`` the rule reads (directly or through the output's shape, or inert)."""
        return tuple(a.name for a in self.schema(overload).arguments
                     if self.kind(overload, a.name) in ("read", "shape", "inert"))

    def default_only_of(self, overload: str) -> Dict[str, Any]:
        """The default-only arguments of ``overload`` with the value each must have."""
        return {a.name: self.required(overload, a.name) for a in self.schema(overload).arguments
                if self.kind(overload, a.name) == "default-only"}

    def undeclared_of(self, overload: str) -> Tuple[str, ...]:
        """The arguments of ``overload`` the rule neither reads nor declares default-only (a schema test fails on
        any)."""
        return tuple(a.name for a in self.schema(overload).arguments if self.kind(overload, a.name) == "undeclared")

    def required(self, overload: str, argument: str) -> Any:
        """The value a default-only argument must have (its schema default unless the declaration gives one)."""
        if argument in self.default_only and self.default_only[argument] is not _MISSING:
            return self.default_only[argument]
        arg = next(a for a in self.schema(overload).arguments if a.name == argument)
        return arg.default_value if arg.has_default_value() else _MISSING


@functools.cache
def _schema(op: str, overload: str) -> Any:
    packet = op_packet(op)
    if packet is None or overload not in packet.overloads():
        raise LookupError(f"{op}.{overload} does not exist in torch.ops")
    return getattr(packet, overload)._schema


_RULES: Dict[str, Rule] = {}
_SPECS: Dict[str, RuleSpec] = {}


def register_rule(*ops: Union[str, Any], reads: Optional[Iterable[str]] = None, via_shape: Iterable[str] = (),
                  default_only: Union[Iterable[str], Mapping[str, Any]] = (),
                  overloads: Optional[Iterable[str]] = None) -> Callable[[Rule], Rule]:
    """Decorator registering a rule for one or more ops, with what it reads of their schemas.

    Args:
        ops: op names (``"aten.linear"``, ``"mylib::op"``) or op objects (``torch.ops.aten.linear``).
        reads: the arguments the rule reads (its bound accounts for them, whatever their values).  ``None``:
            undeclared (a warning; see the module docstring).
        via_shape: arguments read only through the output's concrete shape (``keepdim``, a view's ``size``).
        default_only: arguments the rule is sound for only at their schema default: names, or a mapping
            ``name -> required value`` for an argument without a default.
        overloads: the overload names accepted for every op of the registration (``None``: every functional
            overload that takes and returns tensors).

    Raises:
        ValueError: no op, an op that already has another rule, an argument named twice, an overload that one of
            the ops does not have, or a declared argument that no accepted overload of the ops has.
    """
    keys = [_key(op) for op in ops]
    if not keys:
        raise ValueError("register_rule needs at least one op")
    declared = reads is not None
    read_set = frozenset(reads or ())
    shape_set = frozenset(via_shape)
    dmap: Dict[str, Any] = dict(default_only) if isinstance(default_only, Mapping) else \
        {name: _MISSING for name in default_only}
    for a, b, what in ((read_set, shape_set, "reads and via_shape"), (read_set, set(dmap), "reads and default_only"),
                       (shape_set, set(dmap), "via_shape and default_only")):
        if a & b:
            raise ValueError(f"register_rule({', '.join(keys)}): {sorted(a & b)} named in both {what}")
    ovs = None if overloads is None else tuple(overloads)
    specs = []
    for key in keys:
        spec = RuleSpec(key, None, read_set, shape_set, dmap, ovs, declared)  # type: ignore[arg-type]
        _check_declaration(spec)
        specs.append(spec)
    _check_names(keys, specs, read_set | shape_set | set(dmap))
    if not declared:
        warnings.warn(f"the rule for {', '.join(keys)} declares no reads=: its tensor arguments count as read, every "
                      "other argument must keep its default (an argument without one is refused); declare what it "
                      "reads with register_rule(..., reads=...)", stacklevel=2)

    def decorate(fn: Rule) -> Rule:
        for key, spec in zip(keys, specs):
            if key in _RULES and _RULES[key] is not fn:
                raise ValueError(f"{key} already has a rule ({_RULES[key].__qualname__})")
            _RULES[key] = fn
            _SPECS[key] = RuleSpec(key, fn, spec.reads, spec.via_shape, spec.default_only, spec.overloads,
                                   spec.declared)
        return fn

    return decorate


def _check_declaration(spec: RuleSpec) -> None:
    """Declared overloads must exist (checked when the op is already known to ``torch.ops``)."""
    packet = op_packet(spec.op)
    if packet is None or spec.overloads is None:
        return
    missing = [ov for ov in spec.overloads if ov not in packet.overloads()]
    if missing:
        raise ValueError(f"register_rule: {spec.op} has no overload {missing} (it has {packet.overloads()})")


def _check_names(keys: List[str], specs: List[RuleSpec], names: Iterable[str]) -> None:
    """Every declared argument must be an argument of some accepted overload of the ops (a typo otherwise)."""
    known: set = set()
    for spec in specs:
        if op_packet(spec.op) is None:
            return  # an op not registered with torch yet: the schema test checks it once it is
        for ov in spec.accepted_overloads():
            known |= {a.name for a in spec.schema(ov).arguments}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"register_rule({', '.join(keys)}): {unknown} is not an argument of any accepted overload")


def rule_for(op: Union[str, Any]) -> Optional[Rule]:
    """The rule registered for an op, or ``None``."""
    return _RULES.get(_key(op))


def rule_spec(op: Union[str, Any]) -> Optional[RuleSpec]:
    """The declaration of the rule registered for an op (:class:`RuleSpec`), or ``None``."""
    return _SPECS.get(_key(op))


def registered_rules() -> Dict[str, Rule]:
    """Every registered rule by op name (a copy)."""
    return dict(_RULES)


def _same(value: Any, default: Any) -> bool:
    """Whether a node's argument equals a schema default (lists and tuples alike, numbers by value)."""
    if isinstance(value, torch.fx.Node):
        return False
    if isinstance(value, (list, tuple)) or isinstance(default, (list, tuple)):
        if not isinstance(value, (list, tuple)) or not isinstance(default, (list, tuple)) or len(value) != len(default):
            return False
        return all(_same(v, d) for v, d in zip(value, default))
    if value is None or default is None:
        return value is None and default is None
    if isinstance(value, (bool, int, float)) and isinstance(default, (bool, int, float)):
        return float(value) == float(default)
    try:
        return bool(value == default)
    except Exception:  # an object that does not compare: not the default
        return False


def check_call(node: torch.fx.Node) -> Optional[str]:
    """Why the rule of ``node``'s op may not run on this call (``None``: it may).

    The call is refused when its overload is not accepted, when a default-only argument differs from the value
    the rule accepts, or when an argument is not declared by the rule; the reason names the op, the overload, the
    argument and its value.  A node without a registered rule or without a schema gives ``None`` (the
    interpreter says "no rule" itself).
    """
    name = op_name(node.target)
    spec = _SPECS.get(name)
    schema = getattr(node.target, "_schema", None)
    if spec is None or schema is None:
        return None
    overload = getattr(node.target, "_overloadname", "default")
    accepted = spec.accepted_overloads()
    rule = getattr(spec.fn, "__qualname__", "the rule")
    if overload not in accepted:
        return (f"{name}.{overload}: overload not accepted by the rule {rule} (it accepts "
                f"{', '.join(accepted) or 'none'})")
    bound = bind_args(node) or {}
    for arg in schema.arguments:
        kind = spec.kind(overload, arg.name)
        value = bound.get(arg.name)
        shown = value.name if isinstance(value, torch.fx.Node) else repr(value)
        if kind == "undeclared":
            return (f"{name}.{overload}: argument {arg.name}={shown} is not declared by the rule {rule} (neither read "
                    "nor default-only)")
        if kind != "default-only":
            continue
        required = spec.required(overload, arg.name)
        if required is _MISSING:
            return f"{name}.{overload}: argument {arg.name}={shown} has no default and the rule {rule} does not read it"
        if not _same(value, required):
            return (f"{name}.{overload}: argument {arg.name}={shown} differs from {required!r}, the only value the "
                    f"rule {rule} is sound for")
    return None
