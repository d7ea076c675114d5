"""A Fourier neural operator layer (neuraloperator-style spectral convolution) traced end to end.

The spectral convolution keeps the first ``modes`` Fourier coefficients, mixes channels with complex weights
and writes the result into a zero spectrum by slice assignment, which ``torch.export`` turns into
``copy`` + ``slice_scatter``; ``irfft`` returns to the grid.  docs/theory.md section 2.6: FNO layer GELU o (K + W) is
(1, 0), and (0, 0) with a LayerNorm on its input.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from certblocks.exponents import Exponents
from certblocks.trace import certify

C, N, MODES = 4, 4, 2


class SpectralConv1d(nn.Module):
    """``irfft(W * rfft(x)[..., :modes])`` over the last (grid) dimension; channels second."""

    def __init__(self, channels: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        # real and imaginary parts as real parameters (a float64 copy of the module keeps both)
        self.w_re = nn.Parameter(torch.randn(channels, channels, modes) / channels)
        self.w_im = nn.Parameter(torch.randn(channels, channels, modes) / channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, N)
        x_ft = torch.fft.rfft(x, norm="ortho")
        out_ft = torch.zeros(x.shape[0], x.shape[1], x.shape[-1] // 2 + 1, dtype=x_ft.dtype, device=x.device)
        weight = torch.complex(self.w_re, self.w_im)
        out_ft[:, :, :self.modes] = torch.einsum("bix,iox->box", x_ft[:, :, :self.modes], weight)
        return torch.fft.irfft(out_ft, n=x.shape[-1], norm="ortho")


class FNOBlock(nn.Module):
    """``GELU(K h + W h)`` with ``h = LN(x)`` or ``h = x``; tokens are grid points, features channels."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(C) if norm else nn.Identity()
        self.spectral = SpectralConv1d(C, MODES)
        self.pointwise = nn.Linear(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, C)
        h = self.norm(x)
        return F.gelu(self.spectral(h.transpose(1, 2)).transpose(1, 2) + self.pointwise(h))


class Residual(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.block = FNOBlock(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


@pytest.mark.parametrize("norm, expected", [(True, (0, 0)), (False, (1, 0))])
def test_fno_block(norm, expected, soundness):
    torch.manual_seed(0)
    m = Residual(norm).eval()
    shape = (1, N, C)
    mc = certify(m, torch.randn(*shape))
    assert len(mc.updates) == 1
    c = mc.updates[0]
    assert c.exponents == Exponents(*expected), c.explain()
    assert c.coefficients_derived
    rules = {r.op: r.rule for r in c.nodes}
    assert rules["aten.slice_scatter"].startswith("write into a slice")
    assert rules["aten.copy"] == "structural (preserves)"
    assert c.nodes[[r.op for r in c.nodes].index("aten.copy")].q == expected[0]  # copy returns its source
    soundness(m.block, c.certificate, shape, f"FNO block (norm={norm})")
