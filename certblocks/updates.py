"""The residual updates of a model, in depth order (a compatibility name for :func:`certblocks.model.as_certified`).

:func:`residual_updates` is :func:`~certblocks.model.as_certified` for a model whose updates are known without its
graph (a :class:`~certblocks.CertifiedStack`, a zoo model, a converted model, wrappers of these, ``(name, module)``
pairs); :class:`ResidualUpdates` is :class:`~certblocks.model.CertifiedModel`.
"""

from __future__ import annotations

from typing import Any, Optional

from .model import CertifiedModel, as_certified

__all__ = ["ResidualUpdates", "residual_updates"]

#: The residual updates of a model with the run parameters of its certificate (:class:`CertifiedModel`).
ResidualUpdates = CertifiedModel


def residual_updates(model: Any, *, r0: Optional[float] = None, seq_len: Optional[int] = None) -> CertifiedModel:
    """Find the residual updates of a model, in depth order (:func:`certblocks.model.as_certified`).

    Args:
        model: a :class:`~certblocks.CertifiedStack`, a zoo model, a :class:`~certblocks.ConversionReport` or a
            converted model (every certified block not inside another; a ``PatchTSTBlock`` gives its two updates),
            a DDP / DataParallel / FSDP / ``torch.compile`` wrapper of one, or a sequence of ``(name, module)`` pairs.
        r0: overrides the input radius (converted models and pairs default to 1).
        seq_len: overrides the sequence length offered to the certificates (needed by Mamba blocks in converted
            models and pairs).

    Raises:
        TypeError: ``model`` is none of the above, or has no certified block.
    """
    cm = as_certified(model, r0=r0, seq_len=seq_len)
    if cm.kind == "graph":
        raise TypeError(f"{type(cm.module).__name__} has no certified block (no submodule with certificate() and "
                        "exponents); convert it with certblocks.convert first, or pass (name, module) pairs")
    return cm
