"""Rules for reads by index (gather, index_select, index), writes into slices (slice_scatter, select_scatter),
addcmul/addcdiv/lerp, and division by a denominator with a proven positive minimum."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from certblocks.exponents import Exponents
from certblocks.trace import certify

D, T = 6, 4
SHAPE = (1, T, D)


def _certified(m: nn.Module, shape=SHAPE):
    torch.manual_seed(1)
    return certify(m.eval(), torch.randn(*shape), residual=None)


def _rules(c) -> dict:
    return {r.op: r.rule for r in c.nodes}


class GatherLast(nn.Module):
    """DeBERTa's relative positions: scores against 2T position embeddings, gathered at ``i - j + T``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.pos, self.out = nn.Linear(D, D), nn.Parameter(torch.randn(2 * T, D)), nn.Linear(T, D)
        i = torch.arange(T)
        self.register_buffer("rel", (i[:, None] - i[None, :] + T).clamp(0, 2 * T - 1))

    def forward(self, x):
        scores = self.fc(x) @ self.pos.T  # (B, T, 2T)
        return self.out(scores.gather(-1, self.rel.expand(x.shape[0], -1, -1)))


class GatherRepeats(nn.Module):
    """A gather along the last dimension that repeats one entry of each row (row factor sqrt(5))."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.register_buffer("idx", torch.tensor([0, 0, 0, 0, 0, 1]).repeat(T, 1))

    def forward(self, x):
        return self.fc(x).gather(-1, self.idx.expand(x.shape[0], -1, -1))


class GatherTokens(nn.Module):
    """A gather along the tokens: each feature of an output token comes from another input token."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.register_buffer("idx", torch.randint(0, T, (T, D), generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return self.fc(x).gather(1, self.idx.expand(x.shape[0], -1, -1))


