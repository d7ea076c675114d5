"""Bounds of every intermediate's gradient (certblocks.trace.backward) against autograd.

Each small module is captured, its forward bounds read at a radius ``R``, and every node's gradient bounded from a
costate of ``N* = 1`` at the output (the sum over the rows of their Euclidean norms, docs/theory.md section 7).
Autograd's gradient of every node, parameter and the input must stay within the bounds for random inputs in the
ball (rows of norm up to ``R``), random and one-row costates, and inputs found by gradient ascent on the gradient's
norm of a chosen node; a bound planted below a measured gradient is reported (the check can fail).  A whole model's
bounds come from its chain's certificate; under CPU autocast fp16 a static loss scale ``S*`` (and ``S*/2``) never
makes an fp16 gradient overflow, and a GradScaler's initial 65536 does when ``S*`` is below it.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from certblocks.blocks.mlp import MLP
from certblocks.trace.api import _certify_chain
from certblocks.trace.backward import (
    GradBound,
    LossScale,
    autograd_gradients,
    gradient_violations,
    loss_scale_from,
    max_loss_scale,
    model_gradient_bounds,
    segment_gradients,
)
from certblocks.trace.capture import CapturedGraph, capture
from certblocks.trace.chain import model_chain
from certblocks.trace.residual import find_residual_updates

RTOL = 1e-6


# ------------------------------------------------------------------------------------------------ helpers
def _ball(shape: Sequence[int], radius: float, gen: torch.Generator) -> torch.Tensor:
    """Rows of norm at most ``radius``: random directions at random fractions of it (some at the radius)."""
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    frac = torch.rand(*shape[:-1], 1, generator=gen, dtype=torch.float64)
    frac[..., :1, :] = 1.0
    return x / x.norm(dim=-1, keepdim=True) * radius * frac


def _project(x: torch.Tensor, radius: float) -> torch.Tensor:
    n = x.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    return x * torch.where(n > radius, radius / n, torch.ones_like(n))


def _costate(shape: Sequence[int], gen: torch.Generator, one_row: bool = False) -> torch.Tensor:
    """A costate with ``N* = 1``: random, or all of it in one row (an extreme point of the N* ball)."""
    c = torch.randn(*shape, generator=gen, dtype=torch.float64)
    if one_row:
        flat = c.reshape(-1, shape[-1])
        keep = int(torch.randint(flat.shape[0], (1,), generator=gen))
        mask = torch.zeros_like(flat)
        mask[keep] = 1.0
        c = (flat * mask).reshape(shape)
    return c / c.reshape(-1, shape[-1]).norm(dim=-1).sum()


def _n_star(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).norm(dim=-1).sum()


def _env(g: CapturedGraph, x: torch.Tensor) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """Run the captured program on ``x`` keeping every node's value (differentiable in ``x``)."""
    ep = g.ep
    state, consts = ep.state_dict, getattr(ep, "constants", {}) or {}
    vals = []
    for spec in ep.graph_signature.input_specs:
        v = x if spec.kind.name == "USER_INPUT" else (state[spec.target] if spec.target in state
                                                     else consts.get(spec.target))
        vals.append(v.double() if v.is_floating_point() else v)
    env: Dict[str, torch.Tensor] = {}

    class _Keep(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node):
            r = super().run_node(n)
            env[n.name] = r
            return r

    out = _Keep(ep.graph_module, garbage_collect_values=False).run(*vals)
    return env, (out[0] if isinstance(out, (tuple, list)) else out)


def _ascend(g: CapturedGraph, node: str, radius: float, shape: Sequence[int], seed: int, steps: int = 40) -> float:
    """Gradient ascent on ``N*(dL/d node)`` over inputs in the ball and one-row costates; the largest value found."""
    gen = torch.Generator().manual_seed(seed)
    x = _ball(shape, radius, gen).requires_grad_(True)
    with torch.no_grad():
        _, out0 = _env(g, x.detach())
    cot = _costate(out0.shape, gen, one_row=True)
    opt = torch.optim.Adam([x], lr=0.05 * max(radius, 1e-3))
    best = 0.0
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        for _ in range(steps):
            env, out = _env(g, x)
            t = env[node] if node in env else x
            (gt,) = torch.autograd.grad((out * cot).sum(), t, create_graph=True)
            obj = _n_star(gt)
            best = max(best, float(obj.detach()))
            if not obj.requires_grad:  # the gradient does not depend on the input (the output's own)
                break
            opt.zero_grad()
            (-obj).backward()
            opt.step()
            with torch.no_grad():
                x.copy_(_project(x, radius))
    return best


