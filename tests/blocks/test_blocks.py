"""Block behaviour: masks, dtypes, torch.compile, PatchTST structure, errors, coefficient helpers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from certblocks.blocks.attention import Attention, QKNormAttention
from certblocks.blocks.mlp import MLP, GatedMLP
from certblocks.blocks.patchtst import PatchTSTBlock
from certblocks.certificate import certify_stack
from certblocks.exponents import ATTENTION, QK_NORM_ATTENTION, Exponents

D, H, T = 16, 4, 6


def all_blocks():
    return {
        "qknorm": QKNormAttention(D, H),
        "attention": Attention(D, H),
        "glu": GatedMLP(D, 24),
        "swiglu": GatedMLP(D, 24, gate="silu"),
        "mlp": MLP(D, 24),
        "patchtst": PatchTSTBlock(D, H, 24),
        "patchtst-pre-rms-qk": PatchTSTBlock(D, H, 24, norm="rms", qk_norm=True),
    }


def test_class_exponents():
    assert QKNormAttention.exponents == QK_NORM_ATTENTION == Exponents(1, 1)
    assert Attention.exponents == ATTENTION == Exponents(1, 2)
    assert GatedMLP.exponents == Exponents(1, 1) and GatedMLP(4, 4, gate="silu").exponents == Exponents(2, 1)
    assert MLP.exponents == Exponents(1, 0)
    assert PatchTSTBlock.exponents == (Exponents(1, 2), Exponents(1, 0))
    assert PatchTSTBlock(D, H, 8, qk_norm=True).exponents == (Exponents(1, 1), Exponents(1, 0))
    for norm in ("layer", "rms"):
        for placement in ("pre", "peri"):
            assert PatchTSTBlock(D, H, 8, norm=norm, placement=placement).exponents == (Exponents(0, 0),) * 2
    assert PatchTSTBlock(D, H, 8, norm="batch").exponents == (Exponents(1, 2), Exponents(1, 0))


@pytest.mark.parametrize("cls", [Attention, QKNormAttention])
def test_masks_match_reference(cls):
    torch.manual_seed(0)
    for causal in (True, False):
        block = cls(D, H, causal=causal).double()
        x = torch.randn(3, T, D, dtype=torch.float64)
        pad = torch.zeros(3, T, dtype=torch.bool)
        pad[0, -2:] = True
        pad[1, :1] = True
        bool_mask = torch.rand(T, T) > 0.3
        float_mask = torch.randn(3, 1, T, T, dtype=torch.float64)
        for kw in ({}, {"key_padding_mask": pad}, {"attn_mask": bool_mask}, {"attn_mask": float_mask},
                   {"attn_mask": bool_mask, "key_padding_mask": pad}):
            torch.testing.assert_close(block(x, **kw), block.forward_reference(x, **kw), rtol=1e-10, atol=1e-12)
        # padded keys do not influence the other tokens
        y = block(x, key_padding_mask=pad)
        x2 = x.clone()
        x2[0, -2:] = 1e3 * torch.randn(2, D, dtype=torch.float64)
        torch.testing.assert_close(block(x2, key_padding_mask=pad)[0, :-2], y[0, :-2])
        # a query whose keys are all masked gets a finite output (uniform attention), never NaN
        all_pad = torch.ones(3, T, dtype=torch.bool)
        assert torch.isfinite(block(x, key_padding_mask=all_pad)).all()


def test_causal_matches_explicit_mask():
    torch.manual_seed(1)
    block = Attention(D, H).double()
    x = torch.randn(2, T, D, dtype=torch.float64)
    bidir = Attention(D, H, causal=False).double()
    bidir.load_state_dict(block.state_dict())
    tril = torch.ones(T, T, dtype=torch.bool).tril()
    torch.testing.assert_close(block(x), bidir(x, attn_mask=tril))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_forward(dtype):
    torch.manual_seed(2)
    x = torch.randn(2, T, D)
    for name, block in all_blocks().items():
        block = block.eval()
        ref = block(x)
        low = block.to(dtype)
        y = low(x.to(dtype))
        assert y.dtype == dtype and torch.isfinite(y).all(), name
        tol = 0.05 if dtype == torch.float16 else 0.2
        assert (y.float() - ref).abs().max() <= tol * (ref.abs().max() + 1), name
        if isinstance(low, (Attention, QKNormAttention)):  # masks in low precision: no overflow to NaN
            pad = torch.zeros(2, T, dtype=torch.bool)
            pad[0] = True
            pad[1, 2:] = True
            ym = low(100 * x.to(dtype), key_padding_mask=pad)
            assert torch.isfinite(ym).all(), name


@pytest.mark.slow
def test_torch_compile_fullgraph():
    """One compiled graph holding every block (compile is slow on small CPUs: one call covers all)."""
    blocks = nn.ModuleDict(all_blocks()).eval()

    def run(x: torch.Tensor) -> torch.Tensor:
        return sum(b(x) for b in blocks.values())

    torch.manual_seed(3)
    x = torch.randn(2, T, D)
    compiled = torch.compile(run, fullgraph=True)
    torch.testing.assert_close(compiled(x), run(x), atol=1e-5, rtol=1e-5)


def test_patchtst_two_updates():
    torch.manual_seed(4)
    x = torch.randn(2, T, D, dtype=torch.float64)
    for norm in (None, "layer", "rms", "batch"):
        for placement in ("pre", "peri", "post"):
            block = PatchTSTBlock(D, H, 24, norm=norm, placement=placement).double().eval()
            v1, v2 = block.updates()
            assert v1.branch is block.self_attn and v2.branch is block.ff
            if norm is not None and placement == "post":
                h = block.norm_attn(x + block.self_attn(x))
                want = block.norm_ffn(h + block.ff(h))
            else:
                h = x + v1(x)
                want = h + v2(h)
            torch.testing.assert_close(block(x), want)
            if norm is None:
                assert isinstance(block.norm_attn, nn.Identity)
    # parameters are registered once; the update views share them
    block = PatchTSTBlock(D, H, 24, norm="layer", placement="peri")
    names = set(block.state_dict())
    assert {"norm_attn.weight", "norm_attn_out.weight", "self_attn.c_attn.weight", "ff.fc1.weight"} <= names
    assert sum(p.numel() for p in block.parameters()) == sum(
        p.numel() for u in block.updates() for p in u.parameters())


def test_patchtst_post_norm_is_not_a_residual_update():
    block = PatchTSTBlock(D, H, 24, norm="layer", placement="post")
    certs = block.certificates(seq_len=T)
    assert len(certs) == 2
    for cert in certs:
        assert cert.q is None and cert.sigma is None
        assert "not a residual update" in cert.culprit
        assert "placement='pre'" in cert.fix
    stack = certify_stack(list(certs), "fp32")
    assert not stack.ok and stack.first_failure.kind == "unknown" and stack.certified_depth == 0
    assert not block.updates()[0].is_residual_update


def test_patchtst_batchnorm_training_stats_required():
    block = PatchTSTBlock(D, H, 24, norm="batch")
    block.norm_attn.track_running_stats = False
    block.norm_attn.running_mean = None
    block.norm_attn.running_var = None
    with pytest.raises(ValueError, match="running statistics"):
        block.certificates()


def test_certificates_feed_certify_stack():
    torch.manual_seed(5)
    certs = []
    for _ in range(3):
        certs += [QKNormAttention(D, H).certificate(seq_len=T), GatedMLP(D, 24).certificate()]
    certs += list(PatchTSTBlock(D, H, 24).certificates(seq_len=T))
    stack = certify_stack(certs, "fp32", r0=1.0)
    assert stack.depth == 8 and stack.forward_depth == 8
    swiglu = GatedMLP(D, 24, gate="silu").certificate()
    assert swiglu.exponents == Exponents(2, 1) and "sigmoid" in swiglu.fix


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_heads"):
        Attention(10, 3)
    with pytest.raises(ValueError, match="qk_norm"):
        QKNormAttention(D, H, qk_norm="batch")
    with pytest.raises(ValueError, match="qk_norm"):
        QKNormAttention(D, H, qk_norm=None)
    with pytest.raises(ValueError, match="eps"):
        QKNormAttention(D, H, qk_norm_eps=0.0)
    with pytest.raises(ValueError, match="naming"):
        Attention(D, H, naming="hf")
    with pytest.raises(TypeError, match="dim"):
        Attention(16.0, 4)
    with pytest.raises(ValueError, match="attn_dropout"):
        Attention(D, H, attn_dropout=1.0)
    with pytest.raises(ValueError, match="gate"):
        GatedMLP(D, gate="gelu")
    with pytest.raises(ValueError, match="act"):
        MLP(D, 8, act="tanh")
    with pytest.raises(ValueError, match="norm"):
        PatchTSTBlock(D, H, 8, norm="group")
    with pytest.raises(ValueError, match="placement"):
        PatchTSTBlock(D, H, 8, norm="layer", placement="sandwich")
    with pytest.raises(ValueError, match="num_heads"):
        PatchTSTBlock(D, 5, 8)


def test_bad_inputs():
    attn, glu = Attention(D, H), GatedMLP(D, 8)
    with pytest.raises(ValueError, match=r"\(batch, seq_len, 16\)"):
        attn(torch.randn(T, D))
    with pytest.raises(ValueError, match="last dimension 16"):
        attn(torch.randn(2, T, D + 1))
    with pytest.raises(ValueError, match="last dimension 16"):
        glu(torch.randn(2, T, 3))
    with pytest.raises(TypeError, match="floating-point"):
        glu(torch.ones(2, T, D, dtype=torch.long))
    with pytest.raises(TypeError, match="differs from the block's parameters"):
        attn(torch.randn(2, T, D, dtype=torch.float64))
    with pytest.raises(ValueError, match="key_padding_mask"):
        attn(torch.randn(2, T, D), key_padding_mask=torch.zeros(2, T + 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask"):
        attn(torch.randn(2, T, D), key_padding_mask=torch.zeros(2, T))
    with pytest.raises(ValueError, match="attn_mask"):
        attn(torch.randn(2, T, D), attn_mask=torch.ones(T, T + 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask"):
        attn(torch.randn(2, T, D), attn_mask=torch.ones(T, T, dtype=torch.long))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: mixed dtypes are allowed
        assert attn(torch.randn(2, T, D)).dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["rms", "l2"])
def test_qk_norm_fast_path_matches_reference_with_gradients(kind):
    """The eager fast path (hand-written backward) against the plain twin, values and gradients."""
    torch.manual_seed(7)
    block = QKNormAttention(8, 2, qk_norm=kind, causal=False).double()
    with torch.no_grad():
        block.q_norm.weight.uniform_(0.5, 1.5)
        block.k_norm.weight.uniform_(-1.5, 1.5)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    params = [x] + list(block.parameters())
    y1, y2 = block(x), block.forward_reference(x)
    g = torch.randn_like(y1)
    for a, b in zip(torch.autograd.grad(y1, params, g), torch.autograd.grad(y2, params, g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: block(t), (x,))


def test_token_batchnorm_matches_batchnorm1d():
    from certblocks.blocks.patchtst import TokenBatchNorm

    torch.manual_seed(8)
    tbn, bn = TokenBatchNorm(D), nn.BatchNorm1d(D)
    x = torch.randn(3, T, D) * 2 + 1
    for mode in ("train", "eval"):
        getattr(tbn, mode)()
        getattr(bn, mode)()
        torch.testing.assert_close(tbn(x), bn(x.transpose(1, 2)).transpose(1, 2))
    torch.testing.assert_close(tbn.running_mean, bn.running_mean)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_qknorm_attention_backward_under_cpu_autocast(dtype):
    # float32 parameters, low-precision activations: the fused QK-norm backward must handle both
    torch.manual_seed(0)
    blk = QKNormAttention(32, 4)
    x = torch.randn(2, 6, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        y = blk(x)
    y.float().square().mean().backward()
    grads = [x.grad] + [p.grad for p in blk.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    x2 = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=dtype):
        y2 = blk.forward_reference(x2)
    y2.float().square().mean().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=5e-2, atol=5e-3)


# ------------------------------------------------------------------------------------------------ capabilities
class _Residual(nn.Module):
    """``x + block(x)``: a module the trajectory reads from its graph (the largest logit from the attention
    kernel's own query and key nodes, independent of the block's ``attention_stats``)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


