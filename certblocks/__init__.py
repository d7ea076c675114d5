"""certblocks: residual blocks with a stability certificate.

Decide before training, for a given depth and dtype, whether the forward state
or the gradient of a residual stack ``X_{k+1} = X_k + dt * v_k(X_k)`` can reach
the largest finite value of the dtype.
"""

from typing import Any

from .budget import float_max, jacobian_budget
from .certificate import BlockCertificate, Depths, Failure, Peak, StackCertificate, certify_stack

# convert and enforce are functions named like their modules, so they are imported eagerly: a lazy
# attribute would be replaced by the module as soon as anything imports certblocks.convert/enforce.
from .conversion import ConversionReport, convert
from .enforcement import EnforceReport, enforce, unenforce
from .exponents import Exponents
from .stack import CertificationError, CertifiedStack, build_stack

__version__ = "0.1.0.dev0"

# Heavier parts load on first use: ``certblocks.certify`` (the tracer) and the blocks.
_LAZY = {
    "certify": ("certblocks.trace", "certify"),
    "register_atom": ("certblocks.trace", "register_atom"),
    "Attention": ("certblocks.blocks", "Attention"),
    "QKNormAttention": ("certblocks.blocks", "QKNormAttention"),
    "MLP": ("certblocks.blocks", "MLP"),
    "GatedMLP": ("certblocks.blocks", "GatedMLP"),
    "PatchTSTBlock": ("certblocks.blocks", "PatchTSTBlock"),
    "LinearGrowthMamba": ("certblocks.blocks", "LinearGrowthMamba"),
    "Mamba": ("certblocks.blocks", "Mamba"),
    "CertificateMonitor": ("certblocks.monitor", "CertificateMonitor"),
    "CertificateWarning": ("certblocks.monitor", "CertificateWarning"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'certblocks' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Attention",
    "GatedMLP",
    "LinearGrowthMamba",
    "MLP",
    "Mamba",
    "PatchTSTBlock",
    "QKNormAttention",
    "certify",
    "convert",
    "CertificateMonitor",
    "CertificateWarning",
    "enforce",
    "unenforce",
    "EnforceReport",
    "ConversionReport",
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
