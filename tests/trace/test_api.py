"""The tracer's public API: atoms, module patterns, the selective-scan op, reports, the CLI logic."""

from __future__ import annotations

import argparse
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from certblocks.certificate import BlockCertificate
from certblocks.cli.certify import ModelSpecError, add_certify_parser, load_model, run_certify
from certblocks.exponents import Exponents
from certblocks.trace import (
    ModelCertificate,
    Poly,
    TraceCertificate,
    certify,
    register_atom,
    registered_atoms,
    unregister_atom,
)

D = 6


class MishByHand(nn.Module):
    """x * tanh(softplus(x)): Lipschitz, but the product rule reads (1, 1)."""

    def forward(self, x):
        return x * torch.tanh(F.softplus(x))


class WithMish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(D, 2 * D), MishByHand(), nn.Linear(2 * D, D)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_register_module_atom():
    x = torch.randn(2, 3, D)
    assert certify(WithMish(), x).exponents == Exponents(1, 1)
    calls = []

    def coeffs(module, in_shape, out_shape):
        calls.append((type(module).__name__, in_shape, out_shape))
        return {"c": 1.0, "b": 0.0, "l1": 0.0, "l0": 1.2}  # |mish(x)| <= |x|, slope <= 1.2

    atom = register_atom(MishByHand, (1, 0), coefficients=coeffs, name="Mish")
    try:
        assert MishByHand.__module__ + ".MishByHand" in registered_atoms()
        c = certify(WithMish(), x)
        assert c.exponents == Exponents(1, 0)
        assert c.coefficients_derived and calls and calls[0][0] == "MishByHand"
        assert any(r.rule.startswith("atom Mish") for r in c.nodes)
        assert atom.kind == "module"
    finally:
        unregister_atom(MishByHand)
    assert certify(WithMish(), x).exponents == Exponents(1, 1)


def test_register_atom_validates():
    with pytest.raises(TypeError):
        register_atom(MishByHand, "q=1")
    with pytest.raises(ValueError):
        register_atom(MishByHand, (1, 0), kind="block")
    with pytest.raises(TypeError):
        register_atom(MishByHand, (1, 0), coefficients=3.0)


@torch.library.custom_op("certblocks_trace_test::cube_clip", mutates_args=())
def _cube_clip(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) ** 3


@_cube_clip.register_fake
def _(x):
    return torch.empty_like(x)


class UsesOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return self.lin(torch.ops.certblocks_trace_test.cube_clip(x))


def test_register_op_atom():
    x = torch.randn(2, 3, D)
    c = certify(UsesOp(), x)
    assert c.q is None and "cube_clip" in c.culprit  # an unknown op is named, never guessed
    register_atom("certblocks_trace_test::cube_clip", (0, 0),
                  coefficients=lambda node, i, o: {"c": 0.0, "b": math.sqrt(o[-1]), "l1": 0.0, "l0": 3.0})
    try:
        c = certify(UsesOp(), x)
        assert c.exponents == Exponents(0, 0)
        assert c.coefficients_derived
    finally:
        unregister_atom("certblocks_trace_test::cube_clip")


class ScanBlock(nn.Module):
    """A Mamba-like block calling the certblocks::selective_scan custom op."""

    def __init__(self, d: int = 4, di: int = 6, N: int = 3, linear_growth: bool = False) -> None:
        super().__init__()
        self.in_proj = nn.Linear(d, 2 * di, bias=False)
        self.x_proj = nn.Linear(di, di + 2 * N, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(di, 1))
        self.D = nn.Parameter(torch.ones(di))
        self.dt_bias = nn.Parameter(torch.zeros(di))
        self.out_proj = nn.Linear(di, d, bias=False)
        self.di, self.N, self.lg = di, N, linear_growth

    def forward(self, x):
        u, z = self.in_proj(x).chunk(2, dim=-1)  # (B, L, di)
        xb = F.normalize(u, dim=-1, eps=1e-2) if self.lg else u
        dt, B, C = self.x_proj(xb).split([self.di, self.N, self.N], dim=-1)
        A = -torch.exp(self.A_log)
        y, _, _ = torch.ops.certblocks.selective_scan(
            u.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2), self.D,
            z.transpose(1, 2), self.dt_bias, True, "sigmoid" if self.lg else "silu", False, None, "torch")
        return self.out_proj(y.transpose(1, 2))


