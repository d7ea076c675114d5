"""The tracer on plain-torch modules written here: docs/theory.md section 2.6's table of derived blocks, and soundness.

Every module below is written with ordinary torch code (not certblocks blocks); the tracer
derives its exponents from the exported graph.  The soundness tests search random and
gradient-ascent inputs for a counterexample to the propagated coefficients.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from certblocks.exponents import Exponents
from certblocks.trace import TraceCertificate, certify

D = 8
SHAPE = (2, 5, D)


class MLP(nn.Module):
    def __init__(self, d: int = D, act: str = "gelu") -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), act

    def forward(self, x):
        h = self.fc1(x)
        h = F.gelu(h) if self.act == "gelu" else F.relu(h)
        return self.fc2(h)


class PreNorm(nn.Module):
    """Any block with a normalization on its input: here LayerNorm before a SwiGLU."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.norm, self.inner = nn.LayerNorm(d), SwiGLU(d)

    def forward(self, x):
        return self.inner(self.norm(x))


class SwiGLU(nn.Module):
    def __init__(self, d: int = D, gate: str = "silu") -> None:
        super().__init__()
        self.w_g, self.w_u, self.w2, self.gate = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d), gate

    def forward(self, x):
        g = F.silu(self.w_u(x)) if self.gate == "silu" else torch.sigmoid(self.w_u(x))
        return self.w2(self.w_g(x) * g)


class Attention(nn.Module):
    def __init__(self, d: int = D, heads: int = 2, mode: str = "sdpa", qk_norm: bool = False) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.h, self.mode, self.qk_norm = heads, mode, qk_norm

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))  # (B, h, T, hs)
        if self.qk_norm:
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-2)
            k = F.normalize(k, dim=-1, eps=1e-2)
        if self.mode == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            mask = torch.ones(T, T, dtype=torch.bool).tril()
            att = att.masked_fill(~mask, float("-inf"))
            if self.mode == "explicit":
                att = torch.softmax(att, dim=-1)
            else:  # softmax written out with exp / sum
                e = torch.exp(att - att.amax(-1, keepdim=True))
                att = e / e.sum(-1, keepdim=True)
            y = att @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class LoopMamba(nn.Module):
    """A Mamba block written with an explicit time loop (mamba-ssm's layout, plain torch).

    ``linear_growth=True``: the parameter branch reads x/||x|| (per token) and the gate is a
    sigmoid -- docs/theory.md section 2.6's linear-growth Mamba, same weights.
    """

    def __init__(self, d: int = 4, expand: int = 2, N: int = 3, rank: int = 2, linear_growth: bool = False) -> None:
        super().__init__()
        di = expand * d
        self.in_proj = nn.Linear(d, 2 * di, bias=False)
        self.conv1d = nn.Conv1d(di, di, 3, groups=di, padding=2)
        self.x_proj = nn.Linear(di, rank + 2 * N, bias=False)
        self.dt_proj = nn.Linear(rank, di)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(di, 1))
        self.D = nn.Parameter(torch.ones(di))
        self.out_proj = nn.Linear(di, d, bias=False)
        self.N, self.rank, self.lg = N, rank, linear_growth

    def forward(self, u):
        Bsz, L, _ = u.shape
        x, z = self.in_proj(u).chunk(2, dim=-1)
        x = F.silu(self.conv1d(x.transpose(1, 2))[..., :L].transpose(1, 2))  # (B, L, di)
        xb = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-2) if self.lg else x
        dt, Bm, Cm = self.x_proj(xb).split([self.rank, self.N, self.N], dim=-1)
        delta = F.softplus(self.dt_proj(dt))  # (B, L, di) >= 0
        A = -torch.exp(self.A_log)  # (di, N) < 0
        h = torch.zeros(Bsz, x.shape[-1], self.N)
        ys = []
        for t in range(L):
            dA = torch.exp(delta[:, t, :, None] * A)  # bounded: delta*A <= 0
            h = dA * h + (delta[:, t, :, None] * Bm[:, t, None, :]) * x[:, t, :, None]
            ys.append((h * Cm[:, t, None, :]).sum(-1))
        y = torch.stack(ys, dim=1) + x * self.D
        gate = torch.sigmoid(z) if self.lg else F.silu(z)
        return self.out_proj(y * gate)


class FNOLayer(nn.Module):
    """GELU(LN(K x + W x)) with K a truncated Fourier multiplier along the tokens (or without LN)."""

    def __init__(self, d: int = D, modes: int = 3, norm: bool = True) -> None:
        super().__init__()
        self.w = nn.Linear(d, d)
        self.wr = nn.Parameter(torch.randn(modes, d, d) / d)
        self.wi = nn.Parameter(torch.randn(modes, d, d) / d)
        self.norm = nn.LayerNorm(d) if norm else nn.Identity()
        self.modes = modes

    def forward(self, x):
        xf = torch.fft.rfft(x, dim=1)[:, : self.modes]
        k = torch.fft.irfft(torch.einsum("bmi,mio->bmo", xf, torch.complex(self.wr, self.wi)), n=x.shape[1], dim=1)
        return F.gelu(self.norm(k + self.w(x)))


class Square(nn.Module):
    def forward(self, x):
        return x * x


