"""CertificateMonitor: figures against direct computations, warnings, records, adapters, errors."""

from __future__ import annotations

import csv
import math
import warnings

import pytest
import torch
from torch import nn

import certblocks
from certblocks.blocks import MLP, Attention, GatedMLP, QKNormAttention
from certblocks.bounds import product_norm
from certblocks.monitor import CertificateMonitor, CertificateWarning, residual_updates


def _stack(seed: int = 0, dtype: str = "fp32", dt: float = 0.5, r0: float = 20.0) -> certblocks.stack.CertifiedStack:
    """Four updates, certified for inputs of per-token norm up to ``r0`` (the tests' batches stay inside it)."""
    torch.manual_seed(seed)
    blocks = [Attention(16, 2), MLP(16, 32), QKNormAttention(16, 2), GatedMLP(16, 24, bias=True)]
    return certblocks.build_stack(blocks, dtype, dt=dt, r0=r0, certify=False)


def _train_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = model(x)
    loss = (y - 1.0).square().mean()
    loss.backward()
    return loss


def test_figures_match_direct_computation() -> None:
    st = _stack()
    mon = CertificateMonitor(st, "fp32", every=1, threshold=-1e9)
    x = torch.randn(3, 6, 16) * 2.0
    assert float(x.norm(dim=-1).max()) <= st.r0  # inside the envelope: the certificate is at the stack's r0
    for _ in range(4):  # warm starts: the power iteration refines across checks
        st.zero_grad()
        _train_step(st, x)
        rec = mon.step()
    assert rec is not None
    # direct: the stack by hand, with the gradient of every intermediate state
    states = [x.clone().requires_grad_(True)]
    vs = []
    for blk in st.blocks:
        v = blk(states[-1])
        vs.append(v)
        nxt = states[-1] + st.dt * v
        nxt.retain_grad()
        states.append(nxt)
    (states[-1] - 1.0).square().mean().backward()
    certs = [blk.certificate() for blk in st.blocks]
    stack = certblocks.certificate.certify_stack(certs, "fp32", dt=st.dt, r0=st.r0)
    budget = math.log(torch.finfo(torch.float32).max)
    for k, (blk, cert) in enumerate(zip(st.blocks, certs)):
        key = f"blocks.{k}"
        for name in ("c", "b", "l1", "l0"):
            assert rec[f"{key}/{name}"] == pytest.approx(getattr(cert, name), rel=1e-12)
        assert rec[f"{key}/margin_grad"] == pytest.approx(1 - stack.log_factors[k] * 4 / budget, rel=1e-9)
        xn = states[k].detach().double().norm(dim=-1).amax(dim=1)
        vn = vs[k].detach().double().norm(dim=-1).amax(dim=1)
        sat = float((vn / (cert.c * xn ** cert.q + cert.b)).max())
        assert rec[f"{key}/saturation"] == pytest.approx(sat, rel=1e-6)
        p = states[k + 1].grad.double().flatten()
        v = vs[k].detach().double().flatten()
        cos = float(-(v @ p) / (v.norm() * p.norm()))
        assert rec[f"{key}/cosine"] == pytest.approx(cos, rel=1e-5, abs=1e-7)
        for sub, lin in blk.named_modules():
            if isinstance(lin, nn.Linear):
                exact = float(torch.linalg.matrix_norm(lin.weight.detach().double(), ord=2))
                est = rec[f"{key}/{sub}.opnorm"]
                assert est <= exact * (1 + 1e-9)  # a power-iteration value never exceeds the norm
                assert est >= exact * (1 - 2e-2)
        if isinstance(blk, (Attention, QKNormAttention)):
            D, hd = blk.dim, blk.head_dim
            w = blk.in_proj.weight.detach().double()
            kappa = max(product_norm(w[h * hd:(h + 1) * hd].T, w[D + h * hd:D + (h + 1) * hd])
                        for h in range(blk.num_heads))
            assert rec[f"{key}/kappa"] <= kappa * (1 + 1e-9)
            assert rec[f"{key}/kappa"] >= kappa * (1 - 2e-2)
            with torch.no_grad():
                q, kk, _ = blk._qkv(states[k].detach(), fast=False)
                logits = (q @ kk.transpose(-2, -1)) * blk.scale
                allowed = torch.ones(6, 6, dtype=torch.bool).tril()
                direct = float(logits.abs().masked_fill(~allowed, 0).max())
            assert rec[f"{key}/max_logit"] == pytest.approx(direct, rel=1e-5)
    assert rec["stack/ok"] == stack.ok
    assert rec["stack/margin_grad"] == pytest.approx(1 - stack.log_gradient_bound / budget, rel=1e-9)


