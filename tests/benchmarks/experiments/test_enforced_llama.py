"""benchmarks/experiments/enforced_llama.py: the three forms train, the enforced one keeps its embedding within r0 / 2
and its caps hold after the optimizer's steps, and the summary has every form."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")

import enforced_llama  # noqa: E402


def test_quick_run_reports_every_form(tmp_path):
    out = tmp_path / "el.json"
    res = enforced_llama.main(["--steps", "6", "--seeds", "0", "--layers", "2", "--width", "32", "--heads", "4",
                               "--block", "16", "--batch", "2", "--eval-batches", "1", "--corpus-bytes", "50000",
                               "--threads", "1", "--out", str(out)])
    assert set(res["summary"]) == {"llama", "converted", "enforced"}
    for r in res["runs"]:
        assert r["first_nonfinite"] is None and math.isfinite(r["eval_bits_per_byte"]) and r["ms_per_step"] > 0
        assert 0.0 < r["eval_bits_per_byte"] < 9.0  # 256 symbols: a fresh model is near 8 bits
    assert json.loads(out.read_text())["args"]["steps"] == 6


def test_enforced_form_stays_certified_after_training_steps():
    import argparse

    import torch

    import certblocks

    args = argparse.Namespace(width=32, layers=2, heads=4, kv_heads=2, block=16, seed=0, amp="bf16")
    model, cap = enforced_llama.build("enforced", args)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)  # huge steps: the caps must hold anyway
    for _ in range(3):
        loss = model(torch.randint(0, 256, (2, 16)), use_cache=False).logits.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    updates = [m for layer in model.model.layers for m in (layer.self_attn, layer.mlp)]
    assert certblocks.certificate.certify_stack([m.certificate() for m in updates], "bf16", r0=2.0 * cap).ok
