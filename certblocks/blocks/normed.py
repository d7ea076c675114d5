"""Normalized residual velocities: a branch behind a LayerNorm/RMSNorm (pre), and optionally one after it (peri).

``v(x) = F(N_in(x))`` (``placement="pre"``) or ``N_out(F(N_in(x)))`` (``"peri"``, Peri-LN).  Whatever the
branch ``F``, the update is ``(0, 0)``: the branch sees inputs of norm at most ``A_in`` and the output is the
branch's value there (pre) or a normalized vector (peri).  With ``(A, G)`` the normalizations' output and
Jacobian bounds (:mod:`certblocks.bounds.normalization`) and the branch's certificate ``c_F, b_F, q_F, L_F``:

* pre: ``||v(x)|| <= c_F A_in^q_F + b_F``, ``||dv|| <= sup_x ||J_F(N_in x)|| ||J_N(x)||``;
* peri: ``||v(x)|| <= A_out``, ``||dv|| <= G_out sup_x ||J_F(N_in x)|| ||J_N(x)||``.

The supremum is :func:`certblocks.bounds.prenorm_jacobian` from the weights (tighter than ``L_F(A_in) G_in``,
which :meth:`NormedUpdate.certificate_from_caps` uses when only caps on the scales are known).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, List, Mapping, Optional, Tuple, Union, cast

import torch
from torch import nn

from .. import bounds
from .._validation import check_cert_args, check_choice, check_finite
from ..certificate import BlockCertificate
from ..exponents import NORM, Exponents
from ..fixes import Lever
from ..protocol import CapSlot, EnforceableBlock

__all__ = ["NormedUpdate", "make_norm", "normalized_certificate", "normalized_cap_slots", "norm_cap_slots", "norm_caps"]

_KINDS = ("layer", "rms")
_PLACEMENTS = ("pre", "peri")


def make_norm(kind: str, d: int, eps: float = 1e-5, device=None, dtype=None) -> nn.Module:
    """``"layer"`` -> ``nn.LayerNorm``, ``"rms"`` -> ``nn.RMSNorm`` over ``d`` features."""
    cls = nn.LayerNorm if check_choice("norm", kind, _KINDS) == "layer" else nn.RMSNorm
    return cls(d, eps=eps, device=device, dtype=dtype)


def normalized_certificate(branch: BlockCertificate, norm_in: nn.Module, norm_out: Optional[nn.Module], *,
                           placement: str, kind: str, caps: Optional[Mapping[str, float]] = None,
                           name: str = "") -> BlockCertificate:
    """The ``(0, 0)`` certificate of a branch behind ``norm_in`` (pre), and before ``norm_out`` (peri).

    From the normalizations' weights when ``caps`` is ``None`` (the Jacobian through
    :func:`certblocks.bounds.prenorm_jacobian`); else from caps on their scales and biases (keys ``gamma_in``,
    ``beta_in``, ``gamma_out``, ``beta_out``; the Jacobian ``L_F(A_in) G_in``).

    Args:
        branch: the branch's certificate (exponents derived; from caps too when ``caps`` is given).
        norm_in: the input LayerNorm/RMSNorm.
        norm_out: the output one (``"peri"`` only; ignored for ``"pre"``).
        placement: ``"pre"`` or ``"peri"``.
        kind: the normalization (``"layer"``, ``"rms"``), for the labels.
        caps: the caps, or ``None`` for the current weights.
        name: the certificate's label (default ``"<placement>-<kind>"``).
    """
    if branch.q is None or branch.sigma is None:
        raise ValueError(f"the branch's exponents are not derived: {branch}")
    check_choice("placement", placement, _PLACEMENTS)
    if caps is None:
        a_in, _ = bounds.module_norm_bounds(norm_in)
        inner = bounds.prenorm_jacobian(norm_in, branch.jacobian_bound)  # sup_x ||J_F(N_in x)|| ||J_N_in(x)||
    else:
        a_in, g_in = norm_caps(norm_in, caps, "in")
        inner = branch.jacobian_bound(a_in) * g_in
    if placement == "pre":
        c, l0 = branch.growth_bound(a_in), inner
    else:
        if norm_out is None:
            raise ValueError("a peri-normalized certificate needs norm_out")
        a_out, g_out = bounds.module_norm_bounds(norm_out) if caps is None else norm_caps(norm_out, caps, "out")
        c, l0 = a_out, g_out * inner
    label = f"{placement}-{kind}"
    peak = bounds.normalized_peak(branch.peak, branch.q, branch.c, branch.b, a_in, c,
                                  f"branch intermediates at the normalized radius ({label})")
    return BlockCertificate(0.0, 0.0, c=c, b=0.0, l1=0.0, l0=l0, name=name or label,
                            culprit=f"{label} norm bounds the branch input", peak=peak)


def normalized_cap_slots(norm_in: nn.Module, norm_out: Optional[nn.Module], placement: str) -> List[CapSlot]:
    """The slots of the normalizations around a branch (``gamma_in``, ``beta_in`` and, peri, ``_out``)."""
    slots = norm_cap_slots(norm_in, "in")
    if placement == "peri":
        assert norm_out is not None
        slots += norm_cap_slots(norm_out, "out")
    return slots


def norm_cap_slots(norm: nn.Module, tag: str) -> List[CapSlot]:
    """The slots of an affine LayerNorm/RMSNorm: scale (``"clamp"``, key ``gamma_<tag>``), bias (``beta_<tag>``)."""
    if not isinstance(norm, (nn.LayerNorm, nn.RMSNorm)) or getattr(norm, "weight", None) is None:
        raise TypeError(f"enforce needs an affine nn.LayerNorm or nn.RMSNorm, got {type(norm).__name__}")
    d = norm.normalized_shape[-1]
    slots = [CapSlot(norm, "weight", "clamp", (d,), (f"gamma_{tag}",))]
    if getattr(norm, "bias", None) is not None:
        slots.append(CapSlot(norm, "bias", "vector", (d,), (f"beta_{tag}",)))
    return slots


def norm_caps(norm: nn.Module, caps: Mapping[str, float], tag: str) -> Tuple[float, float]:
    """``(A, G)`` of a LayerNorm/RMSNorm whose scale and bias are within the caps ``gamma_<tag>``, ``beta_<tag>``."""
    kind = "layer" if isinstance(norm, nn.LayerNorm) else "rms"
    ln = cast(Union[nn.LayerNorm, nn.RMSNorm], norm)
    shape = tuple(ln.normalized_shape)
    eps = ln.eps if ln.eps is not None else torch.finfo(torch.float32).eps
    return bounds.scalar_norm_bounds(kind, caps[f"gamma_{tag}"], caps.get(f"beta_{tag}", 0.0), eps,
                                     numel=math.prod(shape), d=shape[-1])


def _enforceable(branch: nn.Module) -> EnforceableBlock:
    if not isinstance(branch, EnforceableBlock):
        raise TypeError(f"enforce does not support the branch {type(branch).__name__}: it has no cap_slots() / "
                        "certificate_from_caps()")
    return branch


class NormedUpdate(nn.Module):
    """A normalized residual velocity ``F(N_in(x))`` (``"pre"``) or ``N_out(F(N_in(x)))`` (``"peri"``): ``(0, 0)``.

    Args:
        branch: the velocity ``F`` (a certified block).
        d_model: width.
        norm: ``"layer"`` or ``"rms"``.
        placement: ``"pre"`` or ``"peri"``.
        eps: the normalizations' ``eps``.
        device, dtype: as for torch layers.

    Submodules: ``norm`` (input), ``branch``, ``norm_out`` (``nn.Identity`` for ``"pre"``).
    """

    exponents: ClassVar[Exponents] = NORM

    def __init__(self, branch: nn.Module, d_model: int, norm: str, placement: str = "pre", eps: float = 1e-5,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.placement = check_choice("placement", placement, _PLACEMENTS)
        self.norm_kind = check_choice("norm", norm, _KINDS)
        self.norm = make_norm(norm, d_model, eps, device, dtype)
        self.branch: Any = branch  # an nn.Module with the CertifiedBlock methods
        self.norm_out = make_norm(norm, d_model, eps, device, dtype) if placement == "peri" else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_out(self.branch(self.norm(x)))

    def certificate(self, *, seq_len: Optional[int] = None, r0: Optional[float] = None) -> BlockCertificate:
        """Certificate from the current weights (module docstring)."""
        check_cert_args(seq_len, r0)
        check_finite(self)
        return normalized_certificate(self.branch.certificate(seq_len=seq_len), self.norm, self.norm_out,
                                      placement=self.placement, kind=self.norm_kind)

    def levers(self) -> List[Lever]:
        """None: the normalized bound is not a closed-form function of the branch's levers (a gain around the whole
        update is :class:`~certblocks.blocks.ScaledBranch`'s)."""
        return []

    def cap_slots(self) -> List[CapSlot]:
        """The branch's slots and the normalizations' (``gamma_in``, ``beta_in``, ``gamma_out``, ``beta_out``)."""
        return _enforceable(self.branch).cap_slots() + normalized_cap_slots(self.norm, self.norm_out, self.placement)

    def certificate_from_caps(self, caps: Mapping[str, float], *, seq_len: Optional[int] = None) -> BlockCertificate:
        """The certificate that holds while the branch's and the normalizations' tensors are within their caps."""
        inner = _enforceable(self.branch).certificate_from_caps(caps, seq_len=seq_len)
        return normalized_certificate(inner, self.norm, self.norm_out, placement=self.placement, kind=self.norm_kind,
                                      caps=caps)