def test_power_iteration_converges_with_warm_start() -> None:
    torch.manual_seed(1)
    blk = MLP(32, 64)
    mon = CertificateMonitor([("mlp", blk)], "fp32", every=1, power_iters=3, power_iters_init=3,
                             batch_figures=False)
    exact = float(torch.linalg.matrix_norm(blk.fc1.weight.detach().double(), ord=2))
    gaps = []
    for _ in range(30):
        rec = mon.step()
        est = rec["mlp/fc1.opnorm"]
        assert est <= exact * (1 + 1e-9)
        gaps.append(exact - est)
    assert gaps[-1] <= gaps[0]
    assert gaps[-1] <= 1e-3 * exact


def test_every_and_records() -> None:
    st = _stack()
    mon = CertificateMonitor(st, "fp32", every=3, threshold=-1e9)
    x = torch.randn(2, 4, 16)
    out = []
    for _ in range(7):
        st.zero_grad()
        _train_step(st, x)
        out.append(mon.step())
    assert [r is not None for r in out] == [True, False, False, True, False, False, True]
    assert [r["step"] for r in mon.records] == [0, 3, 6]
    assert all(isinstance(r, dict) for r in mon.records)


def test_warning_fires_and_names_update() -> None:
    torch.manual_seed(0)
    blocks = [MLP(16, 32) for _ in range(4)]
    st = certblocks.build_stack(blocks, "fp16", dt=1.0)
    alerts = []
    mon = CertificateMonitor(st, "fp16", every=1, threshold=0.5, callback=alerts.append, worst_case_alerts=True,
                             on_data=False)
    x = torch.nn.functional.normalize(torch.randn(2, 4, 16), dim=-1)  # inside the certified r0 = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", CertificateWarning)  # healthy (stack margin ~0.73): no warning
        _train_step(st, x)
        rec = mon.step()
    assert rec["stack/margin_grad"] > 0.5 and alerts == []
    with torch.no_grad():
        st.blocks[2].fc1.weight.mul_(100.0)  # stack margin ~0.37, the factor of blocks.2 dominates
    _train_step(st, x)
    with pytest.warns(CertificateWarning) as rec_w:
        mon.step()
    messages = [str(w.message) for w in rec_w]
    assert "'blocks.2': stack margin_grad" in messages[0] and "'blocks.2': margin_fwd" in messages[1]
    assert all(w.filename == __file__ for w in rec_w)  # the warnings point at the caller of step()
    assert [(a["update"], a["quantity"]) for a in alerts] == [("blocks.2", "stack/margin_grad"),
                                                                ("blocks.2", "margin_fwd")]
    assert alerts[0]["value"] == pytest.approx(mon.records[-1]["stack/margin_grad"])


def test_share_alerts_name_each_update_over_its_share() -> None:
    torch.manual_seed(0)
    st = certblocks.build_stack([MLP(16, 32) for _ in range(4)], "fp16", dt=1.0)
    with torch.no_grad():
        st.blocks[1].fc2.weight.mul_(30.0)
    mon = CertificateMonitor(st, "fp16", threshold=0.0, share_alerts=True, batch_figures=False,
                             worst_case_alerts=True)
    with pytest.warns(CertificateWarning, match=r"'blocks\.1': margin_grad"):
        mon.step()
    shares = [a["update"] for a in mon.alerts if a["quantity"] == "margin_grad"]
    assert shares == ["blocks.1"]
    assert mon.records[-1]["stack/margin_grad"] > 0.0  # the stack itself is fine: only the share alert


