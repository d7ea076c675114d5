"""PatchTST forecasters: ``patchtst_noln`` (certified, no normalization) and its normalized variants.

A channel-independent PatchTST (Nie et al., 2023): each of the ``n_vars`` series of a sample is
normalized by RevIN, cut into patches (length 16, stride 8, end padding), embedded linearly with
learned positions, encoded by ``e_layers`` :class:`~certblocks.blocks.patchtst.PatchTSTBlock`
layers (bidirectional attention then feed-forward, each one residual update: D = 2 e_layers),
flattened and mapped to the horizon by a linear head; RevIN is undone on the forecast.

Defaults (PatchTST's configuration for the larger benchmarks): input 96, horizon 96, width 128,
16 heads, d_ff 256, dropout 0.2, 3 layers.  Unlike the reference implementation, attention scores
are not carried from one layer to the next (no "residual attention"): each update is a plain
velocity.

Variants (``norm``, ``placement`` of :class:`PatchTSTBlock`):

* ``patchtst_noln``: no normalization; attention (1, 2), feed-forward (1, 0).
* ``patchtst_rms``: pre-RMSNorm, (0, 0).
* ``patchtst_preln``: pre-LayerNorm, (0, 0).
* ``patchtst_periln``: Peri-LN (LayerNorm on the branch input and output), (0, 0).

Certificate defaults: ``r0`` from RevIN's affine map and the patch embedding (see
:mod:`certblocks.zoo._layers`), ``seq_len`` = number of patches (12), ``cert_dtype = "bf16"``.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple, cast

import torch
from torch import nn

from certblocks._validation import check_int, check_prob
from certblocks.blocks.patchtst import PatchTSTBlock

from ._base import ZooModel
from ._layers import Patcher, RevIN, SeriesForecasterMixin
from ._registry import register_model

__all__ = ["PatchTSTForecaster"]


class PatchTSTForecaster(SeriesForecasterMixin, ZooModel):
    """Channel-independent PatchTST forecaster ``(batch, seq_len, n_vars) -> (batch, pred_len, n_vars)``.

    Args:
        n_vars: number of series per sample.
        seq_len: input length.
        pred_len: forecast horizon.
        patch_len, stride: patching.
        d_model, n_heads, d_ff, e_layers: encoder size.
        dropout: encoder dropout (residual, feed-forward and embedding).
        head_dropout: dropout before the head.
        norm: ``None``, ``"layer"``, ``"rms"`` or ``"batch"`` (see :class:`PatchTSTBlock`).
        placement: ``"pre"``, ``"post"`` or ``"peri"``.
        qk_norm: QK-normalized attention.
        revin: use RevIN (with a learnable affine map).
        certify: refuse a configuration not certified in ``cert_dtype``.
        cert_dtype: certification dtype (default ``"bf16"``).
        device, dtype: as for torch layers.
    """

    def __init__(self, n_vars: int = 7, seq_len: int = 96, pred_len: int = 96, *, patch_len: int = 16,
                 stride: int = 8, d_model: int = 128, n_heads: int = 16, d_ff: int = 256, e_layers: int = 3,
                 dropout: float = 0.2, head_dropout: float = 0.0, norm: Optional[str] = None,
                 placement: str = "pre", qk_norm: bool = False, revin: bool = True, certify: bool = True,
                 cert_dtype: Any = None, device=None, dtype=None) -> None:
        super().__init__()
        self.n_vars = check_int("n_vars", n_vars)
        self.seq_len = check_int("seq_len", seq_len)
        self.pred_len = check_int("pred_len", pred_len)
        self.e_layers = check_int("e_layers", e_layers)
        dropout = check_prob("dropout", dropout)
        dd = {"device": device, "dtype": dtype}
        self.revin = RevIN(n_vars, affine=True, **dd) if revin else None
        self.patch = Patcher(seq_len, patch_len, stride, d_model, pad_end=True, dropout=dropout, **dd)
        self.layers = nn.ModuleList([
            PatchTSTBlock(d_model, n_heads, d_ff, norm=norm, placement=placement, qk_norm=qk_norm, dropout=dropout,
                          **dd) for _ in range(e_layers)])
        self.head_dropout = nn.Dropout(check_prob("head_dropout", head_dropout))
        self.head = nn.Linear(self.patch.num_patches * d_model, pred_len, **dd)
        self._certify_or_refuse(certify, cert_dtype)

    def residual_updates(self) -> List[Tuple[str, nn.Module]]:
        out: List[Tuple[str, nn.Module]] = []
        for i, layer in enumerate(cast(Iterable[PatchTSTBlock], self.layers)):
            v_attn, v_ffn = layer.updates()
            out += [(f"layers.{i}.self_attn", v_attn), (f"layers.{i}.ff", v_ffn)]
        return out

    def input_radius(self) -> float:
        """Bound on every embedded patch's norm (RevIN-normalized input; see :mod:`certblocks.zoo._layers`)."""
        if self.revin is None:
            raise ValueError("without RevIN the input radius depends on the data: pass r0= to certificate()")
        return self.patch.radius(*self.revin.affine_bounds())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (B, seq_len, n_vars) -> forecast (B, pred_len, n_vars)``."""
        self._check_series(x)
        B = x.shape[0]
        if self.revin is not None:
            x, mean, std = self.revin.normalize(x)
        z = self.patch(x.transpose(1, 2).reshape(B * self.n_vars, self.seq_len))  # (B*C, N, d)
        for layer in self.layers:
            z = layer(z)
        y = self.head(self.head_dropout(z.flatten(1)))  # (B*C, pred_len)
        y = y.reshape(B, self.n_vars, self.pred_len).transpose(1, 2)  # (B, pred_len, C)
        if self.revin is not None:
            y = self.revin.denormalize(y, mean, std)
        return y


_SIZES: Dict[str, Dict[str, Any]] = {
    "full": dict(seq_len=96, pred_len=96, patch_len=16, stride=8, d_model=128, n_heads=16, d_ff=256, e_layers=3,
                 dropout=0.2),
    "test": dict(seq_len=32, pred_len=8, patch_len=8, stride=4, d_model=16, n_heads=2, d_ff=32, e_layers=2,
                 dropout=0.2, n_vars=2),
}


def _patchtst(size: str, norm: Optional[str], placement: str, **overrides: Any) -> PatchTSTForecaster:
    cfg = dict(_SIZES[size], norm=norm, placement=placement)
    cfg.update(overrides)
    return PatchTSTForecaster(**cfg)


_VARIANTS = {"noln": (None, "pre", "no normalization: attention (1, 2), feed-forward (1, 0)"),
             "rms": ("rms", "pre", "pre-RMSNorm: (0, 0)"),
             "preln": ("layer", "pre", "pre-LayerNorm: (0, 0)"),
             "periln": ("layer", "peri", "Peri-LN: (0, 0)")}


def _register(variant: str, size: str) -> None:
    norm, placement, what = _VARIANTS[variant]
    suffix = "_test" if size == "test" else ""

    def fn(**overrides: Any) -> PatchTSTForecaster:
        return _patchtst(size, norm, placement, **overrides)

    fn.__name__ = f"patchtst_{variant}{suffix}"
    fn.__doc__ = (f"PatchTST forecaster, {what}" + (" (test size)." if size == "test" else
                  "; input 96, patch 16/8, width 128, 16 heads, d_ff 256, 3 layers."))
    register_model(fn, family="patchtst", test=size == "test", baseline=variant != "noln")
    globals()[fn.__name__] = fn


for _v in _VARIANTS:
    for _s in ("full", "test"):
        _register(_v, _s)
