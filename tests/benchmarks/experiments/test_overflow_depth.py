"""benchmarks/experiments/overflow_depth.py: the measured overflow depth never beats the certificate on tiny stacks."""

from __future__ import annotations

import math

import torch
from overflow_depth import block_factories, evaluate_block, run_stack


def test_run_stack_marks_overflow_and_keeps_it():
    class Double(torch.nn.Module):
        def forward(self, x):
            return x * 1000.0

    x0 = torch.ones(2, 3, 4, dtype=torch.float16)
    norms = run_stack([Double() for _ in range(4)], x0)
    assert norms.shape == (5, 2)
    assert norms[0, 0] == 2.0  # per-token norm of a token of four ones
    assert math.isfinite(float(norms[1, 0])) and float(norms[1, 0]) < 65504
    assert torch.isinf(norms[2:]).all()  # 2 * 1001^2 > 65504; stays inf after


def test_tiny_stacks_never_beat_the_certificate():
    torch.set_num_threads(1)
    facs = block_factories(8, 4)
    for name, gain, r0 in (("MLP", 6.0, 10.0), ("GatedMLP-silu", 2.0, 10.0)):
        res = evaluate_block(name, facs[name], depth=16, dim=8, seq_len=4, r0=r0, gain=gain, n_random=3,
                             search_steps=3, search_targets=(2,), seed=0, dtypes=("fp16", "fp32"))
        fp16 = res["dtypes"]["fp16"]
        # not vacuous: the stack overflows fp16 within its depth, and the certificate says so earlier
        assert fp16["empirical_overflow_depth"] is not None, name
        assert fp16["certified_forward_depth"] is not None, name
        for dn, d in res["dtypes"].items():
            assert not d["beaten"], (name, dn, d["beaten_reason"])
            if d["empirical_overflow_depth"] is not None and d["certified_forward_depth"] is not None:
                assert d["empirical_overflow_depth"] > d["certified_forward_depth"]
                assert d["tightness"] >= 1.0
            assert d["max_norm_over_radius"] <= 1.0 + 1e-6