def _bounds(res) -> Dict[str, GradBound]:
    out = dict(res.bounds)
    for name, (e, _) in res.parameters.items():
        out[name] = GradBound(math.inf, math.inf, e)
    return out


def _search(m: nn.Module, shape: Sequence[int], radius: float, *, trials: int = 6, ascend: Sequence[str] = (),
            seed: int = 0) -> Tuple[CapturedGraph, Dict[str, GradBound], Dict[str, float]]:
    """Bound every gradient of ``m`` at ``radius`` and search for a counterexample; the largest measured ``N*`` per
    node (random and ascended)."""
    m = m.double().eval()
    gen = torch.Generator().manual_seed(seed)
    g = capture(m, (_ball(shape, radius, gen),))
    res = segment_gradients(g, g.user_inputs[0], g.outputs[0], radius, 1.0)
    bounds = _bounds(res)
    assert bounds and all(b.known for b in bounds.values()), {k: b for k, b in bounds.items() if not b.known}
    measured: Dict[str, float] = {}
    for k in range(trials):
        x = _ball(shape, radius, gen)
        out_shape = g.env[g.outputs[0].name].shape
        cot = _costate(out_shape, gen, one_row=k % 2 == 1)
        grads = autograd_gradients(g, (x,), cot, inputs_require_grad=True)
        bad = gradient_violations(bounds, grads, rtol=RTOL)
        assert not bad, f"{type(m).__name__} at R={radius}: {bad}"
        for name, t in grads.items():
            measured[name] = max(measured.get(name, 0.0), float(_n_star(t.double())))
    for node in ascend:
        found = _ascend(g, node, radius, shape, seed)
        b = bounds[node].total
        assert found <= b * (1 + RTOL), f"{type(m).__name__}: ascent on {node} found N* = {found:.6g} > {b:.6g}"
        measured[node] = max(measured.get(node, 0.0), found)
    return g, bounds, measured


# ------------------------------------------------------------------------------------------------ small modules
class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    """Single-head attention written out: logits, a causal mask, softmax, the weighted sum of the values."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.register_buffer("mask", torch.triu(torch.ones(5, 5, dtype=torch.bool), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ self.k(x).transpose(-2, -1) / math.sqrt(x.shape[-1])
        p = torch.softmax(s.masked_fill(self.mask, float("-inf")), dim=-1)
        return self.o(p @ self.v(x))


class Sdpa(nn.Module):
    """Two-head attention through scaled_dot_product_attention, with the head split and merge views."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.h = heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(o.transpose(1, 2).reshape(b, t, d))


class NormLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.f = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(self.ln(x))


