"""A map whose output batch differs from its input's (a channel-independent forecaster's head: the channels of a
series are folded into the batch in the body and gathered by the head) is one Jacobian block, not one per input
sample: the dense bound is the whole Jacobian's and the Lanczos estimate does not mix up samples."""

from __future__ import annotations

import torch
from torch import nn

from certblocks.ondata.power import LinearizedMap, dense_jacobian_norm, jacobian_spectral_norm


class _GatherHead(nn.Module):
    """``(B * C, T, d) -> (B, out)``: each series' C channels are read together."""

    def __init__(self, channels: int, t: int, d: int, out: int = 3) -> None:
        super().__init__()
        self.channels = channels
        torch.manual_seed(0)
        self.fc = nn.Linear(channels * t * d, out, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(x).reshape(x.shape[0] // self.channels, -1))


def _exact_norm(f: nn.Module, x: torch.Tensor) -> float:
    J = torch.autograd.functional.jacobian(f, x)  # (B, out, B * C, T, d)
    return float(torch.linalg.matrix_norm(J.reshape(f(x).numel(), x.numel()), ord=2))


def test_a_head_that_gathers_folded_channels_is_one_block():
    f = _GatherHead(channels=2, t=3, d=4)
    x = torch.randn(2, 3, 4, dtype=torch.float64)  # one series of two channels: output batch 1
    exact = _exact_norm(f, x)
    dense = dense_jacobian_norm(f, x)
    assert dense.shape == (1,) and float(dense[0]) >= exact * (1 - 1e-12)
    est = jacobian_spectral_norm(LinearizedMap(f, x), steps=24, tol=1e-10)
    assert est.values.shape == (1,) and float(est.values[0]) <= exact * (1 + 1e-9)
    assert float(est.values[0]) >= exact * (1 - 1e-6)  # the estimate reaches the whole block's norm
    # with two series (output batch 2 from input batch 4) the block is still the whole batch, bounded from above
    x2 = torch.randn(4, 3, 4, dtype=torch.float64)
    assert float(dense_jacobian_norm(f, x2)[0]) >= _exact_norm(f, x2) * (1 - 1e-12)


def test_a_map_that_keeps_the_batch_stays_per_sample():
    f = nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), nn.Tanh())
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    assert dense_jacobian_norm(f, x).shape == (3,)
    assert jacobian_spectral_norm(LinearizedMap(f, x), steps=8).values.shape == (3,)
