"""Activation constants: the one table every certificate reads.

Each entry records, for a scalar activation ``phi`` applied entrywise:

* ``derivative = (inf phi', sup phi')`` over the real line;
* ``ratio = (inf phi(z)/z, sup phi(z)/z)`` for the activations of the form ``phi(z) = z g(z)`` with
  ``0 <= g <= 1`` (then ``|phi(z)| <= |z|``): the diagonal ``diag(phi(z)/z)`` that turns an MLP into
  ``W2 diag(r) W1`` ranges over it;
* ``saturation``: ``sup |phi|`` for a bounded activation (``None`` for an unbounded one);
* ``slope``, ``offset``: ``|phi(z)| <= slope |z| + offset`` for every ``z``;
* ``sign``: ``"+"`` when ``phi >= 0`` everywhere.

The extremes of the smooth activations were computed on a grid of step ``3e-5`` over ``[-30, 30]`` in
float64 (outside it every derivative is within ``1e-12`` of its limit) and rounded outward in the sixth
decimal; ``tests/bounds`` checks them again with autograd.  ``lipschitz(name)`` is ``sup |phi'|``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

__all__ = ["Activation", "ACTIVATIONS", "activation", "lipschitz", "SIGMOID_DERIVATIVE_MAX"]


@dataclass(frozen=True)
class Activation:
    """The constants of one activation (see the module docstring)."""

    name: str
    derivative: Tuple[float, float]
    ratio: Optional[Tuple[float, float]] = None
    saturation: Optional[float] = None
    slope: float = 1.0
    offset: float = 0.0
    sign: Optional[str] = None

    @property
    def lipschitz(self) -> float:
        """``sup |phi'|``."""
        lo, hi = self.derivative
        return max(abs(lo), abs(hi))


_UNIT_RATIO = (0.0, 1.0)

#: The table, by name (torch's functional names; aten ops map to these by dropping ``aten.``).
ACTIVATIONS: Dict[str, Activation] = {a.name: a for a in (
    # Lipschitz, |phi(z)| <= |z|
    Activation("relu", (0.0, 1.0), _UNIT_RATIO, sign="+"),
    Activation("gelu", (-0.128905, 1.128905), _UNIT_RATIO),  # sup = Phi(sqrt 2) + sqrt 2 phi(sqrt 2) = 1.1289041...
    Activation("gelu_tanh", (-0.128994, 1.128994), _UNIT_RATIO),
    Activation("silu", (-0.099840, 1.099840), _UNIT_RATIO),  # sup at z = 2.3994: 1.0998393...
    Activation("quick_gelu", (-0.099840, 1.099840), _UNIT_RATIO),  # z sigmoid(1.702 z): SiLU's slopes at 1.702 z
    Activation("mish", (-0.112527, 1.088499), _UNIT_RATIO),
    Activation("hardswish", (-0.5, 1.5), _UNIT_RATIO),
    Activation("abs", (-1.0, 1.0), sign="+"),
    Activation("neg", (-1.0, -1.0)),
    Activation("positive", (1.0, 1.0)),
    Activation("softplus", (0.0, 1.0), slope=1.0, offset=math.log(2.0), sign="+"),  # softplus(z) <= |z| + log 2
    Activation("elu", (0.0, 1.0)),  # alpha = 1; |elu(z)| <= |z|
    # bounded
    Activation("sigmoid", (0.0, 0.25), saturation=1.0, slope=0.0, offset=1.0, sign="+"),
    Activation("tanh", (0.0, 1.0), saturation=1.0, slope=0.0, offset=1.0),
    Activation("hardsigmoid", (0.0, 0.166667), saturation=1.0, slope=0.0, offset=1.0, sign="+"),  # torch: 1/6 in fp32
    Activation("hardtanh", (0.0, 1.0), saturation=1.0, slope=0.0, offset=1.0),
    Activation("sin", (-1.0, 1.0), saturation=1.0, slope=0.0, offset=1.0),
    Activation("cos", (-1.0, 1.0), saturation=1.0, slope=0.0, offset=1.0),
    Activation("erf", (0.0, 2.0 / math.sqrt(math.pi) * (1.0 + 1e-15)), saturation=1.0, slope=0.0, offset=1.0),
    Activation("softsign", (0.0, 1.0), saturation=1.0, slope=0.0, offset=1.0),
)}

#: ``sup sigmoid' = 1/4``.
SIGMOID_DERIVATIVE_MAX = ACTIVATIONS["sigmoid"].derivative[1]


def activation(name: str) -> Activation:
    """The constants of a named activation.

    Raises:
        KeyError: an unknown name (the message lists the known ones).
    """
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise KeyError(f"no constants for activation {name!r}; known: {sorted(ACTIVATIONS)}") from None


def lipschitz(name: str) -> float:
    """``sup |phi'|`` of a named activation."""
    return activation(name).lipschitz
