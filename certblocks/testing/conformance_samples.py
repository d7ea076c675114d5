"""Hand-written conformance samples: calls for the rules that no OpInfo sample reaches.

:data:`conformance_samples` maps a registry key (``"aten.xxx"``) to :class:`~certblocks.testing.conformance.Sample`
calls checked by :func:`~certblocks.testing.conformance.run_conformance` along with PyTorch's OpInfo samples: ops
that ``torch.export`` only records when called by their aten name (aliases, private ops, ops the OpInfo's
function decomposes), ops on complex values (reached through ``view_as_complex`` of the real input), the
selective scan, and calls whose integer or boolean arguments are computed from the input (an index or a mask
that depends on ``x`` is never a constant).  A sample without ``fn`` calls ``torch.ops.<namespace>.<name>``; the
first floating tensor among its arguments is the velocity input.

:data:`unreachable` names the rules that no sample can exercise on the CPU with ``torch.export``, and why (the
test suite checks that none of them is reached, so that the list stays true).

Every tensor is drawn from one seeded generator: the samples are the same on every run.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from .conformance import Sample

__all__ = ["conformance_samples", "unreachable"]

_GEN = torch.Generator().manual_seed(31)
A = torch.ops.aten


def _t(*shape: int, scale: float = 1.0, positive: bool = False) -> torch.Tensor:
    t = torch.randn(shape, generator=_GEN, dtype=torch.float64) * scale
    return t.abs() + 0.5 if positive else t


def _idx(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(high, shape, generator=_GEN)


def _mask(*shape: int) -> torch.Tensor:
    return torch.rand(shape, generator=_GEN) > 0.5


def _scan(*args: Any) -> Any:
    """``certblocks::selective_scan`` (its module registers the op on first use)."""
    from ..kernels import ops  # noqa: F401

    return torch.ops.certblocks.selective_scan(*args)


def _cplx(fn: Any) -> Any:
    """``fn`` applied to ``view_as_complex(x)`` (``x``'s last dimension holds real and imaginary parts)."""
    return lambda x, *rest: fn(torch.view_as_complex(x), *rest)


def _rot(fn: Any) -> Any:
    """``fn`` applied to ``x * p`` for a constant ``p`` of unit complex entries (complex values whose row norms are
    ``x``'s, without ``view_as_complex``)."""
    return lambda x, p, *rest: fn(x * p, *rest)


def _phase(*shape: int) -> torch.Tensor:
    angle = torch.rand(shape, generator=_GEN, dtype=torch.float64) * 2 * torch.pi
    return torch.polar(torch.ones(shape, dtype=torch.float64), angle)


_X = _t(3, 5)
_X3 = _t(2, 3, 4)
_W = _t(4, 3, 3, scale=0.5)

conformance_samples: Dict[str, List[Sample]] = {
    # boolean ops of masks computed from the input
    "aten.__and__": [Sample((_X, _mask(3, 5)), fn=lambda x, m: A.__and__(x > 0, m)),
                     Sample((_X,), fn=lambda x: A.__and__(x > 0, x < 0.5))],
    "aten.__or__": [Sample((_X, _mask(3, 5)), fn=lambda x, m: A.__or__(x > 0, m)),
                    Sample((_X,), fn=lambda x: A.__or__(x > 0.5, x < -0.5))],
    "aten.bitwise_and": [Sample((_X,), fn=lambda x: A.bitwise_and(x > 0, x < 0.5))],
    # pooling, convolutions
    "aten._adaptive_avg_pool2d": [Sample((_t(2, 3, 5, 6), [2, 3])), Sample((_t(3, 4, 4), [1, 1]))],
    "aten.max_pool1d": [Sample((_t(2, 3, 9), [3], [2], [1])), Sample((_t(2, 9), [2], [], [0], [2], True))],
    "aten.max_pool2d": [Sample((_t(1, 2, 6, 7), [2, 3], [2, 1], [1, 1])),
                        Sample((_t(2, 5, 5), [3, 3], [1, 1], [1, 1], [2, 2], True))],
    "aten.max_pool3d": [Sample((_t(1, 2, 4, 5, 6), [2, 2, 2]))],
    "aten.max_pool1d_with_indices": [Sample((_t(2, 3, 9), [3], [2], [1]))],
    "aten.max_pool2d_with_indices": [Sample((_t(1, 2, 6, 7), [2, 3], [2, 1], [1, 1]))],
    "aten.max_pool3d_with_indices": [Sample((_t(1, 2, 4, 5, 6), [2, 2, 2], [1, 2, 2]))],
    "aten._convolution": [
        Sample((_t(1, 3, 8), _W, _t(4), [1], [1], [1], False, [0], 1, False, False, True, True)),
        Sample((_t(1, 4, 6), _t(4, 2, 3, scale=0.5), None, [2], [0], [1], True, [1], 1, False, False, True, True)),
    ],
    "aten.convolution": [
        Sample((_t(2, 3, 8), _W, _t(4), [2], [0], [1], False, [0], 1)),
        Sample((_t(1, 2, 5, 5), _t(6, 1, 3, 3, scale=0.5), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 2)),
    ],
    # FFTs (complex values through view_as_complex of the real input)
    "aten._fft_r2c": [Sample((_t(4, 6), [1], 0, True)), Sample((_t(3, 4, 5), [1, 2], 1, False))],
    "aten._fft_c2c": [Sample((_t(4, 6), _phase(4, 6), [1], 0, True), fn=_rot(A._fft_c2c)),
                      Sample((_t(3, 4), _phase(3, 4), [0, 1], 2, False), fn=_rot(A._fft_c2c)),
                      Sample((_t(4, 6, 2), [1], 1, True), fn=_cplx(A._fft_c2c))],
    "aten._fft_c2r": [Sample((_t(4, 5), _phase(4, 5), [1], 2, 8), fn=_rot(A._fft_c2r)),
                      Sample((_t(3, 4, 2), [1], 0, 6), fn=_cplx(A._fft_c2r))],
    "aten.imag": [Sample((_t(3, 4), _phase(3, 4)), fn=_rot(A.imag)), Sample((_t(3, 4, 2),), fn=_cplx(A.imag))],
    "aten.view_as_real": [Sample((_t(3, 4), _phase(3, 4)), fn=_rot(A.view_as_real)),
                          Sample((_t(3, 4, 2),), fn=_cplx(A.view_as_real))],
    "aten.conj": [Sample((_t(3, 4), _phase(3, 4)), fn=_rot(A.conj)), Sample((_t(3, 4, 2),), fn=_cplx(A.conj))],
    "aten.view_as_complex": [Sample((_t(3, 4, 2),)), Sample((_t(5, 2),))],
    # softmax and normalizations by their private or special names
    "aten._softmax": [Sample((_X, -1, False)), Sample((_X3, 1, False))],
    "aten._log_softmax": [Sample((_X, -1, False)), Sample((_X3, 0, False))],
    "aten.special_softmax": [Sample((_X, -1)), Sample((_X3, 1))],
    "aten.native_layer_norm": [Sample((_t(3, 5), [5], _t(5), _t(5), 1e-5)),
                               Sample((_t(2, 3, 4), [3, 4], None, None, 0.1))],
    "aten.native_batch_norm": [Sample((_X3, _t(3), _t(3), _t(3), _t(3, positive=True), False, 0.1, 1e-5))],
    "aten._native_batch_norm_legit_no_training": [
        Sample((_X3, _t(3), _t(3), _t(3), _t(3, positive=True), 0.1, 1e-5)),
        Sample((_t(2, 3, 2, 2), None, None, _t(3), _t(3, positive=True), 0.1, 0.5)),
    ],
    "aten._native_batch_norm_legit": [Sample((_X3, _t(3), _t(3), True, 0.1, 1e-5),
                                             fn=A._native_batch_norm_legit.no_stats)],
    "aten.frobenius_norm": [Sample((_X, [1])), Sample((_X3, [0, 2], True))],
    "aten.norm": [Sample((_X, 2, [1])), Sample((_X3, 2, [0], True)), Sample((_X, 1, [1]))],
    # attention
    "aten._scaled_dot_product_attention_math": [
        Sample((_t(1, 2, 4, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8))),
        Sample((_t(2, 4, 8), _t(2, 4, 8), _t(2, 4, 8)), {"is_causal": True, "scale": 0.5}),
    ],
    # aliases, copies, views, casts by their aten names
    "aten._unsafe_view": [Sample((_X, [15])), Sample((_X3, [4, 6])), Sample((_X3, [2, 12]))],
    "aten.alias": [Sample((_X,))],
    "aten.detach": [Sample((_X,))],
    "aten.lift_fresh_copy": [Sample((_X,))],
    "aten.contiguous": [Sample((_X,), fn=lambda x: A.contiguous(x.t()))],
    "aten.copy": [Sample((_t(5), _X), fn=lambda x, c: A.copy(c, x)),
                  Sample((_X, _t(3, 5)), fn=lambda x, c: A.copy(c, x))],
    "aten.type_as": [Sample((_X, torch.zeros(1, dtype=torch.float32)))],
    "aten.numpy_T": [Sample((_X,)), Sample((_X3,))],
    "aten.swapaxes": [Sample((_X3, 0, 2)), Sample((_X3, 0, 1))],
    "aten.swapdims": [Sample((_X3, 1, 2)), Sample((_X3, 0, 1))],
    "aten.concat": [Sample(([_X, _t(3, 5)],)), Sample(([_X, _t(3, 2)], 1))],
    "aten.concatenate": [Sample(([_X, _t(2, 5)],)), Sample(([_X, _t(3, 4)], -1))],
    # arithmetic by alias names
    "aten.clip": [Sample((_X, -0.5, 0.5)), Sample((_X, None, 0.3)), Sample((_X, _t(3, 5), _t(5)), fn=A.clip.Tensor)],
    "aten.divide": [Sample((_X, _t(3, 5, positive=True))), Sample((_X, 4.0)),
                    Sample((_X, _t(5, positive=True)), {"rounding_mode": "floor"})],
    "aten.multiply": [Sample((_X, _t(3, 5))), Sample((_X, 3.0))],
    "aten.subtract": [Sample((_X, _t(3, 5)), {"alpha": 2.0}), Sample((_X, _t(5)))],
    "aten._to_copy": [Sample((_X,), {"dtype": torch.float32}), Sample((_X3,))],
    "aten.mm": [Sample((_X, _t(5, 4))), Sample((_t(4, 4), _t(4, 4)))],
    # dropout by aten names (eval and training)
    "aten.feature_dropout": [Sample((_X3, 0.5, False)), Sample((_X3, 0.25, True))],
    "aten.native_dropout": [Sample((_X, 0.5, False)), Sample((_X, 0.3, True))],
    "aten.rand_like": [Sample((_X,))],
    # reads by constant and by input-dependent indices
    "aten.index": [Sample((_t(4, 5), [_idx(4, 3)])), Sample((_t(4, 5), [None, _idx(5, 6)])),
                   Sample((_t(4, 5), [_idx(4, 3), _idx(5, 3)])), Sample((_t(4, 5), [_mask(4)])),
                   Sample((_t(4, 5),), fn=lambda x: A.index(x, [None, x.argmax(0)]))],
    "aten.gather": [Sample((_t(4, 5),), fn=lambda x: A.gather(x, -1, x.argsort(-1))),
                    Sample((_t(4, 5),), fn=lambda x: A.gather(x, 0, x.argsort(0)[:2]))],
    "aten.index_select": [Sample((_t(4, 5),), fn=lambda x: A.index_select(x, 0, x.sum(-1).argsort()))],
    "aten.where": [Sample((_X, _t(3, 5)), fn=lambda x, c: A.where(x > 0, x, c))],
    "aten.masked_fill": [Sample((_X,), fn=lambda x: A.masked_fill(x, x < 0, 2.0))],
    # calls that beat a bound of today's rules (each a class of /work/wt/opinfo_failures.md, kept small)
    "aten.clamp_min": [Sample((_t(5, 1), _t(5)))],  # a broadcasting bound widens the rows
    "aten.clamp_max": [Sample((_t(5, 1), _t(5)))],
    "aten.clamp": [Sample((_t(5, 1), _t(5)), fn=A.clamp.Tensor)],
    "aten.avg_pool2d": [Sample((_t(1, 2, 6, 6), [3, 3], [1, 1], [1, 1], False, True, 1))],  # divisor_override
    "aten.avg_pool3d": [Sample((_t(1, 1, 4, 4, 4), [2, 2, 2], [1, 1, 1], [0, 0, 0], False, True, 1))],
    "aten.roll": [Sample((_t(3, 4), [2]))],  # no dims: the flattened tensor rolls across rows
    "aten.hstack": [Sample(([_X, _t(3, 5), _t(3, 5)],))],  # 2-D: concatenates along the last dimension
    "aten.dropout": [Sample((_X, 0.5, True))],
    "aten.alpha_dropout": [Sample((_X, 0.5, True))],
    "aten.cumsum": [Sample((_t(4, 3), 0))],
    "aten.linear": [Sample((_t(3), _t(4, 3), _t(4)))],  # linear(1): an input-dependent weight, a constant bias
    "aten.max": [Sample((_X, 1))],
    "aten.adaptive_max_pool2d": [Sample((_t(1, 4, 5), [2, 2]))],
    "aten.softmax": [Sample((_X, _mask(3, 5) & torch.tensor([[True], [False], [True]])),
                            fn=lambda x, m: A.softmax(A.where(m, x, float("-inf")), -1))],  # a row all -inf
    "aten.log_softmax": [Sample((_X, _mask(3, 5) & torch.tensor([[True], [False], [True]])),
                                fn=lambda x, m: A.log_softmax(A.where(m, x, float("-inf")), -1))],
    "aten.group_norm": [Sample((_t(1, 6, 3), 2, _t(6), _t(6), 0.5))],  # linear(2): an input-dependent weight
    # the selective scan (u is the velocity input; delta, B, C, D, z constants, or linear images of u)
    "certblocks.selective_scan": [
        Sample((_t(1, 3, 6), _t(1, 3, 6), -_t(3, 4, positive=True), _t(1, 4, 6), _t(1, 4, 6), _t(3), _t(1, 3, 6),
                _t(3), True, "silu", False, None, "torch"), fn=_scan, dtype=torch.float32),
        Sample((_t(2, 2, 5), _t(2, 2, 5, positive=True), -_t(2, 3, positive=True), _t(2, 3, 5), _t(2, 3, 5), None,
                _t(2, 2, 5), None, False, "sigmoid", False, None, "torch"), fn=_scan,
               dtype=torch.float32),
    ],
}

#: Rules no sample can exercise with ``torch.export`` on the CPU, and why.
unreachable: Dict[str, str] = {
    "aten._assert_tensor_metadata": "returns no value (a check on its argument's metadata)",
    "aten.size": "returns an int, not a tensor (a shape query); with static shapes only a number reaches the graph",
    "aten.sym_size": "a symbolic-shape query: static shapes record none",
    "aten.sym_numel": "a symbolic-shape query: static shapes record none",
    "aten.scalar_tensor": "takes no tensor: its value never depends on the input (folded as a constant)",
    "aten.fill_": "in place: torch.export functionalizes it into aten.fill",
    "aten.lift_fresh": "torch.export records aten.lift_fresh_copy",
    "aten.empty_like": "its values are uninitialized memory: only its shape means something",
    "aten.new_empty": "its values are uninitialized memory: only its shape means something",
    "aten._scaled_dot_product_efficient_attention": "CUDA only (no CPU kernel)",
    "aten._scaled_dot_product_flash_attention": "CUDA only (no CPU kernel)",
    "aten._scaled_dot_product_cudnn_attention": "CUDA only (no CPU kernel)",
    "aten._scaled_dot_product_fused_attention_overrideable": "no CPU kernel (a backend extension point)",
}
