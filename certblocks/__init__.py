"""certblocks: residual blocks with a stability certificate.

Decide before training, for a given depth and dtype, whether the forward state or the gradient of a
residual stack ``X_{k+1} = X_k + dt * v_k(X_k)`` can reach the largest finite value of the dtype.

The top level holds what a user needs on the first day (17 names):

* certify a model: :func:`certify` (any ``nn.Module``, from its graph), :func:`as_certified` (any model as a
  :class:`~certblocks.model.CertifiedModel`: ``.certificate(dtype)``, ``.fixes(dtype)``), :func:`build_stack`;
* make one certifiable: :func:`convert` (swap certified blocks into a backbone), the headline blocks
  :class:`LinearGrowthMamba`, :class:`QKNormAttention`, :class:`RotaryQKNormAttention`, :class:`GatedMLP`,
  :class:`MLP` and :class:`DyT` (the normalizer without eps of the models certified in pure fp16);
* train it: :class:`CertificateMonitor`, :class:`CertificateWarning`, :func:`enforce`, :func:`trajectory`;
* read the answer: :class:`BlockCertificate`, :class:`StackCertificate`, :class:`CertificationError`.

Everything else lives in its subpackage: ``certblocks.blocks`` (every block), ``certblocks.certificate``
(``certify_stack``, ``Depths``, ``Peak``, ``Failure``), ``certblocks.budget`` (``float_max``,
``jacobian_budget``), ``certblocks.exponents`` (``Exponents``), ``certblocks.conversion`` (reports, errors,
``register_converter``, ``load_converted``), ``certblocks.enforcement`` (``unenforce``, ``EnforceReport``),
``certblocks.stack`` (``CertifiedStack``), ``certblocks.trace`` (``register_atom``, ``register_rule``),
``certblocks.ondata`` (``TrajectoryReport``), ``certblocks.model``, ``certblocks.fixes``, ``certblocks.testing``.
The names that used to be at the top level still import from here for one release, with a ``DeprecationWarning``
that names their new place.

``import certblocks`` is light: every name is loaded from its module on first use (PEP 562), so that the
pure-Python parts (``certblocks.budget``, ``certblocks.certificate``, ``certblocks.exponents``) and the
``certblocks budget`` / ``table`` commands never import torch.  The functions ``convert`` and ``enforce`` live in
the modules ``certblocks.conversion`` and ``certblocks.enforcement``, named apart so that loading a module never
replaces the package attribute of the same name.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any, Dict, List

__version__ = "0.1.0.dev0"

#: public name -> the module that defines it.
_LAZY: Dict[str, str] = {
    "certify": "certblocks.trace",
    "as_certified": "certblocks.model",
    "build_stack": "certblocks.stack",
    "convert": "certblocks.conversion",
    "enforce": "certblocks.enforcement",
    "trajectory": "certblocks.ondata",
    "CertificateMonitor": "certblocks.monitor",
    "CertificateWarning": "certblocks.monitor",
    "CertificationError": "certblocks.stack",
    "BlockCertificate": "certblocks.certificate",
    "StackCertificate": "certblocks.certificate",
    "LinearGrowthMamba": "certblocks.blocks",
    "QKNormAttention": "certblocks.blocks",
    "RotaryQKNormAttention": "certblocks.blocks",
    "GatedMLP": "certblocks.blocks",
    "MLP": "certblocks.blocks",
    "DyT": "certblocks.blocks",
}

#: names that were at the top level before the API was made small -> where they live now.  They still import from
#: ``certblocks`` (with a DeprecationWarning naming the new import) for one release.
_MOVED: Dict[str, str] = {
    "float_max": "certblocks.budget",
    "jacobian_budget": "certblocks.budget",
    "Depths": "certblocks.certificate",
    "Failure": "certblocks.certificate",
    "Peak": "certblocks.certificate",
    "certify_stack": "certblocks.certificate",
    "Exponents": "certblocks.exponents",
    "ConversionReport": "certblocks.conversion",
    "ConversionError": "certblocks.conversion",
    "ConversionWarning": "certblocks.conversion",
    "EnforceReport": "certblocks.enforcement",
    "unenforce": "certblocks.enforcement",
    "CertifiedStack": "certblocks.stack",
    "register_atom": "certblocks.trace",
    "Attention": "certblocks.blocks",
    "LayerScale": "certblocks.blocks",
    "PatchTSTBlock": "certblocks.blocks",
    "Mamba": "certblocks.blocks",
    "TrajectoryReport": "certblocks.ondata",
}

#: submodules reachable as attributes (``certblocks.budget.float_max``), loaded on first use.
_SUBMODULES = ("budget", "certificate", "exponents", "conversion", "enforcement", "stack", "trace", "blocks",
               "monitor", "model", "ondata", "fixes")

if TYPE_CHECKING:  # what static checkers and IDEs see; nothing is imported at run time
    from .blocks import MLP, DyT, GatedMLP, LinearGrowthMamba, QKNormAttention, RotaryQKNormAttention
    from .certificate import BlockCertificate, StackCertificate
    from .conversion import convert
    from .enforcement import enforce
    from .model import as_certified
    from .monitor import CertificateMonitor, CertificateWarning
    from .ondata import trajectory
    from .stack import CertificationError, build_stack
    from .trace import certify


def __getattr__(name: str) -> Any:
    """Load a public name (or a submodule) on first use and keep it in the package namespace; a moved name is
    loaded from its new module with a ``DeprecationWarning`` (and not kept, so that every use warns)."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _MOVED:
        where = _MOVED[name]
        warnings.warn(f"certblocks.{name} moved to {where}: use 'from {where} import {name}' (the top-level name is "
                      "removed in the next release)", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(where), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


__all__ = [
    "certify",
    "as_certified",
    "build_stack",
    "convert",
    "enforce",
    "trajectory",
    "CertificateMonitor",
    "CertificateWarning",
    "CertificationError",
    "BlockCertificate",
    "StackCertificate",
    "LinearGrowthMamba",
    "QKNormAttention",
    "RotaryQKNormAttention",
    "GatedMLP",
    "MLP",
    "DyT",
]
