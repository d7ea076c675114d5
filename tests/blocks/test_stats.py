"""certblocks.blocks.stats.max_logit: the largest |s q_i . k_j| over the pairs a query sees, against a plain loop."""

import itertools
import math

import pytest
import torch

from certblocks.blocks.stats import max_logit


def _loop(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> float:
    q, k = q.double(), k.double()
    T, S = q.shape[-2], k.shape[-2]
    best = 0.0
    for b, h in itertools.product(range(q.shape[0]), range(q.shape[1])):
        for i, j in itertools.product(range(T), range(S)):
            if causal and j > i + S - T:  # a query sees the keys up to its own position (the last T of S)
                continue
            best = max(best, abs(float(q[b, h, i] @ k[b, h, j])) * scale)
    return best


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,S", [(5, 5), (3, 7), (1, 4)])
def test_max_logit_is_the_largest_seen_pair(causal, T, S):
    gen = torch.Generator().manual_seed(T * 10 + S)
    q = torch.randn(2, 3, T, 4, generator=gen)
    k = torch.randn(2, 3, S, 4, generator=gen)
    q[0, 1, 0] *= 10.0 / q[0, 1, 0].norm()  # the longest query (the others' norms are about 2)
    k[0, 1, -1] = 5.0 * q[0, 1, 0]  # the largest product by far: query 0 with the last key
    planted = 50.0 * float(q[0, 1, 0].norm()) * 0.37
    got = max_logit(q, k, 0.37, causal)
    assert got == pytest.approx(_loop(q, k, 0.37, causal), rel=1e-12)
    if causal and T > 1:  # query 0 does not see the last key: the planted pair is left out
        assert got < 0.5 * planted
    else:
        assert got == pytest.approx(planted, rel=1e-6)

def test_max_logit_edge_cases():
    q, k = torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2)
    assert max_logit(q[..., :0, :], k, 1.0, True) == 0.0  # no query
    q[0, 0, 1, 0] = math.nan
    assert max_logit(q, k, 1.0, True) == math.inf  # NaN counts as inf
    q[0, 0, 1, 0] = -math.inf
    assert max_logit(q, k, 1.0, False) == math.inf
    q16 = torch.full((1, 1, 2, 2), 60000.0, dtype=torch.float16)
    assert max_logit(q16, q16, 1.0, False) == pytest.approx(2 * 60000.0**2)  # in float64: no fp16 overflow
