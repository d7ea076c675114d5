"""Rules for order statistics (topk, sort, cummax/cummin), entrywise extrema and clamps between tensors, a
mixture of experts routed by topk, rounding and comparisons, and module atoms around multi-output ops.

Indices, comparisons and roundings computed from the input are piecewise constant: their derivative is 0 and the
certificate bounds the derivative autograd computes (docs/theory.md section 1.1), so a map that selects by them keeps
``sigma`` derived and says that it is piecewise; the searches (random, gradient-ascent, and inputs at ties of the
router or of the entries sorted) do not beat it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from certblocks.exponents import Exponents
from certblocks.trace import certify, register_atom, unregister_atom

from .test_switches import derivative_holds, router_ties

D, T = 6, 4
SHAPE = (1, T, D)


def _certified(m: nn.Module, shape=SHAPE, residual=None):
    torch.manual_seed(3)
    return certify(m.eval(), torch.randn(*shape), residual=residual)


class Order(nn.Module):
    """Values of an order statistic of ``fc(x)``, mapped back to ``D`` features."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.fc = kind, nn.Linear(D, D)
        self.out = nn.Linear(3 if kind == "topk" else D, D)

    def forward(self, x):
        h = self.fc(x)
        if self.kind == "topk":
            v = torch.topk(h, 3, dim=-1).values
        elif self.kind == "topk_tokens":
            v = torch.topk(h, T, dim=1, largest=False).values
        elif self.kind == "sort":
            v = torch.sort(h, dim=-1, descending=True).values
        elif self.kind == "sort_tokens":
            v = torch.sort(h, dim=1).values
        elif self.kind == "cummax":
            v = torch.cummax(h, dim=-1).values
        else:
            v = torch.cummin(h, dim=1).values
        return self.out(v)


class SortIndices(nn.Module):
    """A permutation of the features by their order: the indices select, discontinuously."""

    def forward(self, x):
        return x.gather(-1, torch.sort(x, dim=-1).indices.flip(-1))


