"""Certificates of LinearGrowthMamba (1, 1) and Mamba (5, 5): validity of c, b, l1, l0.

Soundness is checked in the per-token norm ||X|| = max_t ||X_t||_2 by :mod:`certblocks.testing`: random
inputs and gradient ascent on the ratio ||v(X)|| / (c ||X||^q + b), and on the Jacobian ratio
||J(X) V|| / (l1 max(R, 1)^sigma + l0) with Jacobian-vector products.  A ratio above 1 is a
counterexample.  The scan kernels take float32: the searched inputs are float64, cast on the way in.
"""

from __future__ import annotations

import math

import pytest
import torch

import certblocks.testing as cbt
from certblocks.blocks.mamba import LinearGrowthMamba, Mamba, decay_sums
from certblocks.certificate import BlockCertificate

D_MODEL, L = 8, 10


def tok_norm(x: torch.Tensor) -> torch.Tensor:
    """Per-sample norm in x's dtype (the targeted tests below compare float32 values with float32 values)."""
    return x.norm(dim=-1).amax(dim=-1)


def _block(cls, seed: int, dt_shift: float = 0.0, **kw):
    torch.manual_seed(seed)
    blk = cls(D_MODEL, d_state=4, d_conv=3, expand=2, bias=True, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in blk.named_parameters():
            if name == "A_log":
                p.copy_(torch.rand(p.shape, generator=g) * 3 - 2)
            elif name == "dt_proj.bias":
                p.copy_(torch.randn(p.shape, generator=g) + dt_shift)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() < 2 else 1.0 / math.sqrt(p.shape[-1])))
    blk.backend = "reference"  # plain loop: supports forward-mode AD (jvp)
    return blk


def _growth_ratio(blk, cert, x):
    return tok_norm(blk(x)) / (cert.c * tok_norm(x) ** cert.q + cert.b)


def _jac_ratio(blk, cert, x, v):
    _, jv = torch.func.jvp(blk, (x,), (v / tok_norm(v)[:, None, None],))
    return tok_norm(jv) / (cert.l1 * tok_norm(x).clamp(min=1.0) ** cert.sigma + cert.l0)


@pytest.mark.parametrize("cls", [LinearGrowthMamba, Mamba])
def test_certificate_object(cls):
    blk = _block(cls, 0)
    cert = blk.certificate(seq_len=L)
    assert isinstance(cert, BlockCertificate)
    assert cert.exponents == cls.exponents
    assert all(math.isfinite(v) and v >= 0 for v in (cert.c, cert.b, cert.l1, cert.l0))
    assert cert.c > 0 and cert.l1 > 0 and cert.l0 > 0
    assert cert.name == cls.__name__ and cert.culprit
    longer = blk.certificate(seq_len=10 * L)
    assert longer.c >= cert.c and longer.l1 >= cert.l1 and longer.l0 >= cert.l0
    assert cert.depths("fp16").forward is not None


def test_certificate_argument_errors():
    blk = _block(LinearGrowthMamba, 0)
    with pytest.raises(TypeError, match="seq_len"):
        blk.certificate(seq_len=3.0)
    with pytest.raises(ValueError, match="seq_len"):
        blk.certificate(seq_len=0)
    with pytest.raises(ValueError, match="r0"):
        blk.certificate(seq_len=4, r0=-1.0)
    with pytest.raises(TypeError):
        blk.certificate(4)  # keyword-only


def test_r0_tightens_free_mamba_near_r0_and_stays_sound():
    blk = _block(Mamba, 1)
    c1, c3 = blk.certificate(seq_len=L), blk.certificate(seq_len=L, r0=3.0)
    assert c3.growth_bound(3.0) <= c1.growth_bound(3.0)
    # the growth polynomial is folded by Young's inequality at r0 = 3: sound at every radius, searched on both sides
    g = cbt.search_growth(_v32(blk), c3, (L, D_MODEL), radii=(1e-3, 0.05, 0.5, 1.0, 3.0, 10.0, 100.0), count=32,
                          restarts=2, from_best=1, steps=20, lr=0.05, seed=7, rtol=0.0)
    assert g.ok, g.describe()


def test_decay_sum_tail_is_an_upper_bound():
    g = torch.Generator().manual_seed(0)
    d, n = 6, 3
    dmax = torch.rand(d, generator=g, dtype=torch.float64) + 0.1
    mrow = torch.rand(d, generator=g, dtype=torch.float64)
    dmin = 0.01 * torch.rand(d, generator=g, dtype=torch.float64)
    A = -torch.rand(d, n, generator=g, dtype=torch.float64) - 0.1
    for seq_len in (7, 300, 3000):
        exact = decay_sums(dmax, mrow, A, dmin, seq_len, exact_terms=seq_len)
        tail = decay_sums(dmax, mrow, A, dmin, seq_len, exact_terms=5)
        for e, t in zip(exact, tail):
            assert t >= e * (1 - 1e-12)
        assert exact[0] <= seq_len * float(dmax.max()) * (1 + 1e-12)


def _v32(blk):
    """The block on float64 inputs (its scan takes float32)."""
    return lambda x: blk(x.float())


