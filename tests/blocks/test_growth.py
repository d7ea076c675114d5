"""Measured exponents: growth along rays, and the Jacobian on the tied-logit cone (docs/theory.md section 2)."""

from __future__ import annotations

import math

import pytest
import torch

import certblocks.testing as cbt
from certblocks.blocks.attention import Attention, QKNormAttention
from certblocks.blocks.mlp import MLP, GatedMLP
from certblocks.blocks.patchtst import PatchTSTBlock

D, H, N = 8, 2, 4


def _tok_norm(x: torch.Tensor) -> float:
    return float(x.norm(dim=-1).amax())


RAY_CASES = {
    "attention": (lambda: Attention(D, H), 1.0, 0.95),
    "qk-norm attention": (lambda: QKNormAttention(D, H), 1.0, 0.95),
    "mlp": (lambda: MLP(D, 16), 1.0, 0.95),
    "glu-sigmoid": (lambda: GatedMLP(D, 16, bias=True), 1.0, 0.95),
    "swiglu": (lambda: GatedMLP(D, 16, gate="silu", bias=True), 2.0, 1.9),
    "patchtst-none-attn": (lambda: PatchTSTBlock(D, H, 16).updates()[0], 1.0, 0.95),
    "patchtst-none-ffn": (lambda: PatchTSTBlock(D, H, 16).updates()[1], 1.0, 0.95),
    "patchtst-layer-pre-attn": (lambda: PatchTSTBlock(D, H, 16, norm="layer").updates()[0], 0.0, -1.0),
    "patchtst-rms-peri-ffn": (lambda: PatchTSTBlock(D, H, 16, norm="rms", placement="peri").updates()[1], 0.0, -1.0),
}


@pytest.mark.parametrize("case", sorted(RAY_CASES))
def test_growth_along_rays(case):
    make, q, low = RAY_CASES[case]
    torch.manual_seed(0)
    block = make().double().eval()
    assert block.exponents.q == q
    with torch.no_grad():
        for _ in range(3):
            x0 = torch.randn(1, N, D, dtype=torch.float64)
            x0 = x0 / _tok_norm(x0)
            s0, s1 = 1e3, 1e4
            slope = (math.log(_tok_norm(block(s1 * x0))) - math.log(_tok_norm(block(s0 * x0)))) / math.log(s1 / s0)
            assert slope <= q + 0.05, f"{case}: slope {slope:.3f} above q = {q}"
            assert slope >= low, f"{case}: slope {slope:.3f}, expected about {q}"


def _tied_cone(seed: int = 0):
    """d = d_k = 6, n = 2, one head, Gaussian weights: X0 whose query 1 has two equal (maximal) logits."""
    g = torch.Generator().manual_seed(seed)
    d = 6
    attn = Attention(d, 1, bias=False).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    wq, wk = attn.c_attn.weight[:d].detach(), attn.c_attn.weight[d:2 * d].detach()
    a = wq.T @ wk  # logit_{1j} = s x_1^T A x_j
    x1 = torch.randn(d, generator=g, dtype=torch.float64)
    w = torch.randn(d, generator=g, dtype=torch.float64)
    n = a.T @ x1
    w = w - (w @ n) / (n @ n) * n  # x_1^T A w = 0: x_0 = x_1 + w ties logit_10 with logit_11
    x = torch.stack([x1 + w, x1])[None]
    return attn, x / _tok_norm(x)


def _jac_norm(f, x) -> float:
    return float(cbt.jacobian_norm_lower(f, x, iters=40)[0])


def test_plain_attention_reaches_sigma_2_on_tied_cone():
    attn, x0 = _tied_cone()
    s = attn.scale
    wq, wk = attn.c_attn.weight[:6].detach(), attn.c_attn.weight[6:12].detach()
    logits = s * (x0[0, 1] @ wq.T) @ (wk @ x0[0].T)
    assert torch.allclose(logits[0], logits[1], rtol=1e-12)  # the tie holds for every R (logits scale with R^2)
    radii = [10.0, 100.0, 1e3, 1e4]
    L = [_jac_norm(attn.forward_reference, r * x0) for r in radii]
    slopes = [math.log(L[k + 1] / L[k]) / math.log(radii[k + 1] / radii[k]) for k in range(len(radii) - 1)]
    print("tied cone, plain attention: L(R) =", L, "slopes", slopes)
    assert all(1.9 <= sl <= 2.05 for sl in slopes), slopes
    cert = attn.certificate(seq_len=2)
    assert all(l_ <= cert.jacobian_bound(r) * (1 + 1e-9) for l_, r in zip(L, radii))


