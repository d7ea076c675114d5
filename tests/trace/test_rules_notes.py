"""What the interpreter says besides the bounds: values read at their example (notes), rules that crash (strict
mode), and lower bounds carried through rounding (issue 31, items 4, 5 and 8)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from certblocks.trace import certify
from certblocks.trace.interp import STRICT_ENV
from certblocks.trace.rules.common import floor_in, rounding_factor
from certblocks.trace.rules.registry import _RULES

D, T = 6, 4


class Masked(nn.Module):
    """Residual updates gated by a second model input: the mask is read at its example value."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(D, D) for _ in range(2)])

    def forward(self, x, mask):
        for blk in self.blocks:
            x = x + torch.tanh(blk(x)) * mask
        return x


def test_a_second_model_input_read_at_its_example_is_noted():
    x, mask = torch.randn(1, T, D), torch.ones(1, T, 1)
    whole = certify(Masked().eval(), (x, mask), residual=None)
    assert whole.q is not None
    assert whole.notes == ["the model input args_1 is read at its example value"], whole.notes
    model = certify(Masked().eval(), (x, mask))
    assert all(tc.notes == whole.notes for tc in model.updates)
    grouped = [n for n in model.notes if "the model input args_1" in n]
    assert len(grouped) == 1 and all(tc.name in grouped[0] for tc in model.updates), model.notes


def test_a_model_of_one_input_has_no_notes():
    c = certify(nn.Sequential(nn.Linear(D, D), nn.Tanh()).eval(), torch.randn(1, T, D), residual=None)
    assert c.notes == []


def test_an_uninitialized_tensor_is_noted():
    class Empty(nn.Module):
        def forward(self, x):
            return torch.empty_like(x).copy_(torch.tanh(x))

    c = certify(Empty().eval(), torch.randn(1, T, D), residual=None)
    assert c.q == 0 and any("uninitialized" in n for n in c.notes), (c.explain(), c.notes)


def _raising(it, n, a, shape):
    raise RuntimeError("planted rule bug")


def test_strict_mode_raises_and_users_get_unknown(monkeypatch):
    monkeypatch.setitem(_RULES, "aten.tanh", _raising)
    m = nn.Sequential(nn.Linear(D, D), nn.Tanh()).eval()
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(RuntimeError, match="planted rule bug"):
        certify(m, torch.randn(1, T, D), residual=None)
    monkeypatch.delenv(STRICT_ENV)
    c = certify(m, torch.randn(1, T, D), residual=None)
    assert c.q is None and "planted rule bug" in c.culprit


def test_floor_in_rounds_down_into_the_dtype():
    assert floor_in(1e-10, torch.float16) == 0.0  # below float16's smallest subnormal: nothing is proven
    assert 0 < floor_in(1e-3, torch.float16) <= 1e-3
    assert floor_in(0.1, torch.bfloat16) <= 0.1 < floor_in(0.1, torch.bfloat16) * (1 + 2.0**-7)
    assert floor_in(3.7, torch.int64) == 3.0 and floor_in(-0.5, torch.int32) == -1.0
    assert floor_in(0.5, torch.bool) == 1.0 and floor_in(0.0, torch.bool) == 0.0
    assert floor_in(1e5, torch.float16) == torch.finfo(torch.float16).max  # overflow rounds to the largest
    assert 1.0 - 1e-14 < floor_in(1.0, torch.float64) < 1.0


def test_rounding_factor_only_where_a_cast_rounds():
    assert rounding_factor(torch.float32, torch.float32) == 1.0
    assert rounding_factor(torch.float16, torch.float32) == 1.0
    assert rounding_factor(torch.float32, torch.bfloat16) == 1.0 + 2.0**-8
    assert rounding_factor(torch.int64, torch.float32) == 1.0 + 2.0**-24
    assert rounding_factor(torch.float32, torch.int64) == 1.0  # truncation shrinks magnitudes


class Ratio(nn.Module):
    """``h / (mean |h| + eps)``: a denominator with a proven positive minimum (``eps``, rounded into its dtype)."""

    def __init__(self, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.fc, self.eps, self.dtype = nn.Linear(D, D), eps, dtype

    def forward(self, x):
        h = self.fc(x)
        den = (h.abs().mean(-1, keepdim=True) + self.eps).to(self.dtype).to(h.dtype)
        return h / den


@pytest.mark.parametrize("eps, dtype, derived", [(1e-3, torch.float32, True), (1e-3, torch.float16, True),
                                                 (1e-10, torch.float16, False), (1e-50, torch.float32, False)])
def test_a_lower_bound_survives_a_cast_only_when_it_rounds_to_a_positive_number(eps, dtype, derived):
    c = certify(Ratio(eps, dtype).eval(), torch.randn(1, T, D), residual=None)
    assert (c.q is not None) == derived, c.explain()
    if derived:
        # 1 / eps as rounded down into the dtype bounds the reciprocal
        assert c.certificate.c <= 1.0 / floor_in(eps, dtype) * 1e3 and math.isfinite(c.certificate.c)
    else:
        assert "no proven positive lower bound" in c.culprit
