"""Layers shared by the zoo's forecasters: RevIN, patching, normalized residual velocities.

* :class:`RevIN` -- reversible instance normalization (per series: subtract the mean, divide by
  the standard deviation, learnable affine; undone on the forecast).
* :class:`Patcher` -- split a series into patches (``ReplicationPad1d((0, stride))`` then
  ``unfold``, as PatchTST) and embed them linearly with learned positions.
* :class:`~certblocks.blocks.NormedUpdate` (re-exported) -- a velocity ``v(N_in(x))`` (pre-norm) or
  ``N_out(v(N_in(x)))`` (peri-norm) with LayerNorm or RMSNorm, and its certificate (exponents (0, 0)).

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

from certblocks._validation import check_int
from certblocks.blocks.normed import NormedUpdate, make_norm
from certblocks.bounds import op_norm, row_norm_max, vec_norm

__all__ = ["RevIN", "Patcher", "NormedUpdate", "make_norm"]


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
        return op_norm(self.W_P.weight) * patch + vec_norm(self.W_P.bias) + row_norm_max(self.W_pos)


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

