"""The per-token norm and the random states the searches start from.

* :func:`token_norm` -- the per-token norm of each sample, and the helpers that rescale to a sphere of it;
* :func:`random_inputs` -- random states of a given per-token norm from the direction families
  (:data:`~certblocks.testing.FAMILIES`), and the validation of shapes, radii and counts.

Every norm here is taken of the vector divided by its largest ``|entry|`` and multiplied back
(:func:`vector_norms`): a sum of squares underflows below ``~1e-154`` and overflows above ``~1e154`` in
float64 (``~1e-19`` and ``~1e19`` in float32), and a rescaling by a norm that underflowed to zero would
inflate a direction by the reciprocal of the clamp.  Rescaling never forms the norm of the raw vector:
it divides by the largest entry first, so no value outside ``[|entry| / max, radius]`` appears.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._validation import check_int, check_real
from ._constants import FAMILIES


def vector_norms(t: Tensor, dim: int = -1, keepdim: bool = False) -> Tensor:
    """Euclidean norms along ``dim``, exact at every scale (no overflow or underflow of the squares).

    Each vector is divided by its largest ``|entry|`` (held constant for autograd: the norm is
    homogeneous, so the gradient is the norm's own), its norm taken, and the result multiplied back.
    A zero vector has norm 0; a vector with an infinite entry has norm ``inf``; NaN stays NaN.
    """
    s = t.detach().abs().amax(dim=dim, keepdim=True)
    finite = torch.isfinite(s) & (s > 0)
    n = torch.linalg.vector_norm(t / torch.where(finite, s, torch.ones_like(s)), dim=dim, keepdim=True)
    n = torch.where(finite, n * s, torch.where(torch.isinf(s), s, n))  # 0 stays 0, inf is inf, NaN propagates
    return n if keepdim else n.squeeze(dim)


def token_norm(x: Tensor) -> Tensor:
    """The per-token norm of each sample of a batch ``(B, ..., features)``, in float64.

    Returns:
        ``(B,)``: the largest Euclidean norm of a token's feature vector (``(B, features)``: one token), exact
        at every scale (:func:`vector_norms`).
    """
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise ValueError(f"x must be a tensor (B, ..., features), got {getattr(x, 'shape', type(x).__name__)}")
    return vector_norms(_tokens(x.to(torch.float64)), dim=-1).amax(dim=-1)


def _tokens(x: Tensor) -> Tensor:
    """``(B, ..., d)`` as ``(B, T, d)``."""
    return x.flatten(1, -2) if x.dim() > 2 else x[:, None, :]


def _per_sample(s: Tensor, like: Tensor) -> Tensor:
    return s.reshape(-1, *([1] * (like.dim() - 1))).to(like.dtype)


def _on_sphere(z: Tensor, radius: float) -> Tensor:
    """``z`` rescaled sample by sample to per-token norm ``radius`` (a zero sample: every entry equal).

    The sample is divided by its largest ``|entry|`` first (held constant for autograd: the result does not
    depend on it), so that its per-token norm lies in ``[1, sqrt(features)]`` and the factor ``radius / norm``
    neither underflows nor overflows.
    """
    s = z.detach().abs().flatten(1).amax(dim=1)
    zero = _per_sample(~(s > 0), z).bool()  # a NaN sample stays NaN
    u = torch.where(zero, torch.ones_like(z), z) / _per_sample(torch.where(s > 0, s, torch.ones_like(s)), z)
    n = _tokens(u.to(torch.float64)).norm(dim=-1).amax(dim=-1)  # in [1, sqrt(features)]: no rounding to 0 or inf
    return u * _per_sample(radius / n, u)


def _unit_tokens(w: Tensor) -> Tensor:
    """Every token scaled to norm 1, at any scale: an extreme point of the per-token unit ball (a zero token
    stays zero).  Each token is divided by its largest ``|entry|`` first (held constant for autograd), so its
    norm lies in ``[1, sqrt(features)]``."""
    s = w.detach().abs().amax(dim=-1, keepdim=True)
    ok = (s > 0) & torch.isfinite(s)
    u = w / torch.where(ok, s, torch.ones_like(s))
    n = torch.linalg.vector_norm(u, dim=-1, keepdim=True)
    return u / torch.where(ok, n, torch.ones_like(n))


def random_inputs(shape: Sequence[int], radius: float, count: int, *, generator: Optional[torch.Generator] = None,
                  dtype: torch.dtype = torch.float64, families: Sequence[str] = FAMILIES,
                  offset: int = 0) -> Tensor:
    """Random states of per-token norm exactly ``radius``; draw ``i`` from ``families[(i + offset) % F]``.

    Families: ``gaussian`` (i.i.d. normal); ``dominant_token`` (one token, cycling from the first,
    carries the norm, the others are 1e-3 smaller); ``equal_tokens`` (every token equal: each attention
    logit row ties, at every scale); ``constant_features`` (``1 + 1e-3 g``, where normalization
    Jacobians peak); ``sparse_tokens`` (every other token 1e-4 smaller); ``quiet_last`` (the last token
    1e-4 smaller: a quiet token after a large history); ``axis`` (every token along one coordinate axis).

    Args:
        shape: one sample's shape, ``(..., tokens, features)`` or ``(features,)``.
        radius: the per-token norm of every draw (``>= 0``).
        count: the number of draws.
        generator: the CPU random generator (default: seeded with 0).
        dtype: the floating dtype of the result.
        families: the families cycled through (names from :data:`FAMILIES`).
        offset: the family index of draw 0.

    Returns:
        ``(count, *shape)`` on the CPU.
    """
    shape, radius, count = _check_shape(shape), _check_radius(radius), _check_count("count", count)
    fams = tuple(families)
    if not fams or any(f not in FAMILIES for f in fams):
        raise ValueError(f"families must be a non-empty selection of {FAMILIES}, got {fams!r}")
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    T, d = math.prod(shape[:-1]), shape[-1]
    g = torch.randn(count, T, d, generator=gen, dtype=torch.float64)
    for i in range(count):
        fam, k = fams[(i + offset) % len(fams)], (i + offset) // len(fams)
        if fam == "dominant_token":
            g[i, torch.arange(T) != k % T] *= 1e-3
        elif fam == "equal_tokens":
            g[i] = g[i, :1].expand(T, d)
        elif fam == "constant_features":
            g[i] = 1.0 + 1e-3 * g[i]
        elif fam == "sparse_tokens":
            g[i, k % 2::2] *= 1e-4
        elif fam == "quiet_last":
            g[i, -1] *= 1e-4
        elif fam == "axis":
            mag = g[i, :, 0].abs() + 1e-3
            g[i] = 0.0
            g[i, :, k % d] = mag
    g = g * 0.0 if radius == 0.0 else _on_sphere(g, radius)
    return g.reshape(count, *shape).to(dtype)


def _check_shape(shape: Sequence[int]) -> Tuple[int, ...]:
    try:
        out = tuple(int(s) for s in shape)
    except TypeError:
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}") from None
    if not out or any(s <= 0 for s in out):
        raise ValueError(f"shape must be one sample's shape (..., tokens, features), positive sizes; got {shape!r}")
    return out


def _check_radius(r: float) -> float:
    return check_real("radius", r, ge=0.0)


def _check_count(name: str, n: int) -> int:
    return check_int(name, n, 0)
