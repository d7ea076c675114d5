"""The tracer's chain: a model is cut into stem, updates, maps, blocks and head (certblocks.trace.chain)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from certblocks.trace import certify


class Tanh(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _scale(d: int, s: float) -> nn.Linear:
    lin = nn.Linear(d, d, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(d) * s)
    return lin


class Between(nn.Module):
    def __init__(self, s: float = 1e30) -> None:
        super().__init__()
        self.u1, self.scale, self.u2 = Tanh(), _scale(8, s), Tanh()

    def forward(self, x):
        x = x + self.u1(x)
        x = self.scale(x)
        return x + self.u2(x)


class Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.u1, self.u2 = _scale(8, 1e5), Tanh(), Tanh()

    def forward(self, x):
        x = self.stem(x)
        x = x + self.u1(x)
        return x + self.u2(x)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.u1, self.u2, self.head = Tanh(), Tanh(), _scale(8, 1e6)

    def forward(self, x):
        x = x + self.u1(x)
        x = x + self.u2(x)
        return self.head(x)


class Projection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.branch, self.u = _scale(8, 1e5), Tanh(), Tanh()

    def forward(self, x):
        x = self.proj(x) + self.branch(x)
        return x + self.u(x)


def _verdicts(model: nn.Module):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8)
    rep = certify(model.eval(), x)
    r0 = float(x.norm(dim=-1).max())
    return rep, rep.stack("fp16", r0=r0), rep.stack("fp32", r0=r0)


def test_the_four_models_are_refused_in_fp16_and_certified_in_fp32():
    expected = {Between: ("map", "scale", 1), Stem: ("map", "stem", 0), Head: ("head", "head", 2),
                Projection: ("block", "proj+branch", 0)}
    for cls, (segment, name, index) in expected.items():
        torch.manual_seed(1)
        rep, fp16, fp32 = _verdicts(cls())
        assert rep.chained, rep.explain()
        assert not fp16.ok, (cls.__name__, fp16.explain())
        f = fp16.first_failure
        assert (f.segment, f.name, f.index) == (segment, name, index), (cls.__name__, f)
        assert fp32.ok, (cls.__name__, fp32.explain())


def test_segments_kinds_and_names():
    rep, _, _ = _verdicts(Between())
    assert [(s.name, s.certificate.kind) for s in rep.segments] == [("u1", "update"), ("scale", "map"),
                                                                   ("u2", "update")]
    assert rep.stem is None and rep.head is None and len(rep) == 2
    rep, _, _ = _verdicts(Stem())
    assert rep.stem.name == "stem" and [u.name for u in rep.updates] == ["u1", "u2"]
    rep, _, _ = _verdicts(Head())
    assert rep.head.name == "head" and rep.head.certificate.l0 >= 1e6
    assert "update" in rep.explain() and "head" in rep.explain()


class Parallel(nn.Module):
    """``x + f(x) + g(x)``: the second add reads ``x``; the update and the map merge into one block."""

    def __init__(self) -> None:
        super().__init__()
        self.f, self.g, self.u = Tanh(), Tanh(), Tanh()

    def forward(self, x):
        x = x + self.f(x) + self.g(x)
        return x + self.u(x)


def test_parallel_branches_form_one_block():
    rep, fp16, _ = _verdicts(Parallel())
    kinds = [s.certificate.kind for s in rep.segments]
    assert kinds == ["block", "update"], rep.explain()
    block = rep.segments[0].certificate
    # x + f(x) + g(x): growth R + 2 sqrt(8) at most, Jacobian 1 + Lip f + Lip g
    assert block.q == 1 and block.c >= 1.0 and block.l0 >= 1.0
    assert fp16.ok and fp16.depth == 2


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(50, 8)
        self.wpe = nn.Parameter(torch.randn(6, 8))
        self.u1, self.u2 = Tanh(), Tanh()
        self.head = nn.Linear(8, 50, bias=False)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe[: ids.shape[1]]
        x = x + self.u1(x)
        x = x + self.u2(x)
        return self.head(x)


def test_token_ids_stem_bounds_r0_from_the_tables():
    torch.manual_seed(0)
    m = TokenModel().eval()
    rep = certify(m, torch.randint(0, 50, (1, 6)))
    assert rep.integer_input and rep.stem is not None and rep.stem.certificate.q == 0
    st = rep.stack("fp16", loss="cross_entropy")
    emb = float(m.wte.weight.detach().norm(dim=-1).max() + m.wpe.detach().norm(dim=-1).max())
    assert st.radii[1] >= emb * (1 - 1e-12)  # R_0 after the stem: the largest rows of both tables
    assert st.radii[1] == rep.stack("fp16", r0=123.0, loss="cross_entropy").radii[1]  # r0 is not needed
    assert abs(st.log_factors[0]) <= 1e-15  # no gradient flows into token ids: factor 1
    head_norm = float(torch.linalg.matrix_norm(m.head.weight.double(), ord=2))
    assert st.lip_g >= head_norm * 2**0.5 and st.ok


class InstanceNormHead(nn.Module):
    """A forecaster's head that undoes the input's normalization with its statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.u1, self.u2, self.head = Tanh(), Tanh(), nn.Linear(8, 8)

    def forward(self, x):
        scale = x.detach().abs().amax(dim=-1, keepdim=True) + 1.0
        x = x / scale
        x = x + self.u1(x)
        x = x + self.u2(x)
        return self.head(x) * scale