def test_kappa_growth_alert() -> None:
    torch.manual_seed(0)
    st = certblocks.build_stack([Attention(16, 2), QKNormAttention(16, 2)], "fp32", dt=1.0)
    mon = CertificateMonitor(st, "fp32", every=1, threshold=-1e9, kappa_growth=10.0, batch_figures=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CertificateWarning)
        mon.step()
    with torch.no_grad():
        for blk in st.blocks:
            blk.c_attn.weight[:32].mul_(4.0)  # queries and keys x4: kappa x16
    with pytest.warns(CertificateWarning, match=r"'blocks\.0': kappa = .* grew"):
        mon.step()
    assert [a["update"] for a in mon.alerts] == ["blocks.0"]  # QK-norm attention is not flagged


def test_forward_margin_warning_names_first_update() -> None:
    torch.manual_seed(0)
    st = certblocks.build_stack([MLP(8, 8) for _ in range(3)], "fp16", dt=1.0)
    with torch.no_grad():
        st.blocks[1].fc2.bias.fill_(10000.0)  # radius ~ 3e4: within a factor 2 of fp16 65504
    mon = CertificateMonitor(st, "fp16", every=1, threshold=0.1, batch_figures=False, worst_case_alerts=True)
    with pytest.warns(CertificateWarning, match=r"'blocks\.1': margin_fwd"):
        mon.step()
    assert mon.alerts[0]["quantity"] in ("stack/margin_grad", "margin_fwd")
    fwd = [a for a in mon.alerts if a["quantity"] == "margin_fwd"]
    assert [a["update"] for a in fwd] == ["blocks.1"]


