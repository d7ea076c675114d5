"""The Jacobian figures of ``certblocks.trajectory``: the Lanczos estimate against the exact spectral norm."""

from __future__ import annotations

import pytest
import torch
from _traj_models import PlainResidual, exact_norms, stack

import certblocks
from certblocks.ondata import jacobian_spectral_norm
from certblocks.ondata.power import LinearizedMap


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_single_token_within_5_percent_of_the_exact_norm(seed: int) -> None:
    st = stack(seed, dim=16)
    x = torch.randn(4, 1, 16, generator=torch.Generator().manual_seed(seed)) * 3.0  # one token per sample
    rep = certblocks.trajectory(st, x, "fp32", dense_max=0)
    states = [x]
    with torch.no_grad():
        for blk in st.blocks:
            states.append(states[-1] + st.dt * blk(states[-1]))
    for k, (u, blk) in enumerate(zip(rep.updates, st.blocks)):
        exact = float(exact_norms(blk.eval(), states[k]).max())
        assert u.jacobian_norm <= exact * (1 + 1e-5), (u.name, u.jacobian_norm, exact)  # attained: from below
        assert u.converged
        assert u.jacobian_norm >= 0.95 * exact, (u.name, u.jacobian_norm, exact, u.steps)


@pytest.mark.parametrize("seed", [0, 1])
def test_multi_token_agrees_with_autograd_jacobian(seed: int) -> None:
    st = stack(seed)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(10 + seed)) * 2.0
    rep = certblocks.trajectory(st, x, "fp32")
    h = x
    for u, blk in zip(rep.updates, st.blocks):
        exact = exact_norms(blk.eval(), h)
        e = float(exact.max())
        assert 0.95 * e <= u.jacobian_norm <= e * (1 + 1e-5), (u.name, u.jacobian_norm, e)
        # 40 entries per sample <= dense_max: the certified bound is the whole float64 Jacobian's
        # (the reference is computed in float32: its rounding is the tolerance)
        assert u.bound_source == "dense" and e * (1 - 1e-6) <= u.jacobian_bound <= e * (1 + 1e-6)
        assert u.jvp == "forward"  # fused attention kernels run as plain ops for the forward-mode product
        assert u.state_norm == pytest.approx(float(h.norm(dim=-1).max()), rel=1e-6)
        with torch.no_grad():
            h = h + blk(h)


def test_graph_model_agrees_with_autograd_jacobian() -> None:
    torch.manual_seed(0)
    m = PlainResidual().eval()
    x = torch.randn(2, 4, 6) * 3.0
    rep = certblocks.trajectory(m, x, "fp16")
    assert [u.name for u in rep.updates] == ["mlps.0", "mlps.1", "mlps.2"]
    h = x
    for u, mlp in zip(rep.updates, m.mlps):
        e = float(exact_norms(mlp, h).max())
        assert 0.95 * e <= u.jacobian_norm <= e * (1 + 1e-5)
        assert u.bound_source == "dense" and u.jacobian_bound >= e * (1 - 1e-6)  # float32 reference: its rounding
        with torch.no_grad():
            h = h + mlp(h)
    # the head: ||D head|| = ||W|| (linear), times the loss gradient bound 1 (no loss named)
    w = float(torch.linalg.matrix_norm(m.head.weight.detach().double(), ord=2))
    assert rep.head.source == "jacobian" and rep.head.norm == pytest.approx(w, rel=1e-4)
    assert rep.head.norm_certified >= w


def test_estimate_is_attained_and_converges_on_a_fixed_matrix() -> None:
    g = torch.Generator().manual_seed(0)
    W = torch.randn(40, 40, generator=g, dtype=torch.float64)
    x = torch.randn(3, 40, generator=g, dtype=torch.float64)
    lin = LinearizedMap(lambda a: torch.tanh(a @ W.T) @ W, x)
    est = jacobian_spectral_norm(lin, steps=40, tol=1e-10)
    exact = exact_norms(lambda a: torch.tanh(a @ W.T) @ W, x)
    assert torch.all(est.values <= exact * (1 + 1e-9)) and torch.allclose(est.values, exact, rtol=1e-6)
    assert est.converged and est.jvp == "forward"
    warm = jacobian_spectral_norm(lin, steps=40, tol=1e-10, v0=est.vector)  # a warm start needs fewer steps
    assert warm.steps < est.steps and torch.allclose(warm.values, exact, rtol=1e-6)


def test_a_map_without_forward_mode_uses_another_product() -> None:
    class NoForward(torch.autograd.Function):  # a custom op with a backward only (like a fused kernel)
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    x = torch.randn(2, 3, 4, dtype=torch.float64)
    lin = LinearizedMap(NoForward.apply, x)
    est = jacobian_spectral_norm(lin, steps=20, tol=1e-12)
    assert est.jvp == "double"
    exact = (2 * x.abs()).reshape(2, -1).amax(dim=1)  # diagonal Jacobian
    assert torch.allclose(est.values, exact, rtol=1e-8)
