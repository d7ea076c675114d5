"""torch.compile(fullgraph=True) of LinearGrowthMamba on CPU (fullgraph=True fails on any graph break)."""

from __future__ import annotations

import pytest
import torch

from certblocks.blocks.mamba import LinearGrowthMamba


def _block():
    torch.manual_seed(0)
    return LinearGrowthMamba(16, d_state=8, bias=True)


def test_compile_fullgraph_forward_backward_aot():
    blk = _block()
    x = torch.randn(2, 12, 16, requires_grad=True)
    compiled = torch.compile(blk, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    (gx,) = torch.autograd.grad(y.square().sum(), x)
    x2 = x.detach().clone().requires_grad_(True)
    y2 = blk(x2)
    (gx2,) = torch.autograd.grad(y2.square().sum(), x2)
    torch.testing.assert_close(y, y2, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx, gx2, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_compile_fullgraph_inductor_inference():
    blk = _block()
    x = torch.randn(2, 12, 16)
    compiled = torch.compile(blk, fullgraph=True)  # default backend: inductor (C++ on CPU)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), blk(x), rtol=1e-4, atol=1e-5)