def test_sort_indices_select_piecewise(soundness):
    """Gathering by sort indices is a permutation for every order: (1, 0), derivative bound 1 (times the row factor of a
    gather along the last dimension); the map is piecewise (a permutation that changes where two entries swap)."""
    m = SortIndices()
    c = _certified(m)
    assert c.exponents == Exponents(1, 0) and c.coefficients_derived, c.explain()
    assert c.piecewise and "sort indices" in " ".join(c.notes)
    soundness(m, c.certificate, SHAPE, "gather by sort indices")
    ties = torch.randn(8, T, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ties[..., 1] = ties[..., 0]  # equal entries: the order of the two is a tie
    derivative_holds(m, c.certificate, ties)


class Extrema(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc1, self.fc2, self.fc3 = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.floor = nn.Parameter(torch.randn(D))

    def forward(self, x):
        a, b, c = self.fc1(x), self.fc2(x), self.fc3(x)
        if self.kind == "maximum":
            return torch.maximum(a, b) + torch.fmin(b, self.floor)
        if self.kind == "minimum":
            return torch.minimum(a, b[..., :1]) + torch.fmax(c, a) + torch.max(a, c)
        if self.kind == "clamp":
            return torch.clamp(a, min=-b.abs(), max=c.abs())
        return torch.clamp_min(a, b) + torch.clamp_max(c, self.floor)


LIPSCHITZ_SELECTIONS = [(Order, k) for k in ("topk", "topk_tokens", "sort", "sort_tokens", "cummax",
                                             "cummin_tokens")] + \
    [(Extrema, k) for k in ("maximum", "minimum", "clamp", "clamp_one_sided")]


@pytest.mark.parametrize("make, kind", LIPSCHITZ_SELECTIONS, ids=[k for _, k in LIPSCHITZ_SELECTIONS])
def test_lipschitz_selections(make, kind, soundness):
    """Order statistics' values and entrywise extrema keep the exponents of what they select from."""
    m = make(kind)
    c = _certified(m)
    assert c.exponents == Exponents(1, 0), c.explain()
    assert c.coefficients_derived
    soundness(m, c.certificate, SHAPE, kind)


class ExpOfClamped(nn.Module):
    """``exp(clamp_max(x, hi))``: bounded by 1 only when every entry of ``hi`` is <= 0."""

    def __init__(self, hi: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("hi", hi)

    def forward(self, x):
        return torch.exp(torch.clamp_max(x, self.hi))


def test_clamp_sign_reads_every_entry_of_a_tensor_bound():
    nonpositive = torch.tensor([-1.0, -2.0, 0.0, -0.5, -3.0, -1.0])
    assert _certified(ExpOfClamped(nonpositive)).exponents == Exponents(0, 0)
    mixed = nonpositive.clone()
    mixed[2] = 0.5
    assert _certified(ExpOfClamped(mixed)).q is None  # exp of an argument that reaches 0.5


class Expert(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        with torch.no_grad():
            self.fc2.weight.mul_(scale)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    """Top-2 of 4 experts: router logits, topk, softmax of the top values, a combine by gather or by masks."""

    def __init__(self, combine: str) -> None:
        super().__init__()
        self.combine = combine
        self.router = nn.Linear(D, 4)
        self.experts = nn.ModuleList(Expert(s) for s in (1.0, 3.0, 0.5, 1.0))

    def forward(self, x):
        top, idx = torch.topk(self.router(x), 2, dim=-1)  # (B, T, 2)
        w = torch.softmax(top, dim=-1)
        if self.combine == "gather":
            outs = torch.stack([e(x) for e in self.experts], dim=2)  # (B, T, 4, D)
            sel = outs.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, D))  # (B, T, 2, D)
            return (w.unsqueeze(-1) * sel).sum(dim=2)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            gate = (w * (idx == e)).sum(-1, keepdim=True)  # (B, T, 1)
            out = out + gate * expert(x)
        return out


@pytest.mark.parametrize("combine", ["gather", "masks"])
def test_mixture_of_experts(combine, soundness):
    """q: the experts' (the largest); sigma derived although the routing jumps: the gate (q = 0) times an expert
    (sigma = 0) by the product rule, for every choice of the experts."""
    m = MoE(combine)
    c = _certified(m)
    assert c.q == 1 and c.sigma is not None and c.coefficients_derived, c.explain()
    assert c.piecewise and "topk indices" in " ".join(c.notes)
    soundness(m, c.certificate, SHAPE, f"mixture of experts ({combine})")
    x = torch.randn(6, T, D, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    ties = [router_ties(m.router.weight, x, e, bias=m.router.bias) for e in (0.0, 1e-9, -1e-9, 1e-4)]
    derivative_holds(m, c.certificate, torch.cat(ties))  # the router has a bias: a tie is a hyperplane


class Jumps(nn.Module):
    """Rounding (to tens: within 5 of its input), a comparison and an argmax: bounded or near their input, piecewise
    constant (derivative 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        h = self.fc(x)
        return torch.round(h, decimals=-1) + (h > 0.5) * 3.0 + torch.argmax(h, dim=-1, keepdim=True)


def test_rounding_and_comparisons_have_derivative_zero(soundness):
    """The output is a sum of piecewise-constant terms: growth (1, with the rounding's offset), derivative 0 (autograd's
    derivative of round, of a comparison and of an index is 0), the map piecewise.  Jumps: it moves by a rounding step
    (10) across a multiple of 5, where the derivative bound, 0, says nothing about differences."""
    m = Jumps()
    c = _certified(m)
    cert = c.certificate
    assert cert.exponents == Exponents(1, 0) and (cert.l1, cert.l0) == (0.0, 0.0), c.explain()
    assert c.piecewise and "round" in " ".join(c.notes)
    soundness(m, cert, SHAPE, "rounding and comparisons")
    f = copy.deepcopy(m).double()
    with torch.no_grad():  # across h_0 = 5 (x moved along the first row of fc's weight): round(h_0, -1) jumps 0 -> 10
        w0, b0 = m.fc.weight[0].double(), m.fc.bias[0].double()
        u = w0 / w0.norm() ** 2
        x = ((5.0 - b0) * u).expand(1, T, D)
        jump = (f(x + 1e-6 * u) - f(x - 1e-6 * u)).abs().max()
    assert float(jump) > 5.0


class MishOfSorted(nn.Module):
    """``mish(sort(x))``: Lipschitz with ``|mish(v)| <= |v|``; the rules read the product as (1, 1)."""

    def forward(self, x):
        v = torch.sort(x, dim=-1).values
        return v * torch.tanh(F.softplus(v))


class CummaxAct(nn.Module):
    """A module whose multi-output op leaves an index output unused."""

    def forward(self, x):
        values, _ = torch.cummax(x, dim=-1)
        return values


class WithAtoms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, D)
        self.act, self.cum = MishOfSorted(), CummaxAct()

    def forward(self, x):
        return self.fc2(self.act(self.cum(self.act(self.fc1(x)))))  # `act` is called twice


def _mish_coefficients(module, in_shape, out_shape):
    return {"c": 1.0, "b": 0.0, "l1": 0.0, "l0": 1.2}  # sort is 1-Lipschitz, |mish(v)| <= |v|, mish' <= 1.2


def test_module_atoms_around_multi_output_ops(soundness):
    m = WithAtoms()
    assert _certified(m).exponents == Exponents(1, 2)  # mish o mish by the product rule: (1, 1) o (1, 1)
    register_atom(MishOfSorted, (1, 0), coefficients=_mish_coefficients, name="MishOfSorted")
    register_atom(CummaxAct, (1, 0), name="Cummax")
    try:
        c = _certified(m)
        assert c.exponents == Exponents(1, 0), c.explain()
        atom_rows = [r for r in c.nodes if r.rule.startswith("atom")]
        assert sorted(r.rule.split(" (")[0] for r in atom_rows) == ["atom Cummax", "atom MishOfSorted",
                                                                    "atom MishOfSorted"]
        assert not any(r.op in ("aten.sort", "aten.cummax") for r in c.nodes)  # the atoms hide their ops
        unregister_atom(CummaxAct)
        c = _certified(m)
        assert c.coefficients_derived
        soundness(m, c.certificate, SHAPE, "atoms around sort")
    finally:
        unregister_atom(MishOfSorted)
        unregister_atom(CummaxAct)


class TwoInputs(nn.Module):
    def forward(self, x, y):
        return torch.sort(x * torch.sigmoid(y), dim=-1).values


class UsesTwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.mix = nn.Linear(D, D), TwoInputs()

    def forward(self, x):
        return self.mix(x, self.fc(x))


def test_module_atom_that_cannot_apply_says_why():
    register_atom(TwoInputs, (1, 0), name="TwoInputs")
    try:
        with pytest.warns(UserWarning, match=r"atom TwoInputs registered for mix not applied: .* 2 tensors"):
            c = _certified(UsesTwoInputs())
        assert c.exponents == Exponents(1, 1)  # the ops inside, one by one
    finally:
        unregister_atom(TwoInputs)