def test_qk_norm_attention_slope_at_most_1_on_tied_cone():
    attn, x0 = _tied_cone()
    qk = QKNormAttention(6, 1, bias=False).double()
    sd = {**qk.state_dict(), **attn.state_dict()}
    qk.load_state_dict(sd, strict=True)
    radii = [10.0, 100.0, 1e3, 1e4]
    L = [_jac_norm(qk.forward_reference, r * x0) for r in radii]
    slopes = [math.log(L[k + 1] / L[k]) / math.log(radii[k + 1] / radii[k]) for k in range(len(radii) - 1)]
    print("tied cone, QK-norm attention: L(R) =", L, "slopes", slopes)
    assert all(sl <= 1.05 for sl in slopes), slopes


def test_generic_ray_reads_sigma_low():
    """Along a generic ray the softmax saturates: a measured slope is a lower bound only (docs/theory.md section
    2.5)."""
    torch.manual_seed(1)
    attn = Attention(6, 1, bias=False).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_()
    x0 = torch.randn(1, 2, 6, dtype=torch.float64)
    x0 = x0 / _tok_norm(x0)
    L = [_jac_norm(attn.forward_reference, r * x0) for r in (100.0, 1000.0)]
    assert math.log(L[1] / L[0]) / math.log(10.0) < 1.5


def test_qk_norm_jacobian_is_reached():
    """The 1/sqrt(eps) in the QK-norm coefficient is real: at a query with q = 0, L grows like 1/sqrt(eps)."""
    d, heads, r = 8, 2, 10.0
    hd = d // heads
    found = {}
    for eps in (1e-4, 1e-6):
        torch.manual_seed(2)
        block = QKNormAttention(d, heads, causal=False, qk_norm_eps=eps).double().eval()
        wq, bq = block.c_attn.weight[:hd].detach(), block.c_attn.bias[:hd].detach()  # head 0
        x0 = torch.linalg.lstsq(wq, -bq[:, None]).solution[:, 0]  # W_q x0 + b_q = 0 (head 0)
        null = torch.linalg.svd(wq).Vh[hd:]  # null space of W_q (head 0)
        z = null.T @ torch.randn(d - hd, dtype=torch.float64)
        t = math.sqrt(max(r**2 - float(x0 @ x0), 0.0)) / float(z.norm())
        x_query = x0 + t * z  # ||x_query|| = r, q = 0 for head 0
        x_other = torch.randn(d, dtype=torch.float64)
        x = torch.stack([x_query, r * x_other / x_other.norm()])[None]
        assert float((wq @ x_query + bq).norm()) < 1e-8
        L = _jac_norm(block.forward_reference, x)
        cert = block.certificate(seq_len=2)
        print(f"QK-norm eps={eps:g} at q = 0: L = {L:.4g}, bound {cert.jacobian_bound(r):.4g}")
        assert L <= cert.jacobian_bound(r) * (1 + 1e-9)
        found[eps] = L
    assert found[1e-6] / found[1e-4] > 8.0  # 1/sqrt(eps) scaling: 10x


def test_linear_when_single_token():
    torch.manual_seed(3)
    attn = Attention(D, H).double()
    cert = attn.certificate(seq_len=1)
    assert cert.l1 == 0.0
    x = torch.randn(5, 1, D, dtype=torch.float64) * 30
    found = cbt.jacobian_norm_lower(attn.forward_reference, x)
    assert float(found.max()) <= cert.l0 * (1 + 1e-9)
    assert float(found.max()) >= cert.l0 * (1 - 1e-6)  # exact: the block is the linear map W_O W_V
    with torch.no_grad():
        y = attn(x)
    assert float(y.norm(dim=-1).max()) <= cert.growth_bound(float(x.norm(dim=-1).max())) * (1 + 1e-9)
    with pytest.raises(ValueError, match="seq_len"):
        attn.certificate(seq_len=0)
    with pytest.raises(TypeError, match="seq_len"):
        attn.certificate(seq_len=2.5)
    with pytest.raises(ValueError, match="r0"):
        attn.certificate(r0=-1.0)


@pytest.mark.slow
def test_attention_bounds_hold_for_long_sequences():
    """In the per-token norm the attention coefficients do not depend on n: check them at n = 24."""
    torch.manual_seed(4)
    n, d = 24, 8
    for block in (Attention(d, 2, causal=False).double(), QKNormAttention(d, 2).double()):
        with torch.no_grad():
            block.c_attn.weight.mul_(3.0)
        cert = block.certificate(seq_len=n)
        assert cert.to_dict() == block.certificate().to_dict()  # seq_len > 1 does not change the bounds
        for r in (0.3, 3.0):
            x = cbt.random_inputs((n, d), r, 4, generator=torch.Generator().manual_seed(5))
            with torch.no_grad():
                assert float(cbt.token_norm(block(x)).max()) <= cert.growth_bound(r) * (1 + 1e-9)
            low = cbt.jacobian_norm_lower(block.forward_reference, x)
            assert float(low.max()) <= cert.jacobian_bound(r) * (1 + 1e-9)
