"""Shared machinery for the block tests: counterexample searches against certificates.

Norm: per-token ball, ``||X|| = max_i ||x_i||_2`` per sample.  The searches run in float64
on the blocks' plain-torch twins (``forward_reference``; SDPA has no forward-mode AD) and
look for an ``X`` with ``||v(X)|| > c ||X||^q + b`` or a direction ``V`` (``||V|| = 1``)
with ``||J(X) V|| > l1 max(R, 1)^sigma + l0`` at ``||X|| = R`` (the induced norm is the sup
of ``||J V||`` over such ``V``).  Both random inputs and gradient ascent (Adam) are used;
the Jacobian search differentiates through ``torch.func.jvp``.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Callable, Iterable

import pytest
import torch

RTOL = 1e-7  # float64 rounding allowance on a bound


def tok_norm(x: torch.Tensor) -> torch.Tensor:
    """Per-sample per-token norm of ``(B, n, d)``: ``max_i ||x_i||``."""
    return x.norm(dim=-1).amax(dim=-1)


def _on_sphere(z: torch.Tensor, r: float) -> torch.Tensor:
    return z * (r / tok_norm(z).clamp_min(1e-300))[:, None, None]


def random_inputs(n: int, d: int, r: float, count: int, gen: torch.Generator) -> torch.Tensor:
    """Random states with ``||X|| = r``: Gaussian, one dominant token, all tokens equal, near-constant features."""
    g = torch.randn(count, n, d, generator=gen, dtype=torch.float64)
    k = max(1, count // 4)
    g[:k, 1:] *= 1e-3  # one dominant token
    g[k:2 * k] = g[k:2 * k, :1].expand(-1, n, -1)  # all tokens equal (ties in every logit row)
    g[2 * k:3 * k] = 1.0 + 1e-3 * g[2 * k:3 * k]  # near-constant features (normalization Jacobians peak)
    return _on_sphere(g, r)


def growth_search(f: Callable[[torch.Tensor], torch.Tensor], cert, n: int, d: int, radii: Iterable[float], *,
                  steps: int = 30, restarts: int = 4, count: int = 64, seed: int = 0) -> float:
    """Largest ``||v(X)|| / (c ||X||^q + b)`` found (random and gradient-ascent inputs)."""
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for r in radii:
        bound = cert.growth_bound(r)
        with torch.no_grad():
            x = random_inputs(n, d, r, count, gen)
            worst = max(worst, float((tok_norm(f(x)) / bound).max()))
        z = torch.randn(restarts, n, d, generator=gen, dtype=torch.float64).requires_grad_(True)
        opt = torch.optim.Adam([z], lr=0.1)
        for _ in range(steps):
            ratio = tok_norm(f(_on_sphere(z, r))) / bound
            worst = max(worst, float(ratio.detach().max()))
            opt.zero_grad()
            (-ratio.sum()).backward()
            opt.step()
    return worst


def jacobian_norm_lower(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, iters: int = 25,
                        seed: int = 0) -> torch.Tensor:
    """Per-sample lower bound of the induced (per-token) norm of ``J(x)`` by alternating maximization.

    For each output token ``i``: ``u = normalize(sum_j J_ij v_j)``, ``v_j = normalize(J_ij^T u)`` (an
    ascent iteration for ``max ||sum_j J_ij v_j||`` over unit ``v_j``); the best token is kept.
    """
    B, n, d = x.shape
    J = torch.func.vmap(torch.func.jacrev(lambda t: f(t[None])[0]))(x.detach()).detach()  # (B, n, d, n, d)
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(B, n, n, d, generator=gen, dtype=x.dtype)  # (sample, out token i, in token j, d)
    best = torch.zeros(B, n, dtype=x.dtype)
    for _ in range(iters):
        v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-300)
        y = torch.einsum("siajc,sijc->sia", J, v)
        ny = y.norm(dim=-1)
        best = torch.maximum(best, ny)
        u = y / ny[..., None].clamp_min(1e-300)
        v = torch.einsum("siajc,sia->sijc", J, u)
    return best.amax(dim=-1)


def jacobian_search(f: Callable[[torch.Tensor], torch.Tensor], cert, n: int, d: int, radii: Iterable[float], *,
                    steps: int = 30, restarts: int = 4, count: int = 16, seed: int = 0) -> float:
    """Largest ``||J(X) V|| / (l1 max(R,1)^sigma + l0)`` found at ``||X|| = R``, ``||V|| = 1``.

    Random states are scored with :func:`jacobian_norm_lower` (full Jacobian, alternating maximization);
    gradient ascent moves ``X`` and ``V`` jointly through ``torch.func.jvp``.
    """
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for r in radii:
        bound = cert.jacobian_bound(r)
        with torch.no_grad():
            x = random_inputs(n, d, r, count, gen)
        worst = max(worst, float((jacobian_norm_lower(f, x) / bound).max()))
        z = torch.randn(restarts, n, d, generator=gen, dtype=torch.float64)
        z[: restarts // 2] = random_inputs(n, d, 1.0, restarts, gen)[: restarts // 2]
        z.requires_grad_(True)
        w = torch.randn(restarts, n, d, generator=gen, dtype=torch.float64).requires_grad_(True)
        opt = torch.optim.Adam([z, w], lr=0.1)
        for _ in range(steps):
            x = _on_sphere(z, r)
            v = w / w.norm(dim=-1, keepdim=True)
            _, jv = torch.func.jvp(f, (x,), (v,))
            ratio = tok_norm(jv) / bound
            worst = max(worst, float(ratio.detach().max()))
            opt.zero_grad()
            (-ratio.sum()).backward()
            opt.step()
        with torch.no_grad():  # refine the ascent's end points with the full Jacobian
            worst = max(worst, float((jacobian_norm_lower(f, _on_sphere(z, r)) / bound).max()))
    return worst


def peak_search(f: Callable[[torch.Tensor], torch.Tensor], cert, n: int, d: int, radii: Iterable[float], *,
                largest_value: Callable, steps: int = 20, restarts: int = 3, count: int = 32, seed: int = 0) -> float:
    """Largest ``max |intermediate| / peak(||X||)`` found (random and gradient-ascent inputs).

    ``largest_value`` is the ``intermediates`` fixture's (tests/conftest.py).  The block's parameters must
    not require gradients (only tensors computed from the input count).
    """
    assert cert.peak is not None, "the certificate states no peak"
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for r in radii:
        bound = cert.peak_bound(r)
        x = random_inputs(n, d, r, count, gen)
        worst = max(worst, float(largest_value(f, x).detach()) / bound)
        z = torch.randn(restarts, n, d, generator=gen, dtype=torch.float64).requires_grad_(True)
        opt = torch.optim.Adam([z], lr=0.1)
        for _ in range(steps):
            ratio = largest_value(f, _on_sphere(z, r)) / bound
            worst = max(worst, float(ratio.detach()))
            opt.zero_grad()
            (-ratio).backward()
            opt.step()
    return worst


def slope(f: Callable[[float], float], s0: float, s1: float) -> float:
    """``d log f / d log s`` between ``s0`` and ``s1``."""
    return (math.log(f(s1)) - math.log(f(s0))) / (math.log(s1) - math.log(s0))


@pytest.fixture
def search(intermediates) -> SimpleNamespace:
    peak = functools.partial(peak_search, largest_value=intermediates.largest_value)
    return SimpleNamespace(tok_norm=tok_norm, growth=growth_search, jacobian=jacobian_search, peak=peak,
                           largest_value=intermediates.largest_value, as_atom=intermediates.as_atom,
                           jacobian_lower=jacobian_norm_lower, random_inputs=random_inputs, slope=slope, rtol=RTOL)
