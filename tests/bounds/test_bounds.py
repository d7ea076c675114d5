"""The bounds layer: every norm is an upper bound, tight to its stated margin, and the constants hold."""

import math

import pytest
import torch
import torch.nn.functional as F

from certblocks import bounds
from certblocks.bounds import norms

_ACTS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
    "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t),
    "mish": F.mish,
    "hardswish": F.hardswish,
    "relu": F.relu,
    "softplus": F.softplus,
    "elu": F.elu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "hardsigmoid": F.hardsigmoid,
    "hardtanh": F.hardtanh,
    "erf": torch.erf,
    "softsign": F.softsign,
    "sin": torch.sin,
    "cos": torch.cos,
}


@pytest.mark.parametrize("name", sorted(_ACTS))
def test_activation_constants_hold_and_are_tight(name):
    z = torch.linspace(-30, 30, 600_001, dtype=torch.float64, requires_grad=True)
    y = _ACTS[name](z)
    (g,) = torch.autograd.grad(y.sum(), z)
    act = bounds.activation(name)
    lo, hi = act.derivative
    assert lo <= float(g.min()) and float(g.max()) <= hi
    if name in ("gelu", "gelu_tanh", "silu", "quick_gelu", "mish"):  # interior extremes, from a grid
        assert float(g.max()) > hi - 1e-5 and float(g.min()) < lo + 1e-5  # rounded outward in the 6th decimal
    y, zd = y.detach(), z.detach()
    assert bool((y.abs() <= act.slope * zd.abs() + act.offset + 1e-12).all())
    if act.saturation is not None:
        assert float(y.abs().max()) <= act.saturation
    if act.ratio is not None:
        nz = zd.abs() > 1e-12
        ratio = (y / zd)[nz]
        assert act.ratio[0] - 1e-12 <= float(ratio.min()) and float(ratio.max()) <= act.ratio[1] + 1e-12  # y/z rounds
    if act.sign == "+":
        assert float(y.min()) >= 0


def test_activation_lookup_errors_name_the_known_ones():
    with pytest.raises(KeyError, match="known"):
        bounds.activation("swish2")
    assert math.isclose(bounds.lipschitz("gelu"), 1.128905) and bounds.lipschitz("silu") < 1.1


@pytest.mark.parametrize("shape", [(40, 30), (30, 40), (300, 7), (1, 50), (64, 64)])
def test_op_norm_is_an_upper_bound_within_its_margin(shape):
    torch.manual_seed(6)
    for scale in (1e-30, 1.0, 1e30):
        w = torch.randn(*shape, dtype=torch.float64) * scale
        exact = float(torch.linalg.matrix_norm(w, ord=2))
        got = bounds.op_norm(w)
        assert exact <= got <= exact * (1 + 2 * bounds.margin(*shape) + 1e-15)


def test_op_norm_batched_vectors_scalars_and_empty():
    torch.manual_seed(1)
    w = torch.randn(3, 6, 5, dtype=torch.float64)
    exact = max(float(torch.linalg.matrix_norm(m, ord=2)) for m in w)
    assert exact <= bounds.op_norm(w) <= exact * (1 + 1e-12)
    v = torch.randn(10, dtype=torch.float64)
    assert float(v.norm()) <= bounds.op_norm(v) <= float(v.norm()) * (1 + 1e-14)
    assert bounds.op_norm(torch.tensor(-3.0)) == 3.0
    assert bounds.op_norm(torch.zeros(0, 4)) == 0.0
    with pytest.raises(TypeError, match="tensor"):
        bounds.op_norm([[1.0]])


def test_gram_power_bound_above_the_exact_limit(monkeypatch):
    torch.manual_seed(2)
    w = torch.randn(40, 30, dtype=torch.float64)
    exact = float(torch.linalg.matrix_norm(w, ord=2))
    monkeypatch.setattr(norms, "EXACT_LIMIT", 10)
    bound = norms.op_norm(w)
    assert exact <= bound <= exact * 30 ** (1 / 256) * 1.001


def test_op_norm_follows_in_place_updates():
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(20, 10, dtype=torch.float64))
    first = bounds.op_norm(p)
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):
        p.mul_(2.0)  # as FSDP2 writes gathered weights: the version counter does not move
    assert math.isclose(bounds.op_norm(p), 2 * first, rel_tol=1e-12)


def test_tensor_op_norm_matches_the_float_one():
    torch.manual_seed(4)
    w = torch.randn(33, 17, dtype=torch.float64)
    assert math.isclose(float(bounds.op_norm_tensor(w)), bounds.op_norm(w), rel_tol=1e-13)
    v = torch.randn(9, dtype=torch.float64)
    assert float(bounds.op_norm_tensor(v)) >= float(v.norm())


