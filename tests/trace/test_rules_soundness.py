"""Each class of rule defect found for issue 31, on a small module: the certificate is sound now (the counterexample
search of ``certblocks.testing`` finds nothing), or the node is refused with its reason.

The classes: an argument that changes the value and was not read (``divisor_override``, ``alpha``, ``dtype``,
``input_scale``, ``threshold``, ``lower``, a bias, a broadcast); a factor applied to the rows and not to the
entries (cumsum along a non-last dim, dropout in training) or dropped between them (a complex view, a flattened
roll, a constant times an input-dependent weight, a 0-d bias); an integer or boolean computed from the input
read at its example (indices of max and max pooling, a ``where`` between constants, a cast to bool); a rounding
that was not accounted (a cast to a coarser float, an ``eps`` that rounds to 0 in float16).  The integers and
booleans computed from the input are now bounded over their whole range with derivative 0 (the certificate bounds
the derivative autograd computes, docs/theory.md section 1.1): those modules of ``SOUND`` have ``sigma`` derived, say
that they are piecewise, and are searched for growth, Jacobian (autograd's) and peak.  Measured on the tree
before issue 31 with the same searches: every module of ``SOUND`` beat its certificate (growth, Jacobian or peak
ratio from 1.002 to 4419); of ``REFUSED``, the exponential ones beat theirs by 70 to 1e83, ``x ** 1.5`` and the
float16 ``eps`` gave NaN or inf inside a certified bound, ``view(int32)`` read the bits as numbers, and the
group_norm rule crashed.
"""

from __future__ import annotations

from typing import Callable, Dict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import certblocks.testing as cbt
from certblocks.trace import certify

D, T = 6, 4
SHAPE = (1, T, D)


