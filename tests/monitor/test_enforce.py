"""enforce / unenforce: the certificate survives adversarial weight changes; optimizers, state_dict, restore."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import certblocks
from certblocks.blocks import MLP, Attention, GatedMLP, LinearGrowthMamba, QKNormAttention
from certblocks.enforcement import cap_ratios, enforce, unenforce
from certblocks.monitor import CertificateMonitor


def _blocks(seed: int = 0):
    torch.manual_seed(seed)
    return [Attention(16, 2), MLP(16, 32), QKNormAttention(16, 2), GatedMLP(16, 24, bias=True),
            QKNormAttention(16, 4, qk_norm="layer"), MLP(16, 32, act="silu")]


def _effective_norms_within_caps(model: nn.Module) -> None:
    ratios = cap_ratios(model)
    assert ratios and max(ratios.values()) <= 1.0, max(ratios.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_certificate_holds_after_adversarial_updates(dtype: str) -> None:
    st = certblocks.build_stack(_blocks(), dtype, dt=1.0, certify=False)
    report = enforce(st, dtype)
    assert report.worst_case.ok and report.alpha > 0
    assert st.certificate().ok  # recomputed: enforce registered new caps
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 100.0, 1e4):  # random large perturbations of every parameter
        with torch.no_grad():
            for p in st.parameters():
                p.add_(torch.randn(p.shape, generator=g) * scale)
        cert = st.recertify()
        assert cert.ok
        _effective_norms_within_caps(st)
        for worst, actual in zip(report.worst_case.updates, cert.updates):  # the caps bound the intermediates
            assert worst.peak is not None and actual.peak is not None
            for r in (0.1, 1.0, 1e3):
                assert worst.peak.bound(r) >= actual.peak.bound(r) * (1 - 1e-9), (worst.name, r)
    x = torch.nn.functional.normalize(torch.randn(2, 5, 16, generator=g), dim=-1)  # inside r0 = 1
    for opt in (torch.optim.SGD(st.parameters(), lr=1e6), torch.optim.Adam(st.parameters(), lr=1e3)):
        for _ in range(3):  # huge learning rates, loss pushing the output up
            opt.zero_grad()
            loss = -st(x).square().mean()
            loss.backward()
            opt.step()
            assert st.recertify().ok
            assert all(torch.isfinite(p).all() for p in st.parameters())
    _effective_norms_within_caps(st)


def test_parameters_stay_leaves_and_optimizer_trains() -> None:
    torch.manual_seed(0)
    st = certblocks.build_stack([MLP(8, 16), QKNormAttention(8, 2), MLP(8, 16)], "fp32", dt=0.5)
    before = [id(p) for p in st.parameters()]
    opt = torch.optim.Adam(st.parameters(), lr=1e-2)  # created before enforce: it keeps working
    enforce(st, "fp32")
    params = list(st.parameters())
    assert all(isinstance(p, nn.Parameter) and p.is_leaf for p in params)
    assert sorted(id(p) for p in params) == sorted(before)  # the same Parameter objects, now "original"
    x = torch.randn(8, 4, 8)
    target = torch.sin(x)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = (st(x) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert st.recertify().ok


def test_enforce_does_not_change_a_certified_model() -> None:
    torch.manual_seed(0)
    st = certblocks.build_stack([MLP(8, 16), Attention(8, 2), MLP(8, 16)], "fp32", dt=0.5)
    x = torch.randn(2, 4, 8)
    before = st(x).detach()
    rep = enforce(st, "fp32")
    assert rep.alpha >= 1.0  # caps at or above the current norms: the weights are unchanged
    torch.testing.assert_close(st(x), before, rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip() -> None:
    st = certblocks.build_stack(_blocks(1), "bf16", dt=1.0, certify=False)
    enforce(st, "bf16")
    with torch.no_grad():
        for p in st.parameters():
            p.mul_(5.0)
    other = certblocks.build_stack(_blocks(2), "bf16", dt=1.0, certify=False)
    enforce(other, "bf16")
    other.load_state_dict(st.state_dict(), strict=True)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(other(x), st(x))
    assert other.recertify().ok
    # and through torch.save / torch.load
    import io

    buf = io.BytesIO()
    torch.save(st.state_dict(), buf)
    buf.seek(0)
    other.load_state_dict(torch.load(buf), strict=True)
    torch.testing.assert_close(other(x), st(x))


def test_unenforce_restores_plain_parameters() -> None:
    st = certblocks.build_stack(_blocks(3), "fp16", dt=1.0, certify=False)
    names_before = [c.name for c in st.recertify().updates]
    enforce(st, "fp16")
    # the enforced blocks keep their names (not the Parametrized<Name> class parametrization swaps in)
    assert [c.name for c in st.recertify().updates] == names_before
    assert not any("Parametrized" in n for n in names_before)
    with torch.no_grad():
        for p in st.parameters():
            p.add_(torch.randn_like(p) * 50)
    x = torch.randn(2, 5, 16)
    out = st(x).detach()
    effective = {n: t.detach().clone() for n, t in _effective_tensors(st).items()}
    n = unenforce(st)
    assert n > 0
    assert not any(parametrize.is_parametrized(m) for m in st.modules())
    names = dict(st.named_parameters())
    for name, val in effective.items():
        assert name in names and isinstance(names[name], nn.Parameter)
        torch.testing.assert_close(names[name].detach(), val)
    torch.testing.assert_close(st(x), out)
    assert st.recertify().ok
    plain = certblocks.build_stack(_blocks(3), "fp16", dt=1.0, certify=False)
    plain.load_state_dict(st.state_dict(), strict=True)  # a plain checkpoint again
    assert unenforce(st) == 0


def _effective_tensors(model: nn.Module):
    out = {}
    for mname, m in model.named_modules():
        if parametrize.is_parametrized(m):
            for name in m.parametrizations.keys():
                out[f"{mname}.{name}" if mname else name] = getattr(m, name)
    return out


def test_depth_plans_for_more_updates() -> None:
    torch.manual_seed(0)
    st = certblocks.build_stack([MLP(8, 16), QKNormAttention(8, 2)], "fp16", dt=1.0)
    rep2 = enforce(copy.deepcopy(st), "fp16")
    rep = enforce(st, "fp16", depth=40)
    assert rep.worst_case.depth == 40 and rep.worst_case.ok
    assert rep.alpha < rep2.alpha  # a deeper plan leaves less room per update
    # 20 copies of the enforced pair, perturbed, are still certified (40 updates)
    deep = [copy.deepcopy(b) for _ in range(20) for b in st.blocks]
    with torch.no_grad():
        for b in deep:
            for p in b.parameters():
                p.add_(torch.randn_like(p) * 10)
    assert certblocks.build_stack(deep, "fp16", dt=1.0).certificate().ok


def test_zoo_model_enforced() -> None:
    from certblocks.zoo import create_model

    torch.manual_seed(0)
    model = create_model("gpt2_qknorm_test")
    r0 = model.input_radius()
    rep = enforce(model, "fp16", r0=r0)
    assert rep.worst_case.ok
    opt = torch.optim.SGD(model.parameters(), lr=1e5)
    idx = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        opt.zero_grad()
        _, loss = model(idx, idx)
        (-loss).backward()
        opt.step()
    # enforce caps the residual updates for the run's Lip(G) (1 here); the head is not capped, and after
    # these steps the model's own chain (its lm_head's Lip(G)) is not certified: the updates' stack is
    assert model.certificate("fp16", r0=r0, lip_g=1.0).ok
    assert not model.certificate("fp16", r0=r0).ok
    mon = CertificateMonitor(model, "fp16", r0=r0, every=1, threshold=-1e9)  # the monitor reads effective weights
    model(idx, idx)[1].backward()
    assert mon.step()["stack/ok"]


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention (names only; enough for certblocks.convert)."""

    def __init__(self, n_embd: int = 16, n_head: int = 2) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(0.0)
        self.resid_dropout = nn.Dropout(0.0)
        self.n_head, self.n_embd = n_head, n_embd


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList([nn.ModuleDict({"attn": CausalSelfAttention(), "mlp": MLP(16, 32)}) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.h:
            x = x + blk["attn"](x)
            x = x + blk["mlp"](x)
        return x


def test_converted_model_enforced_and_monitored() -> None:
    torch.manual_seed(0)
    report = certblocks.convert(_Tiny())
    model = report.model
    rep = enforce(report, "fp16", r0=4.0)
    assert len(rep.worst_case.updates) == 4
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 100)
    certs = [b.certificate() for b in (model.h[0]["attn"], model.h[0]["mlp"], model.h[1]["attn"], model.h[1]["mlp"])]
    assert certblocks.certificate.certify_stack(certs, "fp16", r0=4.0).ok
    mon = CertificateMonitor(report, "fp16", r0=4.0, every=1, threshold=-1e9)
    model(torch.randn(2, 5, 16)).sum().backward()
    rec = mon.step()
    assert rec["stack/ok"] and rec["h.0.attn/saturation"] <= 1.0
    assert unenforce(report) > 0


def test_bad_arguments() -> None:
    torch.manual_seed(0)
    st = certblocks.build_stack([MLP(8, 16), MLP(8, 16)], "fp32")
    with pytest.raises(ValueError, match="depth"):
        enforce(st, "fp32", depth=1)
    with pytest.raises(TypeError, match="depth"):
        enforce(st, "fp32", depth=2.0)
    with pytest.raises(ValueError, match="dtype"):
        enforce(st, "fp12")
    enforce(st, "fp32")
    with pytest.raises(TypeError, match="already parametrized"):
        enforce(st, "fp32")
    mamba = certblocks.build_stack([(LinearGrowthMamba(8), certblocks.BlockCertificate(1, 1))], "fp32")
    with pytest.raises(ValueError, match="seq_len"):  # a scan's bound needs the sequence length
        enforce(mamba, "fp32")
    from certblocks.blocks import PatchTSTBlock

    batch = PatchTSTBlock(8, 2, 16, norm="batch", placement="pre").eval()
    with pytest.raises(TypeError, match="running_mean"):
        enforce([("attn", batch.updates()[0])], "fp32")
    with pytest.raises(ValueError, match="r0"):  # the input alone overflows fp16
        enforce(certblocks.build_stack([MLP(8, 16)], "fp16", certify=False), "fp16", r0=1e5)
    with pytest.raises(TypeError, match="model must be"):
        unenforce(3)


def test_bf16_parameters_stay_within_caps() -> None:
    torch.manual_seed(0)
    blocks = [MLP(16, 32, dtype=torch.bfloat16), QKNormAttention(16, 2, dtype=torch.bfloat16),
              Attention(16, 2, dtype=torch.bfloat16)]
    st = certblocks.build_stack(blocks, "bf16", dt=1.0, certify=False)
    enforce(st, "fp16")
    with torch.no_grad():
        for p in st.parameters():
            p.add_((torch.randn(p.shape) * 300).to(p.dtype))
    _effective_norms_within_caps(st)
    st.recertify()
    assert certblocks.certificate.certify_stack([b.certificate() for b in st.blocks], "fp16").ok
    assert torch.isfinite(st(torch.randn(2, 4, 16, dtype=torch.bfloat16))).all()


@pytest.mark.parametrize("name", ["patchtst_preln_test", "patchtst_periln_test"])
def test_normalized_updates_enforced(name: str) -> None:
    from certblocks.zoo import create_model

    torch.manual_seed(0)
    model = create_model(name).eval()
    r0 = model.input_radius()
    enforce(model, "fp16", r0=r0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 100)
    assert model.certificate("fp16", r0=r0).ok
    _effective_norms_within_caps(model)
    norms = [m for m in model.modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm))
             and parametrize.is_parametrized(m, "weight")]
    assert norms and all(m.weight.detach().abs().max().item() <= m.parametrizations.weight[0].cap for m in norms)


def test_post_norm_refused() -> None:
    from certblocks.blocks import PatchTSTBlock

    post = PatchTSTBlock(8, 2, 16, norm="layer", placement="post")
    with pytest.raises(TypeError, match="post-norm"):
        enforce(list(zip(("attn", "ffn"), post.updates())), "bf16")
