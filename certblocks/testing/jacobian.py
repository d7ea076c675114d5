"""A lower bound of the Jacobian's per-token operator norm: :func:`jacobian_norm_lower`.

An alternating (power-iteration) maximization with Jacobian-vector products and vector-Jacobian products.  The
Jacobian is the one autograd computes (docs/theory.md section 1.1: at a switch, the derivative of the branch it takes):
its Jacobian-vector products are forward-mode AD or the transpose of a double backward (``jvp="double"``); central
differences, which across a jump measure the jump and not a derivative, only steer (they are never scored).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

from ._constants import Velocity
from .inputs import _check_count, _per_sample, _tokens, _unit_tokens, token_norm, vector_norms

#: The Jacobian-vector products that are autograd's own (exact up to rounding): their values may be scored.
EXACT_JVP = ("forward", "double")


def _jvp(f: Velocity, x: Tensor, v: Tensor, mode: str) -> Tensor:
    """``J(x) v`` in float64: forward-mode AD; the transpose of a double backward, ``J v = d/du <J^T u, v>``
    (differentiable in ``x`` and ``v`` when they require grad); or central differences with a step relative to
    ``||x||`` (at least the square root of the dtype's smallest normal number, so that the differences stay normal
    numbers)."""
    if mode == "forward":
        return torch.func.jvp(f, (x,), (v,))[1].to(torch.float64)
    if mode == "double":
        with torch.enable_grad():
            xx = x if x.requires_grad else x.detach().requires_grad_(True)
            out = f(xx)
            u = torch.zeros_like(out, requires_grad=True)
            g = torch.autograd.grad(out, xx, u, create_graph=True)[0]
            jv = torch.autograd.grad(g, u, v.to(g.dtype), create_graph=x.requires_grad or v.requires_grad)[0]
        return jv.to(torch.float64)
    h = 1e-6 * token_norm(x).clamp_min(math.sqrt(torch.finfo(x.dtype).tiny) if x.is_floating_point() else 1e-3)
    diff = f(x + _per_sample(h, x) * v).to(torch.float64) - f(x - _per_sample(h, x) * v).to(torch.float64)
    return diff / _per_sample(2 * h, diff)


def _resolve_jvp(f: Velocity, x: Tensor, mode: str) -> str:
    """``"auto"``: ``"forward"`` when ``f`` supports forward-mode AD, else ``"central"`` (which only steers: the scores
    stay autograd's vector-Jacobian products; ``"double"`` is exact where ``f`` has a double backward)."""
    if mode not in ("auto", "forward", "double", "central"):
        raise ValueError(f"jvp must be 'auto', 'forward', 'double' or 'central', got {mode!r}")
    if mode != "auto":
        return mode
    try:
        torch.func.jvp(f, (x,), (torch.ones_like(x),))
    except (RuntimeError, NotImplementedError, TypeError):
        return "central"
    return "forward"


def _jacobian_lower(f: Velocity, x: Tensor, iters: int, gen: torch.Generator, mode: str) -> Tuple[Tensor, Tensor]:
    """Per-sample lower bounds of ``||dv(x)||`` and the tangents (per-token norm 1) attaining them.

    For an output token ``i`` and a unit vector ``u``, ``sum_j ||J_ij^T u||`` equals ``<u, (J w)_i>`` for
    the tangent ``w_j = normalize(J_ij^T u)``, so it and ``||(J w)_i||`` are at most the norm.  Alternating
    ``w <- normalize(J_i.^T u)``, ``u <- normalize((J w)_i)`` raises both (power iteration for one token).
    Each output token of each sample is one row of a batch; the vector-Jacobian products reuse one graph.
    Jacobian-vector products only choose ``u``, and count as scores only when exact (autograd's: :data:`EXACT_JVP`).
    """
    B, x = x.shape[0], x.detach()
    with torch.no_grad():
        out_shape = f(x[:1]).shape[1:]
    T, d_out = math.prod(out_shape[:-1]), out_shape[-1]
    X = x.repeat_interleave(T, dim=0).requires_grad_(True)  # row k reads output token k % T
    rows = torch.arange(B * T, device=x.device)
    tok = rows % T
    with torch.enable_grad():
        out = f(X)
    u = torch.randn(B * T, d_out, generator=gen, dtype=torch.float64).to(x.device)
    best = torch.zeros(B * T, dtype=torch.float64, device=x.device)
    best_w = torch.zeros_like(X)
    for it in range(iters + 1):
        u_out = u.to(out.dtype)
        cot = torch.zeros(B * T, T, d_out, dtype=out.dtype, device=x.device)
        cot[rows, tok] = u_out
        g = _tokens(torch.autograd.grad(out, X, cot.reshape(out.shape), retain_graph=True)[0].to(torch.float64))
        un = vector_norms(u_out.to(torch.float64), dim=-1)
        score = vector_norms(g, dim=-1).sum(-1) / torch.where(un > 0, un, torch.ones_like(un))
        w = _unit_tokens(g).reshape(X.shape).to(x.dtype)
        better = score > best
        best, best_w[better] = torch.where(better, score, best), w[better]
        if it == iters:
            break
        with torch.no_grad():
            jw = _tokens(_jvp(f, X.detach(), w, mode))[rows, tok]
        jn = vector_norms(jw, dim=-1)
        if mode in EXACT_JVP:
            better = jn > best
            best, best_w[better] = torch.where(better, jn, best), w[better]
        fresh = torch.randn(B * T, d_out, generator=gen, dtype=torch.float64).to(x.device)
        u = torch.where(((jn > 0) & torch.isfinite(jn))[:, None], jw, fresh)
        u = _unit_tokens(u)
    best = best.reshape(B, T)
    idx = best.argmax(dim=1)
    return best.gather(1, idx[:, None])[:, 0], best_w.reshape(B, T, *x.shape[1:])[torch.arange(B), idx].detach()


def jacobian_norm_lower(f: Velocity, x: Tensor, *, iters: int = 25, seed: int = 0, jvp: str = "auto") -> Tensor:
    """A lower bound of ``||dv(x)||`` (induced per-token operator norm) at each sample of ``x``.

    An alternating maximization over the output token, the output direction and a tangent of
    per-token norm 1 (power iteration with Jacobian-vector and vector-Jacobian products).  Every value
    is attained by a tangent, so it never exceeds the norm (up to rounding); for a linear map it
    converges to the norm.

    Args:
        f: the velocity, acting on each sample independently.
        x: the states ``(B, *shape)``.
        iters: alternating iterations.
        seed: seed of the starting directions.
        jvp: ``"forward"`` (``torch.func.jvp``), ``"double"`` (the transpose of a double backward), ``"central"``
            (central differences: they only choose directions, the scores stay exact) or ``"auto"`` (forward when ``f``
            supports it, else central).

    Returns:
        ``(B,)`` float64 lower bounds.
    """
    _check_count("iters", iters)
    return _jacobian_lower(f, x, iters, torch.Generator().manual_seed(seed), _resolve_jvp(f, x[:1].detach(), jvp))[0]
