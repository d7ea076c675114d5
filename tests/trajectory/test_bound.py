"""The trajectory bound (T) is an upper bound of the actual gradient ``||p_0||``: a counterexample search.

For each batch -- random ones at several scales, then batches found by gradient ascent on ``||p_0||`` -- the actual
gradient of the loss with respect to the first state (largest per-sample Euclidean norm) must not exceed the reported
bound: neither the estimate (Lanczos factors, ``log_gradient_bound``) nor the certified one
(``log_gradient_bound_certified``).  A failure prints the batch's scale and the two figures.
"""

from __future__ import annotations

import math
from typing import Callable, List

import pytest
import torch
from _traj_models import PlainResidual, stack
from torch.nn.attention import SDPBackend, sdpa_kernel

import certblocks

SLACK = 1e-6  # relative: the float32 rounding of the actual gradient


def _plain(model: torch.nn.Module):
    """Double backward through every op: fused QK-norm off, the math attention kernel."""
    for m in model.modules():
        if getattr(m, "fused_qk_norm", None) is True:
            m.fused_qk_norm = False
    return sdpa_kernel([SDPBackend.MATH])


def _actual(model: torch.nn.Module, loss: Callable, x: torch.Tensor, create_graph: bool = False) -> torch.Tensor:
    """Per-sample ``||d loss / d X_0||`` (the input is the first state: no stem)."""
    x = x.detach().requires_grad_(True) if not x.requires_grad else x
    (g,) = torch.autograd.grad(loss(model(x)), x, create_graph=create_graph)
    return g.reshape(g.shape[0], -1).norm(dim=1)


def _check(model: torch.nn.Module, loss: Callable, x: torch.Tensor, label: str, **kw) -> None:
    rep = certblocks.trajectory(model, x, "fp32", loss=loss, **kw)
    actual = math.log(float(_actual(model, loss, x).max()))
    assert actual <= rep.log_gradient_bound + SLACK, (label, actual, rep.log_gradient_bound)
    cert = rep.log_gradient_bound_certified
    assert cert is not None and actual <= cert + SLACK, (label, actual, cert)
    # the measured costates: p_0 is the actual gradient, and every p_k is under the (T) member from k on
    measured = [u.costate_norm for u in rep.updates]
    assert measured[0] == pytest.approx(math.exp(actual), rel=1e-4), (label, measured[0], math.exp(actual))
    tail = math.log(rep.head.norm)
    for u in reversed(rep.updates):
        tail += u.log_factor_certified
        assert math.log(u.costate_norm) <= tail + SLACK, (label, u.name, u.costate_norm, tail)
    assert rep.log_gradient_measured is not None and rep.headroom_measured >= rep.headroom_certified - SLACK


def _ascent(model: torch.nn.Module, loss: Callable, x0: torch.Tensor, steps: int = 12) -> List[torch.Tensor]:
    """Batches along a gradient ascent on ``log ||p_0||`` (every sample at once)."""
    x = x0.clone().requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.1 * float(x0.abs().mean()))
    found = []
    with _plain(model):
        for _ in range(steps):
            obj = -_actual(model, loss, x, create_graph=True).log().sum()
            opt.zero_grad()
            obj.backward()
            opt.step()
            found.append(x.detach().clone())
    return found[::4] + found[-1:]


def _target_loss(shape, seed: int) -> Callable:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return lambda y: (y - t).square().mean()


@pytest.mark.parametrize("seed", [0, 1])
def test_certified_stack_bound_holds_on_random_and_searched_batches(seed: int) -> None:
    st = stack(seed)
    for m in st.modules():  # the loss' double backward (ascent) needs the plain QK-norm too
        if getattr(m, "fused_qk_norm", None) is True:
            m.fused_qk_norm = False
    st.eval()
    g = torch.Generator().manual_seed(100 + seed)
    loss = _target_loss((4, 5, 8), seed)
    for scale in (0.1, 1.0, 10.0):
        _check(st, loss, torch.randn(4, 5, 8, generator=g) * scale, f"random scale {scale}")
        _check(st, loss, torch.randn(4, 5, 8, generator=g) * scale, f"random scale {scale}, certificates",
               dense_max=0)  # sqrt(n) L(R) from the blocks' certificates
    for k, x in enumerate(_ascent(st, loss, torch.randn(4, 5, 8, generator=g))):
        _check(st, loss, x, f"ascent {k}")


def test_graph_model_bound_holds_on_random_and_searched_batches() -> None:
    torch.manual_seed(3)
    m = PlainResidual().eval()
    t = torch.randint(0, 5, (3, 4), generator=torch.Generator().manual_seed(0))
    loss = lambda logits: torch.nn.functional.cross_entropy(logits.reshape(-1, 5), t.reshape(-1))
    g = torch.Generator().manual_seed(7)
    for scale in (0.3, 3.0, 30.0):
        _check(m, loss, torch.randn(3, 4, 6, generator=g) * scale, f"random scale {scale}")
    for k, x in enumerate(_ascent(m, loss, torch.randn(3, 4, 6, generator=g))):
        _check(m, loss, x, f"ascent {k}")


def test_zoo_model_bound_holds_with_its_own_loss() -> None:
    from certblocks.zoo import create_model

    torch.manual_seed(0)
    model = create_model("gpt2_qknorm_test", certify=False).eval()
    g = torch.Generator().manual_seed(1)
    for trial in range(3):
        idx = torch.randint(0, model.vocab_size, (2, 8), generator=g)
        tgt = torch.randint(0, model.vocab_size, (2, 8), generator=g)
        rep = certblocks.trajectory(model, (idx, tgt), "fp32")
        assert rep.head.source == "loss"  # the model returns its loss: p_D exactly
        seen: list = []
        h = model.transformer.h[0].register_forward_pre_hook(lambda mod, a, seen=seen: seen.append(a[0]))
        try:
            _, lossv = model(idx, tgt)
        finally:
            h.remove()
        (p0,) = torch.autograd.grad(lossv, seen[0])
        actual = math.log(float(p0.reshape(2, -1).norm(dim=1).max()))
        assert actual <= rep.log_gradient_bound + SLACK, (trial, actual, rep.log_gradient_bound)
        assert actual <= rep.log_gradient_bound_certified + SLACK


def test_measured_costates_need_an_exact_costate_at_the_last_state() -> None:
    st = stack(0).eval()
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(7))
    loss = _target_loss((3, 5, 8), 0)
    rep = certblocks.trajectory(st, x, "fp16", loss=loss)
    assert rep.headroom_on("measured") == (rep.headroom_measured, "measured")
    assert "measured: log max_k ||p_k||" in rep.explain()
    assert rep.to_dict()["headroom_measured"] == rep.headroom_measured
    # without a loss the stack's costate at X_D is Lip(G), a bound: nothing is measured, the basis falls back
    blind = certblocks.trajectory(st, x, "fp16")
    assert blind.head.source == "lip_g" and blind.log_gradient_measured is None
    assert all(u.costate_norm is None for u in blind.updates)
    assert blind.headroom_on("measured") == (blind.headroom, "estimate")
    assert blind.headroom_on("certified")[1] == "certified"
    with pytest.raises(ValueError, match="'measured', 'estimate', 'certified'"):
        rep.headroom_on("exact")
    with pytest.raises(ValueError, match="headroom_basis"):
        certblocks.CertificateMonitor(st, "fp16", headroom_basis="exact")
