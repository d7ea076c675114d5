"""certblocks.testing, the soundness harness: it finds planted counterexamples and passes sound certificates.

A checker that cannot fail is worthless: every check is tested against a certificate made wrong on
purpose (a coefficient 10% too small, an intermediate the peak forgot), and against the exact
certificate of a map whose bounds are attained, where the search must come close to them.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import certblocks.testing as cbt
from certblocks.certificate import BlockCertificate, Peak

N, D = 4, 8
SHAPE = (N, D)
FAST = dict(radii=(1e-3, 1.0, 1e3), count=14, restarts=2, from_best=1, steps=10, power_iters=15)


def _linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(D, D).double()


def _exact(lin: nn.Linear, *, c: float = 1.0, l0: float = 1.0, peak: float = 1.0) -> BlockCertificate:
    """The attained certificate of ``W x + b`` (per-token norm), each coefficient scaled by a factor."""
    w, b = lin.weight.detach(), lin.bias.detach()
    op = float(torch.linalg.matrix_norm(w, ord=2))
    rows = float(w.norm(dim=1).max())  # the largest output entry is <= max_i ||w_i|| ||x_t|| + |b_i|
    return BlockCertificate(1, 0, c=c * op, b=float(b.norm()), l1=0.0, l0=l0 * op, name="linear",
                            peak=Peak(1, peak * rows, float(b.abs().max())))


# ------------------------------------------------------------------------------------------ planted counterexamples


def test_exact_linear_certificate_passes_and_is_nearly_attained():
    lin = _linear()
    report = cbt.assert_sound(lin, _exact(lin), SHAPE, **FAST)
    assert report.ok and [r.check for r in report.results] == ["growth", "jacobian", "peak"]
    assert report.growth.ratio > 0.99, report  # ||W x|| -> ||W|| ||x|| along the top singular vector
    assert report.jacobian.ratio > 1 - 1e-9, report  # the power iteration reaches ||W|| exactly
    assert report.peak.ratio > 0.99, report  # a token along the largest row of W


@pytest.mark.parametrize("check, kw", [("growth", dict(c=0.9)), ("jacobian", dict(l0=0.9)), ("peak", dict(peak=0.9))])
def test_finds_a_coefficient_10_percent_too_small(check, kw):
    lin = _linear(1)
    with pytest.raises(AssertionError) as err:
        cbt.assert_sound(lin, _exact(lin, **kw), SHAPE, **FAST)
    msg = str(err.value)
    assert f"{check} bound exceeded by a factor" in msg and "at radius" in msg, msg
    report = err.value.report
    assert [r.check for r in report.failures] == [check], report  # the other two bounds are right
    worst = report.failures[0]
    assert worst.ratio > 1.08, report  # the found ratio approaches 1 / 0.9
    assert worst.input is not None and worst.input.shape == (1, *SHAPE)


def test_reported_input_reproduces_the_ratio():
    lin = _linear(2)
    cert = _exact(lin, c=0.9)
    g = cbt.search_growth(lin, cert, SHAPE, **{k: v for k, v in FAST.items() if k != "power_iters"})
    with torch.no_grad():
        value = float(cbt.token_norm(lin(g.input))[0])
    r = float(cbt.token_norm(g.input)[0])
    assert r == pytest.approx(g.radius, rel=1e-12)
    assert value / cert.growth_bound(r) == pytest.approx(g.ratio, rel=1e-12)
    j = cbt.search_jacobian(lin, _exact(lin, l0=0.9), SHAPE, **FAST)
    assert j.direction is not None and float(cbt.token_norm(j.direction)[0]) == pytest.approx(1.0)
    jw = torch.func.jvp(lin, (j.input,), (j.direction,))[1]
    assert float(cbt.token_norm(jw.detach())[0]) == pytest.approx(j.value, rel=1e-9)  # the tangent attains the value


class Hidden(nn.Module):
    """The identity, computed through an intermediate 1000 times larger than the state."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scale_up_and_down(x)


def _scale_up_and_down(x: torch.Tensor) -> torch.Tensor:
    return (1e3 * x) / 1e3


def test_finds_an_intermediate_the_peak_forgot(monkeypatch):
    cert = BlockCertificate(1, 0, c=1.0, b=0.0, l1=0.0, l0=1.0, name="hidden", peak=Peak(1, 1.0))
    p = cbt.search_peak(Hidden(), cert, SHAPE, radii=(0.5, 10.0), count=7, restarts=1, steps=3)
    assert not p.ok and p.ratio == pytest.approx(1e3, rel=1e-9), p.describe()
    # the same function seen as one primitive: only its output counts
    monkeypatch.setitem(globals(), "_scale_up_and_down", cbt.as_atom(_scale_up_and_down))
    p = cbt.search_peak(Hidden(), cert, SHAPE, radii=(0.5, 10.0), count=7, restarts=1, steps=3)
    assert p.ok and p.ratio > 0.99, p.describe()


