"""Soundness search shared by the tracer tests.

``soundness(module, cert, shape, name)`` searches random and gradient-ascent inputs of the given
shape for a counterexample to ``||v(x)|| <= c ||x||^q + b`` and to the Jacobian bound
``||J(x) u|| <= l1 max(R, 1)^sigma + l0`` (``||x|| <= R``, ``||u|| = 1``), in the per-token norm,
and fails if it finds one.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch


def _token_norm(t: torch.Tensor) -> torch.Tensor:
    """Per-sample per-token norm: max over tokens of the feature norm -> (batch,)."""
    return t.flatten(1, -2).norm(dim=-1).amax(-1)


def _growth_excess(m, cert, x):
    r = _token_norm(x)
    v = _token_norm(m(x))
    bound = cert.c * r ** (cert.q or 0.0) + cert.b
    return v - bound, bound


def _search_growth(m, cert, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    worst = -math.inf
    for scale in (1e-2, 1.0, 100.0):
        x = torch.randn(16, *shape[1:], generator=g) * scale
        ex, bound = _growth_excess(m, cert, x)
        worst = max(worst, float((ex / bound).max().detach()))
        # gradient ascent on ||v(x)|| / bound at fixed radius
        x = x.clone().requires_grad_(True)
        opt = torch.optim.Adam([x], lr=0.05 * scale)
        for _ in range(8):
            ex, bound = _growth_excess(m, cert, x)
            loss = -(ex / bound).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            ex, bound = _growth_excess(m, cert, x)
            worst = max(worst, float((ex / bound).max()))
    return worst


def _jacobian_lower(m, x, u, h=1e-5):
    """||J(x) u|| by central differences in float64 (error O(h^2); SDPA has no forward AD on CPU)."""
    jv = (m(x + h * u) - m(x - h * u)) / (2 * h)
    return _token_norm(jv)


def _search_jacobian(m, cert, shape, seed=0):
    """max over x in the ball of radius R and directions u (per-token norm 1) of ||J u|| / bound."""
    g = torch.Generator().manual_seed(seed)
    worst = -math.inf
    for R in (0.5, 5.0, 30.0):
        bound = cert.jacobian_bound(R)
        for _ in range(1):
            x = torch.randn(1, *shape[1:], generator=g, dtype=torch.float64)
            x = x / _token_norm(x)[:, None, None] * R * float(torch.rand(1, generator=g))
            u = torch.randn(1, *shape[1:], generator=g, dtype=torch.float64)
            x.requires_grad_(True)
            u.requires_grad_(True)
            opt = torch.optim.Adam([x, u], lr=0.05 * max(R, 1.0))
            for _ in range(5):
                un = u / u.flatten(1, -2).norm(dim=-1).amax(-1)[:, None, None]
                val = _jacobian_lower(m, x, un)
                worst = max(worst, float(val.max().detach()) / bound)
                opt.zero_grad()
                (-val.sum()).backward()
                opt.step()
                with torch.no_grad():  # project x back into the ball
                    r = _token_norm(x)
                    x.mul_(torch.clamp(R / r, max=1.0)[:, None, None])
    return worst



def _search_peak(m, cert, shape, largest_value, seed=0):
    """max over random and gradient-ascent inputs of (largest value computed from x) / peak(||x||)."""
    g = torch.Generator().manual_seed(seed)
    worst = -math.inf
    m.requires_grad_(False)
    try:
        for scale in (1e-2, 1.0, 100.0):
            x = (torch.randn(4, *shape[1:], generator=g, dtype=torch.float64) * scale).requires_grad_(True)
            opt = torch.optim.Adam([x], lr=0.05 * scale)
            for _ in range(6):
                bound = cert.peak_bound(float(_token_norm(x).max()))
                ratio = largest_value(m, x) / bound
                worst = max(worst, float(ratio.detach()))
                opt.zero_grad()
                (-ratio).backward()
                opt.step()
    finally:
        m.requires_grad_(True)
    return worst


def _check(m, cert, shape, name="", largest_value=None):
    g = _search_growth(m, cert, shape)
    assert g <= 1e-6, f"growth bound beaten for {name}: {cert} (excess ratio {g})"
    j = _search_jacobian(m.double(), cert, shape)
    assert j <= 1.0 + 1e-6, f"Jacobian bound beaten for {name}: {cert} (ratio {j})"
    if largest_value is not None and cert.peak is not None:
        # the ratio uses the largest token norm of the batch, a bound on every sample's radius
        p = _search_peak(m, cert, shape, largest_value)
        assert p <= 1.0 + 1e-6, f"peak bound beaten for {name}: {cert.peak} (ratio {p})"
    m.float()
    return g, j


@pytest.fixture
def soundness(intermediates):
    return functools.partial(_check, largest_value=intermediates.largest_value)
