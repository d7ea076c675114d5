"""Whole-model certificates against the counterexample search (docs/theory.md section 6).

For each model the search (:func:`certblocks.testing.search_model`) tries to beat the fp32 stack
certificate: the output, every intermediate, the gradient in the input (float inputs), the state and the
costate at each segment boundary.  Four toy models put a huge gain in a map, the stem, the head or a
projection shortcut: fp16 refuses them at that segment, fp32 certifies them.  Real backbones (tiny timm
ResNet, Swin and ViT, HF GPT-2 on token ids) are searched too.  A search that cannot fail proves nothing:
certificates made wrong on purpose (a bound or a coefficient 100x too small) must be beaten.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
from torch import nn

import certblocks.testing as cbt
from certblocks.certificate import StackCertificate, certify_stack, cross_entropy_gradient
from certblocks.trace import ModelCertificate, certify

D = 8
SEARCH: Dict[str, Any] = dict(count=6, restarts=1, from_best=1, steps=6, rtol=1e-6)


class _Tanh(nn.Module):
    """The velocity ``tanh(W x + b)`` of one residual update."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l(x))


def _scaling(gain: float) -> nn.Linear:
    lin = nn.Linear(D, D, bias=False)
    with torch.no_grad():
        lin.weight.copy_(gain * torch.eye(D))
    return lin


class MapBetween(nn.Module):
    """Two tanh updates with a x1e30 map between them."""

    def __init__(self) -> None:
        super().__init__()
        self.u1, self.u2, self.scale = _Tanh(), _Tanh(), _scaling(1e30)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.u1(x)
        x = self.scale(x)
        return x + self.u2(x)


