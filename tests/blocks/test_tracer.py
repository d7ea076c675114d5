"""Class-level exponents agree with what the tracer derives from each block's own forward (its rules alone:
``rules_only`` keeps the tracer from reading the blocks' own certificates back)."""

from __future__ import annotations

import pytest
import torch

from certblocks.blocks.attention import Attention, QKNormAttention
from certblocks.blocks.mlp import MLP, GatedMLP
from certblocks.blocks.patchtst import PatchTSTBlock
from certblocks.blocks.rotary import RotaryQKNormAttention

trace = pytest.importorskip("certblocks.trace")
from certblocks.trace.own import rules_only  # noqa: E402

D, H, T = 16, 4, 5

BLOCKS = {
    "attention": lambda: Attention(D, H),
    "qknorm-rms": lambda: QKNormAttention(D, H),
    "qknorm-l2": lambda: QKNormAttention(D, H, qk_norm="l2", causal=False),
    "qknorm-layer": lambda: QKNormAttention(D, H, qk_norm="layer"),
    "qknorm-nobias": lambda: QKNormAttention(D, H, bias=False),
    "rope-gqa": lambda: RotaryQKNormAttention(D, H, 2),
    "rope-mqa-partial-bias": lambda: RotaryQKNormAttention(D, H, 1, partial_rotary_factor=0.5, bias=True),
    "rope-layer-scaled": lambda: RotaryQKNormAttention(D, H, 2, qk_norm="layer", rope_attention_scaling=1.5),
    "mlp": lambda: MLP(D, 32),
    "glu-sigmoid": lambda: GatedMLP(D, 24, bias=True),
    "glu-silu": lambda: GatedMLP(D, 24, gate="silu"),
}


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_exponents_match_tracer(name):
    block = BLOCKS[name]().eval()
    with rules_only():
        traced = trace.certify(block, torch.randn(2, T, D), residual=None)
    assert traced.exponents == block.exponents, f"{name}: tracer {traced.exponents}, class {block.exponents}"
    assert type(block).exponents.q == 1  # class level: the default (certified) configuration


@pytest.mark.parametrize("kw", [{}, {"qk_norm": True}, {"norm": "layer"}, {"norm": "rms", "placement": "peri"}],
                         ids=["none", "qk", "pre-layer", "peri-rms"])
def test_patchtst_updates_match_tracer(kw):
    block = PatchTSTBlock(D, H, 32, **kw).eval()
    with rules_only():
        traced = trace.certify(block, torch.randn(2, T, D))
    assert [u.exponents for u in traced.updates] == list(block.exponents)