class RMSNormWritten(nn.Module):
    """HF's RMSNorm written out (recognized as a normalization), then a Linear."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.w, self.f = nn.Parameter(torch.linspace(0.5, 1.5, d)), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-2)
        return self.f(self.w * y)


class SoftmaxProduct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.f(x), dim=-1) * x


class Products(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f, self.g = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * torch.sigmoid(self.f(x)) + x * self.g(x)


class Residual(nn.Module):
    """Two residual updates ``x + f(x)`` (one through a certified MLP block) read as one segment."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(8, 8)
        self.mlp = MLP(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * torch.relu(self.f(x))
        return x + self.mlp(x)


CASES = [
    (Linear, (2, 5, 8), 3.0, ("linear",)),
    (Mlp, (2, 5, 8), 3.0, ("gelu",)),
    (Attention, (2, 5, 8), 2.0, ("softmax",)),
    (Sdpa, (2, 5, 8), 2.0, ("scaled_dot_product_attention",)),
    (NormLinear, (2, 5, 8), 2.0, ("layer_norm",)),
    (RMSNormWritten, (2, 5, 8), 1.0, ("mul_1",)),
    (SoftmaxProduct, (2, 5, 8), 3.0, ("softmax",)),
    (Products, (2, 5, 8), 2.0, ("tanh",)),
    (Residual, (2, 5, 8), 2.0, ("relu",)),
]


@pytest.mark.parametrize("cls,shape,radius,ascend", CASES, ids=[c[0].__name__ for c in CASES])
def test_gradients_within_bounds(cls, shape, radius, ascend):
    torch.manual_seed(0)
    g, bounds, measured = _search(cls(), shape, radius, ascend=ascend)
    x = g.user_inputs[0].name
    assert math.isfinite(bounds[x].total), f"the input's gradient is not bounded: {bounds[x]}"
    assert measured.get(x, 0.0) > 0, "autograd gave the input no gradient: nothing was checked"
    params = [n for n in bounds if n.startswith("p_")]
    assert params and all(math.isfinite(bounds[p].entry) for p in params), {p: bounds[p] for p in params}
    assert all(p in measured for p in params), "a parameter's gradient was not measured"


def test_planted_small_bound_is_found():
    """The check fails on a bound below a gradient autograd computes (here, half the largest one measured)."""
    g, bounds, measured = _search(Mlp(), (2, 5, 8), 3.0, trials=4)
    node = "gelu"
    planted = dict(bounds)
    planted[node] = GradBound.of(measured[node] / 2)
    gen = torch.Generator().manual_seed(1)
    found = []
    for k in range(6):
        x = _ball((2, 5, 8), 3.0, gen)
        cot = _costate((2, 5, 8), gen, one_row=k % 2 == 1)
        found += gradient_violations(planted, autograd_gradients(g, (x,), cot), rtol=RTOL)
    assert any(v.startswith(f"{node}:") for v in found), found


def test_certified_block_gradients_are_bounded_inside():
    """A module with its own certificate is one group: its input's gradient is capped by the certificate's
    Jacobian bound, and the nodes it hides (traced op by op) get bounds of their own."""
    m = Residual().double().eval()
    gen = torch.Generator().manual_seed(0)
    g = capture(m, (_ball((2, 5, 8), 2.0, gen),))
    res = segment_gradients(g, g.user_inputs[0], g.outputs[0], 2.0, 1.0)
    hidden = [n.name for n in g.nodes if g.module_path(n).startswith("mlp") and n.op == "call_function"]
    assert hidden and all(math.isfinite(res.bounds[h].total) for h in hidden if h in res.bounds), res.bounds
    assert any(h in res.bounds for h in hidden)


def test_unknown_op_is_named_and_never_zero():
    """An op without a local bound (sqrt of an input-dependent value with no proven positive minimum) leaves every
    gradient upstream unbounded, named; with a proven minimum (``y**2 + 1 >= 1``) the same op is bounded."""

    class Sqrt(nn.Module):
        def __init__(self, floor: float) -> None:
            super().__init__()
            self.f, self.g = nn.Linear(8, 8), nn.Linear(8, 8)
            self.floor = floor

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.g(torch.sqrt(self.f(x) ** 2 + self.floor))

    g = capture(Sqrt(0.0).eval(), (torch.randn(2, 5, 8),))
    res = segment_gradients(g, g.user_inputs[0], g.outputs[0], 1.0, 1.0)
    assert math.isfinite(res.bounds["sqrt"].total)  # downstream of the op: bounded
    up = res.bounds["linear"]
    assert not up.known and math.isinf(up.total) and "sqrt" in up.why, up

    g = capture(Sqrt(1.0).eval(), (torch.randn(2, 5, 8),))
    res = segment_gradients(g, g.user_inputs[0], g.outputs[0], 1.0, 1.0)
    assert res.bounds["linear"].known and math.isfinite(res.bounds["linear"].total)


def test_unbounded_local_derivative_refuses_the_loss_scale():
    """x / ||x|| without eps is bounded forward but its derivative is not (1 / ||x|| near 0): every fp16 gradient
    upstream is unbounded, and no loss scale is certified; the reason names the division."""

    class NormUpdate(nn.Module):
        def __init__(self, d: int = 16) -> None:
            super().__init__()
            self.stem, self.f, self.head = nn.Linear(4, d), nn.Linear(d, d), nn.Linear(d, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stem(x)
            x = x + self.f(x / x.norm(dim=-1, keepdim=True))
            return self.head(x)

    ls = max_loss_scale(NormUpdate().eval(), torch.randn(2, 3, 4), r0=2.0)
    assert not ls.certified and ls.value == 0.0 and not ls.safe_unscaled and ls.grad_scaler_above
    assert "aten.div" in ls.reason and "lower bound" in ls.reason, ls.reason
    with pytest.raises(ValueError, match="r0"):
        max_loss_scale(NormUpdate().eval(), torch.randn(2, 3, 4))


# ------------------------------------------------------------------------------------------------ whole models
class Stack(nn.Module):
    """A stem, two residual updates and a linear head of gain ``head_gain`` (a large gain: large gradients)."""

    def __init__(self, head_gain: float = 1.0, d: int = 16) -> None:
        super().__init__()
        self.stem = nn.Linear(4, d)
        self.f1, self.f2 = MLP(d, 2 * d), nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, 10)
        with torch.no_grad():
            self.head.weight.mul_(head_gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = x + self.f1(x)
        x = x + self.f2(x)
        return self.head(x)


def _model(m: nn.Module, x: torch.Tensor, r0: float, autocast: Optional[torch.dtype]):
    import contextlib

    ctx = torch.autocast("cpu", autocast) if autocast is not None else contextlib.nullcontext()
    with ctx:
        g = capture(m, (x,))
    mc = _certify_chain(g, model_chain(g, find_residual_updates(g)), type(m).__name__)
    stack = mc.stack("fp32", r0=r0, loss="cross_entropy")
    return g, model_gradient_bounds(g, stack)


def _ce(target: torch.Tensor, scale: float = 1.0):
    return lambda out: scale * F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))