def test_selective_scan_op_rule():
    pytest.importorskip("certblocks.kernels.ops")
    x = torch.randn(1, 5, 4)
    plain = certify(ScanBlock(), x)
    assert plain.q == 5 and 4 <= plain.sigma <= 5, plain.explain()
    assert any("selective scan" in r.rule for r in plain.nodes)
    lg = certify(ScanBlock(linear_growth=True), x)
    assert lg.exponents == Exponents(1, 1), lg.explain()
    assert lg.coefficients_derived
    # soundness of the growth coefficients on random inputs at several scales
    m = ScanBlock(linear_growth=True)
    c = certify(m, x).certificate
    for s in (0.01, 1.0, 10.0, 100.0):
        xs = torch.randn(8, 5, 4) * s
        with torch.no_grad():
            v = m(xs).norm(dim=-1).amax(-1)
        r = xs.norm(dim=-1).amax(-1)
        assert bool((v <= c.c * r ** c.q + c.b).all())


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D)) for _ in range(2)])
        self.extra = nn.Linear(D, D)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def test_residual_discovery_plain_torch():
    c = certify(TwoBlocks(), torch.randn(2, 3, D))
    assert isinstance(c, ModelCertificate)
    assert c.names == ["blocks.0", "blocks.1"]
    assert all(u.exponents == Exponents(0, 0) for u in c)
    assert c["blocks.1"] is c[1]
    st = c.stack("bf16", r0=2.0)
    assert st.depth == 2 and st.r0 == 2.0
    d = json.loads(c.to_json())
    assert d["depth"] == 2 and d["updates"][0]["name"] == "blocks.0"
    assert "blocks.0" in c.explain()


def test_explicit_paths_and_errors():
    c = certify(TwoBlocks(), torch.randn(2, 3, D), residual=["blocks.*"])
    assert c.names == ["blocks.0", "blocks.1"]
    c1 = certify(TwoBlocks(), torch.randn(2, 3, D), residual="blocks.1.1")
    assert c1.names == ["blocks.1.1"] and c1[0].exponents == Exponents(1, 0)
    with pytest.raises(ValueError, match="matches no module path"):
        certify(TwoBlocks(), torch.randn(2, 3, D), residual="nothing.*")
    with pytest.raises(TypeError):
        certify(TwoBlocks(), torch.randn(2, 3, D), residual=3)
    with pytest.raises(TypeError):
        certify(TwoBlocks(), "not a tensor")
    whole = certify(TwoBlocks(), torch.randn(2, 3, D), residual=None)
    assert isinstance(whole, TraceCertificate) and whole.exponents == Exponents(1, 0)


def test_report_contents():
    c = certify(WithMish(), torch.randn(2, 3, D))
    assert isinstance(c.certificate, BlockCertificate)
    text = c.explain()
    assert "fc1" in text and "(q, sigma)" in text and "fix:" in text
    d = c.to_dict()
    assert d["q"] == 1 and d["sigma"] == 1 and d["nodes"] and d["culprit"]
    json.loads(c.to_json())


def test_poly_collapse_is_an_upper_bound():
    p = Poly({0: 0.5, 0.5: 2.0, 2: 1.5})
    c, b = p.collapse_growth(2)
    l1, l0 = p.collapse_jacobian(2)
    for r in (0.0, 0.01, 0.3, 1.0, 2.5, 40.0):
        assert p(r) <= c * r**2 + b + 1e-12
        assert p(r) <= l1 * max(r, 1.0) ** 2 + l0 + 1e-12
    q = Poly({1: 1.0, 0: 2.0})
    for e in (0.5, 1.5, 2.0, 3.0):
        pw = q.power(e)
        for r in (0.0, 0.5, 1.0, 7.0):
            assert q(r) ** e <= pw(r) * (1 + 1e-12)
    with pytest.raises(ValueError):
        Poly({3: 1.0}).collapse_growth(2)


