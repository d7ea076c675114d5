"""Small models shared by the trajectory tests."""

from __future__ import annotations

from typing import List

import torch
from torch import nn

import certblocks
from certblocks.blocks import MLP, Attention, GatedMLP, QKNormAttention
from certblocks.certificate import BlockCertificate


def stack(seed: int = 0, dim: int = 8, dt: float = 1.0) -> certblocks.stack.CertifiedStack:
    """Attention, MLP, QK-norm attention and a gated MLP: a CertifiedStack of four kinds of update."""
    torch.manual_seed(seed)
    blocks = [Attention(dim, 2), MLP(dim, 2 * dim), QKNormAttention(dim, 2, qk_norm="layer"), GatedMLP(dim, 2 * dim)]
    return certblocks.build_stack(blocks, "fp32", dt=dt, certify=False)


class PlainResidual(nn.Module):
    """A residual net of plain torch layers (no certified block): updates found in its graph, a linear head."""

    def __init__(self, dim: int = 6, depth: int = 3, out: int = 5) -> None:
        super().__init__()
        self.mlps = nn.ModuleList([nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.Tanh(),
                                                 nn.Linear(2 * dim, dim)) for _ in range(depth)])
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, dim)
        for m in self.mlps:
            x = x + m(x)
        return self.head(x)


class Scale(nn.Module):
    """The velocity ``(g - 1) x``: the state is multiplied by ``g`` at each update (a planted blow-up)."""

    def __init__(self, g: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(g - 1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w.to(x.dtype) * x


def scale_stack(g: float, depth: int) -> certblocks.stack.CertifiedStack:
    c = g - 1.0
    pairs: List = [(Scale(g), BlockCertificate(1.0, 0.0, c=c, b=0.0, l1=0.0, l0=c)) for _ in range(depth)]
    return certblocks.build_stack(pairs, "fp32", certify=False)


def exact_norms(f, x: torch.Tensor) -> torch.Tensor:
    """Per-sample spectral norm of the whole-sample Jacobian of ``f`` (``torch.autograd.functional.jacobian``)."""
    out = []
    for s in range(x.shape[0]):
        J = torch.autograd.functional.jacobian(lambda a: f(a[None])[0], x[s].detach())
        n_out = J.shape[: J.ndim - (x.ndim - 1)].numel()
        out.append(torch.linalg.matrix_norm(J.reshape(n_out, -1).double(), ord=2))
    return torch.stack(out)


def overflowing() -> tuple:
    """A factory for ``certblocks trajectory module:_traj_models:overflowing``: the state doubles 20 times."""
    return scale_stack(2.0, 20), torch.ones(1, 2, 4)
