"""Linear-algebra rules: linear, matmul/mm/bmm, addmm, einsum, convolutions, FFTs.

With a constant operand they are affine (``q`` kept, the factor an operator norm read from
:mod:`certblocks.bounds.norms`); with two input-dependent operands they are products (exponents added).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple

import torch

from ... import exponents as E
from ...bounds.norms import inf_norm, op_norm
from ...bounds.poly import Poly
from ..nodes import op_name
from ..values import AValue, max_abs, row_norm
from .common import const_row_norm, sign_mul, sqrt_last, unknown
from .registry import register_rule

if TYPE_CHECKING:
    from ..interp import VelocityInterpreter

Args = Dict[str, Any]
Shape = Tuple[int, ...]


def _linear_core(x: AValue, w_norm: float, bias: Optional[AValue], shape: Sequence[int], rule: str) -> AValue:
    """``x @ W^T + bias`` with ``||W||_op <= w_norm`` (a constant bias, broadcast to ``shape``)."""
    b_norm = 0.0 if bias is None else const_row_norm(bias.value, shape)
    growth = None if x.growth is None else x.growth.scale(w_norm) + Poly.const(b_norm)
    return AValue(exps=x.exps, shape=shape, growth=growth, max_abs=growth,
                  jacobian=None if x.jacobian is None else x.jacobian.scale(w_norm), rule=rule)


def _with_bias(out: AValue, bias: Optional[AValue], shape: Sequence[int]) -> AValue:
    """``out + bias`` for a constant bias broadcast to ``shape`` (the growth and entry bounds grow by its norm)."""
    if bias is None:
        return out
    if out.growth is not None:
        out.growth = out.growth + Poly.const(const_row_norm(bias.value, shape))
    if out.max_abs is not None:
        out.max_abs = out.max_abs + Poly.const(max_abs(bias.value))
    return out


def _matmul_const_left(c: AValue, y: AValue, shape: Sequence[int]) -> AValue:
    """``c @ y`` with a constant ``c``: a row of the output combines rows of ``y`` with the weights of a row of
    ``c`` (``N <= max_i sum_j |c_ij| N(y)``); a vector ``y`` is one row, mapped by ``c`` (``||c||_op``)."""
    cv = c.value.unsqueeze(0) if c.value.dim() == 1 else c.value
    f = op_norm(cv) if y.ndim == 1 else inf_norm(cv)
    growth = None if y.growth is None else y.growth.scale(f)
    return AValue(exps=y.exps, shape=shape, growth=growth, max_abs=growth,
                  jacobian=None if y.jacobian is None else y.jacobian.scale(f),
                  rule="affine (constant matrix on the left)")


def _matmul_acts(x: AValue, y: AValue, shape: Sequence[int], rows_b: int, name: str) -> AValue:
    """Product of two input-dependent matrices: ``N(x @ y) <= N(x) ||y||_F <= sqrt(rows of y) N(x) N(y)``."""
    f = math.sqrt(max(rows_b, 1))
    growth = jacobian = None
    if x.growth is not None and y.growth is not None:
        growth = (x.growth * y.growth).scale(f)
    if None not in (x.growth, y.growth, x.jacobian, y.jacobian):
        jacobian = (x.jacobian * y.growth + x.growth * y.jacobian).scale(f)
    return AValue(exps=E.product(x.exps, y.exps), shape=shape, growth=growth, max_abs=growth, jacobian=jacobian,
                  sign=sign_mul(x.sign, y.sign), rule=f"{name} of two input-dependent tensors (product)")


def _times_vector(x: AValue, v: torch.Tensor, shape: Sequence[int], name: str) -> AValue:
    """``x @ v`` with a constant vector ``v``: each output entry is ``<x_row, v>`` (``|.| <= N(x) ||v||``), and a row
    of the output collects entries of several rows of ``x``."""
    f = row_norm(v)
    entries = None if x.growth is None else x.growth.scale(f)
    jac = None if x.jacobian is None else x.jacobian.scale(f)
    last = math.sqrt(shape[-1]) if shape else 1.0
    return AValue(exps=x.exps, shape=shape, growth=None if entries is None else entries.scale(last),
                  max_abs=entries, jacobian=None if jac is None else jac.scale(last),
                  rule=f"affine ({name} with a constant vector)")


def _matmul(x: AValue, y: AValue, shape: Shape, name: str) -> AValue:
    if x.const and y.const:
        return AValue.unknown(shape, name, "constant matmul")
    if y.const:
        if y.ndim == 1:
            return _times_vector(x, y.value, shape, name)
        return _linear_core(x, op_norm(y.value), None, shape, f"affine ({name} with a parameter/constant)")
    if x.const:
        return _matmul_const_left(x, y, shape)
    if y.ndim == 1:
        return AValue.unknown(shape, name, f"{name} with a 1-D input-dependent operand has no rule")
    k = y.shape[-2]
    if x.stochastic_dim is not None and (x.stochastic_dim % max(x.ndim, 1)) == x.ndim - 1:
        # rows of x are (up to a rounding, row_sum) probability vectors: N(x @ y) <= row_sum N(y);
        # d(xy) = dx y + x dy
        s = x.row_sum
        jacobian = None if None in (x.jacobian, y.growth, y.jacobian) else \
            y.jacobian.scale(s) + (x.jacobian * y.growth).scale(math.sqrt(k))
        growth = None if y.growth is None else y.growth.scale(s)
        return AValue(exps=E.product(x.exps, y.exps), shape=shape, growth=growth, max_abs=growth,
                      jacobian=jacobian,
                      rule=f"{name} of a row-stochastic matrix with an input-dependent tensor (product)")
    return _matmul_acts(x, y, shape, rows_b=k, name=name)


@register_rule("aten.linear", reads=("input", "weight", "bias"))
def linear(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``input @ weight^T + bias``: affine in the input with a constant weight, in the weight with a constant input
    (``||W x_i|| <= ||x_i|| ||W||_F <= ||x_i|| sqrt(rows) N(W)``), a product with both input-dependent."""
    x, w, b = a["input"], a["weight"], a.get("bias")
    if isinstance(b, AValue) and not b.const:
        return unknown(shape, "linear with an input-dependent bias")
    if w.const:
        if w.ndim == 1:  # x @ w: one entry per row of x
            return _with_bias(_times_vector(x, w.value, shape, "linear"), b, shape)
        return _linear_core(x, op_norm(w.value), b, shape, "affine (linear with a parameter)")
    rows = w.shape[-2] if w.ndim >= 2 else 1
    if x.const:
        f = row_norm(x.value) * math.sqrt(rows)
        out = AValue(exps=w.exps, shape=shape, growth=None if w.growth is None else w.growth.scale(f),
                     jacobian=None if w.jacobian is None else w.jacobian.scale(f),
                     rule="affine (linear of a constant input by an input-dependent weight)")
        out.max_abs = out.growth
        return _with_bias(out, b, shape)
    return _with_bias(_matmul_acts(x, w, shape, rows_b=rows, name="linear"), b, shape)


