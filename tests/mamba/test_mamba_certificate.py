"""Certificates of LinearGrowthMamba (1, 1) and Mamba (5, 5): validity of c, b, l1, l0.

Soundness is checked in the per-token norm ||X|| = max_t ||X_t||_2 against random inputs and
inputs found by gradient ascent on the ratio ||v(X)|| / (c ||X||^q + b) (and on the Jacobian ratio
||J(X) V|| / (l1 max(R, 1)^sigma + l0) over X in the ball of radius R and ||V|| <= 1, with
Jacobian-vector products).  A ratio above 1 is a counterexample.
"""

from __future__ import annotations

import math

import pytest
import torch

from certblocks.blocks.mamba import LinearGrowthMamba, Mamba, _decay_sums
from certblocks.certificate import BlockCertificate

D_MODEL, L = 8, 10


def tok_norm(x: torch.Tensor) -> torch.Tensor:
    """Per-sample norm: max over tokens of the token's Euclidean norm. x: (B, L, d) -> (B,)."""
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


def _ascent(ratio_fn, y0, log_r0, steps, lr=0.05):
    """Gradient ascent on log ratio over directions y (and log radius when log_r0 requires grad)."""
    y = y0.clone().requires_grad_(True)
    params = [y] + ([log_r0] if log_r0.requires_grad else [])
    opt = torch.optim.Adam(params, lr=lr)
    best = torch.zeros(())
    for _ in range(steps):
        r = ratio_fn(y)
        best = torch.maximum(best, r.detach().max())
        opt.zero_grad()
        (-torch.log(r).sum()).backward()
        opt.step()
    return float(torch.maximum(best, ratio_fn(y).detach().max()))


def _unit(y):
    return y / tok_norm(y)[:, None, None]


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
    x = torch.randn(16, L, D_MODEL)
    for s in (0.05, 0.5, 3.0, 10.0):
        with torch.no_grad():
            assert float(_growth_ratio(blk, c3, s * _unit(x)).max()) <= 1.0


def test_decay_sum_tail_is_an_upper_bound():
    g = torch.Generator().manual_seed(0)
    d, n = 6, 3
    dmax = torch.rand(d, generator=g, dtype=torch.float64) + 0.1
    mrow = torch.rand(d, generator=g, dtype=torch.float64)
    dmin = 0.01 * torch.rand(d, generator=g, dtype=torch.float64)
    A = -torch.rand(d, n, generator=g, dtype=torch.float64) - 0.1
    for seq_len in (7, 300, 3000):
        exact = _decay_sums(dmax, mrow, A, dmin, seq_len, exact_terms=seq_len)
        tail = _decay_sums(dmax, mrow, A, dmin, seq_len, exact_terms=5)
        for e, t in zip(exact, tail):
            assert t >= e * (1 - 1e-12)
        assert exact[0] <= seq_len * float(dmax.max()) * (1 + 1e-12)


def _radii(scales, per):
    """log radii, ``per`` samples at each scale (one batch searches all scales at once)."""
    return torch.tensor([math.log(s) for s in scales for _ in range(per)])[:, None, None]


@pytest.mark.parametrize("seed, dt_shift", [(0, 0.0), (1, 3.0), (2, -4.0)])
def test_linear_growth_forward_bound_is_sound(seed, dt_shift):
    blk = _block(LinearGrowthMamba, seed, dt_shift)
    cert = blk.certificate(seq_len=L)
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    with torch.no_grad():
        for s in (1e-3, 0.1, 1.0, 10.0, 1e3):
            x = s * _unit(torch.randn(64, L, D_MODEL, generator=g))
            x[:8, ::2] *= 1e-4  # near-zero tokens between large ones
            worst = max(worst, float(_growth_ratio(blk, cert, x).max()))
    log_r = _radii((0.1, 1.0, 30.0), 3).requires_grad_(True)
    y0 = torch.randn(9, L, D_MODEL, generator=g)
    worst = max(worst, _ascent(lambda y: _growth_ratio(blk, cert, torch.exp(log_r) * _unit(y)), y0, log_r, 25))
    assert worst <= 1.0, worst


@pytest.mark.parametrize("seed, dt_shift", [(0, 0.0), (1, 3.0)])
def test_linear_growth_jacobian_bound_is_sound(seed, dt_shift):
    blk = _block(LinearGrowthMamba, seed, dt_shift, eps=1e-2)
    cert = blk.certificate(seq_len=L)
    g = torch.Generator().manual_seed(10 + seed)
    worst = 0.0
    for R in (0.01, 1.0, 10.0):
        x = R * _unit(torch.randn(32, L, D_MODEL, generator=g))
        x[:8, 1::2] *= 1e-3
        v = torch.randn(32, L, D_MODEL, generator=g)
        with torch.no_grad():
            worst = max(worst, float(_jac_ratio(blk, cert, x, v).max()))
    n = 6
    log_r = _radii((0.1, 1.0, 10.0), 2)  # fixed radii: the ratio's denominator is monotone in R
    yv0 = torch.randn(2 * n, L, D_MODEL, generator=g)
    worst = max(worst, _ascent(
        lambda yv: _jac_ratio(blk, cert, torch.exp(log_r) * _unit(yv[:n]), yv[n:]), yv0, log_r, 15))
    assert worst <= 1.0, worst


@pytest.mark.parametrize("seed", [0, 1])
def test_free_mamba_bounds_are_sound(seed):
    blk = _block(Mamba, seed)
    cert = blk.certificate(seq_len=L)
    g = torch.Generator().manual_seed(20 + seed)
    worst_f = worst_j = 0.0
    for s in (0.01, 0.5, 2.0, 8.0):
        x = s * _unit(torch.randn(32, L, D_MODEL, generator=g))
        v = torch.randn(32, L, D_MODEL, generator=g)
        with torch.no_grad():
            worst_f = max(worst_f, float(_growth_ratio(blk, cert, x).max()))
            worst_j = max(worst_j, float(_jac_ratio(blk, cert, x, v).max()))
    log_r = _radii((0.01, 0.5, 2.0, 8.0), 2).requires_grad_(True)
    worst_f = max(worst_f, _ascent(lambda y: _growth_ratio(blk, cert, torch.exp(log_r) * _unit(y)),
                                   torch.randn(8, L, D_MODEL, generator=g), log_r, 20))
    assert worst_f <= 1.0 and worst_j <= 1.0, (worst_f, worst_j)


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
    assert max(ratios) <= 1.0, ratios
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
