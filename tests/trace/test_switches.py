"""Input-dependent switches (``where``, ``masked_fill``): q kept from the sum rule, sigma not derived."""

from __future__ import annotations

import torch
from torch import nn

from certblocks.trace import certify

D = 8


class Where(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return torch.where(x > 0, self.a(x), torch.tanh(self.b(x)))


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x):
        return self.a(x).masked_fill(x < 0, 3.0)


def test_switches_keep_q_and_name_the_switch():
    import certblocks.testing as cbt

    for m in (Where(), Masked()):
        torch.manual_seed(0)
        m = m.eval()
        c = certify(m, torch.randn(2, 4, D))
        assert c.q == 1 and c.sigma is None, c.explain()
        assert "discontinuous" in c.culprit
        # growth and peak hold for every input, whatever the switch picks
        cert = c.certificate
        kw = dict(radii=(0.03, 3.0, 300.0), count=16, restarts=4, steps=6)
        assert cbt.search_growth(m, cert, (4, D), **kw).ok
        assert cbt.search_peak(m, cert, (4, D), **kw).ok
