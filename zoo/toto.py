"""``toto_style``: a Toto-2.0-style decoder for multivariate series, certified at the 4m scale.

Input ``(batch, n_vars, time)``; each variate is standardized over its context (mean and standard
deviation, undone on the output), cut into non-overlapping patches of 32 steps and embedded
linearly.  The state is ``(batch, n_vars, num_patches, d_model)``; ``n_layer`` layers of two
residual updates each (D = 2 n_layer)::

    x = x + attn(x)    # causal attention over time patches, per variate; every 4th layer
                       # (layers 3, 7, ...) bidirectional attention over variates, per time patch
    x = x + mlp(x)     # GatedMLP(gate="sigmoid"), hidden 688: (1, 1)

No RMSNorm in the updates (Toto 2.0 has one on each branch input).  Attention is QK-normalized
(``qk_norm=True``, default: (1, 1)) or plain (``qk_norm=False``: (1, 2)).  The head maps each
patch's state to the next patch (point forecast; Toto's mixture head is not reproduced), after a
final RMSNorm (part of the head).  Rotary embeddings are omitted.

4m scale: d_model 256, 4 heads, MLP 688, patch 32, 4 layers (about 3.3M parameters in the layers).

Certificate defaults: ``r0 = ||W_embed|| sqrt(context) + ||b_embed||`` (a standardized series has
``sum_t s_t^2 <= context``), ``seq_len`` = number of patches, ``cert_dtype = "bf16"``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, cast

import torch
from torch import nn

from certblocks._validation import check_bool, check_cert_args, check_int
from certblocks.blocks.attention import Attention, QKNormAttention
from certblocks.blocks.mlp import GatedMLP
from certblocks.bounds import op_norm, vec_norm
from certblocks.certificate import BlockCertificate
from certblocks.protocol import CapSlot

from ._base import ZooModel
from ._registry import register_model

__all__ = ["TotoStyle", "AxisAttention"]


class AxisAttention(nn.Module):
    """Self-attention of a ``(B, V, N, d)`` state along time (``axis="time"``, causal) or variates (``"variate"``).

    The certificate is the attention's: its bounds hold per token whatever the number of tokens.
    """

    def __init__(self, d_model: int, n_heads: int, axis: str, qk_norm: bool, dropout: float = 0.0,
                 device=None, dtype=None) -> None:
        super().__init__()
        if axis not in ("time", "variate"):
            raise ValueError(f"axis must be 'time' or 'variate', got {axis!r}")
        self.axis = axis
        cls = QKNormAttention if qk_norm else Attention
        self.attn = cls(d_model, n_heads, causal=axis == "time", attn_dropout=dropout, resid_dropout=dropout,
                        device=device, dtype=dtype)
        self.exponents = cls.exponents

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, V, N, d)
        B, V, N, d = x.shape
        if self.axis == "time":
            return self.attn(x.reshape(B * V, N, d)).reshape(B, V, N, d)
        y = self.attn(x.transpose(1, 2).reshape(B * N, V, d))  # (B*N, V, d)
        return y.reshape(B, N, V, d).transpose(1, 2)

    def certificate(self, *, seq_len: Optional[int] = None, r0: Optional[float] = None) -> BlockCertificate:
        """The attention's certificate (its bounds hold per token whatever the number of tokens along the axis)."""
        check_cert_args(seq_len, r0)
        return dataclasses.replace(self.attn.certificate(), name=f"{self.axis}-attention")

    def cap_slots(self) -> List[CapSlot]:
        """The attention's slots (:meth:`certblocks.QKNormAttention.cap_slots`)."""
        return self.attn.cap_slots()

    def certificate_from_caps(self, caps: Mapping[str, float], *, seq_len: Optional[int] = None) -> BlockCertificate:
        """The attention's certificate from caps."""
        return dataclasses.replace(self.attn.certificate_from_caps(caps), name=f"{self.axis}-attention")