@pytest.mark.slow
@pytest.mark.parametrize("seed, dt_shift", [(0, 0.0), (1, 3.0), (2, -4.0)])
def test_linear_growth_forward_bound_is_sound(seed, dt_shift):
    blk = _block(LinearGrowthMamba, seed, dt_shift)
    cert = blk.certificate(seq_len=L)
    # the radii of the former random draws (1e-3 .. 1e3) and of its ascent, which moved the radius from 0.1, 1, 30
    g = cbt.search_growth(_v32(blk), cert, (L, D_MODEL), radii=(1e-3, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 1e3),
                          count=64, restarts=2, from_best=1, steps=25, lr=0.05, seed=seed, rtol=0.0)
    assert g.ok, g.describe()


@pytest.mark.slow
@pytest.mark.parametrize("seed, dt_shift", [(0, 0.0), (1, 3.0)])
def test_linear_growth_jacobian_bound_is_sound(seed, dt_shift):
    blk = _block(LinearGrowthMamba, seed, dt_shift, eps=1e-2)
    cert = blk.certificate(seq_len=L)
    j = cbt.search_jacobian(_v32(blk), cert, (L, D_MODEL), radii=(0.01, 0.1, 1.0, 10.0), count=32, restarts=2,
                            from_best=1, steps=15, lr=0.05, power_iters=3, seed=10 + seed, rtol=0.0)
    assert j.ok, j.describe()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_free_mamba_bounds_are_sound(seed):
    blk = _block(Mamba, seed)
    cert = blk.certificate(seq_len=L)
    # the former random draws' radii, and those its growth ascent moved through from 0.01, 0.5, 2 and 8
    g = cbt.search_growth(_v32(blk), cert, (L, D_MODEL), radii=(0.01, 0.5, 1.0, 2.0, 4.0, 8.0), count=32, restarts=2,
                          from_best=1, steps=20, lr=0.05, seed=20 + seed, rtol=0.0)
    j = cbt.search_jacobian(_v32(blk), cert, (L, D_MODEL), radii=(0.01, 0.5, 2.0, 8.0), count=32, restarts=1,
                            from_best=1, steps=10, lr=0.05, power_iters=1, seed=20 + seed, rtol=0.0)
    assert g.ok and j.ok, (g.describe(), j.describe())


def _tight_block(dt_bias: float) -> LinearGrowthMamba:
    """Weights on which the linear-growth forward bound is attained (up to SiLU/sigmoid/eps effects).

    Identity in/out projections, a 1-tap conv, B = C = e_1 . p, constant delta = softplus(dt_bias), A = -1:
    along X_t = s e_1 the output is (sum_k delta e^{-delta k} + D) s e_1, which is what the bound sums.
    """
    d = 4
    blk = LinearGrowthMamba(d, d_state=2, d_conv=1, expand=1, dt_rank=1, conv_bias=False)
    with torch.no_grad():
        for p in blk.parameters():
            p.zero_()
        blk.in_proj.weight[:d] = torch.eye(d)
        blk.in_proj.weight[d:] = 10 * torch.eye(d)  # z = 10 X: the sigmoid gate is open along +e_1
        blk.conv1d.weight.fill_(1.0)
        blk.x_proj.weight[1, 0] = 1.0  # B_0 = p_0
        blk.x_proj.weight[3, 0] = 1.0  # C_0 = p_0
        blk.dt_proj.bias.fill_(dt_bias)
        blk.D.fill_(1.0)
        blk.out_proj.weight.copy_(torch.eye(d))
    blk.backend = "reference"
    return blk


@pytest.mark.parametrize("dt_bias", [-2.0, 0.5, 3.0])
def test_linear_growth_forward_bound_is_attained_and_never_exceeded(dt_bias):
    blk = _tight_block(dt_bias)
    cert = blk.certificate(seq_len=L)
    x = torch.zeros(1, L, 4)
    x[..., 0] = 1.0
    with torch.no_grad():
        ratios = [float(_growth_ratio(blk, cert, s * x)) for s in (1.0, 10.0, 100.0, 1e4)]
    # the bound is attained exactly on this ray: the block's float32 arithmetic may land a few ulps above it
    assert max(ratios) <= 1.0 + 4 * torch.finfo(torch.float32).eps, ratios
    assert ratios[-1] >= 0.99, ratios  # sharp: the bound is what the block does on this ray


def test_linear_growth_jacobian_grows_linearly_and_stays_below_bound():
    """sigma = 1 is attained: a zero token after a large history has ||dv/dx|| ~ ||history|| / sqrt(eps).

    Its normalized parameter input p_t = x_t / sqrt(||x_t||^2 + eps) moves by |dx_t| / sqrt(eps), which moves
    C_t, which reads the large state h_t.
    """
    blk = _tight_block(-2.0)
    cert = blk.certificate(seq_len=L)
    v = torch.zeros(1, L, 4)
    v[0, -1, 0] = 1.0
    norms = []
    for s in (10.0, 100.0):
        x = torch.zeros(1, L, 4)
        x[0, :-1, 0] = s  # large history, last token zero
        r = float(_jac_ratio(blk, cert, x, v))
        assert r <= 1.0
        assert r >= 0.1  # the bound is within 10x of the attained value here
        norms.append(float(tok_norm(torch.func.jvp(blk, (x,), (v,))[1])))
    assert norms[1] / norms[0] >= 9.0  # linear in the radius