# CLI -----------------------------------------------------------------------------------------------
def _parse(argv):
    p = argparse.ArgumentParser(prog="certblocks")
    sp = p.add_subparsers()
    add_certify_parser(sp)
    return p.parse_args(argv)


def test_cli_module_factory(tmp_path, monkeypatch, capsys):
    (tmp_path / "cb_trace_factory.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def make():\n"
        "    m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))\n"
        "    return m, torch.randn(1, 3, 4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = _parse(["certify", "module:cb_trace_factory:make", "--dtype", "fp16", "--json"])
    rc = run_certify(args)
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["certificates"]["updates"][0]["q"] == 1.0 and out["stack"]["dtype"] == "fp16"
    args = _parse(["certify", "module:cb_trace_factory:make", "--r0", "3", "--explain"])
    assert run_certify(args) == 0
    assert "stack of 1 updates" in capsys.readouterr().out


def test_cli_errors(capsys):
    assert run_certify(_parse(["certify", "no-such-zoo-model"])) == 2
    err = capsys.readouterr().err
    assert "no-such-zoo-model" in err and "timm:<name>" in err
    with pytest.raises(ModelSpecError, match="allowed: hf:gpt2, .*hf:mamba, .*hf:llama"):
        load_model("hf:bert")
    with pytest.raises(ModelSpecError, match="module:pkg.mod:factory"):
        load_model("module:only_one_part")
    with pytest.raises(ModelSpecError, match="seq-len"):
        load_model("hf:gpt2", seq_len=0)
    _ = sys


def test_cli_certifies_hf_llama(capsys):
    pytest.importorskip("transformers")
    model, ids = load_model("hf:llama", seq_len=4)
    assert type(model).__name__ == "LlamaModel" and model.config.num_key_value_heads == 4 and ids.shape == (1, 4)
    assert run_certify(_parse(["certify", "hf:llama", "--seq-len", "4", "--json"])) == 1  # pre-norm: refused in fp16
    out = json.loads(capsys.readouterr().out)
    ups = out["certificates"]["updates"]
    assert len(ups) == 24 and {(u["q"], u["sigma"]) for u in ups} == {(0.0, 0.0)}


class InPlace(nn.Module):
    """Residual written with in-place ops (x += f(x), relu_): the graph is functionalized first."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        x = x.clone()
        h = self.fc1(x).relu_()
        x += self.fc2(h)
        return torch.nn.functional.max_pool1d(x, 2)


def test_in_place_ops_are_functionalized():
    c = certify(InPlace(), torch.randn(2, 3, D))
    assert isinstance(c, ModelCertificate) and len(c) == 1
    assert c[0].exponents == Exponents(1, 0)


@pytest.mark.parametrize("zoo_name", ["gpt2_qknorm_test", "gpt2_dyt_test"])
def test_segments_certified_side_by_side_equal_one_after_another(zoo_name, monkeypatch):
    """With two threads the chain's segments are certified concurrently (the head first): the same certificate,
    every coefficient bit for bit, as one segment after another."""
    from certblocks.zoo import create_model

    from certblocks.trace import api

    torch.manual_seed(0)
    model = create_model(zoo_name).eval()
    ids = torch.randint(0, model.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        started = []
        original = api.certify_segment

        def recording(g, seg, k):
            started.append(seg.kind)
            return original(g, seg, k)

        monkeypatch.setattr(api, "certify_segment", recording)
        side_by_side = certify(model, ids)
        assert started[0] == "head" and len(started) == len(side_by_side.segments) + 2  # stem and head too
        monkeypatch.setattr(api, "_certify_segments",
                            lambda g, segs: [original(g, s, k) for k, s in enumerate(segs)])
        in_order = certify(model, ids)
    finally:
        torch.set_num_threads(threads)
    assert side_by_side.to_dict() == in_order.to_dict()
    assert [s.name for s in side_by_side.segments] == [s.name for s in in_order.segments]
