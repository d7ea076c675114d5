"""The demo's velocity: ``v(x) = W x`` with a chosen operator norm, certified from ``||W||_op``."""

from __future__ import annotations

import torch
from torch import nn

from certblocks.certificate import BlockCertificate

__all__ = ["ScaledLinear"]


class ScaledLinear(nn.Module):
    """A linear velocity ``v(x) = W x`` whose certificate is read off ``||W||_op``.

    Args:
        dim: the state's width.
        norm: the operator norm ``||W||_op`` of the random weight.
        generator: the random source of the weight.
    """

    def __init__(self, dim: int, norm: float, generator: torch.Generator) -> None:
        super().__init__()
        w = torch.randn(dim, dim, generator=generator)
        self.weight = nn.Parameter(w * (norm / torch.linalg.matrix_norm(w, ord=2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T  # (..., dim)

    def certificate(self, *, seq_len: int | None = None, r0: float | None = None) -> BlockCertificate:
        """``||W x|| <= ||W||_op ||x||``: exponents (1, 0), ``c = l0 = ||W||_op``."""
        op = float(torch.linalg.matrix_norm(self.weight.detach().double(), ord=2))
        return BlockCertificate(1, 0, c=op, l1=0.0, l0=op)