def _attentions():
    from certblocks import RotaryQKNormAttention

    torch.manual_seed(0)
    return {"attention": Attention(D, H), "qknorm": QKNormAttention(D, H, qk_norm="layer"),
            "bidirectional": QKNormAttention(D, H, causal=False),
            "rotary_gqa": RotaryQKNormAttention(D, H, 2), "rotary_partial": RotaryQKNormAttention(
                D, H, partial_rotary_factor=0.5, rope_theta=100.0)}


@pytest.mark.parametrize("name", sorted(_attentions()))
def test_every_attention_reports_kappa_and_its_largest_logit(name):
    import certblocks
    from certblocks.bounds import product_norm

    block = _attentions()[name].eval()
    x = torch.randn(3, T, D, generator=torch.Generator().manual_seed(1)) * 2.0
    warm: dict = {}
    stats = block.attention_stats(x, samples=2, warm=warm, iters=200)
    assert set(stats) == {"kappa", "max_logit", "qk_norm"} and stats["qk_norm"] == (name != "attention")
    hw = block._head_weights()  # per query head, its key head (grouped-query heads repeated)
    exact = max(product_norm(q.T, k) for q, k in zip(hw["wq"], hw["wk"]))
    assert exact * (1 - 1e-3) <= stats["kappa"] <= exact * (1 + 1e-9)  # power iteration: from below
    again = block.attention_stats(None, warm=warm, iters=1)  # warm start: one step keeps the value
    assert again["max_logit"] is None and again["kappa"] == pytest.approx(stats["kappa"], rel=1e-6)
    rep = certblocks.trajectory(_Residual(block), x, "fp32", logit_samples=2, certified=False)
    assert stats["max_logit"] == pytest.approx(rep.updates[0].max_logit, rel=1e-5)
    assert rep.updates[0].kappa == pytest.approx(exact, rel=2e-2)
    assert block.attention_stats(x, kappa=False)["kappa"] is None