def test_product_row_and_sandwich_norms():
    torch.manual_seed(6)
    a, b = torch.randn(50, 5, dtype=torch.float64), torch.randn(5, 60, dtype=torch.float64)
    exact = float(torch.linalg.matrix_norm(a @ b, ord=2))
    assert exact <= bounds.product_norm(a, b) <= exact * (1 + 1e-9)
    a2, b2 = torch.randn(8, 20, dtype=torch.float64), torch.randn(20, 9, dtype=torch.float64)  # not thin
    exact2 = float(torch.linalg.matrix_norm(a2 @ b2, ord=2))
    assert exact2 <= bounds.product_norm(a2, b2) <= exact2 * (1 + 1e-9)
    with pytest.raises(ValueError, match="inner sizes"):
        bounds.product_norm(a, a)
    w = torch.randn(40, 30, dtype=torch.float64)
    assert float(w.norm(dim=1).max()) <= bounds.row_norm_max(w) <= float(w.norm(dim=1).max()) * (1 + 1e-13)
    assert float(w.abs().sum(1).max()) <= bounds.inf_norm(w)
    a, b = torch.randn(7, 12, dtype=torch.float64), torch.randn(12, 9, dtype=torch.float64)
    bound = bounds.sandwich_norm(a, b, -0.2, 1.1)
    for _ in range(200):
        dd = -0.2 + 1.3 * torch.rand(12, dtype=torch.float64)
        dd[torch.rand(12) < 0.5] = torch.tensor([-0.2, 1.1], dtype=torch.float64)[torch.randint(0, 2, (1,))]
        assert float(torch.linalg.matrix_norm(a @ torch.diag(dd) @ b, ord=2)) <= bound


def test_margin_grows_with_the_shape_and_stays_small():
    assert 0 < bounds.margin(64, 32) < bounds.margin(3072, 768) < 2e-9
    assert bounds.margin(768, 3072) == bounds.margin(3072, 768)


def test_poly_collapse_at_a_scale_is_sound_and_tight_there():
    p = bounds.Poly({0.0: 2.0, 1.0: 3.0, 2.0: 0.5, 5.0: 1.0})
    for t in (0.1, 1.0, 7.0):
        c, b = p.collapse_growth(5, t)
        for r in (0.0, 1e-3, 0.5, t, 3.0, 1e3):
            assert p(r) <= c * r**5 + b + 1e-12 * (c * r**5 + b)
        assert math.isclose(c * t**5 + b, p(t), rel_tol=1e-12)
    with pytest.raises(ValueError, match="degree"):
        p.collapse_growth(2)


def test_fold_peak_dominates_every_polynomial():
    polys = [{0.0: 1.0, 1.0: 2.0}, {2.0: 0.5, 0.0: 3.0}, bounds.Poly({1.0: 4.0})]
    peak = bounds.fold_peak(polys, "x")
    for r in (0.0, 0.3, 1.0, 10.0, 1e4):
        top = max(bounds.Poly(p)(r) if isinstance(p, dict) else p(r) for p in polys)
        assert top <= peak.bound(r)
    with pytest.raises(ValueError, match="non-negative"):
        bounds.fold_peak([{1.0: -1.0}], "x")


@pytest.mark.parametrize("kind", ["layer", "rms", "l2"])
def test_normalization_bounds_hold(kind):
    torch.manual_seed(5)
    d, eps = 16, 1e-3
    g = torch.randn(d, dtype=torch.float64)
    beta = torch.randn(d, dtype=torch.float64) if kind == "layer" else None
    a, jac = bounds.norm_bounds(kind, g, beta, eps, numel=d)

    def f(x):
        if kind == "layer":
            return F.layer_norm(x, (d,), g, beta, eps)
        if kind == "rms":
            return F.rms_norm(x, (d,), g, eps)
        return g * x / torch.sqrt((x * x).sum() + eps)

    for scale in (1e-4, 1e-2, 1.0, 1e3):
        x = torch.randn(d, dtype=torch.float64) * scale
        assert float(f(x).norm()) <= a
        J = torch.autograd.functional.jacobian(f, x)
        assert float(torch.linalg.matrix_norm(J, ord=2)) <= jac
    with pytest.raises(ValueError, match="eps"):
        bounds.norm_bounds(kind, g, beta, 0.0, numel=d)
    with pytest.raises(ValueError, match="kind"):
        bounds.norm_bounds("batch", g, beta, eps, numel=d)


def test_prenorm_jacobian_is_below_the_plain_product():
    norm = torch.nn.LayerNorm(8, eps=1e-4)
    a, g = bounds.module_norm_bounds(norm)
    branch = lambda r: 1.0 + 2.0 * r  # noqa: E731
    assert bounds.prenorm_jacobian(norm, branch) <= branch(a) * g
