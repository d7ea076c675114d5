"""certblocks.testing at every scale: norms and rescalings exact from 1e-200 to 1e300 (float64) and across the float32
range, and searches that neither invent counterexamples (a direction inflated by a norm that underflowed) nor miss
planted ones (a value whose norm underflowed to 0)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import certblocks.testing as cbt
from certblocks.certificate import BlockCertificate, Peak
from certblocks.testing.inputs import _on_sphere, _unit_tokens, vector_norms

SHAPE = (4, 8)
F64_RADII = (1e-200, 1e-160, 1e150, 1e300)
F32_RADII = (1e-30, 1e-12, 1e12, 1e30)
SEARCH = dict(count=10, restarts=1, from_best=1, steps=8, power_iters=10)


def _reference_token_norm(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The per-token norm of ``x`` computed on ``x / scale`` (entries of order 1) and multiplied back."""
    y = (x.to(torch.float64) / scale).reshape(x.shape[0], -1, x.shape[-1])
    return y.norm(dim=-1).amax(dim=-1) * scale


@pytest.mark.parametrize("radius", F64_RADII)
def test_random_inputs_have_the_radius_in_float64(radius):
    x = cbt.random_inputs(SHAPE, radius, 21)  # every family three times
    assert torch.isfinite(x).all() and (x.abs().amax(dim=(1, 2)) > 0).all()
    got = cbt.token_norm(x)
    assert torch.allclose(got, torch.full_like(got, radius), rtol=1e-12, atol=0.0), got / radius
    assert torch.allclose(_reference_token_norm(x, radius), got, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("scale", (1e-300, 1e-200, 1e-160, 1e150, 1e200, 1e300))
def test_token_norm_unit_tokens_and_on_sphere_at_every_scale(scale):
    g = torch.randn(3, *SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    z = g * scale
    assert torch.allclose(cbt.token_norm(z), cbt.token_norm(g) * scale, rtol=1e-12, atol=0.0)
    u = _unit_tokens(z)
    assert torch.isfinite(u).all()
    assert torch.allclose(u.norm(dim=-1), torch.ones(3, SHAPE[0], dtype=torch.float64), rtol=1e-12, atol=0.0)
    assert torch.allclose(u, _unit_tokens(g), rtol=1e-12, atol=1e-15)  # the direction does not depend on the scale
    for radius in (1e-200, 1.0, 1e300):
        s = _on_sphere(z, radius)
        assert torch.isfinite(s).all()
        assert torch.allclose(_reference_token_norm(s, radius), torch.full((3,), radius, dtype=torch.float64),
                              rtol=1e-12, atol=0.0)


def test_zeros_and_non_finite_values_are_handled_explicitly():
    z = torch.zeros(2, *SHAPE, dtype=torch.float64)
    z[1, 0, 0] = 1e-320  # a subnormal sample
    s = _on_sphere(z, 2.0)
    assert torch.allclose(cbt.token_norm(s), torch.full((2,), 2.0, dtype=torch.float64), rtol=1e-12, atol=0.0)
    assert torch.allclose(s[0], torch.full(SHAPE, 2.0 / math.sqrt(SHAPE[1]), dtype=torch.float64))  # equal entries
    w = torch.zeros(SHAPE, dtype=torch.float64)
    w[1] = 1e-310
    u = _unit_tokens(w)
    assert torch.equal(u[0], torch.zeros(SHAPE[1], dtype=torch.float64))  # a zero token stays zero
    assert u[1].norm() == pytest.approx(1.0, rel=1e-12)
    t = torch.tensor([[3.0, 4.0], [0.0, 0.0], [math.inf, 1.0], [math.nan, 1.0]], dtype=torch.float64)
    n = vector_norms(t)
    assert n[0] == 5.0 and n[1] == 0.0 and n[2] == math.inf and math.isnan(n[3])
    grad = torch.autograd.functional.jacobian(lambda v: vector_norms(v * 1e-200), torch.tensor([3.0, 4.0]).double())
    assert torch.allclose(grad, torch.tensor([0.6e-200, 0.8e-200], dtype=torch.float64), rtol=1e-12)


@pytest.mark.parametrize("radius", F32_RADII)
def test_random_inputs_have_the_radius_in_float32(radius):
    x = cbt.random_inputs(SHAPE, radius, 14, dtype=torch.float32)
    assert x.dtype == torch.float32 and torch.isfinite(x).all()
    got = cbt.token_norm(x)
    assert torch.allclose(got, torch.full_like(got, radius), rtol=1e-6, atol=0.0)
    z = x * 1e-3  # far below the radius where float32 squares underflow (1e-30 * 1e-3 squared)
    on = _on_sphere(z, radius)
    assert on.dtype == torch.float32 and torch.isfinite(on).all()
    assert torch.allclose(cbt.token_norm(on), torch.full_like(got, radius), rtol=1e-6, atol=0.0)
    u = _unit_tokens(z)
    assert torch.allclose(u.double().norm(dim=-1), torch.ones(14, SHAPE[0], dtype=torch.float64), rtol=1e-6)


class _Linear(nn.Module):
    """``x W^T``, ``W`` of operator norm about ``scale``."""

    def __init__(self, scale: float, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        g = torch.randn(SHAPE[1], SHAPE[1], dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        self.unit = g / math.sqrt(SHAPE[1])
        self.scale = scale
        self.w = nn.Parameter((self.unit * scale).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.T

    def certificate(self, factor: float = 1.0) -> BlockCertificate:
        """The exact certificate (its coefficients of the weights as stored, rounded up), each scaled by ``factor``."""
        w = self.w.detach().double() / self.scale  # entries of order 1: norms exact, then scaled back
        up = (1.0 + 1e-12) * factor * self.scale
        op = float(torch.linalg.matrix_norm(w, ord=2)) * up
        rows = float(w.norm(dim=1).max()) * up
        return BlockCertificate(1, 0, c=op, l1=0.0, l0=op, name=f"linear x{self.scale:g}", peak=Peak(1, rows))


# (weight scale, radius): tiny and huge states, tiny and huge Jacobians (the case whose tangents the old clamp inflated)
F64_CASES = [(1.0, 1e-200), (1.0, 1e-160), (1.0, 1e150), (0.5, 1e300), (1e-200, 1.0), (1e-160, 1e-10), (1e150, 1.0)]


@pytest.mark.parametrize("scale, radius", F64_CASES)
def test_search_at_every_scale_float64(scale, radius):
    lin = _Linear(scale)
    report = cbt.search(lin, lin.certificate(), SHAPE, radii=(radius,), **SEARCH)
    assert report.ok, report
    assert report.jacobian.ratio > 0.999, report  # the power iteration reaches ||W|| at this scale too
    assert all(math.isfinite(r.value) and r.value > 0 for r in report.results), report
    for check, factor in (("growth", 0.9), ("jacobian", 0.9), ("peak", 0.9)):
        planted = cbt.search(lin, lin.certificate(factor), SHAPE, radii=(radius,), checks=[check], count=24,
                             restarts=2, from_best=2, steps=20, power_iters=10)
        assert not planted.ok and planted.failures[0].check == check, planted
        assert 1.0 < planted.failures[0].ratio < 1.0 / 0.9 + 1e-6, planted  # found, and not inflated


@pytest.mark.parametrize("radius", F32_RADII)
def test_search_at_every_scale_float32(radius):
    lin = _Linear(1.0, torch.float32)
    kw = dict(radii=(radius,), dtype=torch.float32, rtol=1e-5)
    report = cbt.search(lin, lin.certificate(), SHAPE, **SEARCH, **kw)
    assert report.ok, report
    assert report.jacobian.ratio > 0.999, report
    planted = cbt.search(lin, lin.certificate(0.9), SHAPE, checks=["growth", "jacobian"], count=24, restarts=2,
                         from_best=2, steps=20, power_iters=10, **kw)
    assert {r.check for r in planted.failures} == {"growth", "jacobian"}, planted


def test_model_search_at_tiny_and_huge_radii():
    from certblocks.trace import certify

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _Linear(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.inner(x)

    net = Net().eval()
    example = torch.randn(1, *SHAPE, dtype=torch.float64)
    cert = certify(net, example)
    for r0 in (1e-200, 1e150):
        st = cert.stack("fp64", r0=r0)
        assert st.ok, st.explain()
        report = cbt.search_model(net, st, example, model_certificate=cert, count=4, restarts=1, steps=4)
        assert report.ok, report
        assert report["output"].ratio > 0.5, report  # the output norm is read, not rounded to 0