@register_rule("aten.matmul", "aten.mm", "aten.bmm", overloads=("default",), reads=("self", "other", "mat2"))
def matmul(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    return _matmul(a["self"], a.get("other", a.get("mat2")), shape, op_name(n.target).split(".")[-1])


@register_rule("aten.addmm", "aten.baddbmm", "aten.addbmm", overloads=("default",),
               reads=("self", "mat1", "mat2", "batch1", "batch2", "beta", "alpha"))
def addmm(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``beta * self + alpha * (mat1 @ mat2)`` with a constant ``self`` (broadcast); ``addbmm`` sums the batch's
    products (a factor of the batch size)."""
    bias, m1, m2 = a["self"], a.get("mat1", a.get("batch1")), a.get("mat2", a.get("batch2"))
    beta = 1.0 if a.get("beta") is None else abs(complex(a["beta"]))
    alpha = 1.0 if a.get("alpha") is None else abs(complex(a["alpha"]))
    if isinstance(bias, AValue) and not bias.const:
        return unknown(shape, "addmm with an input-dependent bias")
    name = op_name(n.target)
    batches = m1.shape[0] if name == "aten.addbmm" and m1.ndim == 3 else 1
    core = _matmul(m1, m2, tuple(m1.shape[:-1]) + tuple(m2.shape[-1:]), name.split(".")[-1])
    f = alpha * batches
    if core.growth is not None:
        b_norm = 0.0 if beta == 0 else const_row_norm(bias.value, shape)
        core.growth = core.growth.scale(f) + Poly.const(beta * b_norm)
        core.max_abs = core.growth
    if core.jacobian is not None:
        core.jacobian = core.jacobian.scale(f)
    core.shape = tuple(shape)
    return core


@register_rule("aten.einsum", overloads=("default",), reads=("equation", "tensors", "path"))
def einsum(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    ops = list(a["tensors"])
    acts = [o for o in ops if not o.const]
    if not acts:
        return AValue.constant(it.g.env[n.name])
    # |out| <= einsum(|A|, ..., ones) * prod max|act|  (entries), N(out) <= sqrt(last) * max|out|
    absops = [o.value.abs().double() if o.const else torch.ones(o.shape, dtype=torch.float64) for o in ops]
    f = float(torch.einsum(a["equation"], *absops).max()) * (1 + 1e-9)
    d = sqrt_last(shape)
    entries = [o.entry_bound() for o in acts]
    growth = jacobian = None
    if None not in entries:
        prod = Poly.const(1.0)
        for m in entries:
            prod = prod * m
        growth = prod.scale(f * d)
        if all(o.jacobian is not None for o in acts):
            jacobian = Poly()
            for i, o in enumerate(acts):
                term = o.jacobian
                for j, m in enumerate(entries):
                    if j != i:
                        term = term * m
                jacobian = jacobian + term
            jacobian = jacobian.scale(f * d)
    rule = "affine (einsum with constants)" if len(acts) == 1 else "einsum of input-dependent tensors (product)"
    return AValue(exps=E.product(*[o.exps for o in acts]), shape=shape, growth=growth,
                  max_abs=None if growth is None else growth.scale(1.0 / d), jacobian=jacobian, rule=rule)


@register_rule("aten.conv1d", "aten.conv2d", "aten.conv3d", "aten.convolution", "aten._convolution",
               "aten.conv_transpose1d", "aten.conv_transpose2d", "aten.conv_transpose3d",
               reads=("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding",
                      "groups"))
def conv(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x, w, b = a["input"], a["weight"], a.get("bias")
    if not w.const or (isinstance(b, AValue) and not b.const):
        return unknown(shape, "convolution with input-dependent weights")
    transposed = bool(a.get("transposed", False)) or "transpose" in op_name(n.target)
    # every output entry sums weights times input entries: |out| <= max over output channels of sum |W| max|x|
    wv = w.value
    per_out = wv.transpose(0, 1).reshape(wv.shape[1], -1) if transposed else wv.reshape(wv.shape[0], -1)
    f = inf_norm(per_out)
    d = sqrt_last(shape)
    entries = x.entry_bound()
    b_max = max_abs(b.value) if isinstance(b, AValue) else 0.0
    m = None if entries is None else entries.scale(f) + Poly.const(b_max)
    return AValue(exps=x.exps, shape=shape, growth=None if m is None else m.scale(d), max_abs=m,
                  jacobian=None if x.jacobian is None else x.jacobian.scale(f * d), rule="affine (convolution)")


def _fft_scale(norm: Any, inverse: bool, n: int) -> float:
    if isinstance(norm, int):  # aten _fft_* : 0 none, 1 1/sqrt(n), 2 1/n
        return {0: 1.0, 1: 1.0 / math.sqrt(n), 2: 1.0 / n}[norm]
    if norm in (None, "backward"):
        return 1.0 / n if inverse else 1.0
    if norm == "ortho":
        return 1.0 / math.sqrt(n)
    if norm == "forward":
        return 1.0 if inverse else 1.0 / n
    raise ValueError(f"unknown fft norm {norm!r}")


@register_rule("aten.fft_fft", "aten.fft_ifft", "aten.fft_rfft", "aten.fft_irfft", "aten.fft_fftn",
               "aten.fft_ifftn", "aten.fft_rfftn", "aten.fft_irfftn", "aten.fft_fft2", "aten.fft_ifft2",
               "aten.fft_rfft2", "aten.fft_irfft2", "aten.fft_hfft", "aten.fft_ihfft", "aten._fft_r2c",
               "aten._fft_c2r", "aten._fft_c2c",
               reads=("self", "n", "s", "dim", "norm", "normalization", "forward", "onesided", "last_dim_size"))
def fft(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """FFTs are linear: every output entry is a combination of at most n entries with moduli <= scale."""
    x = a["self"]
    name = op_name(n.target)
    inverse = "ifft" in name or "irfft" in name or name == "aten._fft_c2r" or \
        (name == "aten._fft_c2c" and not a.get("forward", True))
    dims = a.get("dim")
    if dims is None:
        dims = list(range(-2, 0)) if name.endswith("2") else (list(range(x.ndim)) if name.endswith("n") else [-1])
    if isinstance(dims, int):
        dims = [dims]
    nd_in = max(x.ndim, 1)
    terms = 1
    for d in dims:
        terms *= max(x.shape[d], shape[d] if len(shape) == x.ndim else 1)
    f = _fft_scale(a.get("norm", a.get("normalization")), inverse, terms) * terms
    if name in ("aten.fft_hfft", "aten.fft_irfft", "aten._fft_c2r", "aten.fft_irfftn", "aten.fft_irfft2"):
        f *= 2  # hermitian extension: each stored coefficient appears at most twice
    entries = x.entry_bound()
    if any((d % nd_in) == nd_in - 1 for d in dims):  # the last dimension is transformed: through the entries
        dd = sqrt_last(shape)
        m = None if entries is None else entries.scale(f)
        growth = None if m is None else m.scale(dd)
        jacobian = None if x.jacobian is None else x.jacobian.scale(f * dd)
    else:
        growth = None if x.growth is None else x.growth.scale(f)
        m = None if entries is None else entries.scale(f)
        jacobian = None if x.jacobian is None else x.jacobian.scale(f)
    return AValue(exps=x.exps, shape=shape, growth=growth, max_abs=m, jacobian=jacobian, rule="linear (FFT)")