class ParameterOnly(nn.Module):
    """A large value computed from the parameters alone, and a masked-logit sentinel computed from x."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.ones(D, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = self.p * 1e6  # not computed from x: never counts
        masked = x * 0.0 + torch.finfo(x.dtype).min / 2  # a mask sentinel: its exponential is 0
        return x + (big - big) + torch.exp(masked)


def test_parameters_and_mask_sentinels_do_not_count():
    cert = BlockCertificate(1, 0, c=1.0, b=0.0, l1=0.0, l0=1.0, name="identity", peak=Peak(1, 1.0))
    report = cbt.assert_sound(ParameterOnly(), cert, SHAPE, **FAST)
    assert report.peak.ratio > 0.99  # the output itself (entries up to ||x||) counts


def test_a_non_finite_value_is_a_counterexample():
    cert = BlockCertificate(1, 0, c=1e300, b=0.0, l1=0.0, l0=1e300, name="overflow")
    g = cbt.search_growth(lambda x: torch.exp(x * 1e3), cert, SHAPE, radii=(1.0,), count=7, restarts=0, from_best=0)
    assert g.ratio == math.inf and not g.ok


class NoForwardAD(torch.autograd.Function):
    """``x W^T`` with a backward and no forward-mode derivative (like the fused attention on the CPU)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(w)
        return x @ w.T

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        (w,) = ctx.saved_tensors
        return g @ w, None


def test_jacobian_without_forward_mode_ad_uses_exact_reverse_scores():
    lin = _linear(3)
    f = lambda x: NoForwardAD.apply(x, lin.weight.detach()) + lin.bias.detach()  # noqa: E731
    assert cbt._resolve_jvp(f, torch.randn(1, *SHAPE, dtype=torch.float64), "auto") == "central"
    ok = cbt.search_jacobian(f, _exact(lin), SHAPE, **FAST)
    assert ok.ok and ok.ratio > 1 - 1e-9, ok.describe()
    bad = cbt.search_jacobian(f, _exact(lin, l0=0.9), SHAPE, **FAST)
    assert not bad.ok and bad.ratio == pytest.approx(1 / 0.9, rel=1e-9), bad.describe()


def test_the_example_batch_is_searched():
    # a needle: ||v(x)|| exceeds ||x|| only within ~1e-2 rad of e, where no family nor any gradient reaches
    e = torch.arange(1.0, D + 1, dtype=torch.float64)
    e = e / e.norm()

    def needle(x: torch.Tensor) -> torch.Tensor:
        cos = (x @ e) / x.norm(dim=-1).clamp_min(1e-300)
        return x * (1 + 0.5 * torch.exp(-1e4 * (1 - cos)))[..., None]

    cert = BlockCertificate(1, 0, c=1.0, b=0.0, name="needle")
    kw = dict(radii=(1.0, 10.0), count=14, restarts=2, steps=5)
    assert cbt.search_growth(needle, cert, (1, D), **kw).ok
    found = cbt.search_growth(needle, cert, e.reshape(1, 1, D), **kw)
    assert found.ratio == pytest.approx(1.5, rel=1e-12) and not found.ok
    assert torch.allclose(found.input[0, 0] / found.radius, e)


# ------------------------------------------------------------------------------------------ pieces


def test_jacobian_norm_lower_reaches_the_norm_of_a_token_mixing_map():
    # v(X) = A X mixes tokens: the per-token induced norm is the largest absolute row sum of A
    g = torch.Generator().manual_seed(4)
    a = torch.randn(N, N, generator=g, dtype=torch.float64)
    exact = float(a.abs().sum(dim=1).max())
    x = torch.randn(3, N, D, generator=g, dtype=torch.float64)
    for mode in ("forward", "central"):
        low = cbt.jacobian_norm_lower(lambda t: a @ t, x, iters=30, jvp=mode)
        assert low.shape == (3,)
        assert float(low.max()) <= exact * (1 + 1e-12) and float(low.min()) >= exact * (1 - 1e-9), (mode, low)


