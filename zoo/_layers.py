"""Layers shared by the zoo's forecasters: RevIN, patching, normalized residual velocities.

* :class:`RevIN` -- reversible instance normalization (per series: subtract the mean, divide by
  the standard deviation, learnable affine; undone on the forecast).
* :class:`Patcher` -- split a series into patches (``ReplicationPad1d((0, stride))`` then
  ``unfold``, as PatchTST) and embed them linearly with learned positions.
* :class:`NormedUpdate` -- a velocity ``v(N_in(x))`` (pre-norm) or ``N_out(v(N_in(x)))``
  (peri-norm) with LayerNorm or RMSNorm, and its certificate (exponents (0, 0)).

Radius bound of the embedded input (used as ``r0``): after RevIN each series ``s`` of
length ``L`` has ``sum_t s_t^2 <= L`` (population variance 1, or less with ``eps``), so an
affine-mapped patch of ``P`` values, of which one may be repeated ``stride`` more times by
the end padding, has norm at most ``|w| sqrt(L (1 + stride)) + |b| sqrt(P)``; the patch
embedding adds ``||W_P||`` times that, ``||b_P||`` and the largest position vector.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import nn

from certblocks.certificate import BlockCertificate
from certblocks.exponents import Exponents
from certblocks.stack import block_certificate

from ._base import check_int, row_norm_max, spectral_norm, vec_norm

__all__ = ["RevIN", "Patcher", "NormedUpdate", "make_norm", "norm_bounds"]


class RevIN(nn.Module):
    """Reversible instance normalization over the time axis of ``(batch, time, channels)``.

    Args:
        num_channels: number of series per sample.
        eps: added to the variance.
        affine: learnable per-channel weight and bias.
    """

    def __init__(self, num_channels: int, eps: float = 1e-5, affine: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.num_channels = check_int("num_channels", num_channels)
        self.eps = float(eps)
        self.affine = affine
        if affine:
            self.affine_weight = nn.Parameter(torch.ones(num_channels, device=device, dtype=dtype))
            self.affine_bias = nn.Parameter(torch.zeros(num_channels, device=device, dtype=dtype))

    def normalize(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x (B, L, C) -> (x_norm, mean, std)`` with ``mean, std`` of shape ``(B, 1, C)``."""
        mean = x.mean(dim=1, keepdim=True).detach()
        std = torch.sqrt(x.var(dim=1, keepdim=True, unbiased=False) + self.eps).detach()
        x = (x - mean) / std
        if self.affine:
            x = x * self.affine_weight + self.affine_bias
        return x, mean, std

    def denormalize(self, y: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        """Undo :meth:`normalize` on a forecast ``y (B, H, C)``."""
        if self.affine:
            y = (y - self.affine_bias) / (self.affine_weight + self.eps * self.eps)
        return y * std + mean

    def affine_bounds(self) -> Tuple[float, float]:
        """``(max |w|, max |b|)`` of the affine map (``(1, 0)`` without affine)."""
        if not self.affine:
            return 1.0, 0.0
        return (float(self.affine_weight.detach().abs().max()) * (1 + 1e-12),
                float(self.affine_bias.detach().abs().max()) * (1 + 1e-12))


class Patcher(nn.Module):
    """Patching and linear embedding of univariate series: ``(N, L) -> (N, num_patches, d_model)``.

    Args:
        seq_len: series length ``L``.
        patch_len: patch length ``P``.
        stride: patch stride.
        d_model: embedding width.
        pad_end: repeat the last value ``stride`` times first (PatchTST's ``padding_patch="end"``).
        dropout: dropout after the embedding.
    """

    def __init__(self, seq_len: int, patch_len: int, stride: int, d_model: int, *, pad_end: bool = True,
                 dropout: float = 0.0, device=None, dtype=None) -> None:
        super().__init__()
        self.seq_len = check_int("seq_len", seq_len)
        self.patch_len = check_int("patch_len", patch_len)
        self.stride = check_int("stride", stride)
        if patch_len > seq_len:
            raise ValueError(f"patch_len={patch_len} must be <= seq_len={seq_len}")
        self.pad_end = pad_end
        total = seq_len + (stride if pad_end else 0)
        self.num_patches = (total - patch_len) // stride + 1
        dd = {"device": device, "dtype": dtype}
        self.W_P = nn.Linear(patch_len, d_model, **dd)
        self.W_pos = nn.Parameter(torch.empty(self.num_patches, d_model, **dd).uniform_(-0.02, 0.02))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, L)
        if self.pad_end:
            x = torch.cat([x, x[:, -1:].expand(-1, self.stride)], dim=1)  # (N, L + stride)
        p = x.unfold(-1, self.patch_len, self.stride)  # (N, num_patches, P)
        return self.dropout(self.W_P(p) + self.W_pos)  # (N, num_patches, d_model)

    def radius(self, w_max: float, b_max: float) -> float:
        """Bound on every embedded token's norm for RevIN-normalized series with affine ``|w| <= w_max``,
        ``|b| <= b_max`` (see the module docstring)."""
        reps = 1 + (self.stride if self.pad_end else 0)
        patch = w_max * math.sqrt(self.seq_len * reps) + b_max * math.sqrt(self.patch_len)
        return spectral_norm(self.W_P.weight) * patch + vec_norm(self.W_P.bias) + row_norm_max(self.W_pos)