def test_csv_round_trip(tmp_path) -> None:
    st = _stack()
    mon = CertificateMonitor(st, "bf16", every=2, threshold=-1e9)
    x = torch.randn(2, 4, 16)
    for _ in range(4):
        st.zero_grad()
        _train_step(st, x)
        mon.step()
    path = tmp_path / "m.csv"
    mon.to_csv(path)
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(mon.records) == 2
    for row, rec in zip(rows, mon.records):
        assert set(row) == set(rec)
        for key, val in rec.items():
            if val is None:
                assert row[key] == ""
            elif isinstance(val, (bool, str)):  # flags; the on-data names (worst update, head source)
                assert row[key] == str(val)
            else:
                assert float(row[key]) == pytest.approx(float(val), rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_saturation_at_most_one_and_cosine_in_range(seed: int) -> None:
    st = _stack(seed, dt=1.0)
    mon = CertificateMonitor(st, "fp64", every=1, threshold=-1e9)
    opt = torch.optim.Adam(st.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed)
    for _ in range(4):
        x = torch.randn(4, 5, 16, generator=g) * float(torch.rand(1, generator=g) * 20 + 0.1)
        opt.zero_grad()
        _train_step(st, x)
        rec = mon.step()
        opt.step()
        for k in range(len(st.blocks)):
            assert 0.0 <= rec[f"blocks.{k}/saturation"] <= 1.0
            assert -1.0 <= rec[f"blocks.{k}/cosine"] <= 1.0


def test_zoo_model() -> None:
    from certblocks.zoo import create_model

    torch.manual_seed(0)
    model = create_model("gpt2_qknorm_test").eval()
    mon = CertificateMonitor(model, "bf16", every=1)
    idx = torch.randint(0, 64, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    rec = mon.step()
    names = [n for n, _ in model.residual_updates()]
    assert mon.updates.names == names
    cert = model.certificate("bf16")
    for k, name in enumerate(names):
        assert rec[f"{name}/l1"] == pytest.approx(cert.updates[k].l1, rel=1e-12)
        assert 0.0 <= rec[f"{name}/saturation"] <= 1.0
        assert -1.0 <= rec[f"{name}/cosine"] <= 1.0
    assert rec["transformer.h.0.attn/kappa"] > 0 and rec["transformer.h.1.attn/max_logit"] >= 0
    assert rec["stack/ok"] == cert.ok


class _Converted(nn.Module):
    """A hand-made residual model holding certified blocks (the converted-model case)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 16)
        self.layers = nn.ModuleList([nn.ModuleDict({"attn": QKNormAttention(16, 2), "mlp": MLP(16, 32)})
                                     for _ in range(2)])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for layer in self.layers:
            x = x + layer["attn"](x)
            x = x + layer["mlp"](x)
        return self.head(x)


def test_converted_model_adapter() -> None:
    torch.manual_seed(0)
    model = _Converted()
    ups = residual_updates(model, r0=3.0)
    assert ups.names == ["layers.0.attn", "layers.0.mlp", "layers.1.attn", "layers.1.mlp"]
    assert ups.radius() == 3.0 and ups.dt == 1.0
    mon = CertificateMonitor(model, "fp32", every=1, r0=3.0, threshold=-1e9)
    model(torch.randn(2, 5, 4)).sum().backward()
    rec = mon.step()
    assert rec["layers.1.mlp/saturation"] <= 1.0 and rec["layers.0.attn/cosine"] is not None
    mon.remove()
    model(torch.randn(2, 5, 4)).sum().backward()
    assert mon.step()["layers.0.attn/saturation"] is None  # hooks removed: no batch figures


def test_patchtst_block_gives_two_updates() -> None:
    from certblocks.blocks import PatchTSTBlock

    model = nn.Sequential(PatchTSTBlock(16, 2, 32, dropout=0.0), PatchTSTBlock(16, 2, 32, dropout=0.0))
    ups = residual_updates(model)
    assert ups.names == ["0.updates[0]", "0.updates[1]", "1.updates[0]", "1.updates[1]"]


def test_bad_arguments() -> None:
    st = _stack()
    with pytest.raises(TypeError, match="every"):
        CertificateMonitor(st, "fp32", every=1.5)
    with pytest.raises(ValueError, match="every"):
        CertificateMonitor(st, "fp32", every=0)
    with pytest.raises(ValueError, match="threshold"):
        CertificateMonitor(st, "fp32", threshold=1.5)
    with pytest.raises(ValueError, match="threshold"):
        CertificateMonitor(st, "fp32", threshold=float("nan"))
    with pytest.raises(TypeError, match="callback"):
        CertificateMonitor(st, "fp32", callback=3)
    with pytest.raises(ValueError, match="r0"):
        CertificateMonitor(st, "fp32", r0=-1.0)
    with pytest.raises(ValueError, match="dtype"):
        CertificateMonitor(st, "fp17")
    with pytest.raises(TypeError, match="model must be"):
        CertificateMonitor(42, "fp32")
    with pytest.raises(TypeError, match="no certified block"):  # with on_data, watched on data only (its graph)
        CertificateMonitor(nn.Linear(3, 3), "fp32", on_data=False)
    with pytest.raises(TypeError, match=r"model\[0\]"):
        CertificateMonitor([("a", 3)], "fp32")
    with pytest.raises(ValueError, match="kappa_growth"):
        CertificateMonitor(st, "fp32", kappa_growth=0.5)
    with pytest.raises(TypeError, match="share_alerts"):
        CertificateMonitor(st, "fp32", share_alerts="yes")
    with pytest.raises(TypeError, match="batch_figures"):
        CertificateMonitor(st, "fp32", batch_figures=1)


def test_data_parallel_is_unwrapped() -> None:
    st = _stack()
    ups = residual_updates(nn.DataParallel(st))
    assert ups.names == [f"blocks.{k}" for k in range(4)] and ups.dt == st.dt


def test_mamba_update_needs_seq_len() -> None:
    from certblocks.blocks import LinearGrowthMamba

    torch.manual_seed(0)
    pairs = [("mixer", LinearGrowthMamba(8)), ("mlp", MLP(8, 16))]
    with pytest.raises(ValueError, match="seq_len"):
        CertificateMonitor(pairs, "fp32", batch_figures=False).check()
    rec = CertificateMonitor(pairs, "fp32", seq_len=16, batch_figures=False, threshold=-1e9).check()
    assert rec["mixer/q"] == 1.0 and rec["stack/depth"] == 2
    with pytest.raises(ValueError, match="seq_len"):
        CertificateMonitor(pairs, "fp32", seq_len=0)
