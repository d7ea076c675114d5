"""Atoms: sub-graphs collapsed into one primitive with known exponents.

The per-op rules give upper bounds that can be loose (docs/theory.md section 2): a GELU written
out with ``tanh`` and ``x**3`` reads ``(1, 3)`` by the rules although GELU is Lipschitz.  An
atom replaces such a sub-graph by a primitive whose exponents are known.

Two kinds of atoms can be registered with :func:`register_atom`:

* a **module type** (an ``nn.Module`` subclass, or its qualified name as a string): every
  instance in a traced graph that has one input depending on the velocity's input and one
  output is collapsed;
* an **op** (a ``torch.ops`` overload or packet, or its name such as ``"mylib::myop"``): the
  op's node is collapsed (its other tensor arguments must not depend on the velocity input).

The atom's exponents ``(q, sigma)`` describe the map from its input ``y`` to its output; the
tracer composes them with the exponents of ``y``.  The optional coefficient function returns
``dict(c=..., b=..., l1=..., l0=...)`` with ``N(f(y)) <= c N(y)^q + b`` and
``||df(y)|| <= l1 max(N(y), 1)^sigma + l0`` for every ``y`` (row norms: Euclidean norm along the
last dimension, maximized over the other indices).  Without it the certificate carries
exponents only (its coefficients are reported as not derived).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

from ..bounds.activations import activation
from ..exponents import Exponents

__all__ = ["Atom", "register_atom", "unregister_atom", "registered_atoms", "lookup_module_atom", "lookup_op_atom"]

CoefficientFn = Callable[[Any, Tuple[int, ...], Tuple[int, ...]], Dict[str, float]]


@dataclass(frozen=True)
class Atom:
    """A registered atom.

    Attributes:
        key: the qualified module type name or op name it matches.
        kind: ``"module"`` or ``"op"``.
        exponents: ``(q, sigma)`` of the atom as a map of its input.
        coefficients: ``fn(module_or_node, input_shape, output_shape) -> dict(c, b, l1, l0)`` or ``None``.
        name: a label for reports.
    """

    key: str
    kind: str
    exponents: Exponents
    coefficients: Optional[CoefficientFn]
    name: str


_MODULE_ATOMS: Dict[str, Atom] = {}
_OP_ATOMS: Dict[str, Atom] = {}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _op_key(op: Any) -> str:
    """Canonical op key ``namespace.name`` (``"mylib::op"``, ``torch.ops.mylib.op.default`` -> ``"mylib.op"``)."""
    name: Optional[str]
    if isinstance(op, str):
        name = op
    else:
        name = getattr(op, "_name", None) or getattr(op, "__name__", None)
        if name is None:
            raise TypeError(f"op must be a torch op overload/packet or its name, got {op!r}")
    name = str(name).replace("::", ".")
    return name[: -len(".default")] if name.endswith(".default") else name


def register_atom(target: Union[type, str, Any], exponents: Union[Exponents, Tuple[float, float]], *,
                  coefficients: Optional[CoefficientFn] = None, name: str = "", kind: Optional[str] = None) -> Atom:
    """Register an atom for a module type or an op.

    Args:
        target: an ``nn.Module`` subclass, a qualified class name (``"pkg.mod.Class"``), a torch op
            (``torch.ops.mylib.myop`` or ``.default``) or an op name (``"mylib::myop"``).
        exponents: the atom's ``(q, sigma)`` as a map of its input (an :class:`Exponents` or a pair).
        coefficients: optional ``fn(module_or_node, input_shape, output_shape)`` returning
            ``{"c", "b", "l1", "l0"}`` (see the module docstring); ``None`` leaves coefficients underived.
        name: a label for reports (default: the target's name).
        kind: ``"module"`` or ``"op"``; inferred from ``target`` when omitted (a string containing
            ``"::"`` is an op, any other string a module type).

    Returns:
        The registered :class:`Atom` (a later registration for the same target replaces it).
    """
    if isinstance(exponents, tuple):
        exponents = Exponents(*exponents)
    if not isinstance(exponents, Exponents):
        raise TypeError(f"exponents must be an Exponents or a (q, sigma) pair, got {exponents!r}")
    if coefficients is not None and not callable(coefficients):
        raise TypeError(f"coefficients must be callable or None, got {coefficients!r}")
    if kind is None:
        if isinstance(target, type):
            kind = "module"
        elif isinstance(target, str):
            kind = "op" if "::" in target else "module"
        else:
            kind = "op"
    if kind not in ("module", "op"):
        raise ValueError(f"kind must be 'module' or 'op', got {kind!r}")
    if kind == "module":
        key = _qualname(target) if isinstance(target, type) else str(target)
        if not isinstance(target, (type, str)):
            raise TypeError(f"a module atom needs an nn.Module subclass or its qualified name, got {target!r}")
    else:
        key = _op_key(target)
    atom = Atom(key, kind, exponents, coefficients, name or key.rsplit(".", 1)[-1])
    (_MODULE_ATOMS if kind == "module" else _OP_ATOMS)[key] = atom
    return atom


def unregister_atom(target: Union[type, str, Any]) -> None:
    """Remove the atom registered for ``target`` (no error when none is)."""
    if isinstance(target, type):
        _MODULE_ATOMS.pop(_qualname(target), None)
        return
    if isinstance(target, str) and "::" not in target:
        _MODULE_ATOMS.pop(target, None)
        return
    _OP_ATOMS.pop(_op_key(target), None)


def registered_atoms() -> Dict[str, Atom]:
    """All registered atoms by key."""
    return {**_MODULE_ATOMS, **_OP_ATOMS}


def lookup_module_atom(type_name: str) -> Optional[Atom]:
    return _MODULE_ATOMS.get(type_name)


def lookup_op_atom(op_name: str) -> Optional[Atom]:
    return _OP_ATOMS.get(_op_key(op_name)) if _OP_ATOMS else None


# ----------------------------------------------------------------------------------------------
# Built-in module atoms: GELU written out with tanh / sigmoid (HF, timm).  The rules would read
# 0.5 x (1 + tanh(a (x + b x^3))) as (1, 3); these activations are globally Lipschitz with
# |phi(x)| <= |x|, so they are (1, 0) with c = 1 and l0 the activation's Lipschitz constant, read
# from certblocks.bounds.activations under the name of the function each module computes.
_GELU_FAMILY: Dict[str, str] = {
    "transformers.activations.NewGELUActivation": "gelu_tanh",
    "transformers.activations.GELUActivation": "gelu",
    "transformers.activations.GELUTanh": "gelu_tanh",
    "transformers.activations.PytorchGELUTanh": "gelu_tanh",
    "transformers.activations.FastGELUActivation": "gelu_tanh",
    "transformers.activations.QuickGELUActivation": "quick_gelu",
    "transformers.activations.AccurateGELUActivation": "gelu_tanh",
    "timm.layers.activations.GELUTanh": "gelu_tanh",
    "timm.layers.activations.GELU": "gelu",
    "timm.layers.activations.QuickGELU": "quick_gelu",
    "torch.nn.modules.activation.GELU": "gelu",  # "gelu_tanh" when built with approximate="tanh"
}


def _gelu_coefficients(name: str) -> CoefficientFn:
    """Coefficients of an activation of the GELU family: ``|phi(y)| <= slope |y| + offset``, ``Lip(phi)``."""

    def coefficients(module: Any, in_shape: Tuple[int, ...], out_shape: Tuple[int, ...]) -> Dict[str, float]:
        act = activation("gelu_tanh" if getattr(module, "approximate", "none") == "tanh" else name)
        offset = act.offset * math.sqrt(out_shape[-1] if out_shape else 1)
        return {"c": act.slope, "b": offset, "l1": 0.0, "l0": act.lipschitz}

    return coefficients


for _name, _activation in _GELU_FAMILY.items():
    register_atom(_name, (1.0, 0.0), coefficients=_gelu_coefficients(_activation), name="GELU", kind="module")