class StemScale(nn.Module):
    """A x1e5 stem before two tanh updates."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.u1, self.u2 = _scaling(1e5), _Tanh(), _Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = x + self.u1(x)
        return x + self.u2(x)


class HeadScale(nn.Module):
    """Two tanh updates, then a x1e6 head."""

    def __init__(self) -> None:
        super().__init__()
        self.u1, self.u2, self.head = _Tanh(), _Tanh(), _scaling(1e6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.u1(x)
        x = x + self.u2(x)
        return self.head(x)


class ProjectionShortcut(nn.Module):
    """A residual block ``P x + tanh(W x)`` with ``P = 1e5 I``, then a tanh update."""

    def __init__(self) -> None:
        super().__init__()
        self.P, self.u1, self.u2 = _scaling(1e5), _Tanh(), _Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.P(x) + self.u1(x)
        return x + self.u2(x)


# model -> (the failing segment's kind in fp16, its name, its index in the chain)
TOYS: Dict[type, Tuple[str, str, int]] = {MapBetween: ("map", "scale", 1), StemScale: ("map", "stem", 0),
                                          HeadScale: ("head", "head", 2), ProjectionShortcut: ("block", "P+u1", 0)}

Built = Tuple[nn.Module, torch.Tensor, ModelCertificate, float]


def _token_norm(x: torch.Tensor) -> float:
    return float(x.double().norm(dim=-1).max())


@pytest.fixture(scope="module")
def toys() -> Dict[type, Built]:
    out = {}
    for k, cls in enumerate(TOYS):
        torch.manual_seed(k)
        m, x = cls().eval(), torch.randn(1, 4, D)
        rep = certify(m, x)
        assert isinstance(rep, ModelCertificate) and rep.chained, rep
        out[cls] = (m, x, rep, _token_norm(x))
    return out


@pytest.mark.parametrize("cls", list(TOYS), ids=lambda c: c.__name__)
def test_toy_refused_in_fp16_at_its_segment_certified_and_sound_in_fp32(toys, cls):
    m, x, rep, r0 = toys[cls]
    st16 = rep.stack("fp16", r0=r0)
    assert st16.ok is False and st16.first_failure is not None, st16.explain()
    f = st16.first_failure
    assert (f.segment, f.name, f.index) == TOYS[cls], f
    assert rep.stack("fp32", r0=r0).ok, rep.stack("fp32", r0=r0).explain()
    st = rep.stack("fp32", r0=r0, loss="mse")  # sound whether or not fp32 holds its gradient
    report = cbt.assert_model_sound(m, st, x, model_certificate=rep, loss="mse", **SEARCH)
    assert [r.check for r in report.checks] == list(cbt.MODEL_CHECKS)
    # the search gets close where the bound is attained: the gain maps x to exactly 1e5 x
    if cls is StemScale:
        assert report["state"].ratio > 0.99, report


def test_toy_segments_kinds_and_names(toys):
    rep = toys[MapBetween][2]
    assert [(s.name, s.certificate.kind) for s in rep.segments] == [("u1", "update"), ("scale", "map"),
                                                                   ("u2", "update")]
    assert rep.stem is None and rep.head is None and len(rep) == 2
    rep = toys[StemScale][2]
    assert rep.stem.name == "stem" and [u.name for u in rep.updates] == ["u1", "u2"]
    rep = toys[HeadScale][2]
    assert rep.head.name == "head" and rep.head.certificate.l0 >= 1e6
    assert "update" in rep.explain() and "head" in rep.explain()


# ------------------------------------------------------------------------------------------------ real backbones


def _resnet() -> Tuple[nn.Module, torch.Tensor]:
    pytest.importorskip("timm")
    from timm.models.resnet import BasicBlock, ResNet

    m = ResNet(BasicBlock, layers=(2, 2, 2, 2), channels=(8, 8, 16, 16), stem_width=8, num_classes=5)
    for block in m.modules():  # timm zero-initializes the last BN's gain of each block: make it count
        if isinstance(block, BasicBlock):
            nn.init.uniform_(block.bn2.weight, 0.5, 1.5)
    return m, torch.randn(1, 3, 32, 32)


def _swin() -> Tuple[nn.Module, torch.Tensor]:
    timm = pytest.importorskip("timm")
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1), num_heads=(1, 2),
                             embed_dim=16, img_size=28, window_size=7, num_classes=5), torch.randn(1, 3, 28, 28)


def _vit() -> Tuple[nn.Module, torch.Tensor]:
    timm = pytest.importorskip("timm")
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=2, img_size=16, patch_size=8,
                             embed_dim=16, num_heads=2, num_classes=5), torch.randn(1, 3, 16, 16)


def _gpt2() -> Tuple[nn.Module, torch.Tensor]:
    tr = pytest.importorskip("transformers")
    cfg = tr.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64, bos_token_id=0,
                        eos_token_id=0)
    return tr.GPT2LMHeadModel(cfg), torch.randint(0, 64, (1, 8))


BACKBONES: Dict[str, Callable[[], Tuple[nn.Module, torch.Tensor]]] = {
    "resnet": _resnet, "swin": _swin, "vit": _vit, "gpt2": _gpt2}
_BUILT: Dict[str, Built] = {}


def _backbone(name: str) -> Built:
    if name not in _BUILT:
        torch.manual_seed(0)
        m, x = BACKBONES[name]()
        m = m.eval()
        rep = certify(m, x)
        assert isinstance(rep, ModelCertificate) and rep.chained, rep
        _BUILT[name] = (m, x, rep, _token_norm(x) if x.is_floating_point() else 1.0)
    return _BUILT[name]


def test_backbones_have_the_segments_searched():
    kinds = {name: [c.kind for c in _backbone(name)[2].chain()] for name in ("resnet", "swin")}
    assert "block" in kinds["resnet"], kinds  # projection shortcuts
    assert "map" in kinds["swin"], kinds  # patch merging
    vit, gpt2 = _backbone("vit")[2], _backbone("gpt2")[2]
    assert vit.stem is not None and vit.head is not None
    assert gpt2.integer_input and gpt2.stem is not None and gpt2.head is not None


@pytest.mark.parametrize("name", list(BACKBONES))
def test_backbone_search_does_not_beat_the_certificate(name):
    m, x, rep, r0 = _backbone(name)
    st = rep.stack("fp32", r0=r0, loss="cross_entropy")
    report = cbt.assert_model_sound(m, st, x, model_certificate=rep, loss="cross_entropy", **SEARCH)
    expected = [c for c in cbt.MODEL_CHECKS if not (rep.integer_input and c == "gradient")]
    assert [r.check for r in report.checks] == expected
    assert all(r.evaluations > SEARCH["count"] and 0 < r.ratio <= 1 + SEARCH["rtol"] for r in report.checks), report


# --------------------------------------------------------------------------------------- planted counterexamples


def _shrunk_radii(st: StackCertificate, factor: float) -> StackCertificate:
    return replace(st, radii=tuple(r / factor for r in st.radii), output_bound=st.output_bound / factor)


def test_planted_output_bound_is_beaten(toys):
    m, x, rep, r0 = toys[HeadScale]
    st = rep.stack("fp32", r0=r0)
    bad = replace(st, output_bound=st.output_bound / 100)
    with pytest.raises(AssertionError, match="output bound exceeded"):
        cbt.assert_model_sound(m, bad, x, checks=["output"], **SEARCH)
    report = cbt.search_model(m, bad, x, checks=["output"], **SEARCH)
    assert report["output"].ratio > 10, report


def test_planted_map_coefficient_is_beaten_at_the_next_boundary(toys):
    m, x, rep, r0 = toys[MapBetween]
    chain = rep.chain()
    k = next(i for i, c in enumerate(chain) if c.kind == "map")
    chain[k] = replace(chain[k], c=chain[k].c / 100, l0=chain[k].l0 / 100)
    bad = certify_stack(chain, "fp32", r0=r0)
    report = cbt.search_model(m, bad, x, model_certificate=rep, checks=["output", "state"], **SEARCH)
    assert report["output"].ratio > 10 and report["state"].ratio > 10, report
    assert report["state"].where == f"boundary {k + 1} (input of u2)", report


def test_planted_intermediate_bound_is_beaten(toys):
    m, x, rep, r0 = toys[ProjectionShortcut]
    bad = _shrunk_radii(rep.stack("fp32", r0=r0), 100)
    report = cbt.search_model(m, bad, x, checks=["intermediate"], **SEARCH)
    assert report["intermediate"].ratio > 10, report


def test_planted_segment_peak_is_beaten(toys):
    m, x, rep, r0 = toys[StemScale]
    chain = rep.chain()
    p = chain[0].peak  # the stem's: its largest entry is 1e5 times the input's
    chain[0] = replace(chain[0], peak=replace(p, c=p.c / 100, b=p.b / 100))
    bad = certify_stack(chain, "fp32", r0=r0)
    report = cbt.search_model(m, bad, x, model_certificate=rep, checks=["peak"], **SEARCH)
    assert report["peak"].ratio > 10 and "segment 0 (stem)" in report["peak"].where, report


def test_planted_gradient_bound_is_beaten(toys):
    m, x, rep, r0 = toys[HeadScale]
    st = rep.stack("fp32", r0=r0, loss="cross_entropy")
    bad = replace(st, lip_g=st.lip_g / 100)
    report = cbt.search_model(m, bad, x, model_certificate=rep, loss="cross_entropy",
                              checks=["gradient", "costate"], **SEARCH)
    assert report["gradient"].ratio > 1 and report["costate"].ratio > 1, report
    assert not report.ok and {r.check for r in report.failures} == {"gradient", "costate"}


def test_planted_token_embedding_bound_is_beaten():
    m, x, rep, _ = _backbone("gpt2")
    chain = rep.chain()
    chain[0] = replace(chain[0], b=chain[0].b / 100)  # the stem: the embedding's largest row, 100x too small
    head = replace(rep.head.certificate, kind="map")
    bad = certify_stack(chain, "fp32", head=head, loss_grad=cross_entropy_gradient)
    report = cbt.search_model(m, bad, x, model_certificate=rep, checks=["state"], **SEARCH)
    assert report["state"].ratio > 10 and report["state"].where.startswith("boundary 1 "), report
    assert math.isnan(report["state"].radius)  # token ids: no radius
    st = rep.stack("fp32", loss="cross_entropy")
    bad = replace(st, lip_g=st.lip_g / 100)
    report = cbt.search_model(m, bad, x, model_certificate=rep, loss="cross_entropy", checks=["costate"], **SEARCH)
    assert report["costate"].ratio > 1, report


def test_search_model_arguments(toys):
    m, x, rep, r0 = toys[MapBetween]
    st = rep.stack("fp32", r0=r0)
    with pytest.raises(ValueError, match="checks"):
        cbt.search_model(m, st, x, checks=["state"])  # needs the model certificate
    with pytest.raises(ValueError, match="checks"):
        cbt.search_model(m, st, x, checks=["gradient"])  # needs a loss
    with pytest.raises(ValueError, match="loss"):
        cbt.search_model(m, st, x, loss="hinge")
    other = toys[HeadScale][2]
    with pytest.raises(ValueError, match="segments|node"):
        cbt.search_model(m, st, x, model_certificate=other, checks=["state"])
