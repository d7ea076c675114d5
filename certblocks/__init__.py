"""certblocks: residual blocks with a stability certificate.

Decide before training, for a given depth and dtype, whether the forward state or the gradient of a
residual stack ``X_{k+1} = X_k + dt * v_k(X_k)`` can reach the largest finite value of the dtype.

``import certblocks`` is light: every public name is loaded from its module on first use (PEP 562), so
that the pure-Python parts (``certblocks.budget``, ``certblocks.certificate``, ``certblocks.exponents``)
and the ``certblocks budget`` / ``table`` commands never import torch. The functions ``convert`` and
``enforce`` live in the modules ``certblocks.conversion`` and ``certblocks.enforcement``, named apart so
that loading a module never replaces the package attribute of the same name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict, List

__version__ = "0.1.0.dev0"

#: public name -> the module that defines it.
_LAZY: Dict[str, str] = {
    "float_max": "certblocks.budget",
    "jacobian_budget": "certblocks.budget",
    "BlockCertificate": "certblocks.certificate",
    "Depths": "certblocks.certificate",
    "Failure": "certblocks.certificate",
    "Peak": "certblocks.certificate",
    "StackCertificate": "certblocks.certificate",
    "certify_stack": "certblocks.certificate",
    "Exponents": "certblocks.exponents",
    "ConversionReport": "certblocks.conversion",
    "ConversionError": "certblocks.conversion",
    "ConversionWarning": "certblocks.conversion",
    "convert": "certblocks.conversion",
    "EnforceReport": "certblocks.enforcement",
    "enforce": "certblocks.enforcement",
    "unenforce": "certblocks.enforcement",
    "CertificationError": "certblocks.stack",
    "CertifiedStack": "certblocks.stack",
    "build_stack": "certblocks.stack",
    "certify": "certblocks.trace",
    "register_atom": "certblocks.trace",
    "Attention": "certblocks.blocks",
    "QKNormAttention": "certblocks.blocks",
    "RotaryQKNormAttention": "certblocks.blocks",
    "MLP": "certblocks.blocks",
    "GatedMLP": "certblocks.blocks",
    "LayerScale": "certblocks.blocks",
    "PatchTSTBlock": "certblocks.blocks",
    "LinearGrowthMamba": "certblocks.blocks",
    "Mamba": "certblocks.blocks",
    "CertificateMonitor": "certblocks.monitor",
    "CertificateWarning": "certblocks.monitor",
    "trajectory": "certblocks.ondata",
    "TrajectoryReport": "certblocks.ondata",
}

#: submodules that ``import certblocks`` used to load eagerly; reachable as attributes, loaded on first use.
_SUBMODULES = ("budget", "certificate", "exponents", "conversion", "enforcement", "stack", "trace", "blocks",
               "monitor")

if TYPE_CHECKING:  # what static checkers and IDEs see; nothing is imported at run time
    from .blocks import (
        MLP,
        Attention,
        GatedMLP,
        LayerScale,
        LinearGrowthMamba,
        Mamba,
        PatchTSTBlock,
        QKNormAttention,
        RotaryQKNormAttention,
    )
    from .budget import float_max, jacobian_budget
    from .certificate import BlockCertificate, Depths, Failure, Peak, StackCertificate, certify_stack
    from .conversion import ConversionError, ConversionReport, ConversionWarning, convert
    from .enforcement import EnforceReport, enforce, unenforce
    from .exponents import Exponents
    from .monitor import CertificateMonitor, CertificateWarning
    from .ondata import TrajectoryReport, trajectory
    from .stack import CertificationError, CertifiedStack, build_stack
    from .trace import certify, register_atom


def __getattr__(name: str) -> Any:
    """Load a public name (or a submodule) on first use and keep it in the package namespace."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


__all__ = [
    "Attention",
    "GatedMLP",
    "LayerScale",
    "LinearGrowthMamba",
    "MLP",
    "Mamba",
    "PatchTSTBlock",
    "QKNormAttention",
    "RotaryQKNormAttention",
    "certify",
    "convert",
    "CertificateMonitor",
    "CertificateWarning",
    "trajectory",
    "TrajectoryReport",
    "enforce",
    "unenforce",
    "EnforceReport",
    "ConversionReport",
    "ConversionError",
    "ConversionWarning",
    "register_atom",
    "BlockCertificate",
    "CertificationError",
    "CertifiedStack",
    "Depths",
    "Exponents",
    "Failure",
    "Peak",
    "StackCertificate",
    "build_stack",
    "certify_stack",
    "float_max",
    "jacobian_budget",
]
