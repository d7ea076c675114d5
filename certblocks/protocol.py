"""The block protocol: what every certified block promises, and what makes it enforceable.

A *certified block* is an ``nn.Module`` velocity ``v`` (the stack adds ``X + dt * v(X)``) with

* a class-level ``exponents`` (:class:`~certblocks.exponents.Exponents`), checked by the tests against what
  the tracer derives from the block's own forward;
* ``certificate(*, seq_len=None, r0=None) -> BlockCertificate``, computed from the current weights.  A block
  whose bound depends on the sequence length (a scan sums over time) raises ``ValueError`` naming
  ``seq_len`` when it is missing; ``r0`` is a scale at which a block may fold its bound most tightly (the
  bound stays valid at every radius).

An *enforceable block* is a certified block whose certificate is a monotone function of a few norms of its
weights (operator norms of matrices or of their row blocks, Euclidean norms of biases, largest normalization
scales, the largest ``softplus`` of a Mamba block's ``delta`` bias). It lists those tensors as
:class:`CapSlot` s and computes a certificate from caps on them with the SAME function its ``certificate()``
uses (:meth:`EnforceableBlock.certificate_from_caps`): :func:`certblocks.enforce` caps the tensors by
parametrizations and then that certificate holds for every parameter value.

**Capabilities.**  What else a block can do is a method it exposes, read by the monitor, the on-data certificate,
:func:`certblocks.enforce` and the fixes (never a check of its class; :mod:`certblocks.model`):

* ``levers() -> List[Lever]`` (:class:`LeveredBlock`): the knobs a fix may name (``init_values`` of a branch gain,
  ``qk_norm_eps``), each with the map from the certificate at the current value to the certificate at another;
* ``cap_slots()`` / ``certificate_from_caps()`` (:class:`EnforceableBlock`);
* ``attention_stats(x=None, *, samples, kappa, warm, iters, generator) -> dict`` (:class:`AttentionBlock`): an
  attention's query-key coefficient ``kappa`` and its largest logit on ``x`` (:mod:`certblocks.blocks.stats`);
* ``velocity_io() -> (entry, exit)``: an update that is a view outside the model's forward (a gained branch): the
  module that receives the state and the one that returns the velocity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Mapping, Optional, Protocol, Tuple, runtime_checkable

from ._validation import check_choice
from .certificate import BlockCertificate
from .exponents import Exponents

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import Tensor, nn

    from .fixes import Lever

__all__ = ["CapSlot", "CertifiedBlock", "EnforceableBlock", "LeveredBlock", "AttentionBlock", "CAP_KINDS",
           "linear_cap_slots", "softplus_ceiling"]

#: ``"matrix"``: spectral norm of each row block; ``"vector"``: Euclidean norm of each part; ``"clamp"``: the
#: largest absolute entry (a normalization's scale, a convolution's taps); ``"softplus"``: the largest
#: ``softplus(entry)`` (one-sided: the entries stay at most ``softplus^-1(cap)``, and at least the slot's fixed
#: ``lower``; a Mamba block's ``delta`` bias).
CAP_KINDS = ("matrix", "vector", "clamp", "softplus")


def softplus_ceiling(cap: float) -> float:
    """The largest entry a ``"softplus"`` slot with cap ``cap > 0`` allows: ``softplus^-1(cap)``.

    ``softplus^-1(cap) = cap + log(1 - exp(-cap))``.

    Computed in float64; the parametrization rounds it down in the parameter's dtype and a block's
    :meth:`EnforceableBlock.certificate_from_caps` evaluates its bound at this same value.
    """
    if not cap > 0:
        raise ValueError(f"a softplus cap must be > 0, got {cap!r}")
    return cap + math.log(-math.expm1(-cap))


@dataclass(frozen=True)
class CapSlot:
    """One tensor whose norms a certificate reads, split in parts along dimension 0.

    Attributes:
        module: the module that owns the tensor.
        name: the tensor's attribute name on ``module`` (``"weight"``, ``"bias"``).
        kind: one of :data:`CAP_KINDS`.
        sizes: the sizes of the parts along dimension 0 (a fused ``qkv`` projection has three).
        keys: one name per part: the key under which :meth:`EnforceableBlock.certificate_from_caps` reads
            the cap of that part.
        lower: ``"softplus"`` only: the fixed lower end of the entries (not scaled with the caps; the block's
            certificate reads it as a constant).
    """

    module: nn.Module
    name: str
    kind: str
    sizes: Tuple[int, ...]
    keys: Tuple[str, ...]
    lower: Optional[float] = None

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, CAP_KINDS)
        if len(self.sizes) != len(self.keys):
            raise ValueError(f"sizes {self.sizes} and keys {self.keys} differ in length")
        if (self.kind == "softplus") != (self.lower is not None):
            raise ValueError(f"lower is required for kind 'softplus' and only for it, got kind={self.kind!r}, "
                             f"lower={self.lower!r}")
        if self.lower is not None and not math.isfinite(self.lower):
            raise ValueError(f"lower must be finite, got {self.lower!r}")


@runtime_checkable
class CertifiedBlock(Protocol):
    """A velocity with a certificate computed from its current weights (see the module docstring)."""

    exponents: ClassVar[Exponents]

    def certificate(self, *, seq_len: Optional[int] = None, r0: Optional[float] = None) -> BlockCertificate:
        """The block's certificate from its current weights."""
        ...


@runtime_checkable
class EnforceableBlock(CertifiedBlock, Protocol):
    """A certified block whose certificate :func:`certblocks.enforce` can make hold for every weight."""

    def cap_slots(self) -> List[CapSlot]:
        """The tensors the certificate reads, with one key per part."""
        ...

    def certificate_from_caps(self, caps: Mapping[str, float], *, seq_len: Optional[int] = None) -> BlockCertificate:
        """The certificate that holds whenever every part's norm is at most its cap (keys of :meth:`cap_slots`).

        A key absent from ``caps`` is a part that does not exist (a bias-free layer): its norm is 0.
        """
        ...


@runtime_checkable
class LeveredBlock(Protocol):
    """A block whose certificate depends on some of its settings in a known way (the fixes' levers)."""

    def levers(self) -> List[Lever]:
        """The levers, each with its current value (empty: none)."""
        ...


@runtime_checkable
class AttentionBlock(Protocol):
    """An attention that reports its query-key coefficient and largest logit (diagnostics, not bounds)."""

    def attention_stats(self, x: Optional[Tensor] = None, *, samples: int = 8, kappa: bool = True,
                        warm: Optional[Dict[str, Tensor]] = None, iters: int = 50,
                        generator: Optional[torch.Generator] = None) -> Dict[str, Any]:
        """``{"kappa", "max_logit", "qk_norm"}``."""
        ...


def linear_cap_slots(linear: nn.Module, sizes: Tuple[int, ...], weight_keys: Tuple[str, ...],
                     bias_keys: Tuple[str, ...]) -> List[CapSlot]:
    """The slots of an ``nn.Linear`` split in row blocks ``sizes``: its weight (``"matrix"``) and bias if any."""
    slots = [CapSlot(linear, "weight", "matrix", tuple(sizes), tuple(weight_keys))]
    if getattr(linear, "bias", None) is not None:
        slots.append(CapSlot(linear, "bias", "vector", tuple(sizes), tuple(bias_keys)))
    return slots
