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
    def __init__(self, p: float, signed: bool = False) -> None:
        super().__init__()
        self.p, self.signed = p, signed

    def forward(self, x):
        if self.p == 0.5:
            return torch.sqrt(x.abs())
        return x.pow(self.p) if self.p.is_integer() or self.signed else x.abs().pow(self.p)


@pytest.mark.parametrize("p, expected", [(2.0, (2, 1)), (3.0, (3, 2)), (1.5, (1.5, 0.5)), (0.5, (None, None))])
def test_power(p, expected):
    assert certify(Powers(p), torch.randn(2, 3, D)).exponents == Exponents(*expected)


def test_fractional_power_of_a_signed_tensor_is_refused():
    """``x ** 1.5`` is NaN for negative entries: no bound holds there, the node is refused with the reason."""
    c = certify(Powers(1.5, signed=True), torch.randn(2, 3, D))
    assert c.q is None and "may be negative" in c.culprit


class DivByInput(nn.Module):
    """A denominator with no proven lower bound (a linear function of x can vanish)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 1)

    def forward(self, x):
        return x / (self.fc(x) + 1.0)


def test_division_by_input_is_not_derived():
    c = certify(DivByInput(), torch.randn(2, 3, D))
    assert c.q is None and c.culprit_node.startswith("div")


@pytest.mark.slow
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
    """The activation constants the rules and atoms read from certblocks.bounds bound the true slopes."""
    import importlib

    from certblocks.bounds import activation
    from certblocks.trace import registered_atoms

    x = torch.linspace(-12, 12, 400001, dtype=torch.float64, requires_grad=True)
    fns = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu, "mish": F.mish,
           "hardswish": F.hardswish, "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t)}
    for name, f in fns.items():
        y = f(x)
        (g,) = torch.autograd.grad(y.sum(), x)
        y = y.detach()
        act = activation(name)
        assert float(g.abs().max()) <= act.lipschitz, name
        assert float((y.abs() - act.slope * x.detach().abs() - act.offset).max()) <= 1e-12, name
    # each GELU-family module atom: its coefficients bound the function its module computes
    modules = [nn.GELU(approximate="tanh")]
    for key, atom in registered_atoms().items():
        if atom.kind != "module" or atom.name != "GELU":
            continue
        path, cls = key.rsplit(".", 1)
        try:
            modules.append(getattr(importlib.import_module(path), cls)())
        except (ImportError, AttributeError):  # optional package, or a class this version does not have
            continue
    for module in modules:
        atom = registered_atoms()[f"{type(module).__module__}.{type(module).__qualname__}"]
        co = atom.coefficients(module, (1, 3, D), (1, 3, D))
        y = module(x)
        (g,) = torch.autograd.grad(y.sum(), x)
        assert float(g.abs().max()) <= co["l0"], type(module).__name__
        assert float((y.detach().abs() - co["c"] * x.detach().abs()).max()) <= 1e-12, type(module).__name__


class InstanceNormEval(nn.Module):
    """``instance_norm`` with running statistics (eval): one affine map per channel, one output (it returned a
    list of rows before and crashed the certificate)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.fc = nn.Linear(D, D)
        self.register_buffer("mean", torch.randn(D))
        self.register_buffer("var", torch.rand(D) + 0.5)

    def forward(self, x):
        return F.instance_norm(self.fc(x).transpose(1, 2), self.mean, self.var, use_input_stats=False).transpose(1, 2)


def test_instance_norm_with_running_statistics(soundness):
    m = InstanceNormEval().eval()
    c = certify(m, torch.randn(1, 4, D), residual=None)
    assert c.exponents == Exponents(1, 0) and c.coefficients_derived, c.explain()
    soundness(m, c.certificate, (1, 4, D), "instance_norm eval")