def _check_model(g: CapturedGraph, mg, inputs: List[torch.Tensor], targets: List[torch.Tensor],
                 autocast: Optional[torch.dtype], rtol: float) -> Dict[str, float]:
    acts = {ng.name: ng.bound for ng in mg.gradients if ng.kind == "activation"}
    params = {ng.name: GradBound(math.inf, math.inf, ng.entry) for ng in mg.gradients if ng.kind == "parameter"}
    worst: Dict[str, float] = {}
    for x, t in zip(inputs, targets):
        grads = autograd_gradients(g, (x,), _ce(t), autocast_dtype=autocast)
        bad = gradient_violations({**acts, **params}, grads, rtol=rtol)
        assert not bad, bad
        for name, v in grads.items():
            if name in acts or name in params:
                b = (acts.get(name) or params[name]).entry
                worst[name] = max(worst.get(name, 0.0), float(v.abs().max()) / b if b else 0.0)
    assert worst, "no gradient was compared"
    return worst


def _ascended_inputs(m: nn.Module, shape: Sequence[int], r0: float, target: torch.Tensor, seed: int,
                     steps: int = 30) -> torch.Tensor:
    """An input in the ball of per-token norm ``r0`` that ascends the largest entry of the gradient of the model's
    first hidden state (fp32): where the fp16 gradients are largest."""
    gen = torch.Generator().manual_seed(seed)
    x = _ball(shape, r0, gen).float().requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.05 * r0)
    for _ in range(steps):
        h = m.stem(x)
        out = m.head(h + m.f2(h + m.f1(h)) + m.f1(h))
        (gh,) = torch.autograd.grad(F.cross_entropy(out.reshape(-1, 10), target.reshape(-1)), h, create_graph=True)
        opt.zero_grad()
        (-gh.abs().max()).backward()
        opt.step()
        with torch.no_grad():
            x.copy_(_project(x.double(), r0).float())
    return x.detach()


def test_model_gradients_within_bounds_fp32():
    torch.manual_seed(0)
    m = Stack().eval()
    r0 = 2.0
    gen = torch.Generator().manual_seed(0)
    g, mg = _model(m, _ball((2, 4, 4), r0, gen).float(), r0, None)
    assert all(ng.bound.known for ng in mg.gradients), [ng for ng in mg.gradients if not ng.bound.known]
    xs = [_ball((2, 4, 4), r0, gen).float() for _ in range(4)]
    ts = [torch.randint(0, 10, (2, 4), generator=gen) for _ in xs]
    _check_model(g, mg, xs, ts, None, 1e-5)


