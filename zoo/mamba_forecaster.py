"""Mamba forecasters (CMamba-style): channel-independent, patch embedding, Mamba + MLP updates.

Each series of a sample is normalized by RevIN, cut into patches, embedded linearly with learned
positions and passed through ``e_layers`` layers of two residual updates each (D = 2 e_layers)::

    x = x + mixer(x)    # a Mamba mixer over the patch sequence
    x = x + mlp(x)      # MLP(GELU), width d_ff

then flattened and mapped to the horizon by a linear head; RevIN is undone on the forecast.
Defaults: input 96, horizon 96, patch 16 / stride 8, width 128, d_ff 128, d_state 16, expand 2,
dt_rank 32, d_conv 4, 3 layers, dropout 0.1.

Variants:

* ``mamba_forecaster_lg``: :class:`~certblocks.blocks.mamba.LinearGrowthMamba`, no norm: (1, 1), MLP (1, 0).
* ``mamba_forecaster_free``: :class:`~certblocks.blocks.mamba.Mamba`, no norm: (5, 5) -- refused in
  every dtype unless ``certify=False`` (the baseline).
* ``mamba_forecaster_rms`` / ``_preln``: Mamba and MLP with pre-RMSNorm / pre-LayerNorm, (0, 0).
* ``mamba_forecaster_periln``: Peri-LN (norm on the branch input and output), (0, 0).

Certificate defaults: ``r0`` from RevIN's affine map and the patch embedding, ``seq_len`` = number
of patches, ``cert_dtype = "bf16"``.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple, cast

import torch
from torch import nn

from certblocks._validation import check_choice, check_int, check_prob
from certblocks.blocks.mamba import LinearGrowthMamba, Mamba
from certblocks.blocks.mlp import MLP

from ._base import ZooModel
from ._layers import NormedUpdate, Patcher, RevIN, SeriesForecasterMixin
from ._registry import register_model

__all__ = ["MambaForecaster", "MambaForecasterLayer"]

_MIXERS = ("linear_growth", "free")


class MambaForecasterLayer(nn.Module):
    """Two residual updates: ``x + mixer(x)`` then ``x + mlp(x)`` (each optionally normalized)."""

    def __init__(self, d_model: int, d_ff: int, *, mixer: str, d_state: int, d_conv: int, expand: int, dt_rank: int,
                 norm: Optional[str], placement: str, dropout: float, device=None, dtype=None) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        check_choice("mixer", mixer, _MIXERS)
        cls = LinearGrowthMamba if mixer == "linear_growth" else Mamba
        m: nn.Module = cls(d_model, d_state=d_state, d_conv=d_conv, expand=expand, dt_rank=dt_rank, **dd)
        f: nn.Module = MLP(d_model, d_ff, "gelu", dropout=dropout, **dd)
        if norm is not None:
            m = NormedUpdate(m, d_model, norm, placement, **dd)
            f = NormedUpdate(f, d_model, norm, placement, **dd)
        self.mixer = m
        self.mlp = f
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, T, d)
        x = x + self.dropout(self.mixer(x))
        return x + self.dropout(self.mlp(x))


class MambaForecaster(SeriesForecasterMixin, ZooModel):
    """Channel-independent Mamba forecaster ``(batch, seq_len, n_vars) -> (batch, pred_len, n_vars)``.

    Args:
        n_vars: number of series per sample.
        seq_len, pred_len: input length and horizon.
        patch_len, stride: patching.
        d_model, d_ff, e_layers: width, MLP width, number of layers (2 updates each).
        d_state, d_conv, expand, dt_rank: the Mamba mixer's sizes.
        mixer: ``"linear_growth"`` (:class:`LinearGrowthMamba`) or ``"free"`` (:class:`Mamba`).
        norm: ``None``, ``"rms"`` or ``"layer"``; placement ``"pre"`` or ``"peri"``.
        dropout: residual and MLP dropout.
        certify: refuse a configuration not certified in ``cert_dtype``.
        cert_dtype: certification dtype (default ``"bf16"``).
        device, dtype: as for torch layers.
    """

    def __init__(self, n_vars: int = 7, seq_len: int = 96, pred_len: int = 96, *, patch_len: int = 16,
                 stride: int = 8, d_model: int = 128, d_ff: int = 128, e_layers: int = 3, d_state: int = 16,
                 d_conv: int = 4, expand: int = 2, dt_rank: int = 32, mixer: str = "linear_growth",
                 norm: Optional[str] = None, placement: str = "pre", dropout: float = 0.1, certify: bool = True,
                 cert_dtype: Any = None, device=None, dtype=None) -> None:
        super().__init__()
        self.n_vars = check_int("n_vars", n_vars)
        self.seq_len = check_int("seq_len", seq_len)
        self.pred_len = check_int("pred_len", pred_len)
        check_int("e_layers", e_layers)
        dropout = check_prob("dropout", dropout)
        dd = {"device": device, "dtype": dtype}
        self.revin = RevIN(n_vars, affine=True, **dd)
        self.patch = Patcher(seq_len, patch_len, stride, d_model, pad_end=True, dropout=dropout, **dd)
        self.layers = nn.ModuleList([
            MambaForecasterLayer(d_model, d_ff, mixer=mixer, d_state=d_state, d_conv=d_conv, expand=expand,
                                 dt_rank=dt_rank, norm=norm, placement=placement, dropout=dropout, **dd)
            for _ in range(e_layers)])
        self.head = nn.Linear(self.patch.num_patches * d_model, pred_len, **dd)
        self._certify_or_refuse(certify, cert_dtype)

    def residual_updates(self) -> List[Tuple[str, nn.Module]]:
        out: List[Tuple[str, nn.Module]] = []
        for i, layer in enumerate(cast(Iterable[MambaForecasterLayer], self.layers)):
            out += [(f"layers.{i}.mixer", layer.mixer), (f"layers.{i}.mlp", layer.mlp)]
        return out

    def input_radius(self) -> float:
        return self.patch.radius(*self.revin.affine_bounds())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (B, seq_len, n_vars) -> forecast (B, pred_len, n_vars)``."""
        self._check_series(x)
        B = x.shape[0]
        x, mean, std = self.revin.normalize(x)
        z = self.patch(x.transpose(1, 2).reshape(B * self.n_vars, self.seq_len))  # (B*C, N, d)
        for layer in self.layers:
            z = layer(z)
        y = self.head(z.flatten(1)).reshape(B, self.n_vars, self.pred_len).transpose(1, 2)  # (B, pred_len, C)
        return self.revin.denormalize(y, mean, std)


