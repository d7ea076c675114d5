"""Per-op rules on small plain-torch blocks: activations, normalizations, convolutions, attention forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from certblocks.exponents import Exponents
from certblocks.trace import certify

D = 6


class Act(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(D, 2 * D), act, nn.Linear(2 * D, D)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("act", [nn.ReLU(), nn.GELU(), nn.GELU(approximate="tanh"), nn.SiLU(), nn.Softplus(),
                                 nn.ELU(), nn.LeakyReLU(0.1), nn.Hardswish()])
def test_lipschitz_activations(act):
    assert certify(Act(act), torch.randn(2, 3, D)).exponents == Exponents(1, 0)


@pytest.mark.parametrize("act", [nn.Tanh(), nn.Sigmoid(), nn.Hardtanh(), nn.ReLU6()])
def test_saturating_activations(act):
    # W2 s(W1 x): the affine output map keeps q = 0 (bounded) plus the bias
    assert certify(Act(act), torch.randn(2, 3, D)).exponents == Exponents(0, 0)


class Normed(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = {"ln": nn.LayerNorm(D), "rms": nn.RMSNorm(D, eps=1e-5), "gn": nn.GroupNorm(2, D),
                     "l2": None}[kind]
        self.mlp = Act(nn.SiLU())

    def forward(self, x):
        if self.kind == "gn":
            h = self.norm(x.transpose(1, 2)).transpose(1, 2)
        elif self.kind == "l2":
            h = F.normalize(x, dim=-1)
        else:
            h = self.norm(x)
        return self.mlp(h)


@pytest.mark.parametrize("kind", ["ln", "rms", "gn", "l2"])
def test_normalizations_on_the_input(kind):
    c = certify(Normed(kind), torch.randn(2, 3, D))
    assert c.exponents == Exponents(0, 0), c.explain()
    assert c.coefficients_derived


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(D, D, 3, padding=1)
        self.dw = nn.Conv1d(D, D, 3, padding=1, groups=D)

    def forward(self, x):  # (B, L, D)
        return self.dw(F.gelu(self.conv(x.transpose(1, 2)))).transpose(1, 2)


def test_convolutions_are_linear():
    assert certify(ConvBlock(), torch.randn(2, 5, D)).exponents == Exponents(1, 0)


class FlashCPU(nn.Module):
    """The CPU flash-attention aten op called directly (what decomposed graphs contain)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]
        return out.squeeze(1)


def test_cpu_flash_attention_form():
    assert certify(FlashCPU(), torch.randn(2, 4, D)).exponents == Exponents(1, 2)


class Powers(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        return x.pow(self.p) if self.p != 0.5 else torch.sqrt(x.abs())


@pytest.mark.parametrize("p, expected", [(2, (2, 1)), (3, (3, 2)), (1.5, (1.5, 0.5)), (0.5, (None, None))])
def test_power(p, expected):
    assert certify(Powers(p), torch.randn(2, 3, D)).exponents == Exponents(*expected)


class DivByInput(nn.Module):
    def forward(self, x):
        return x / (x.abs().sum(-1, keepdim=True) + 1.0)


def test_division_by_input_is_not_derived():
    c = certify(DivByInput(), torch.randn(2, 3, D))
    assert c.q is None and c.culprit_node.startswith("div")


@pytest.mark.parametrize("make", [lambda: Normed("rms"), lambda: Normed("gn"), lambda: Normed("l2"), ConvBlock,
                                  lambda: Act(nn.Tanh()), lambda: Act(nn.Softplus()), FlashCPU])
def test_op_coefficients_sound(make, soundness):
    torch.manual_seed(2)
    m = make().eval()
    shape = (1, 4, D)
    c = certify(m, torch.randn(*shape))
    assert c.coefficients_derived
    soundness(m, c.certificate, shape, type(m).__name__)


class ScaleNormNoEps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g, self.mlp = nn.Parameter(torch.tensor(2.0)), Act(nn.GELU())

    def forward(self, x):
        return self.mlp(self.g * x / torch.linalg.vector_norm(x, dim=-1, keepdim=True))


def test_x_over_norm_without_eps():
    c = certify(ScaleNormNoEps(), torch.randn(2, 3, D))
    assert c.exponents == Exponents(0, 0)
    assert not c.coefficients_derived  # the Jacobian of x/||x|| is unbounded at the origin
    assert c.certificate.b < 1e3  # the growth bound is still derived


def test_activation_lipschitz_constants():
    """The Lipschitz constants used by the rules and atoms bound the true slopes."""
    from certblocks.trace.atoms import GELU_LIP
    from certblocks.trace.interp import _LIPSCHITZ

    x = torch.linspace(-12, 12, 400001, dtype=torch.float64, requires_grad=True)
    fns = {"aten.gelu": F.gelu, "aten.silu": F.silu, "aten.mish": F.mish, "aten.hardswish": F.hardswish}
    for name, f in fns.items():
        y = f(x)
        (g,) = torch.autograd.grad(y.sum(), x)
        y = y.detach()
        lip, slope, a0, _ = _LIPSCHITZ[name]
        assert float(g.abs().max()) <= lip
        assert float((y.abs() - slope * x.detach().abs() - a0).max()) <= 1e-12
    for f in (lambda t: F.gelu(t, approximate="tanh"), lambda t: t * torch.sigmoid(1.702 * t)):
        y = f(x)
        (g,) = torch.autograd.grad(y.sum(), x)
        y = y.detach()
        assert float(g.abs().max()) <= GELU_LIP
        assert float((y.abs() - x.detach().abs()).max()) <= 1e-12