class Case(nn.Module):
    """``op(fc(x))`` (a linear layer first, so that the search reaches the op's every input), or ``op(x)`` where the
    defect shows only with a tight bound (a name starting with ``"direct "``)."""

    def __init__(self, op: Callable, direct: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Identity() if direct else nn.Linear(D, D)
        self.op = op
        self.register_buffer("c", torch.randn(5, D))
        self.register_buffer("w", torch.randn(D, D))
        self.register_buffer("five", torch.tensor(5.0))
        self.register_buffer("thirty", torch.full((T,), 30.0))
        self.register_buffer("tiny", torch.full((D,), 1e-3))
        self.register_buffer("onehot", torch.eye(5, D))
        self.register_buffer("column", torch.eye(D)[:1].repeat(5, 1))  # every row e_0: ||C h|| = sqrt(5) |h_0|
        self.register_buffer("after", torch.ones(T, D, dtype=torch.bool).triu(1))  # row t: columns after t
        self.register_buffer("row_masked", torch.zeros(T, D, dtype=torch.bool).index_fill(0, torch.tensor([1]), True))

    def forward(self, x):
        return self.op(self, self.fc(x))


def _causal(m: nn.Module) -> torch.Tensor:
    """An additive causal mask: ``-inf`` after column ``t`` in row ``t`` (a constant of the graph)."""
    return torch.where(m.after, float("-inf"), 0.0)


def _per_sample(f: Callable) -> Callable:
    """``f`` applied to each sample of the batch (for ops without a batch dimension)."""
    return lambda m, h: torch.stack([f(m, h[b]) for b in range(h.shape[0])])


#: Modules whose certificate was beaten before the fix; now derived and sound.
SOUND: Dict[str, Callable] = {
    # arguments that change the value
    "avg_pool2d divisor_override": lambda m, h: F.avg_pool2d(h.unsqueeze(1), 2, divisor_override=1).squeeze(1),
    "direct mean dtype bfloat16": lambda m, h: h.mean(-1, keepdim=True, dtype=torch.bfloat16).to(h.dtype),
    "elu input_scale": lambda m, h: torch.ops.aten.elu(h, 1.0, 1.0, 5.0),
    "rrelu lower": lambda m, h: F.rrelu(h, lower=-3.0, upper=0.5, training=False),
    "clamp_max broadcast": lambda m, h: torch.clamp_max(h[..., :1], m.tiny),
    "linear bias with an input-dependent weight": _per_sample(lambda m, h: F.linear(h, h, m.thirty)),
    # factors between rows, entries and Jacobian
    "cumsum along tokens then transpose": lambda m, h: h.cumsum(1).transpose(1, 2),
    "view_as_complex": lambda m, h: torch.view_as_complex(torch.tanh(h).reshape(*h.shape[:-1], D // 2, 2)).abs(),
    "roll without dims": _per_sample(lambda m, h: torch.roll(h, 3)),
    "direct linear of a constant by an input-dependent weight": _per_sample(lambda m, h: F.linear(m.onehot, h)),
    "addmm with a 0-d bias": _per_sample(lambda m, h: torch.addmm(m.five, h, m.w)),
    "direct constant matrix times a vector": _per_sample(lambda m, h: torch.stack([m.column @ h[t]
                                                                                   for t in range(h.shape[0])])),
    # values computed from the input read at their example
    "max indices as numbers": lambda m, h: h + 10.0 * h.max(-1, keepdim=True).indices.to(h.dtype),
    "max_pool indices as numbers": lambda m, h: F.max_pool1d(h, 2, return_indices=True)[1].to(h.dtype)
    + 0.0 * h[..., :3],
    "direct where between constants": lambda m, h: h * torch.where(h.sum(-1, keepdim=True) > 100.0, 10.0, 1.0),
    "cast to bool": lambda m, h: 100.0 * (h * 1e-3).bool().to(h.dtype) + 0.0 * h,
    "cast to uint8": lambda m, h: h.to(torch.uint8).to(h.dtype) + 0.0 * h,
    # rounding
    "cast to bfloat16": lambda m, h: h.to(torch.bfloat16).to(h.dtype),
    # reciprocals of arguments with a proven positive minimum (HF's RMSNorm written out: its rsqrt node in the peak)
    "direct rms norm written out": lambda m, h: h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6),
    "reciprocal of a positive sum": lambda m, h: h * torch.reciprocal(h.abs() + 0.5),
    # -inf masks that leave a finite entry in every row
    "direct softmax with a causal -inf mask": lambda m, h: torch.softmax(h + _causal(m), -1),
    "direct softmax after masked_fill": lambda m, h: torch.softmax(h.masked_fill(m.after, float("-inf")), -1),
    # a node's outputs after the first (each counts in the peak)
    "direct native_layer_norm mean and rstd": lambda m, h: (lambda r: r[0] + r[1] + 1e-2 * r[2])(
        torch.ops.aten.native_layer_norm(h, [D], None, None, 1e-5)),
    "direct fused attention logsumexp": lambda m, h: (lambda r: r[0].transpose(1, 2).reshape(h.shape) + r[1].transpose(
        1, 2).mean(-1, keepdim=True))(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *(h.view(h.shape[0], T, 2, D // 2).transpose(1, 2),) * 3)),
}


#: The modules of ``SOUND`` that compute an integer or boolean from the input: piecewise, with sigma derived.
PIECEWISE = ("max indices as numbers", "max_pool indices as numbers", "direct where between constants", "cast to bool",
             "cast to uint8")


def _growth_and_peak(m: nn.Module, cert, name: str) -> None:
    """The soundness search of the growth and the peak (for a certificate that states no Jacobian bound)."""
    from .conftest import GROWTH, PEAK

    report = cbt.SoundnessReport(name, growth=cbt.search_growth(m, cert, SHAPE[1:], **GROWTH),
                                 peak=cbt.search_peak(m, cert, SHAPE[1:], **PEAK) if cert.peak is not None else None)
    assert report.ok, f"{cert}\n{report}"


@pytest.mark.parametrize("name", list(SOUND))
def test_the_certificate_holds(name, soundness):
    m = Case(SOUND[name], direct=name.startswith("direct ")).eval()
    torch.manual_seed(1)
    c = certify(m, torch.randn(*SHAPE), residual=None)
    assert c.q is not None and c.certificate.c < float("inf"), c.explain()
    if name in PIECEWISE:
        assert c.sigma is not None and c.coefficients_derived and c.piecewise, c.explain()
    if c.sigma is None:  # the logsumexp of a fused attention: no Jacobian bound stated
        _growth_and_peak(m, c.certificate, name)
    else:
        soundness(m, c.certificate, SHAPE, name)


def test_max_indices_as_numbers_at_equal_maxima():
    """``x + 10 * argmax(x)`` (the indices of a max, used as numbers): derivative 1 for every index (autograd's: the
    index has none), the map piecewise; at equal maxima the index, and the value, jump by 10 while the derivative
    bound holds on both sides and on the tie."""
    m = Case(SOUND["max indices as numbers"], direct=True).eval()
    c = certify(m, torch.randn(*SHAPE), residual=None)
    cert = c.certificate
    assert (cert.q, cert.sigma) == (1.0, 0.0) and c.piecewise, c.explain()
    x = torch.randn(4, T, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    top = x.max(-1, keepdim=True).values
    x[..., 1:3] = top  # two equal maxima in every token
    e = torch.zeros(D, dtype=torch.float64)
    e[1], e[2] = 1e-9, -1e-9
    xs = torch.cat([x, x + e, x - e])
    low = cbt.jacobian_norm_lower(m.double(), xs, iters=10)
    bounds = torch.tensor([cert.jacobian_bound(float(r)) for r in cbt.token_norm(xs)], dtype=torch.float64)
    assert bool((low <= bounds * (1 + 1e-9)).all()) and float(low.min()) >= 1 - 1e-9, (low, bounds)
    with torch.no_grad():
        jump = float((m(x + e) - m(x - e)).abs().max())
    assert jump == pytest.approx(10.0, rel=1e-6)  # the index moves from 1 to 2: the bound is no Lipschitz constant


#: Modules whose certificate was beaten before the fix; now the culprit node is refused with this reason.
REFUSED: Dict[str, tuple] = {
    "exp(x - alpha max(x)) with alpha < 1": (
        lambda m, h: torch.exp(torch.sub(h, h.amax(-1, keepdim=True), alpha=0.5)), "exp of an argument of unknown"),
    "softplus with a negative threshold": (
        lambda m, h: torch.exp(-F.softplus(h, threshold=-5.0)), "exp of an argument of unknown"),
    "celu with a negative alpha": (lambda m, h: F.celu(h, alpha=-1.0), "celu with alpha=-1"),
    "x ** 1.5 of a signed tensor": (lambda m, h: h ** 1.5, "may be negative"),
    "eps rounded to 0 by a cast to float16": (
        lambda m, h: h / (h.abs() + 1e-10).to(torch.float16).to(h.dtype), "no proven positive lower bound"),
    "rms eps rounded to 0 in float16": (
        lambda m, h: (lambda g: g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-10))(h.to(torch.float16)),
        "rsqrt"),
    "group_norm with an input-dependent weight": (
        lambda m, h: F.group_norm(h.transpose(1, 2), 2, weight=h[0, 0]), "input-dependent affine parameters"),
    "view reinterpreting the bits": (lambda m, h: h.view(torch.int32).to(h.dtype), "view.dtype"),
    "rsqrt without a positive minimum": (lambda m, h: torch.rsqrt(h.abs()), "no proven positive lower bound"),
    "softmax of a fully masked row": (
        lambda m, h: torch.softmax(h.masked_fill(m.row_masked, float("-inf")), -1), "fully masked row"),
    "softmax of an input with no entry bound": (lambda m, h: torch.softmax(torch.exp(h), -1), "no finite entry"),
    "log_softmax of a masked input": (lambda m, h: torch.log_softmax(h + _causal(m), -1), "without a finite entry"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_the_node_is_refused_with_its_reason(name):
    op, why = REFUSED[name]
    m = Case(op).eval()
    c = certify(m, torch.randn(*SHAPE), residual=None)
    assert c.q is None, c.explain()
    assert why in c.culprit or any(why in r.rule or why in r.note for r in c.nodes), c.explain()
