"""The Mamba blocks' class exponents are what the tracer derives from their own forward."""

from __future__ import annotations

import pytest
import torch

from certblocks.blocks.mamba import LinearGrowthMamba, Mamba
from certblocks.trace import certify
from certblocks.trace.own import rules_only


@pytest.mark.parametrize("cls", [LinearGrowthMamba, Mamba])
def test_tracer_derives_the_class_exponents(cls):
    torch.manual_seed(0)
    block = cls(16, d_state=4).eval()
    with rules_only():  # derived from the graph, not read back from the block's own certificate
        report = certify(block, torch.randn(1, 6, 16), residual=None)
    assert report.exponents == cls.exponents, report.explain()
    assert report.coefficients_derived
    # both certificates are sound upper bounds; the block's own analysis is the tighter one
    own = block.certificate(seq_len=6)
    assert own.exponents == report.exponents
    assert own.c <= report.certificate.c