_SIZES: Dict[str, Dict[str, Any]] = {
    "full": dict(seq_len=96, pred_len=96, patch_len=16, stride=8, d_model=128, d_ff=128, e_layers=3, d_state=16,
                 expand=2, dt_rank=32),
    "test": dict(seq_len=32, pred_len=8, patch_len=8, stride=4, d_model=16, d_ff=16, e_layers=2, d_state=4,
                 expand=2, dt_rank=4, n_vars=2),
}

_VARIANTS = {"lg": ("linear_growth", None, "pre", "LinearGrowthMamba, no norm: (1, 1)"),
             "free": ("free", None, "pre", "Mamba, no norm: (5, 5), refused unless certify=False"),
             "rms": ("free", "rms", "pre", "Mamba with pre-RMSNorm: (0, 0)"),
             "preln": ("free", "layer", "pre", "Mamba with pre-LayerNorm: (0, 0)"),
             "periln": ("free", "layer", "peri", "Mamba with Peri-LN: (0, 0)")}


def _register(variant: str, size: str) -> None:
    mixer, norm, placement, what = _VARIANTS[variant]
    suffix = "_test" if size == "test" else ""

    def fn(**overrides: Any) -> MambaForecaster:
        cfg = dict(_SIZES[size], mixer=mixer, norm=norm, placement=placement)
        cfg.update(overrides)
        return MambaForecaster(**cfg)

    fn.__name__ = f"mamba_forecaster_{variant}{suffix}"
    fn.__doc__ = (f"Mamba forecaster, {what}" + (" (test size)." if size == "test" else
                  "; width 128, d_ff 128, d_state 16, expand 2, dt_rank 32, 3 layers."))
    register_model(fn, family="mamba_forecaster", test=size == "test", baseline=variant != "lg")
    globals()[fn.__name__] = fn


for _v in _VARIANTS:
    for _s in ("full", "test"):
        _register(_v, _s)
