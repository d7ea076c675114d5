"""Input-dependent switches: ``where`` and ``masked_fill`` with a condition computed from the input, a router's top-k
selection of experts, a gather by the index of a maximum.

The Jacobian bound of a certificate bounds the derivative autograd computes at every input of the ball
(docs/theory.md section 1.1): at a switch, the derivative of the branch autograd takes.  So a switch keeps ``sigma``
derived (the sum rule of its branches, every index in range), the certificate says that the map is piecewise, and:

* the searches (autograd's vector-Jacobian and Jacobian-vector products, random and gradient-ascent inputs, and
  inputs on and near the switching surfaces: entries at 0 for ``x > 0``, ties of the router's logits, equal maxima)
  do not beat it;
* the map does jump: across a switching surface its value changes by far more than the Jacobian bound times the
  distance (the bound is not a Lipschitz constant between two inputs), and the note says so;
* a derivative bound taken too small on a switch (the ``where`` rule planted to read one branch only) is found, by the
  conformance checker and by the search.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, List, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import certblocks.testing as cbt
from certblocks.testing.conformance import FAST, Sample, check_rule
from certblocks.trace import certify
from certblocks.trace.report import PIECEWISE_NOTE
from certblocks.trace.rules import registry

D, T, E = 8, 4, 4
SHAPE = (1, T, D)


class Where(nn.Module):
    """``where(x > 0, a(x), s tanh(b(x)))``: the branches differ at ``x_i = 0``, the map jumps there."""

    def __init__(self, s: float = 1.0) -> None:
        super().__init__()
        self.a, self.b, self.s = nn.Linear(D, D), nn.Linear(D, D), s

    def forward(self, x):
        return torch.where(x > 0, self.a(x), self.s * torch.tanh(self.b(x)))


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x):
        return self.a(x).masked_fill(x < 0, 3.0)


class Routed(nn.Module):
    """Top-2 of 4 experts: bias-free router logits (a tie stays a tie when ``x`` is scaled), the softmax of the two
    largest as weights, each expert's output gated by its weight where it is selected."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(E))

    def forward(self, x):
        top, idx = torch.topk(self.router(x), 2, dim=-1)
        w = torch.softmax(top, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + (w * (idx == e)).sum(-1, keepdim=True) * torch.tanh(expert(x))
        return out


class ArgmaxPick(nn.Module):
    """``fc(x)`` scaled by the entry of ``x`` at its own maximum, read by a gather (an index computed from ``x``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return self.fc(x) * x.gather(-1, x.argmax(-1, keepdim=True))


def _certified(m: nn.Module):
    torch.manual_seed(0)
    m = m.eval()
    return m, certify(m, torch.randn(*SHAPE), residual=None)


SWITCHES: List[Callable[[], nn.Module]] = [Where, Masked, Routed, ArgmaxPick]


@pytest.mark.parametrize("make", SWITCHES, ids=[f.__name__ for f in SWITCHES])
def test_a_switch_derives_sigma_and_says_the_map_is_piecewise(make, soundness):
    m, c = _certified(make())
    assert c.q is not None and c.sigma is not None and c.coefficients_derived, c.explain()
    assert c.piecewise and any(str(n).startswith(PIECEWISE_NOTE) for n in c.notes), c.notes
    assert "piecewise" in c.explain() and "jumps between branches" in c.explain()
    soundness(m, c.certificate, SHAPE, make.__name__)


def router_ties(weight: torch.Tensor, x: torch.Tensor, eps: float = 0.0, bias: Optional[torch.Tensor] = None) -> \
        torch.Tensor:
    """``x`` moved, token by token, onto the surface where the 2nd and 3rd router logits ``x W^T + b`` tie, then ``eps``
    off it along its normal (towards the 3rd expert for ``eps > 0``): where a top-2 routing switches experts."""
    w = weight.detach().double()
    x = x.clone().double()
    logits = x @ w.T + (0.0 if bias is None else bias.detach().double())
    order = logits.argsort(dim=-1, descending=True)
    a, b = order[..., 1], order[..., 2]
    d = w[a] - w[b]  # (..., D): the normal of the surface l_a = l_b
    gap = (logits.gather(-1, a[..., None]) - logits.gather(-1, b[..., None]))[..., 0]
    nn2 = (d * d).sum(-1)
    return x - ((gap / nn2)[..., None] - eps / nn2.sqrt()[..., None]) * d


def _ties(m: Routed, x: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    return router_ties(m.router.weight, x, eps)


def _surface(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Inputs on and near ``m``'s switching surfaces, from the batch ``x``."""
    if isinstance(m, Routed):
        return torch.cat([_ties(m, x)] + [_ties(m, x, s * e) for e in (1e-12, 1e-7, 1e-3) for s in (1, -1)])
    if isinstance(m, ArgmaxPick):  # the two largest entries of every token made equal (then split by eps)
        top = x.topk(2, dim=-1)
        outs = []
        for eps in (0.0, 1e-9, -1e-9, 1e-4):
            y = x.clone()
            y.scatter_(-1, top.indices[..., 1:], top.values[..., :1] - eps)
            outs.append(y)
        return torch.cat(outs)
    outs = []  # x > 0 and x < 0: entries at 0 and around it
    for eps in (0.0, 1e-12, -1e-12, 1e-6, -1e-6):
        y = x.clone()
        y[..., ::2] = eps
        outs.append(y)
    return torch.cat(outs)


def on_sphere(x: torch.Tensor, r: float) -> torch.Tensor:
    """Every sample of ``x`` rescaled to per-token norm ``r``."""
    return x * (r / cbt.token_norm(x))[:, None, None]


def derivative_holds(m: nn.Module, cert, xs: torch.Tensor, iters: int = 20) -> float:
    """autograd's derivative at the inputs ``xs`` (on and near switching surfaces, where it is the branch autograd
    takes) is within the bound, and a search started from them finds nothing; the largest ratio derivative / bound."""
    low = cbt.jacobian_norm_lower(copy.deepcopy(m).double(), xs, iters=iters)
    bound = torch.tensor([cert.jacobian_bound(float(n)) for n in cbt.token_norm(xs)], dtype=torch.float64)
    assert bool((low <= bound * (1 + 1e-9)).all()), float((low / bound).max())
    radius = float(cbt.token_norm(xs).max())
    found = cbt.search_jacobian(m, cert, xs, radii=(radius,), count=4, restarts=1, from_best=2, steps=5, power_iters=8)
    assert found.ok, found.describe()
    return float((low / bound).max())


@pytest.mark.parametrize("make", SWITCHES, ids=[f.__name__ for f in SWITCHES])
def test_the_derivative_bound_holds_on_and_near_the_switching_surface(make):
    m, c = _certified(make())
    g = torch.Generator().manual_seed(1)
    for r in (0.5, 3.0, 30.0):
        xs = _surface(m, on_sphere(torch.randn(6, T, D, generator=g, dtype=torch.float64), r))
        assert derivative_holds(m, c.certificate, xs) > 1e-3  # the derivative is not negligible there: it can fail


def test_the_router_jumps_across_a_tie_and_the_note_says_so():
    """Across a tie of the 2nd and 3rd router logits the selected expert changes and the output jumps by about
    ``w_2 (E_3(x) - E_2(x))``: far more than the derivative bound times the distance.  The bound holds for the
    derivative (the previous test), not for differences across the jump."""
    m, c = _certified(Routed())
    m64 = copy.deepcopy(m).double()
    x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    eps = 1e-7
    hi, lo = _ties(m, x, eps), _ties(m, x, -eps)
    with torch.no_grad():
        jump = float(cbt.token_norm(m64(hi) - m64(lo)))
    dist = float(cbt.token_norm(hi - lo))
    r = float(torch.maximum(cbt.token_norm(hi), cbt.token_norm(lo)))
    assert dist == pytest.approx(2 * eps, rel=1e-6)
    assert jump > 1e-3 and jump > 1e3 * c.certificate.jacobian_bound(r) * dist, (jump, dist)
    note = next(str(n) for n in c.notes if str(n).startswith(PIECEWISE_NOTE))
    assert "topk indices" in note and "jumps between branches" in note


def _one_branch_where(rule: Callable) -> Callable:
    """The ``where`` rule planted with a derivative bound too small: the ``self`` branch's only."""

    def planted(it, n, a, shape):
        out = rule(it, n, a, shape)
        x = a["self"]
        return dataclasses.replace(out, jacobian=x.jacobian) if getattr(x, "jacobian", None) is not None else out

    return planted


def test_a_too_small_derivative_bound_on_a_switch_is_found(monkeypatch):
    """The rule of ``where`` planted to bound the derivative by the ``self`` branch's only: the conformance checker
    (autograd's products at the points, no difference quotient across the jump at 0) and the search both find it;
    the true rule passes the same checks."""
    fn = lambda x: torch.where(x > 0, 2.0 * x + 1.0, -3.0 * x)  # noqa: E731  (jumps by 1 at 0)
    x = torch.linspace(-1.0, 2.0, 15, dtype=torch.float64).reshape(3, 5)
    x[1, 2] = 0.0  # on the switching surface
    sample = [Sample((x,), fn=fn, label="where(x > 0, 2x + 1, -3x)")]
    e = torch.zeros_like(x)
    e[1, 2] = 1.0
    quotient = float((fn(x + 1e-6 * e) - fn(x - 1e-6 * e)).abs().max()) / 2e-6
    assert quotient > 1e5  # across the jump at 0 a difference quotient reads 1/(2h), not a derivative (at most 3)
    assert check_rule("aten.where", sample, effort=FAST).ok  # the true rule: sum of the branches, 5
    torch.manual_seed(0)
    m = Where(s=3.0).eval()
    true = certify(m, torch.randn(*SHAPE), residual=None).certificate
    monkeypatch.setitem(registry._RULES, "aten.where", _one_branch_where(registry._RULES["aten.where"]))
    rep = check_rule("aten.where", sample, effort=FAST)
    found = [f for f in rep.findings if f.op == "aten.where" and f.check == "jacobian"]
    assert found and max(f.ratio for f in found) == pytest.approx(1.5, rel=1e-6), rep.table()
    assert all("difference quotient" not in f.detail for f in found), [f.detail for f in found]
    planted = certify(m, torch.randn(*SHAPE), residual=None).certificate
    assert planted.l0 < true.l0 and planted.sigma == true.sigma == 0
    search = dict(radii=(0.5, 5.0), count=8, restarts=1, from_best=1, steps=5, power_iters=10)
    assert cbt.search_jacobian(m, true, (T, D), **search).ok
    beaten = cbt.search_jacobian(m, planted, (T, D), **search)
    assert not beaten.ok and beaten.ratio > 1.2, beaten.describe()


def test_where_between_constants_and_a_gather_of_constants_have_derivative_zero():
    """A switch between two constants (or a gather from a constant table) has derivative 0: sigma 0, L = 0, and the
    value bounded by the constants whatever the condition."""

    class Consts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.randn(D, D))

        def forward(self, x):
            return torch.where(x.sum(-1, keepdim=True) > 1.0, 10.0, -2.0) + F.embedding(x.argmax(-1), self.table)

    m, c = _certified(Consts())
    cert = c.certificate
    assert (cert.q, cert.sigma, cert.c, cert.l1, cert.l0) == (0.0, 0.0, 0.0, 0.0, 0.0), c.explain()
    assert cert.b >= 10.0 and c.piecewise
