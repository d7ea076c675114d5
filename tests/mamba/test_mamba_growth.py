"""Growth along rays and fp16 overflow: the free Mamba (q = 5) against LinearGrowthMamba (q = 1)."""

from __future__ import annotations

import math

import pytest
import torch

from certblocks.blocks.mamba import LinearGrowthMamba, Mamba
from certblocks.certificate import certify_stack

D_MODEL, L = 16, 12


def tok_norm(x: torch.Tensor) -> torch.Tensor:
    return x.norm(dim=-1).amax(dim=-1)


def _slopes(blk, scales):
    """Slopes of log ||v(s x)|| against log s between consecutive scales, for 4 random rays."""
    torch.manual_seed(1)
    x = torch.randn(4, L, D_MODEL)
    x = x / tok_norm(x)[:, None, None]
    with torch.no_grad():
        logs = [torch.log(tok_norm(blk(s * x)).double()) for s in scales]
    return torch.stack([(logs[i + 1] - logs[i]) / math.log(scales[i + 1] / scales[i])
                        for i in range(len(scales) - 1)])


def test_free_mamba_grows_superlinearly_along_rays():
    torch.manual_seed(0)
    slopes = _slopes(Mamba(D_MODEL, d_state=8), [100.0, 300.0, 1000.0, 3000.0])
    assert torch.isfinite(slopes).all()
    assert float(slopes.min()) > 1.5  # degree-5 growth: the measured slope approaches 5
    assert float(slopes[-1].max()) > 4.0


def test_linear_growth_mamba_slope_at_most_linear():
    torch.manual_seed(0)
    blk = LinearGrowthMamba(D_MODEL, d_state=8)
    slopes = _slopes(blk, [300.0, 1000.0, 1e4, 1e5])
    assert torch.isfinite(slopes).all()
    assert float(slopes.max()) <= 1.05, slopes
    # and linear growth is attained (not bounded): the slope is close to 1 at large scale
    assert float(slopes[-1].min()) >= 0.95


def _stack(cls, depth=8, dtype=torch.float16):
    torch.manual_seed(0)
    return [cls(D_MODEL, d_state=8).to(dtype) for _ in range(depth)]


def _run(blocks, x):
    norms = [float(tok_norm(x).max())]
    with torch.no_grad():
        for b in blocks:
            x = x + b(x)
            norms.append(float(tok_norm(x.float()).max()))
    return x, norms


@pytest.mark.parametrize("scale", [30.0, 100.0])
def test_fp16_depth8_stack_free_overflows_linear_growth_stays_finite(scale):
    torch.manual_seed(2)
    x = (scale * torch.randn(2, L, D_MODEL)).half()
    y_free, _ = _run(_stack(Mamba), x)
    assert not torch.isfinite(y_free).all()  # overflow (inf, or nan from inf - inf)
    y_lg, norms = _run(_stack(LinearGrowthMamba), x)
    assert torch.isfinite(y_lg).all()
    assert norms[-1] < 20 * norms[0]  # at most linear growth per layer


def test_linear_growth_stack_stays_below_its_certified_radii():
    blocks = _stack(LinearGrowthMamba, depth=8, dtype=torch.float32)
    x = 30.0 * torch.randn(2, L, D_MODEL)
    _, norms = _run(blocks, x)
    sc = certify_stack([b.certificate(seq_len=L) for b in blocks], "fp32", r0=norms[0])
    assert sc.forward_depth == len(blocks)  # the forward bound certifies all 8 updates in fp32
    for k, (n, r) in enumerate(zip(norms, sc.radii)):
        assert n <= r * (1 + 1e-5), (k, n, r)