def make_norm(kind: str, d: int, eps: float = 1e-5, device=None, dtype=None) -> nn.Module:
    """``"layer"`` -> LayerNorm, ``"rms"`` -> RMSNorm."""
    if kind == "layer":
        return nn.LayerNorm(d, eps=eps, device=device, dtype=dtype)
    if kind == "rms":
        return nn.RMSNorm(d, eps=eps, device=device, dtype=dtype)
    raise ValueError(f"norm must be 'layer' or 'rms', got {kind!r}")


def norm_bounds(norm: nn.Module) -> Tuple[float, float]:
    """``(A, G)`` of a LayerNorm / RMSNorm: per-token output norm bound ``||g||_inf sqrt(d) + ||beta||``
    and Jacobian bound ``||g||_inf / sqrt(eps)``."""
    d = norm.normalized_shape[-1]
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    g = 1.0 if norm.weight is None else float(norm.weight.detach().double().abs().max()) * (1 + 1e-12)
    beta = vec_norm(getattr(norm, "bias", None))
    return g * math.sqrt(d) + beta, g / math.sqrt(eps)


class NormedUpdate(nn.Module):
    """A normalized residual velocity: ``v(N_in(x))`` (``placement="pre"``) or ``N_out(v(N_in(x)))`` (``"peri"``).

    Args:
        branch: the velocity (a certblocks block with ``certificate()``).
        d_model: width.
        norm: ``"layer"`` or ``"rms"``.
        placement: ``"pre"`` or ``"peri"``.
        eps: the norms' ``eps``.

    Certificate (exponents (0, 0)): with ``A``, ``G`` from :func:`norm_bounds` and the branch's
    ``(c, b, q)`` and Jacobian bound ``L_v``: pre ``||v(N x)|| <= c A^q + b``, ``L <= L_v(A) G_in``;
    peri ``||N_out(.)|| <= A_out``, ``L <= G_out L_v(A_in) G_in``.
    """

    exponents = Exponents(0, 0)

    def __init__(self, branch: nn.Module, d_model: int, norm: str, placement: str = "pre", eps: float = 1e-5,
                 device=None, dtype=None) -> None:
        super().__init__()
        if placement not in ("pre", "peri"):
            raise ValueError(f"placement must be 'pre' or 'peri', got {placement!r}")
        self.placement = placement
        self.norm_kind = norm
        self.norm = make_norm(norm, d_model, eps, device, dtype)
        self.branch = branch
        self.norm_out = make_norm(norm, d_model, eps, device, dtype) if placement == "peri" else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_out(self.branch(self.norm(x)))

    def certificate(self, *, seq_len: Optional[int] = None, r0: Optional[float] = None) -> BlockCertificate:
        """Certificate from the current weights (see the class docstring)."""
        inner = block_certificate(self.branch, seq_len=seq_len)
        if inner.q is None or inner.sigma is None:
            raise ValueError(f"the branch {type(self.branch).__name__} has exponents not derived: {inner}")
        a_in, g_in = norm_bounds(self.norm)
        l_branch = inner.jacobian_bound(a_in)
        if self.placement == "pre":
            c, l0 = inner.growth_bound(a_in), l_branch * g_in
        else:
            a_out, g_out = norm_bounds(self.norm_out)
            c, l0 = a_out, g_out * l_branch * g_in
        from certblocks.blocks._coeffs import normalized_peak

        peak = normalized_peak(inner.peak, inner.q, inner.c, inner.b, a_in, c,
                               f"branch intermediates at the normalized radius ({self.placement}-{self.norm_kind})")
        return BlockCertificate(0.0, 0.0, c=c, b=0.0, l1=0.0, l0=l0, name=f"{self.placement}-{self.norm_kind}",
                                culprit=f"{self.placement}-{self.norm_kind} norm bounds the branch input", peak=peak)


class SeriesForecasterMixin:
    """What the channel-independent forecasters share: input ``(batch, seq_len, n_vars)``, patch tokens.

    Expects ``self.seq_len``, ``self.n_vars`` and ``self.patch`` (a :class:`Patcher`).
    """

    seq_len: int
    n_vars: int
    patch: Patcher

    def example_input(self, seq_len: Optional[int] = None) -> torch.Tensor:
        """A random series ``(1, seq_len, n_vars)``; the look-back window is fixed, so ``seq_len`` is ignored."""
        return torch.randn(1, self.seq_len, self.n_vars, generator=torch.Generator().manual_seed(0))

    def certificate_seq_len(self) -> int:
        """The residual stream's tokens are the patches."""
        return self.patch.num_patches

    def _check_series(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[1] != self.seq_len or x.shape[2] != self.n_vars:
            raise ValueError(f"x must have shape (batch, {self.seq_len}, {self.n_vars}), got "
                             f"{tuple(getattr(x, 'shape', ()))}")