def test_loss_scale_under_autocast_fp16():
    """S* < 65536 on a model with a large head gain: at S = S* and S*/2 no fp16 gradient overflows (random and
    ascended inputs), at the GradScaler's 65536 one does."""
    torch.manual_seed(0)
    m = Stack(head_gain=400.0).eval()
    r0 = 2.0
    gen = torch.Generator().manual_seed(0)
    g, mg = _model(m, _ball((2, 4, 4), r0, gen).float(), r0, torch.float16)
    ls = loss_scale_from(mg)
    assert isinstance(ls, LossScale) and ls.certified, ls.reason
    assert ls.grad_scaler_above and ls.value < 65536.0, ls.reason
    fp16 = [ng for ng in mg.gradients if ng.dtype == torch.float16]
    assert fp16 and ls.node in {ng.name for ng in fp16}
    ts = [torch.randint(0, 10, (2, 4), generator=gen) for _ in range(4)]
    xs = [_ball((2, 4, 4), r0, gen).float() for _ in range(2)]
    xs += [_ascended_inputs(m, (2, 4, 4), r0, t, seed=k) for k, t in enumerate(ts[2:])]
    _check_model(g, mg, xs, ts, torch.float16, 1e-2)
    overflowed_at_init = False
    for x, t in zip(xs, ts):
        for scale in (ls.value, ls.value / 2):
            grads = autograd_gradients(g, (x,), _ce(t, scale), autocast_dtype=torch.float16)
            assert all(bool(torch.isfinite(v).all()) for v in grads.values()), f"overflow at S = {scale:.4g}"
        grads = autograd_gradients(g, (x,), _ce(t, 65536.0), autocast_dtype=torch.float16)
        overflowed_at_init |= not all(bool(torch.isfinite(v).all()) for v in grads.values())
    assert overflowed_at_init, "the GradScaler's initial scale did not overflow: the model does not show the case"


def test_max_loss_scale_names_the_node():
    m = Stack(head_gain=400.0).eval()
    x = _ball((2, 4, 4), 2.0, torch.Generator().manual_seed(0)).float()
    ls = max_loss_scale(m, x, r0=2.0)
    assert ls.certified and 0 < ls.value < 65536 and ls.module, ls.reason
    assert str(ls) == ls.reason and ls.node in ls.reason


def test_zoo_gpt2_test_amp_fp16():
    """The zoo's GPT-2 (test size) under CPU autocast fp16: every gradient bounded, within its bound for random
    token ids, and S* certified with the node that sets it."""
    from certblocks.zoo import create_model

    m = create_model("gpt2_qknorm_test").eval()
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 64, (2, 16), generator=gen)
    g, mg = _model(m, idx, 1.0, torch.float16)
    fp16 = [ng for ng in mg.gradients if ng.dtype == torch.float16]
    assert fp16 and all(ng.bound.known for ng in fp16), [ng for ng in fp16 if not ng.bound.known]
    xs = [torch.randint(0, 64, (2, 16), generator=gen) for _ in range(4)]
    ts = [torch.randint(0, 64, (2, 16), generator=gen) for _ in xs]
    _check_model(g, mg, xs, ts, torch.float16, 1e-2)
    ls = loss_scale_from(mg)
    assert ls.certified and math.isfinite(ls.value) and ls.value > 0, ls.reason
    for x, t in zip(xs[:2], ts[:2]):
        grads = autograd_gradients(g, (x,), _ce(t, ls.value), autocast_dtype=torch.float16)
        assert all(bool(torch.isfinite(v).all()) for v in grads.values())


def test_zoo_vit_test_amp_fp16():
    """The zoo's ViT (test size) under CPU autocast fp16: the patch embedding's conv, the class token's cat and the
    position embedding's add (parameters) and every activation within their bounds for random images."""
    from certblocks.zoo import create_model

    m = create_model("certblocks_vit_test").eval()
    gen = torch.Generator().manual_seed(0)
    r0 = math.sqrt(32)  # a row of 32 pixels in [-1, 1]
    imgs = [torch.rand(2, 3, 32, 32, generator=gen) * 2 - 1 for _ in range(4)]
    g, mg = _model(m, imgs[0], r0, torch.float16)
    assert all(ng.bound.known for ng in mg.gradients if ng.dtype == torch.float16)
    names = {ng.name for ng in mg.gradients if ng.kind == "parameter"}
    assert any("cls_token" in n for n in names) and any("pos_embed" in n for n in names)
    ts = [torch.randint(0, 10, (2,), generator=gen) for _ in imgs]
    worst = _check_model(g, mg, imgs, ts, torch.float16, 1e-2)
    assert any("patch_embed" in k for k in worst)


