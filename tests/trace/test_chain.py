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


def _verdicts(model: nn.Module):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8)
    rep = certify(model.eval(), x)
    r0 = float(x.norm(dim=-1).max())
    return rep, rep.stack("fp16", r0=r0), rep.stack("fp32", r0=r0)


# The four refused-in-fp16 models (x1e30 map, x1e5 stem, x1e6 head, projection shortcut) live in
# test_whole_models.py, with their verdicts, segment kinds and names and the whole-model search.


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
    assert "NOT BOUNDED:" in rep.explain()
    for lip_g in (None, 1.0):  # a Lip(G) given by hand does not stand for the head left out of the chain
        st = rep.stack("fp32", r0=1.0, lip_g=lip_g)
        assert not st.ok and st.first_failure.segment == "head" and st.first_failure.kind == "unknown", st.explain()
        assert "not a function of the last state alone" in st.first_failure.reason
        assert st.backward_depth == 0 and st.forward_depth == 2  # the updates' forward bounds stand


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