def test_every_block_lists_its_levers():
    from certblocks import LinearGrowthMamba, RotaryQKNormAttention
    from certblocks.blocks import LayerScale, Mamba, NormedUpdate, ScaledBranch

    assert [lv.name for lv in QKNormAttention(D, H).levers()] == ["qk_norm_eps"]
    assert [lv.name for lv in RotaryQKNormAttention(D, H).levers()] == ["qk_norm_eps"]
    for block in (Attention(D, H), MLP(D, 24), GatedMLP(D, 24), LinearGrowthMamba(D), Mamba(D),
                  NormedUpdate(QKNormAttention(D, H), D, "rms"), PatchTSTBlock(D, H, 24, norm="layer").updates()[0]):
        assert block.levers() == []
    assert [lv.name for lv in PatchTSTBlock(D, H, 24, qk_norm=True).updates()[0].levers()] == ["qk_norm_eps"]
    gained = ScaledBranch(QKNormAttention(D, H), LayerScale(D, init_values=0.1), ("attn", "ls1"))
    levers = {lv.name: lv for lv in gained.levers()}
    assert set(levers) == {"qk_norm_eps", "init_values"} and levers["init_values"].current == pytest.approx(0.1)
    cert = gained.certificate()
    halved = levers["init_values"].apply(cert, 0.05)  # the certificate at half the gain: every coefficient halved
    assert halved.c == pytest.approx(cert.c / 2, rel=1e-6) and halved.l1 == pytest.approx(cert.l1 / 2, rel=1e-6)
    assert gained.velocity_io() == (gained.branch, gained.gain) and gained.gain_bound() == pytest.approx(0.1)