class IndexReads(nn.Module):
    """index_select and advanced indexing, along the tokens and along the features (with repeats)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.register_buffer("tok", torch.tensor([3, 3, 0, 1]))
        self.register_buffer("feat", torch.tensor([5, 5, 5, 2, 1, 0]))

    def forward(self, x):
        h = self.fc(x)
        a = h.index_select(1, self.tok) + h.index_select(-1, self.feat)
        return a + h[:, self.tok] + h[..., self.feat]


@pytest.mark.parametrize("make", [GatherLast, GatherRepeats, GatherTokens, IndexReads])
def test_constant_index_reads(make, soundness):
    m = make()
    c = _certified(m)
    assert c.exponents == Exponents(1, 0), c.explain()
    assert c.coefficients_derived
    soundness(m, c.certificate, SHAPE, make.__name__)


def test_gather_repeats_count_in_the_bound():
    """The row factor is sqrt(largest repetition count): 5 copies of entry 0 give sqrt(5 + 1) >= ratio."""
    c = _certified(GatherRepeats())
    assert "row factor 2.24" in _rules(c)["aten.gather"]


class Scatters(nn.Module):
    """Writes into slices: ``out[..., :2] = ...`` (the last dim), ``out[:, 1:] = ...`` (RWKV's time shift),
    ``out[:, 0] = ...`` and ``out[..., 3] = ...`` (select_scatter along a token and along the features)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h, g = self.fc1(x), self.fc2(x)
        out = h.clone()
        out[..., :2] = 3.0 * g[..., :2]
        shifted = torch.zeros_like(h)
        shifted[:, 1:] = h[:, :-1]
        out[:, 0] = g[:, 1]
        out[..., 3] = g[..., 0] * 2.0
        return out + shifted


def test_slice_and_select_scatter(soundness):
    m = Scatters()
    c = _certified(m)
    assert c.exponents == Exponents(1, 0), c.explain()
    assert {"aten.slice_scatter", "aten.select_scatter"} <= set(_rules(c))
    soundness(m, c.certificate, SHAPE, "Scatters")


class Affine(nn.Module):
    """ResMLP's affine ``alpha * x + beta``, written ``addcmul(beta, alpha, x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha, self.beta = nn.Parameter(torch.randn(D)), nn.Parameter(torch.randn(D))

    def forward(self, x):
        return torch.addcmul(self.beta, self.alpha, x)


def test_addcmul_affine_is_tight(soundness):
    m = Affine()
    c = _certified(m)
    assert c.exponents == Exponents(1, 0)
    cert = c.certificate
    assert cert.c <= float(m.alpha.abs().max()) * (1 + 1e-6)  # |alpha * x| <= max|alpha| |x|, no more
    assert cert.b <= float(m.beta.norm()) * (1 + 1e-6)
    assert cert.l0 <= float(m.alpha.abs().max()) * (1 + 1e-6)
    soundness(m, cert, SHAPE, "Affine")


class AddcOps(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, D)
        self.den = nn.Parameter(torch.rand(D) + 0.5)
        self.w = nn.Parameter(torch.rand(D))

    def forward(self, x):
        h, g = self.fc1(x), self.fc2(x)
        if self.kind == "addcmul2":
            return torch.addcmul(h, h, g, value=0.5)
        if self.kind == "addcdiv":
            return torch.addcdiv(g, h, self.den, value=-2.0)
        if self.kind == "addcdiv_input":  # the denominator 1 + relu(g) >= 1
            return torch.addcdiv(g, h, 1.0 + F.relu(g))
        if self.kind == "lerp":
            return torch.lerp(h, g, 0.3)
        return torch.lerp(h, g, self.w)


@pytest.mark.parametrize("kind, expected", [("addcmul2", (2, 1)), ("addcdiv", (1, 0)), ("addcdiv_input", (1, 1)),
                                            ("lerp", (1, 0)), ("lerp_tensor", (1, 0))])
def test_addc_and_lerp(kind, expected, soundness):
    m = AddcOps(kind)
    c = _certified(m)
    assert c.exponents == Exponents(*expected), c.explain()
    assert c.coefficients_derived
    soundness(m, c.certificate, SHAPE, kind)


class AddcdivUnbounded(nn.Module):
    def __init__(self, const: bool) -> None:
        super().__init__()
        self.const, self.fc = const, nn.Linear(D, D)
        self.den = nn.Parameter(torch.tensor([1.0, 0.0, 1.0, 1.0, 2.0, 1.0]))

    def forward(self, x):
        return torch.addcdiv(x, x, self.den if self.const else self.fc(x))


@pytest.mark.parametrize("const, why", [(True, "a constant with zeros"), (False, "no proven positive lower bound")])
def test_addcdiv_without_a_minimum_is_not_derived(const, why):
    c = _certified(AddcdivUnbounded(const))
    assert c.q is None and c.sigma is None
    assert why in c.culprit and c.culprit_node.startswith("addcdiv")


class LinearAttention(nn.Module):
    """Linear attention: ``phi(q) (phi(k)^T v) / (phi(q) . sum phi(k) + eps)`` with ``phi = relu``."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        q, k, v = F.relu(self.q(x)), F.relu(self.k(x)), self.v(x)
        num = q @ (k.transpose(1, 2) @ v)  # (B, T, D)
        den = (q * k.sum(dim=1, keepdim=True)).sum(-1, keepdim=True)  # (B, T, 1), >= 0
        return num / (den + 1e-2)


class DivByPositive(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.fc = kind, nn.Linear(D, D)

    def forward(self, x):
        if self.kind == "l1":
            return x / (x.abs().sum(-1, keepdim=True) + 1.0)
        if self.kind == "clamp":
            return self.fc(x) / F.relu(self.fc(x)).sum(-1, keepdim=True).clamp_min(0.5)
        return x / (self.fc(x).sum(-1, keepdim=True) + 1.0)  # the denominator can be 0


@pytest.mark.parametrize("make, expected", [(LinearAttention, (3, 4)), (lambda: DivByPositive("l1"), (1, 1)),
                                            (lambda: DivByPositive("clamp"), (1, 1))])
def test_division_by_a_proven_positive_denominator(make, expected, soundness):
    m = make()
    c = _certified(m)
    assert c.exponents == Exponents(*expected), c.explain()
    assert c.coefficients_derived
    assert "proven minimum" in _rules(c)["aten.div"]
    soundness(m, c.certificate, SHAPE, type(m).__name__)


def test_division_without_a_lower_bound_names_the_denominator():
    c = _certified(DivByPositive("any"))
    assert c.q is None and c.culprit_node.startswith("div")
    assert "(add)" in c.culprit and "no proven positive lower bound" in c.culprit