def test_a_head_reading_the_input_statistics_is_not_certified_silently():
    torch.manual_seed(0)
    rep = certify(InstanceNormHead().eval(), torch.randn(2, 4, 8))
    assert rep.head is None and rep.chained
    assert any("head" in n and "not certified" in n for n in rep.notes), rep.notes
    assert "note:" in rep.explain()


def test_a_traced_certified_stack_gives_build_stacks_verdict():
    from certblocks import build_stack
    from certblocks.blocks import GatedMLP, LinearGrowthMamba, QKNormAttention

    for dtype in ("bf16", "fp16", "fp32"):
        torch.manual_seed(0)
        blocks = [b for _ in range(2) for b in (LinearGrowthMamba(32), GatedMLP(32, 64), QKNormAttention(32, 4))]
        stack = build_stack(blocks, dtype, seq_len=16, certify=False, r0=2.0)
        rep = certify(stack.eval(), torch.randn(1, 16, 32))
        assert rep.chained and rep.stem is None and rep.head is None and len(rep.segments) == 6
        traced = rep.stack(dtype, r0=2.0)
        own = stack.certificate
        assert [u.certificate for u in rep.updates] == [
            dataclasses.replace(c, name=u.name) for c, u in zip(own.updates, rep.updates)]
        assert (traced.certified_depth, traced.forward_depth, traced.backward_depth, traced.radii) == (
            own.certified_depth, own.forward_depth, own.backward_depth, own.radii), dtype


def test_strip_casts_follows_copy_to_its_source():
    from certblocks.trace.capture import capture
    from certblocks.trace.nodes import op_name, strip_casts

    class Written(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f = Tanh()

        def forward(self, x):
            buf = torch.zeros_like(x)
            buf.copy_(self.f(x))
            return x + buf

    g = capture(Written().eval(), (torch.randn(1, 3, 8),), {})
    copies = [n for n in g.nodes if n.op == "call_function" and op_name(n.target) == "aten.copy"]
    assert copies, [op_name(n.target) for n in g.nodes if n.op == "call_function"]
    assert op_name(strip_casts(copies[0]).target) == "aten.tanh"
    rep = certify(Written().eval(), torch.randn(1, 3, 8))
    assert len(rep.updates) == 1 and rep.updates[0].q == 0  # x + tanh(...): the copy holds the branch


def test_map_names_follow_the_modules():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    swin = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1), num_heads=(1, 2),
                             embed_dim=16, img_size=28, window_size=7, num_classes=3).eval()
    rep = certify(swin, torch.randn(1, 3, 28, 28))
    maps = [s.name for s in rep.segments if s.certificate.kind == "map"]
    assert rep.stem.name == "patch_embed" and "layers.0.blocks.0+layers.1.downsample" in maps, maps
