"""Headroom is negative exactly when a planted batch overflows the dtype.

The planted model multiplies the state by ``g`` at each of its ``D`` updates (``v(x) = (g - 1) x``), run in float16:
the state after the last update is ``g^D x`` and the costate entering the first update ``g^D p_D``, so the batch
overflows float16 -- a state or the gradient reaches ``inf`` -- exactly when ``g^D max|x|`` or ``g^D`` passes
65504.  One token per sample, one nonzero feature: the per-token norm equals the largest entry, and the trajectory
bound (T) equals the actual gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
from _traj_models import scale_stack

import certblocks


def _overflows(model: torch.nn.Module, x: torch.Tensor, loss) -> bool:
    """A float16 forward and backward of the batch: does a state, the output or the gradient reach inf/NaN?"""
    x = x.detach().clone().requires_grad_(True)
    states = []
    hooks = [b.register_forward_hook(lambda m, a, o: states.append(a[0] + m.w.to(a[0].dtype) * a[0]))
             for b in model.blocks]
    try:
        y = model(x)
        (g,) = torch.autograd.grad(loss(y), x)
    finally:
        for h in hooks:
            h.remove()
    return not (all(torch.isfinite(s).all() for s in states) and torch.isfinite(y).all() and torch.isfinite(g).all())


def _batch(scale: float) -> torch.Tensor:
    x = torch.zeros(3, 1, 4, dtype=torch.float16)
    x[:, 0, 0] = torch.tensor([0.5, -1.0, 0.25]) * scale
    return x


LOSS = lambda y: y[..., 0].sum()  # p_D has one entry 1 per sample: ||p_D|| = 1


@pytest.mark.parametrize("g,depth", [(1.5, 12), (2.0, 8), (1.05, 40)])
def test_headroom_negative_exactly_when_float16_overflows(g: float, depth: int) -> None:
    model = scale_stack(g, depth).half()
    grow = g ** depth
    seen = {True: 0, False: 0}
    for log_scale in range(-2, 9):  # the batch's largest entry from 1e-2 to 1e8 (well inside and past 65504)
        scale = 10.0 ** log_scale
        if not math.isfinite(float(_batch(scale).abs().max())):
            continue
        rep = certblocks.trajectory(model, _batch(scale), "fp16", loss=LOSS)
        over = _overflows(model, _batch(scale), LOSS)
        assert (rep.headroom < 0) == over, (g, depth, scale, rep.headroom, over)
        assert (rep.headroom_certified < 0) == over
        assert (rep.headroom_measured < 0) == over, (g, depth, scale, rep.headroom_measured, over)
        seen[over] += 1
        if not over:  # (T) is exact here: the bound is the actual gradient g^D, the forward the largest entry
            assert rep.log_gradient_bound == pytest.approx(depth * math.log(g), rel=1e-3)
            assert rep.forward_max == pytest.approx(grow * float(_batch(scale).abs().max()), rel=1e-2)
    assert seen[True] and seen[False]  # the sweep crosses the boundary


def test_gradient_overflow_alone_is_negative_headroom() -> None:
    # g^D = 2^17 > 65504 with a state of entries 2^-20: the forward stays small, the gradient overflows
    model = scale_stack(2.0, 17).half()
    x = _batch(2.0 ** -19)
    rep = certblocks.trajectory(model, x, "fp16", loss=LOSS)
    assert _overflows(model, x, LOSS) and rep.headroom < 0 < rep.forward_headroom
    name, qty, _ = rep.worst()
    assert qty == "Jacobian"


def test_real_model_overflowing_in_float16_has_negative_headroom() -> None:
    from certblocks.blocks import MLP, Attention

    torch.manual_seed(0)
    st = certblocks.build_stack([Attention(16, 2), MLP(16, 32), Attention(16, 2), MLP(16, 32)], "fp32",
                                certify=False).eval()
    with torch.no_grad():
        for b in st.blocks:
            for p in b.parameters():
                p.mul_(4.0)
    small, big = torch.randn(2, 6, 16) * 0.1, torch.randn(2, 6, 16) * 300.0
    for x, expect_over in ((small, False), (big, True)):
        with torch.autocast("cpu", dtype=torch.float16):
            y = st(x)
            rep = certblocks.trajectory(st, x, "fp16", loss=lambda y: y.float().mean())
        assert (not torch.isfinite(y).all()) == expect_over
        assert (rep.headroom < 0) == expect_over, (expect_over, rep.headroom)
    assert rep.worst()[1] in ("state norm", "logits", "intermediate")


def _prenorm_stack(gain: float) -> certblocks.stack.CertifiedStack:
    """Pre-LN MLP updates; ``gain`` scales the last linear layer of each (a large one overflows float16)."""
    from certblocks.zoo._layers import NormedUpdate

    from certblocks.blocks import MLP

    torch.manual_seed(0)
    blocks = [NormedUpdate(MLP(8, 16), 8, "layer") for _ in range(3)]
    with torch.no_grad():
        for b in blocks:
            b.branch.fc2.weight.mul_(gain)
    return certblocks.build_stack(blocks, "fp16", certify=False).eval()


def _autocast_run_overflows(model: torch.nn.Module, x: torch.Tensor) -> bool:
    """Under float16 CPU autocast: does any tensor the forward computes, or the input's gradient, reach inf/NaN?"""
    from certblocks.testing.record import intermediate_peaks

    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.float16):
        peak, _ = intermediate_peaks(model, x)
        y = model(x)
    (g,) = torch.autograd.grad(y.float().sum(), x)
    return not (math.isfinite(peak) and torch.isfinite(g).all())


def test_measured_forward_headroom_reads_each_tensor_in_its_own_dtype_under_autocast() -> None:
    """A float32 residual stream far above 65504 under float16 autocast does not overflow: the measured headroom
    (entries against their own dtype) says so; the estimate (every state norm against float16's M) does not, and
    a run asked about float16 without autocast (nothing ran in float16) counts every tensor against 65504."""
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0)) * 1e6  # float32 states ~1e6
    loss = lambda y: y.float().sum()  # noqa: E731
    safe = _prenorm_stack(1.0)
    with torch.autocast("cpu", dtype=torch.float16):
        rep = certblocks.trajectory(safe, x, "fp16", loss=loss)
    assert not _autocast_run_overflows(safe, x)
    assert rep.forward_headroom < 0 < rep.forward_headroom_measured and rep.headroom_measured > 0
    items = rep.measured_forward_items()
    assert {q for _, _, q, _ in items} >= {"state", "intermediate"}
    states = [h for h, where, q, _ in items if q == "state"]
    assert min(states) > math.log(float(torch.finfo(torch.float32).max)) - math.log(1e8)  # judged as float32
    hypothetical = certblocks.trajectory(safe, x, "fp16", loss=loss)  # float32 run asked about float16
    assert hypothetical.forward_headroom_measured < 0
    # the same stack with a float16 matmul output past 65504: the run overflows, the measured headroom is negative
    hot = _prenorm_stack(1e6)
    with torch.autocast("cpu", dtype=torch.float16):
        rep_hot = certblocks.trajectory(hot, x, "fp16", loss=loss)
    assert _autocast_run_overflows(hot, x)
    assert rep_hot.forward_headroom_measured < 0 and rep_hot.headroom_measured < 0
    assert rep_hot.worst("measured")[1] in ("intermediate", "state")
