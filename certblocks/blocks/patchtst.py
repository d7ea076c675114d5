"""The PatchTST encoder layer as two residual updates: :class:`PatchTSTBlock`.

One PatchTST layer is self-attention (bidirectional) then a feed-forward network
(``Linear -> GELU -> Dropout -> Linear``), each wrapped in a residual connection.  Here each
sub-layer is one update ``X <- X + v_k(X)`` (DESIGN.md: a 12-layer encoder has 24 updates);
:meth:`PatchTSTBlock.updates` returns the two velocities as modules.

Variants (``norm``, ``placement``):

* ``norm=None``: the certified no-normalization layer; attention (1, 2), feed-forward (1, 0);
  ``qk_norm=True`` makes the attention update (1, 1).
* ``norm`` in ``{"layer", "rms", "batch"}`` with ``placement``:

  - ``"pre"``: ``X + v(N(X))``; LayerNorm/RMSNorm bound the branch input: (0, 0).
  - ``"peri"``: ``X + N_out(v(N_in(X)))`` (Peri-LN); LayerNorm/RMSNorm: (0, 0).
  - ``"post"``: ``N(X + v(X))`` (the original Transformer and PatchTST default).  This
    normalizes the residual stream itself; it is NOT a residual update ``X + dt v(X)``, so the
    certificate of a post-norm update has ``q`` and ``sigma`` not derived (``None``) and says
    why in ``culprit``; :func:`certblocks.certify_stack` stops there.

  BatchNorm (PatchTST's default) is certified in evaluation mode, where it is the affine map
  of its running statistics: it does not bound the branch input, so pre/peri BatchNorm updates
  keep the branch's exponents ((1, 2) / (1, 1) / (1, 0)), with the affine map folded into the
  coefficients.  In training mode BatchNorm mixes the samples of a batch and no per-sample
  certificate applies.

Certificates bound the velocities with dropout inactive (``eval()``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import ClassVar, List, Mapping, Optional, Tuple

import torch
from torch import nn

from .. import bounds
from .._validation import check_bool, check_cert_args, check_choice, check_finite, check_int, check_prob, check_real
from ..certificate import BlockCertificate
from ..exponents import ATTENTION, NORM, Exponents
from ..fixes import Lever
from ..protocol import CapSlot, EnforceableBlock
from .attention import Attention, QKNormAttention
from .mlp import MLP
from .normed import normalized_cap_slots, normalized_certificate

__all__ = ["PatchTSTBlock", "PatchTSTUpdate", "TokenBatchNorm"]

_NORMS = ("layer", "rms", "batch")
_PLACEMENTS = ("pre", "post", "peri")


class TokenBatchNorm(nn.BatchNorm1d):
    """``BatchNorm1d`` over the feature axis of a ``(batch, seq_len, d_model)`` tensor (PatchTST's norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training or self.running_mean is None or self.running_var is None:
            return super().forward(x.transpose(1, 2)).transpose(1, 2)  # (B, T, D) -> (B, D, T) -> BN -> back
        # evaluation mode: the affine map of the running statistics, on the feature axis directly
        y = (x - self.running_mean) * torch.rsqrt(self.running_var + self.eps)
        if self.weight is not None:
            y = y * self.weight + self.bias
        return y

    def eval_affine(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The evaluation-mode map ``x -> a * x + c`` (float64)."""
        if self.running_mean is None or self.running_var is None:
            raise ValueError("BatchNorm without running statistics (track_running_stats=False) has no evaluation-mode "
                             "map; it cannot be certified per sample")
        rv = self.running_var.detach().double().cpu()
        rm = self.running_mean.detach().double().cpu()
        g = torch.ones_like(rv) if self.weight is None else self.weight.detach().double().cpu()
        beta = torch.zeros_like(rv) if self.bias is None else self.bias.detach().double().cpu()
        a = g / torch.sqrt(rv + self.eps)
        return a, beta - a * rm


def _make_norm(kind: str, d: int, eps: float, dd: dict) -> nn.Module:
    if kind == "layer":
        return nn.LayerNorm(d, eps=eps, **dd)
    if kind == "rms":
        return nn.RMSNorm(d, eps=eps, **dd)
    return TokenBatchNorm(d, eps=eps, **dd)


def _fold(branch: nn.Module, a_in: Optional[torch.Tensor], c_in: Optional[torch.Tensor],
          a_out: Optional[torch.Tensor], c_out: Optional[torch.Tensor]) -> nn.Module:
    """A float64 copy of ``branch`` computing ``a_out * branch(a_in * x + c_in) + c_out``."""
    f = copy.deepcopy(branch).to(torch.float64).eval()
    first = f.in_proj if isinstance(f, (Attention, QKNormAttention)) else f.fc1
    last = f.out_proj if isinstance(f, (Attention, QKNormAttention)) else f.fc2
    with torch.no_grad():
        if a_in is not None:
            assert c_in is not None
            b = torch.zeros(first.out_features, dtype=torch.float64) if first.bias is None else first.bias.double()
            b = b + first.weight.double() @ c_in
            first.weight.mul_(a_in[None, :])
            first.bias = nn.Parameter(b)
        if a_out is not None:
            assert c_out is not None
            b = torch.zeros(last.out_features, dtype=torch.float64) if last.bias is None else last.bias.double()
            last.weight.mul_(a_out[:, None])
            last.bias = nn.Parameter(a_out * b + c_out)
    return f


class PatchTSTUpdate(nn.Module):
    """One residual update of a :class:`PatchTSTBlock`: the velocity ``v`` (modules shared with the block).

    ``forward(x)`` is ``v(x)``: ``dropout(branch(x))`` without norm or with ``"post"`` placement,
    ``dropout(branch(N(x)))`` for ``"pre"`` and ``N_out(dropout(branch(N(x))))`` for ``"peri"``.
    """

    def __init__(self, kind: str, branch: nn.Module, dropout: nn.Module, norm: Optional[str], placement: str,
                 norm_in: nn.Module, norm_out: nn.Module) -> None:
        super().__init__()
        self.kind = kind
        self.branch = branch
        self.dropout = dropout
        self.norm = norm
        self.placement = placement
        self.norm_in = norm_in
        self.norm_out = norm_out

    @property
    def is_residual_update(self) -> bool:
        """False for post-norm: the layer is ``N(X + v(X))``, not ``X + dt v(X)``."""
        return self.norm is None or self.placement != "post"

    @property
    def exponents(self) -> Exponents:
        """This update's exponents (not derived for post-norm)."""
        if not self.is_residual_update:
            return Exponents(None, None)
        base = self.branch.exponents
        if self.norm in ("layer", "rms"):
            return NORM
        return base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None and self.placement in ("pre", "peri"):
            x = self.norm_in(x)
        y = self.dropout(self.branch(x))
        if self.norm is not None and self.placement == "peri":
            y = self.norm_out(y)
        return y

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with the branch's plain twin (``forward_reference``) and no dropout."""
        if self.norm is not None and self.placement in ("pre", "peri"):
            x = self.norm_in(x)
        y = self.branch.forward_reference(x)
        if self.norm is not None and self.placement == "peri":
            y = self.norm_out(y)
        return y

    def certificate(self, *, seq_len: Optional[int] = None, r0: Optional[float] = None) -> BlockCertificate:
        """Certificate of this velocity from the current weights (dropout inactive, BatchNorm in eval mode)."""
        check_cert_args(seq_len, r0)
        name = f"PatchTST.{self.kind}"
        if not self.is_residual_update:
            return BlockCertificate(
                None, None, name=name,
                culprit=(f"post-norm ({self.norm}): the layer is N(X + v(X)), which normalizes the residual stream "
                         "itself and is not a residual update X + dt*v(X); the stack theory does not apply"),
                fix="use placement='pre' or 'peri' (bounded branch input, (0, 0)) or norm=None (the certified "
                    "no-norm layer)")
        check_finite(self)
        if self.norm is None:
            return _renamed(self.branch.certificate(seq_len=seq_len), name)
        if self.norm == "batch":
            a_in, c_in = self.norm_in.eval_affine()
            a_out = c_out = None
            if self.placement == "peri":
                a_out, c_out = self.norm_out.eval_affine()
            cert = _fold(self.branch, a_in, c_in, a_out, c_out).certificate(seq_len=seq_len)
            # the folded branch covers everything after the input BatchNorm; add its own output a * x + c
            bn_in = {1.0: float(a_in.abs().max()), 0.0: bounds.vec_norm(c_in)}
            peak = bounds.fold_peak([bounds.peak_poly(cert.peak, cert.q, cert.c, cert.b), bn_in],
                                    cert.peak.what if cert.peak is not None else "BatchNorm output")
            cert = dataclasses.replace(cert, peak=peak)
            return _renamed(cert, name, note=" (BatchNorm folded in eval mode: an affine map, not a normalization)")
        return normalized_certificate(self.branch.certificate(seq_len=seq_len), self.norm_in, self.norm_out,
                                      placement=self.placement, kind=self.norm, name=name)

    def _check_enforceable(self) -> EnforceableBlock:
        if self.norm == "batch" and self.placement in ("pre", "peri"):
            raise TypeError(
                f"PatchTSTUpdate with norm='batch', placement={self.placement!r} is not supported by enforce: its "
                "certificate is for eval mode, where BatchNorm is x -> a * x + c with a = weight / sqrt(running_var + "
                "eps) and c = bias - a * running_mean; the running statistics are buffers that every training step "
                "overwrites, and no cap on the parameters bounds c (running_mean is unbounded; a is at most "
                "|weight| / sqrt(eps)). Use norm='layer' or 'rms' (pre/peri), or norm=None")
        if self.norm is not None and (self.norm not in ("layer", "rms") or self.placement not in ("pre", "peri")):
            raise TypeError(f"PatchTSTUpdate with norm={self.norm!r}, placement={self.placement!r} is not supported by "
                            "enforce (norm None, or 'layer'/'rms' with placement 'pre'/'peri'; post-norm is not a "
                            "residual update)")
        if not isinstance(self.branch, EnforceableBlock):
            raise TypeError(f"enforce does not support the branch {type(self.branch).__name__}")
        return self.branch

    def levers(self) -> List[Lever]:
        """Without a norm the branch's levers (its certificate is the branch's); with one none (the normalized
        bound is not a closed-form function of them)."""
        if self.norm is None and self.is_residual_update:
            return list(getattr(self.branch, "levers", lambda: [])())
        return []

    def cap_slots(self) -> List[CapSlot]:
        """The branch's slots and, when normalized, the norms' scales and biases (``gamma_in``, ``beta_in``, ...)."""
        slots = self._check_enforceable().cap_slots()
        if self.norm is not None:
            slots += normalized_cap_slots(self.norm_in, self.norm_out, self.placement)
        return slots

    def certificate_from_caps(self, caps: Mapping[str, float], *, seq_len: Optional[int] = None) -> BlockCertificate:
        """The certificate that holds while every capped tensor is within its cap (no norm, pre or peri)."""
        branch = self._check_enforceable().certificate_from_caps(caps, seq_len=seq_len)
        name = f"PatchTST.{self.kind}"
        if self.norm is None:
            return _renamed(branch, name)
        return normalized_certificate(branch, self.norm_in, self.norm_out, placement=self.placement, kind=self.norm,
                                      caps=caps, name=name)


def _renamed(cert: BlockCertificate, name: str, note: str = "") -> BlockCertificate:
    return dataclasses.replace(cert, name=name, culprit=cert.culprit + note)


class PatchTSTBlock(nn.Module):
    """PatchTST encoder layer (bidirectional attention, then feed-forward) as two residual updates.

    Args:
        d_model: model width.
        n_heads: attention heads (must divide ``d_model``).
        d_ff: feed-forward hidden width.
        norm: ``None`` (certified, no normalization), ``"layer"``, ``"rms"`` or ``"batch"``.
        placement: ``"pre"``, ``"post"`` or ``"peri"`` (ignored when ``norm=None``).
        qk_norm: normalize queries and keys (:class:`QKNormAttention`, RMS): attention (1, 2) -> (1, 1).
        dropout: residual dropout of both updates and the feed-forward's hidden dropout.
        attn_dropout: dropout on the attention probabilities.
        act: feed-forward activation (``"gelu"`` as in PatchTST).
        bias: biases of all linear layers.
        norm_eps: ``eps`` of the normalizations.
        device, dtype: as for torch layers.

    Submodules (names from PatchTST's ``TSTEncoderLayer``): ``self_attn``, ``dropout_attn``,
    ``norm_attn``, ``ff``, ``dropout_ffn``, ``norm_ffn``; with ``placement="peri"`` also
    ``norm_attn_out`` and ``norm_ffn_out``.  Unused norms are ``nn.Identity``.
    """

    #: Exponents of the two updates for the default configuration (``norm=None, qk_norm=False``);
    #: instances carry their own in ``exponents``.
    exponents: ClassVar[Tuple[Exponents, Exponents]] = (ATTENTION, Exponents(1, 0))

    def __init__(self, d_model: int, n_heads: int, d_ff: int, *, norm: Optional[str] = None, placement: str = "pre",
                 qk_norm: bool = False, dropout: float = 0.2, attn_dropout: float = 0.0, act: str = "gelu",
                 bias: bool = True, norm_eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        d_model = check_int("d_model", d_model)
        check_int("n_heads", n_heads)
        check_int("d_ff", d_ff)
        if norm is not None:
            check_choice("norm", norm, _NORMS)
        self.norm = norm
        self.placement = check_choice("placement", placement, _PLACEMENTS)
        check_bool("qk_norm", qk_norm)
        check_real("norm_eps", norm_eps, gt=0.0)
        dropout = check_prob("dropout", dropout)
        dd = {"device": device, "dtype": dtype}
        self.d_model = d_model
        attn_cls = QKNormAttention if qk_norm else Attention
        self.self_attn = attn_cls(d_model, n_heads, causal=False, bias=bias, attn_dropout=attn_dropout, **dd)
        self.dropout_attn = nn.Dropout(dropout)
        self.ff = MLP(d_model, d_ff, act, bias=bias, dropout=dropout, **dd)
        self.dropout_ffn = nn.Dropout(dropout)

        def mk() -> nn.Module:
            return nn.Identity() if norm is None else _make_norm(norm, d_model, float(norm_eps), dd)

        self.norm_attn = mk()
        self.norm_ffn = mk()
        peri = norm is not None and placement == "peri"
        if peri:
            self.norm_attn_out = mk()
            self.norm_ffn_out = mk()
        out_a = self.norm_attn_out if peri else nn.Identity()
        out_f = self.norm_ffn_out if peri else nn.Identity()
        updates = (PatchTSTUpdate("attn", self.self_attn, self.dropout_attn, norm, placement, self.norm_attn, out_a),
                   PatchTSTUpdate("ffn", self.ff, self.dropout_ffn, norm, placement, self.norm_ffn, out_f))
        object.__setattr__(self, "_updates", updates)  # shared submodules; not registered twice
        self.exponents = tuple(u.exponents for u in updates)  # type: ignore[misc]

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, norm={self.norm!r}, placement={self.placement!r}"

    def updates(self) -> Tuple[PatchTSTUpdate, PatchTSTUpdate]:
        """The two velocities ``(v_attn, v_ffn)`` in depth order (modules sharing this block's parameters)."""
        return self._updates  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, seq_len, d_model) -> (batch, seq_len, d_model)``: ``X + v1(X)`` then ``+ v2``
        (post-norm: ``N1(X + v1(X))`` then ``N2(. + v2(.))``)."""
        v1, v2 = self._updates  # type: ignore[attr-defined]
        if self.norm is not None and self.placement == "post":
            x = self.norm_attn(x + v1(x))
            return self.norm_ffn(x + v2(x))
        x = x + v1(x)
        return x + v2(x)

    def certificates(self, *, seq_len: Optional[int] = None,
                     r0: Optional[float] = None) -> Tuple[BlockCertificate, BlockCertificate]:
        """One certificate per update, ``(attention, feed-forward)``, ready for ``certify_stack``.

        A PatchTST layer is two residual updates, so it is not itself a certified block: each of
        :meth:`updates` is.  Post-norm updates get certificates with ``q`` and ``sigma`` not derived and the
        reason in ``culprit``.
        """
        return tuple(u.certificate(seq_len=seq_len, r0=r0) for u in self._updates)  # type: ignore[return-value]