def test_token_norm_and_random_inputs():
    x = torch.zeros(2, 3, 4)
    x[0, 1] = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert cbt.token_norm(x).tolist() == [5.0, 0.0] and cbt.token_norm(x).dtype == torch.float64
    assert cbt.token_norm(torch.ones(2, 4)).tolist() == [2.0, 2.0]  # (B, features): one token
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    draws = cbt.random_inputs((2, N, D), 7.0, 21, generator=gen())
    assert draws.shape == (21, 2, N, D) and draws.dtype == torch.float64
    assert torch.allclose(cbt.token_norm(draws), torch.full((21,), 7.0, dtype=torch.float64))
    assert torch.equal(draws, cbt.random_inputs((2, N, D), 7.0, 21, generator=gen()))  # deterministic
    fam = {name: i for i, name in enumerate(cbt.FAMILIES)}
    tokens = draws.flatten(1, 2)
    eq = tokens[fam["equal_tokens"]]
    assert torch.allclose(eq, eq[:1].expand_as(eq))  # every attention logit row ties
    dom = tokens[fam["dominant_token"]].norm(dim=-1)
    assert float(dom[0]) == pytest.approx(7.0) and float(dom[1:].max()) < 0.1
    assert float(tokens[fam["quiet_last"]][-1].norm()) < 0.01
    assert int((tokens[fam["axis"]] != 0).any(dim=0).sum()) == 1  # one active feature
    assert torch.all(cbt.random_inputs((N, D), 0.0, 3) == 0)


def test_largest_intermediate_and_as_atom():
    x = torch.full((2, N, D), 2.0, dtype=torch.float64)
    assert float(cbt.largest_intermediate(lambda t: (t * 5.0) / 5.0, x).detach()) == 10.0
    atom = cbt.as_atom(lambda t: (t * 5.0) / 5.0)
    assert float(cbt.largest_intermediate(atom, x).detach()) == 2.0
    assert torch.equal(atom(x), x)  # outside a recording: the function itself
    z = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(cbt.largest_intermediate(lambda t: t * 3.0, z), z)  # differentiable
    assert float(g.abs().sum()) == 3.0


def test_deterministic_for_a_seed():
    lin = _linear(5)
    cert = _exact(lin, c=0.95)
    kw = dict(radii=(1.0, 30.0), count=7, restarts=2, steps=5)
    a, b = (cbt.search_growth(lin, cert, SHAPE, seed=3, **kw) for _ in range(2))
    assert a.ratio == b.ratio and torch.equal(a.input, b.input)
    c = cbt.search_growth(lin, cert, SHAPE, seed=4, **kw)
    assert not torch.equal(a.input, c.input)


def test_module_is_searched_as_a_float64_copy_and_left_unchanged():
    torch.manual_seed(6)
    lin = nn.Linear(D, D)  # float32
    cert = BlockCertificate(1, 0, c=100.0, b=100.0, name="loose")
    g = cbt.search_growth(lin, cert, SHAPE, radii=(1.0,), count=7, restarts=1, steps=2)
    assert g.ok and g.input.dtype == torch.float64
    assert lin.weight.dtype == torch.float32 and lin.weight.requires_grad and lin.weight.grad is None


def test_samples_that_mix_are_refused():
    cert = BlockCertificate(1, 0, c=2.0, b=0.0, name="mix")
    with pytest.raises(ValueError, match="mixes the samples"):
        cbt.search_growth(lambda x: x - x.mean(dim=0, keepdim=True), cert, SHAPE)
    with pytest.raises(ValueError, match="mixes the samples"):
        cbt.search_growth(nn.Sequential(nn.Linear(D, D), nn.Dropout(0.5)).train(), cert, SHAPE)


def test_argument_errors():
    lin = _linear()
    no_peak = BlockCertificate(1, 0, c=10.0, b=10.0, l1=0.0, l0=10.0, name="no peak")
    with pytest.raises(ValueError, match="states no peak bound"):
        cbt.search(lin, no_peak, SHAPE, checks=("peak",))
    with pytest.raises(ValueError, match="checks must be among"):
        cbt.search(lin, no_peak, SHAPE, checks=("norm",))
    assert [r.check for r in cbt.search(lin, no_peak, SHAPE, **FAST).results] == ["growth", "jacobian"]
    with pytest.raises(ValueError, match="radius"):
        cbt.search_growth(lin, no_peak, SHAPE, radii=(-1.0,))
    with pytest.raises(ValueError, match="shape"):
        cbt.search_growth(lin, no_peak, ())
    with pytest.raises(ValueError, match="families"):
        cbt.search_growth(lin, no_peak, SHAPE, families=("uniform",))
    with pytest.raises(ValueError, match="steps"):
        cbt.search_growth(lin, no_peak, SHAPE, steps=-1)
    with pytest.raises(ValueError, match="jvp"):
        cbt.search_jacobian(lin, no_peak, SHAPE, jvp="fd")
    with pytest.raises(TypeError, match="BlockCertificate"):
        cbt.search(lin, {"c": 1.0}, SHAPE)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        cbt.search_growth("linear", no_peak, SHAPE)  # type: ignore[arg-type]


@pytest.mark.subprocess
def test_not_imported_by_the_package():
    import subprocess
    import sys

    code = "import sys, certblocks; certblocks.BlockCertificate; print('certblocks.testing' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
