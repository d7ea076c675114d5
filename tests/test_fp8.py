"""certblocks.fp8: static fp8 scales from certified peaks never saturate; the emulation counts what it loses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from certblocks.blocks.mlp import MLP
from certblocks.fp8 import E4M3_MAX, E4M3_MIN_SUBNORMAL, Fp8Scale, format_limits, fp8_emulation, fp8_scales, quantize


def test_format_limits():
    assert format_limits(torch.float8_e4m3fn) == (E4M3_MAX, E4M3_MIN_SUBNORMAL)
    top, sub = format_limits(torch.float8_e5m2)
    assert top == 57344.0 and sub == 2.0 ** -16
    with pytest.raises(TypeError, match="fmt"):
        format_limits(torch.float16)


def test_quantize_counts_saturated_and_flushed():
    s = 0.5
    x = torch.tensor([0.0, 1.0, -100.0, 224.0, 225.0, -1000.0, s * 2.0 ** -11, s * 2.0 ** -9])
    q, st = quantize(x, s)
    assert st.values == 8 and st.nonzero == 7
    assert st.saturated == 2  # |x / s| = 450 and 2000 exceed 448
    assert float(q[4]) == 224.0 and float(q[5]) == -224.0  # clamped to 448 s
    assert st.flushed == 1 and float(q[6]) == 0.0 and float(q[7]) == s * 2.0 ** -9  # below half a subnormal: 0
    assert float(q[1]) == 1.0 and float(q[3]) == 224.0 and st.amax == 1000.0
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="scale"):
            quantize(x, bad)


class Net(nn.Module):
    """A stem, two residual updates (one a certified MLP block), and a head: five Linears."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.stem = nn.Linear(4, d)
        self.mlp = MLP(d, 2 * d)
        self.f, self.g = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.head = nn.Linear(d, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = x + self.mlp(x)
        x = x + self.g(torch.tanh(self.f(x)))
        return self.head(x)


def _ball(shape, radius, gen):
    x = torch.randn(*shape, generator=gen)
    frac = torch.rand(*shape[:-1], 1, generator=gen)
    frac[..., :1, :] = 1.0
    return x / x.norm(dim=-1, keepdim=True) * radius * frac


def _linear_inputs(model: nn.Module, x: torch.Tensor):
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, p=p: seen.__setitem__(p, a[0]))
             for p, m in model.named_modules() if isinstance(m, nn.Linear)]
    out = model(x)
    for h in hooks:
        h.remove()
    return seen, out


def test_static_scales_never_saturate():
    """Random inputs in the ball and inputs ascending each Linear's input amax stay within the certified peak: the
    static emulation never saturates.  A scale planted below a measured amax does (the check can fail)."""
    torch.manual_seed(0)
    m = Net().eval()
    r0 = 3.0
    gen = torch.Generator().manual_seed(0)
    scales = fp8_scales(m, _ball((2, 6, 4), r0, gen), r0=r0)
    linears = {p for p, mod in m.named_modules() if isinstance(mod, nn.Linear)}
    assert set(scales) == linears and all(isinstance(s, Fp8Scale) and s.certified for s in scales.values())
    for s in scales.values():
        w = m.get_submodule(s.module).weight
        assert s.weight_amax == float(w.detach().abs().max()) and s.weight_scale >= s.weight_amax / E4M3_MAX
        assert s.input_scale >= s.input_peak / E4M3_MAX
    worst = {p: 0.0 for p in linears}
    for _ in range(8):
        x = _ball((2, 6, 4), r0, gen)
        seen, _ = _linear_inputs(m, x)
        for p, t in seen.items():
            worst[p] = max(worst[p], float(t.detach().abs().max()))
        with torch.no_grad(), fp8_emulation(m, scales) as st:
            m(x)
        assert all(rec["input"].saturated == 0 and rec["weight"].saturated == 0 for rec in st.values()), st
    for target in sorted(linears):  # gradient ascent on the amax of each Linear's input
        x = _ball((2, 6, 4), r0, gen).requires_grad_(True)
        opt = torch.optim.Adam([x], lr=0.1)
        for _ in range(40):
            seen, _ = _linear_inputs(m, x)
            amax = seen[target].abs().max()
            worst[target] = max(worst[target], float(amax.detach()))
            opt.zero_grad()
            (-amax).backward()
            opt.step()
            with torch.no_grad():
                n = x.norm(dim=-1, keepdim=True)
                x.mul_(torch.where(n > r0, r0 / n, torch.ones_like(n)))
    for p in linears:
        assert worst[p] <= scales[p].input_peak, f"{p}: input amax {worst[p]:.6g} > certified {scales[p].input_peak}"
    p = "head"
    planted = dict(scales)
    x = _ball((2, 6, 4), r0, torch.Generator().manual_seed(5))
    with torch.no_grad():
        seen, _ = _linear_inputs(m, x)
    quarter = float(seen[p].abs().max()) / 4
    planted[p] = Fp8Scale(p, quarter, quarter / E4M3_MAX, scales[p].weight_amax, scales[p].weight_scale)
    with torch.no_grad(), fp8_emulation(m, planted) as st:
        m(x)
    assert st[p]["input"].saturated > 0


def test_unbounded_input_is_named_and_falls_back():
    """A Linear whose input has no finite certified peak (exp of a value of unknown sign) has no static scale: the
    reason names the value; the emulation uses dynamic scaling for it (or leaves it in high precision)."""

    class Exp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f, self.g = nn.Linear(4, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.g(torch.exp(self.f(x)))

    m = Exp().eval()
    x = torch.randn(2, 5, 4)
    scales = fp8_scales(m, x, r0=2.0)
    assert scales["f"].certified and not scales["g"].certified
    assert scales["g"].input_scale == math.inf and "exp" in scales["g"].why, scales["g"]
    with torch.no_grad():
        with fp8_emulation(m, scales) as st:
            m(x)
        assert st["g"]["input"].scales[0] > 0 and math.isfinite(st["g"]["input"].scales[0])  # dynamic
        with fp8_emulation(m, scales, fallback="none") as st2:
            m(x)
        assert "g" not in st2 and "f" in st2
    with pytest.raises(ValueError, match="r0"):
        fp8_scales(m, x)


def test_emulation_restores_and_dynamic_never_saturates():
    torch.manual_seed(0)
    m = Net().eval()
    x = torch.randn(2, 6, 4) * 5
    with torch.no_grad():
        ref = m(x)
        with fp8_emulation(m, "dynamic") as st:
            out = m(x)
        again = m(x)
    assert torch.equal(ref, again) and not any("forward" in vars(mod) for mod in m.modules())
    assert all(r["input"].saturated == 0 and r["input"].values > 0 for r in st.values())
    assert 0 < float((out - ref).abs().max()) < 0.1 * float(ref.abs().max())  # fp8 changes the output a little
    with pytest.raises(ValueError, match="scales"):
        with fp8_emulation(m, "static"):
            pass
    with pytest.raises(ValueError, match="fallback"):
        with fp8_emulation(m, "dynamic", fallback="bf16"):
            pass


def test_gradient_flows_through_the_emulation():
    m = nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    with fp8_emulation(m, "dynamic"):
        F.mse_loss(m(x), torch.zeros(2, 3)).backward()
    assert x.grad is not None and m.weight.grad is not None and torch.isfinite(m.weight.grad).all()


def test_fp8_scales_is_reachable_from_the_precision_module():
    import certblocks.precision as precision
    from certblocks.fp8 import fp8_scales

    assert precision.fp8_scales is fp8_scales
