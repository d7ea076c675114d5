"""QK-norm: per-head normalization of queries and keys, and its fused split-and-normalize for the eager path.

* :class:`QKNorm` -- ``"rms"`` (``g * x / sqrt(mean(x^2) + eps)``), ``"l2"`` (``g * x / sqrt(||x||^2 + eps)``) or
  ``"layer"`` (LayerNorm with weight and bias) over the head dimension; its output and Jacobian bounds come from
  :mod:`certblocks.bounds.normalization`.
* :class:`SplitQKVRMSNorm` -- an ``autograd.Function`` that splits a fused ``qkv`` projection into heads and
  RMS-normalizes queries and keys in one pass, with a hand-written backward (the attention blocks use it in eager
  mode; their ``forward_reference`` is the plain twin).
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import bounds
from .._validation import check_choice, check_int, check_real

__all__ = ["QKNorm", "QK_NORMS", "SplitQKVRMSNorm"]

#: The QK-normalizations.
QK_NORMS = ("rms", "l2", "layer")


class SplitQKVRMSNorm(torch.autograd.Function):
    """Split a fused projection into heads and RMS-normalize queries and keys, with a hand-written backward.

    Input ``qkv`` is ``(B, T, 3 C)``; outputs ``q, k, v`` are contiguous ``(B, nh, T, hs)`` with
    ``q = x_q * rsqrt(mean(x_q^2) + eps) * w_q`` (likewise ``k``).  Compared with the autograd composition
    (split, permute, norm, mul) it makes fewer passes over memory, writes the gradient of the projection
    directly in its own layout (no zero fill, stack or copy) and reads everything contiguously.  Its plain
    twin is :class:`QKNorm` (used by ``forward_reference``; the tests check both agree, gradients too).
    """

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float,
                num_heads: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, C3 = qkv.shape
        hd = C3 // (3 * num_heads)
        x = qkv.view(B, T, 3, num_heads, hd).permute(2, 0, 3, 1, 4)  # (3, B, nh, T, hs) view
        # the sum of squares in float32 at least: squared in fp16 it overflows once a head's norm passes 256
        ms = torch.linalg.vector_norm(x[:2], dim=-1, keepdim=True, dtype=torch.promote_types(qkv.dtype, torch.float32))
        r = torch.rsqrt(ms.square_().mul_(1.0 / hd).add_(eps)).to(qkv.dtype)  # (2, B, nh, T, 1)
        xhat = torch.empty((2, B, num_heads, T, hd), dtype=qkv.dtype, device=qkv.device)
        torch.mul(x[:2], r, out=xhat)
        w = torch.stack([wq, wk])[:, None, None, None, :]  # (2, 1, 1, 1, hs)
        qk = xhat * w
        v = x[2].contiguous()
        ctx.save_for_backward(xhat, r, w)
        ctx.needs_w = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        return qk[0], qk[1], v

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
        xhat, r, w = ctx.saved_tensors
        _, B, nh, T, hd = xhat.shape
        dqkv = torch.empty((B, T, 3 * nh * hd), dtype=xhat.dtype, device=xhat.device)
        dview = dqkv.view(B, T, 3, nh, hd).permute(2, 0, 3, 1, 4)
        if dv is None:
            dview[2].zero_()
        else:
            dview[2].copy_(dv)
        dws = []
        for c, dy in enumerate((dq, dk)):  # per half: no stacking copy of the incoming gradients
            if dy is None:
                dview[c].zero_()
                dws.append(None)
                continue
            xh, wc = xhat[c], w[c]
            g = dy * wc
            if g.dtype != xh.dtype:  # autocast: low-precision activations, float32 scales and gradients
                xh = xh.to(g.dtype)
            m = torch.linalg.vecdot(xh, g, dim=-1).unsqueeze_(-1).mul_(1.0 / hd)
            g = torch.addcmul(g, xh, m, value=-1.0)  # g - xhat mean(xhat g)
            if g.dtype == dview.dtype:
                torch.mul(g, r[c], out=dview[c])
            else:
                dview[c].copy_(g * r[c])
            dws.append((dy * xh).sum(dim=(0, 1, 2)) if ctx.needs_w else None)
        dwq, dwk = dws
        return dqkv, dwq, dwk, None, None


class QKNorm(nn.Module):
    """Per-head normalization of queries or keys over the head dimension.

    Args:
        dim: head dimension ``d_k``.
        kind: ``"rms"`` (``g * x / sqrt(mean(x^2) + eps)``), ``"l2"`` (``g * x / sqrt(||x||^2 + eps)``)
            or ``"layer"`` (LayerNorm with weight and bias).
        eps: the ``eps`` above (``> 0``: it bounds the normalization's Jacobian by ``||g||_inf / sqrt(eps)``).
    """

    def __init__(self, dim: int, kind: str = "rms", *, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.dim = check_int("dim", dim)
        self.kind = check_choice("qk_norm", kind, QK_NORMS)
        self.eps = check_real("eps", eps, gt=0.0, note="it bounds the Jacobian of the normalization")
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        if kind == "layer":
            self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # under autocast x is low precision and the scale float32: cast the scale, so that rms_norm runs fused (it
        # accumulates in float32 either way) instead of warning and falling back to the composite
        w = self.weight.to(x.dtype)  # the tensor itself when the dtypes agree (no branch: torch.fx traces it)
        if self.kind == "rms":
            return F.rms_norm(x, (self.dim,), w, self.eps)
        if self.kind == "l2":
            return F.rms_norm(x, (self.dim,), w, self.eps / self.dim) * (self.dim ** -0.5)
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)

    def output_bound(self) -> float:
        """``A``: an upper bound of the Euclidean norm of the output, whatever the input."""
        return bounds.norm_bounds(self.kind, self.weight, self.bias, self.eps, numel=self.dim)[0]

    def jacobian_bound(self) -> float:
        """``G``: an upper bound of the spectral norm of the Jacobian, at every input."""
        return bounds.norm_bounds(self.kind, self.weight, self.bias, self.eps, numel=self.dim)[1]

    def extra_repr(self) -> str:
        return f"{self.dim}, kind={self.kind!r}, eps={self.eps:g}"