def test_hf_gpt2_conv1d_parameters_amp_fp16():
    """HF GPT-2's Conv1D is ``addmm(bias, x, W)``: its weight's and bias's gradients are bounded (they were
    not: no loss scale was certified for any HF GPT-2), within their bounds for random token ids under CPU autocast
    fp16, and ``ModelCertificate.stack`` carries the scale."""
    tr = pytest.importorskip("transformers")
    from certblocks.trace import certify

    cfg = tr.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    m = tr.GPT2Model(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 64, (1, 8), generator=gen)

    class LastState(nn.Module):  # the model's first output, so that the loss is a function of it
        def __init__(self) -> None:
            super().__init__()
            self.m = m

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.m(input_ids=ids, use_cache=False).last_hidden_state

    rep = certify(LastState().eval(), idx, precision="amp-fp16")  # autocast's casts are nodes of this graph
    st = rep.stack("amp-fp16", loss="cross_entropy")
    assert st.max_loss_scale is not None and st.max_loss_scale > 0 and "loss scale" in st.explain()
    g = rep.graph
    mg = model_gradient_bounds(g, rep.stack("fp32", loss="cross_entropy"))
    weights = [ng for ng in mg.gradients if ng.kind == "parameter" and ng.dtype == torch.float16]
    assert weights and all(ng.bound.known for ng in weights), [ng for ng in weights if not ng.bound.known]
    xs = [torch.randint(0, 64, (1, 8), generator=gen) for _ in range(3)]
    ts = [torch.randint(0, 32, (1, 8), generator=gen) for _ in xs]
    _check_model(g, mg, xs, ts, torch.float16, 1e-2)


class Bottleneck(nn.Module):
    """``x + W2 (W1 x)`` with ``W1`` scaled by ``1/s`` and ``W2`` by ``s``: the stream and its costates do not see
    ``s`` (``W2 W1`` does not change), the gradient of the bottleneck ``W1 x`` does (``W2^T g``, ``s`` times larger),
    then a linear head."""

    def __init__(self, s: float, d: int = 8) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(d, 2, bias=False), nn.Linear(2, d, bias=False), nn.Linear(d, 4)
        with torch.no_grad():
            self.fc1.weight.div_(s)
            self.fc2.weight.mul_(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.fc2(self.fc1(x)))


@pytest.mark.parametrize("s, certified", [(1.0, True), (1e6, False)])
def test_stack_in_fp16_needs_a_safe_unscaled_step(s: float, certified: bool):
    """``ModelCertificate.stack`` in pure fp16 bounds every gradient (each held in fp16): certified means
    forward-safe and ``max_loss_scale >= 1``.  Where only an intermediate's gradient can pass 65504 (the stream's
    costates stay small), the chain is refused backward at a step without a loss scale, naming the gradient, and
    autograd in fp16 does overflow there."""
    from certblocks.trace import certify

    torch.manual_seed(0)
    m = Bottleneck(s).eval()
    x = _ball((1, 1, 8), 1.0, torch.Generator().manual_seed(0)).float()
    rep = certify(m, x)
    st = rep.stack("fp16", r0=1.0, loss="cross_entropy")
    assert st.max_loss_scale is not None and st.max_loss_scale > 0
    assert st.ok is certified and (st.max_loss_scale >= 1.0) is certified, st.explain()
    assert rep.stack("fp32", r0=1.0, loss="cross_entropy").max_loss_scale is None  # no fp16 gradient: none computed
    if not certified:
        assert st.first_failure.kind == "backward" and "held in fp16" in st.first_failure.reason, st.explain()
        h = m.half()
        xh = (x / x.norm(dim=-1, keepdim=True)).half().requires_grad_(True)
        mid = h.fc1(xh)
        mid.retain_grad()
        out = h.head(xh + h.fc2(mid))
        F.cross_entropy(out.reshape(-1, 4).float(), torch.tensor([int(out.float().argmin())])).backward()
        assert not bool(torch.isfinite(mid.grad).all())  # the bottleneck's fp16 gradient overflows