class HandRMSNormMLP(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.weight, self.mlp = nn.Parameter(torch.ones(d) * 0.7), MLP(d)

    def forward(self, x):
        x32 = x.float()
        n = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
        return self.mlp(self.weight * n.type_as(x))


class CentredNormMLP(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.mlp = MLP(d)

    def forward(self, x):
        c = x - x.mean(-1, keepdim=True)
        return self.mlp(c / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5))


class ExpUnknown(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.exp(self.lin(x))


def _cert(m: nn.Module, shape=SHAPE) -> TraceCertificate:
    torch.manual_seed(0)
    c = certify(m.eval(), torch.randn(*shape))
    assert isinstance(c, TraceCertificate)
    return c


CASES = {
    "mlp_gelu": (lambda: MLP(), (1, 0)),
    "pre_norm": (lambda: PreNorm(), (0, 0)),
    "swiglu": (lambda: SwiGLU(), (2, 1)),
    "sigmoid_glu": (lambda: SwiGLU(gate="sigmoid"), (1, 1)),
    "attention_sdpa": (lambda: Attention(mode="sdpa"), (1, 2)),
    "attention_explicit": (lambda: Attention(mode="explicit"), (1, 2)),
    "attention_exp_sum": (lambda: Attention(mode="exp_sum"), (1, 2)),
    "attention_qk_norm_sdpa": (lambda: Attention(mode="sdpa", qk_norm=True), (1, 1)),
    "attention_qk_norm_explicit": (lambda: Attention(mode="explicit", qk_norm=True), (1, 1)),
    "linear_growth_mamba": (lambda: LoopMamba(linear_growth=True), (1, 1)),
    "fno_ln": (lambda: FNOLayer(norm=True), (0, 0)),
    "fno_no_ln": (lambda: FNOLayer(norm=False), (1, 0)),
    "square": (lambda: Square(), (2, 1)),
    "hand_rmsnorm": (lambda: HandRMSNormMLP(), (0, 0)),
    "centred_norm": (lambda: CentredNormMLP(), (0, 0)),
}
MAMBA_SHAPE = (1, 4, 4)


def _shape(name: str):
    return MAMBA_SHAPE if "mamba" in name else SHAPE


@pytest.mark.parametrize("name", list(CASES))
def test_theory_table(name):
    make, expected = CASES[name]
    c = _cert(make(), _shape(name))
    assert c.exponents == Exponents(*expected), c.explain()


def test_mamba_loop_q5_sigma_between_4_and_5():
    c = _cert(LoopMamba(), MAMBA_SHAPE)
    assert c.q == 5
    assert 4 <= c.sigma <= 5
    # the culprit is a product (a gate or a state product) and the fix says how to bound it
    assert "multiplies" in c.culprit and c.suggestion


def test_swiglu_culprit_and_suggestion():
    c = _cert(SwiGLU())
    assert "W_g x (q=1)" in c.culprit and "SiLU(W_u x) (q=1)" in c.culprit
    assert "gate with sigmoid or normalize the gate input" in c.suggestion
    assert c.certificate.culprit == c.culprit and c.certificate.fix == c.suggestion


def test_attention_culprit_names_attention():
    c = _cert(Attention())
    assert "scaled_dot_product_attention" in c.culprit
    assert "QK-norm" in c.suggestion


def test_hand_rmsnorm_recognized():
    c = _cert(HandRMSNormMLP())
    rows = {r.node: r for r in c.nodes}
    rec = [r for r in rows.values() if "recognized" in r.rule]
    assert rec, c.explain()
    assert (rec[0].q, rec[0].sigma) == (0, 0)


def test_exp_of_unknown_sign_is_not_derived_and_named():
    c = _cert(ExpUnknown())
    assert c.q is None and c.sigma is None
    assert c.culprit_node == "exp"
    assert "exp" in c.culprit and "unknown sign" in c.culprit
    assert not c.coefficients_derived


# ------------------------------------------------------------------------------------------------
# soundness: random and gradient-ascent inputs never beat the propagated coefficients (tests/trace/conftest.py)

SOUND = ["mlp_gelu", "pre_norm", "swiglu", "sigmoid_glu", "attention_sdpa", "attention_explicit",
         "attention_exp_sum", "attention_qk_norm_sdpa", "linear_growth_mamba", "fno_ln", "fno_no_ln", "square",
         "hand_rmsnorm", "centred_norm"]


@pytest.mark.slow
@pytest.mark.parametrize("name", SOUND)
def test_coefficients_sound(name, soundness):
    make, _ = CASES[name]
    torch.manual_seed(1)
    m = make().eval()
    shape = _shape(name)
    c = _cert(m, shape)
    assert c.coefficients_derived, c.explain()
    cert = c.certificate
    soundness(m, cert, shape, name)


@pytest.mark.slow
def test_mamba_loop_coefficients_sound(soundness):
    torch.manual_seed(1)
    m = LoopMamba().eval()
    c = _cert(m, MAMBA_SHAPE)
    assert c.coefficients_derived
    soundness(m, c.certificate, MAMBA_SHAPE, "loop mamba")


class ChannelFirstNorm(nn.Module):
    """A normalization over a non-last dimension (channels-first layout, as in a Mamba parameter branch)."""

    def __init__(self, d: int = 8, eps: float = 1e-3) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.eps = eps

    def forward(self, x):
        h = self.fc(x).transpose(1, 2)  # (B, D, L)
        h = h * torch.rsqrt(h.square().sum(1, keepdim=True) + self.eps)
        return self.out(h.transpose(1, 2))


def test_normalization_over_a_non_last_dim_is_recognized_and_sound(soundness):
    m = ChannelFirstNorm().eval()
    c = _cert(m)
    assert c.exponents == Exponents(0, 0), c.explain()
    assert c.coefficients_derived
    soundness(m, c.certificate, SHAPE, "channel-first norm")
