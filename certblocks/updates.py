"""The residual updates of a model, in depth order: what the monitor watches and :func:`certblocks.enforce` caps.

:func:`residual_updates` finds them in a :class:`~certblocks.CertifiedStack`, a zoo model, a converted model (every
certified block not inside another), a DDP-wrapped one, or a list of ``(name, module)`` pairs, and returns a
:class:`ResidualUpdates` with the run parameters of their certificate (``dt``, ``r0``, ``seq_len``, ``lip_g``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Union

from torch import nn

from ._validation import check_int
from .bounds import one_thread
from .certificate import BlockCertificate
from .stack import CertifiedStack, block_certificate

__all__ = ["ResidualUpdates", "residual_updates"]


@dataclass
class ResidualUpdates:
    """The residual updates of a model in depth order, with the run parameters of its certificate.

    Attributes:
        names: one label per update (module paths where known).
        modules: the velocity modules ``v_k``.
        dt: the residual step.
        r0: bound on the per-token norm of the first update's input (a callable is re-evaluated at each
            check, e.g. a zoo model's ``input_radius`` computed from the embedding weights).
        seq_len: sequence length offered to the certificates (``None``: the blocks' default).
        lip_g: Lipschitz constant of the loss head.
        fixed: a given certificate per update, or ``None`` (computed from the module).
    """

    names: List[str]
    modules: List[nn.Module]
    dt: float = 1.0
    r0: Union[float, Callable[[], float]] = 1.0
    seq_len: Optional[int] = None
    lip_g: float = 1.0
    fixed: List[Optional[BlockCertificate]] = field(default_factory=list)

    def radius(self) -> float:
        return float(self.r0()) if callable(self.r0) else float(self.r0)

    def certificates(self) -> List[BlockCertificate]:
        """One certificate per update, named by :attr:`names` (float64 linear algebra on one thread: on a busy
        machine multi-threaded LAPACK on these small matrices was measured many times slower)."""
        with one_thread():
            return self._certificates()

    def _certificates(self) -> List[BlockCertificate]:
        out = []
        fixed = self.fixed or [None] * len(self.modules)
        for name, m, f in zip(self.names, self.modules, fixed):
            try:
                cert = f if f is not None else block_certificate(m, seq_len=self.seq_len, prefix=f"{name}.")
            except ValueError as e:
                if self.seq_len is None and "needs seq_len" in str(e):
                    raise ValueError(f"update {name!r} ({type(m).__name__}) needs the sequence length for its "
                                     "certificate: pass seq_len=") from e
                raise
            out.append(dataclasses.replace(cert, name=name))
        return out


def _is_zoo(model: Any) -> bool:
    return all(callable(getattr(model, a, None)) for a in ("residual_updates", "input_radius",
                                                            "certificate_seq_len"))


def residual_updates(model: Any, *, r0: Optional[float] = None, seq_len: Optional[int] = None) -> ResidualUpdates:
    """Find the residual updates of a model, in depth order.

    Args:
        model: one of

            * a :class:`~certblocks.CertifiedStack` (``blocks``, its ``dt``, ``r0``, ``lip_g``, ``seq_len``
              and any certificates given explicitly to :func:`~certblocks.build_stack`);
            * a zoo model (``residual_updates()``, ``input_radius()``, ``certificate_seq_len()``; ``dt = 1``);
            * a :class:`~certblocks.ConversionReport` or a converted model: every module with a
              ``certificate()`` method and an ``exponents`` attribute that is not inside another one,
              in module order (a ``PatchTSTBlock`` gives its two updates); ``dt = 1``.  In a converted
              model that keeps its LayerNorms the velocity is the certified block alone: the monitor
              measures it on its own input (the normalized state);
            * a sequence of ``(name, module)`` pairs.
        r0: overrides the input radius (needed for converted models and pairs, default 1).
        seq_len: overrides the sequence length offered to the certificates (needed by Mamba blocks in
            converted models and pairs; default: the stack's or zoo model's, else none).

    Raises:
        TypeError: ``model`` is none of the above, or has no certified block.
    """
    if r0 is not None and (isinstance(r0, bool) or not isinstance(r0, (int, float)) or not math.isfinite(r0)
                           or r0 < 0):
        raise ValueError(f"r0 must be a finite number >= 0 or None, got {r0!r}")
    if seq_len is not None:
        check_int("seq_len", seq_len)
    if isinstance(model, CertifiedStack):
        n = len(model.blocks)
        return ResidualUpdates([f"blocks.{k}" for k in range(n)], list(model.blocks), dt=model.dt,
                               r0=model.r0 if r0 is None else r0,
                               seq_len=model.seq_len if seq_len is None else seq_len, lip_g=model.lip_g,
                               fixed=list(getattr(model, "_explicit", [None] * n)))
    if isinstance(model, nn.Module) and _is_zoo(model):
        pairs = list(model.residual_updates())
        return ResidualUpdates([p for p, _ in pairs], [m for _, m in pairs], dt=1.0,
                               r0=model.input_radius if r0 is None else r0,
                               seq_len=int(model.certificate_seq_len()) if seq_len is None else seq_len)
    if type(model).__name__ in ("DistributedDataParallel", "DataParallel") and isinstance(
            getattr(model, "module", None), nn.Module):
        return residual_updates(model.module, r0=r0, seq_len=seq_len)
    if hasattr(model, "model") and hasattr(model, "swaps") and isinstance(model.model, nn.Module):
        model = model.model  # ConversionReport
    if isinstance(model, nn.Module):
        names: List[str] = []
        mods: List[nn.Module] = []
        taken: List[str] = []
        for path, m in model.named_modules():
            if any(path.startswith(t + ".") for t in taken):
                continue
            ups = getattr(m, "updates", None)
            if callable(ups) and callable(getattr(m, "certificates", None)):  # a layer of several updates
                for j, u in enumerate(ups()):
                    names.append(f"{path}.updates[{j}]" if path else f"updates[{j}]")
                    mods.append(u)
                taken.append(path)
            elif callable(getattr(m, "certificate", None)) and hasattr(m, "exponents") and m is not model:
                names.append(path)
                mods.append(m)
                taken.append(path)
        if not mods:
            raise TypeError(f"{type(model).__name__} has no certified block (no submodule with certificate() and "
                            "exponents); convert it with certblocks.convert first, or pass (name, module) pairs")
        return ResidualUpdates(names, mods, r0=1.0 if r0 is None else r0, seq_len=seq_len)
    if isinstance(model, (list, tuple)):
        names, mods = [], []
        for k, item in enumerate(model):
            if (not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str)
                    or not isinstance(item[1], nn.Module)):
                raise TypeError(f"model[{k}] must be a (name, nn.Module) pair, got {item!r}")
            names.append(item[0])
            mods.append(item[1])
        if not mods:
            raise ValueError("model must contain at least one (name, module) pair")
        return ResidualUpdates(names, mods, r0=1.0 if r0 is None else r0, seq_len=seq_len)
    raise TypeError(f"model must be a CertifiedStack, a zoo model, a ConversionReport, an nn.Module with certified "
                    f"blocks or a sequence of (name, module) pairs, got {type(model).__name__}")