class TotoStyleLayer(nn.Module):
    def __init__(self, d_model: int, n_heads: int, mlp_hidden: int, axis: str, qk_norm: bool, dropout: float,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.attention = AxisAttention(d_model, n_heads, axis, qk_norm, dropout, device=device, dtype=dtype)
        self.mlp = GatedMLP(d_model, mlp_hidden, gate="sigmoid", device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        return x + self.mlp(x)


class TotoStyle(ZooModel):
    """Toto-2.0-style decoder ``(batch, n_vars, context) -> next-patch forecasts (batch, n_vars, context)``.

    Output position ``t`` of patch ``k`` is the forecast of step ``t + patch`` (the next patch), from
    patches ``<= k`` of every variate.

    Args:
        context: input length (a multiple of ``patch``).
        patch: patch length.
        d_model, n_heads, mlp_hidden, n_layer: sizes.
        variate_every: every ``variate_every``-th layer attends over variates.
        qk_norm: QK-normalized attention.
        dropout: attention dropout.
        certify: refuse a configuration not certified in ``cert_dtype``.
        cert_dtype: certification dtype (default ``"bf16"``).
        device, dtype: as for torch layers.
    """

    def __init__(self, context: int = 512, patch: int = 32, d_model: int = 256, n_heads: int = 4,
                 mlp_hidden: int = 688, n_layer: int = 4, *, variate_every: int = 4, qk_norm: bool = True,
                 dropout: float = 0.0, certify: bool = True, cert_dtype: Any = None, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.context = check_int("context", context)
        self.patch_len = check_int("patch", patch)
        if context % patch:
            raise ValueError(f"context={context} must be a multiple of patch={patch}")
        self.n_layer = check_int("n_layer", n_layer)
        self.variate_every = check_int("variate_every", variate_every)
        check_bool("qk_norm", qk_norm)
        dd = {"device": device, "dtype": dtype}
        self.embed = nn.Linear(patch, d_model, **dd)
        self.layers = nn.ModuleList([
            TotoStyleLayer(d_model, n_heads, mlp_hidden,
                           "variate" if (i + 1) % variate_every == 0 else "time", qk_norm, dropout, **dd)
            for i in range(n_layer)])
        self.norm_f = nn.RMSNorm(d_model, eps=1e-6, **dd)
        self.head = nn.Linear(d_model, patch, **dd)
        self._certify_or_refuse(certify, cert_dtype)

    def residual_updates(self) -> List[Tuple[str, nn.Module]]:
        out: List[Tuple[str, nn.Module]] = []
        for i, layer in enumerate(cast(Iterable[TotoStyleLayer], self.layers)):
            out += [(f"layers.{i}.attention", layer.attention), (f"layers.{i}.mlp", layer.mlp)]
        return out

    def input_radius(self) -> float:
        return op_norm(self.embed.weight) * math.sqrt(self.context) + vec_norm(self.embed.bias)

    def example_input(self, seq_len: Optional[int] = None) -> torch.Tensor:
        """A random context ``(1, 3, context)`` (three variates); ``seq_len`` is ignored (fixed context)."""
        return torch.randn(1, 3, self.context, generator=torch.Generator().manual_seed(0))

    def certificate_seq_len(self) -> int:
        return self.context // self.patch_len

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (B, V, context) -> (B, V, context)`` next-patch forecasts (in the input's scale)."""
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != self.context:
            raise ValueError(f"x must have shape (batch, n_vars, {self.context}), got {tuple(getattr(x, 'shape', ()))}")
        B, V, L = x.shape
        mean = x.mean(-1, keepdim=True).detach()
        std = torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5).detach()
        z = self.embed(((x - mean) / std).reshape(B, V, L // self.patch_len, self.patch_len))  # (B, V, N, d)
        for layer in self.layers:
            z = layer(z)
        y = self.head(self.norm_f(z)).reshape(B, V, L)
        return y * std + mean


_SIZES: Dict[str, Dict[str, Any]] = {
    "4m": dict(context=512, patch=32, d_model=256, n_heads=4, mlp_hidden=688, n_layer=4),
    "test": dict(context=32, patch=8, d_model=16, n_heads=2, mlp_hidden=24, n_layer=4),
}


@register_model(family="toto_style")
def toto_style(**overrides: Any) -> TotoStyle:
    """Toto-2.0-style decoder, 4m scale: d 256, 4 heads, GatedMLP(sigmoid) 688, patch 32, QK-norm, 4 layers."""
    return TotoStyle(**{**_SIZES["4m"], **overrides})


@register_model(family="toto_style", test=True)
def toto_style_test(**overrides: Any) -> TotoStyle:
    """Toto-2.0-style decoder, test size (width 16, 2 heads, 4 layers, patch 8, context 32)."""
    return TotoStyle(**{**_SIZES["test"], **overrides})
