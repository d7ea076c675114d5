"""The recognizer of a normalized linear attention: ``(W V) / (W 1 + eps)`` with nonnegative kernel weights ``W``.

EfficientViT's lightweight attention (and other ReLU linear attentions) pads the values with a column of ones and
computes ``M = Q (K^T [V | c])`` once: ``M[..., :-1] = Q K^T V`` is the numerator and ``M[..., -1] = c Q K^T 1`` the
denominator, ``out = M[..., :-1] / (M[..., -1:] + eps)``.  With ``Q, K >= 0`` (a ReLU kernel), ``W = Q K^T >= 0`` and
every output row is a combination of value rows with nonnegative weights summing to at most ``1/c``:

    out_i = sum_j a_ij v_j,   a_ij = W_ij / (c s_i + eps),   s_i = sum_j W_ij,   sum_j a_ij <= 1/c.

The division rule alone would bound it by ``|num| / eps`` (cubic in the input); recognized, it is bounded like
attention: ``N(out_i) <= max_j N(v_j) / c`` (``q = q_V``).  Its derivative is

    d out_i = [sum_j W_ij dv_j + sum_j dW_ij (v_j - c out_i)] / (c s_i + eps),

so ``||d out|| <= J_V / c + (2 / eps) (sum_j |dW_ij|) G_V`` with ``|dW_ij| <= N(dq_i) N(k_j) + N(q_i) N(dk_j)``: the
``1/eps`` is attained where a query's kernel weights vanish (``s_i -> 0``), as a normalization's ``1/sqrt(eps)``
is; the exponents are attention's, ``(q_V, max(sigma_logits + q_V, sigma_V))`` (docs/theory.md section 2.5).

In floating point ``M`` is a sum of products of nonnegative weights with the values: its error is at most
``gamma sum_j W_ij |V_jc|`` (``gamma ~ (n + d_k) u``), the same factor on the denominator's side, so the bound
holds up to ``1 + 2 (sqrt(d_v) + 2)(n + d_k + 3) u``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple

import torch

from ... import exponents as E
from ...bounds.poly import Poly
from ...exponents import Exponents
from ..nodes import bind_args, strip_exact_casts, target_name
from ..values import AValue
from .common import unit_roundoff
from .lower_bounds import lower_bound
from .normalizations import _plus_eps

if TYPE_CHECKING:
    from ..interp import VelocityInterpreter

__all__ = ["recognize_linear_attention"]

_MATMULS = ("aten.matmul", "aten.mm", "aten.bmm")


def _columns(it: VelocityInterpreter, n: Any) -> Optional[Tuple[torch.fx.Node, range]]:
    """``(M, columns)`` when ``n`` is a slice, narrow or select of the last dimension of ``M``."""
    n = strip_exact_casts(n, it.g.env)
    t = target_name(n)
    if t not in ("aten.slice", "aten.narrow", "aten.select") or not isinstance(n.args[0], torch.fx.Node):
        return None
    src = it.g.env.get(n.args[0].name)
    b = bind_args(n) or {}
    if not isinstance(src, torch.Tensor) or src.dim() < 2 or int(b.get("dim", 0) or 0) % src.dim() != src.dim() - 1:
        return None
    width = src.shape[-1]
    if t == "aten.select":
        return None  # a row of the result would hold one entry per token: not the shape of an attention's output
    if t == "aten.narrow":
        start = int(b["start"]) % width
        return n.args[0], range(start, start + int(b["length"]))
    return n.args[0], range(width)[slice(b.get("start"), b.get("end"), b.get("step") or 1)]


def _padded_values(it: VelocityInterpreter, vp: Any) -> Optional[Tuple[torch.fx.Node, int, int, float]]:
    """``(V, left, width, c)`` when ``vp`` is ``V`` padded along its last dimension with the constant ``c``."""
    vp = strip_exact_casts(vp, it.g.env)
    if target_name(vp) not in ("aten.pad", "aten.constant_pad_nd"):
        return None
    b = bind_args(vp) or {}
    pad = list(b.get("pad") or [])
    src = it.g.env.get(getattr(vp.args[0], "name", ""))
    if b.get("mode", "constant") != "constant" or len(pad) < 2 or min(int(pad[0]), int(pad[1])) < 0 or \
            not isinstance(src, torch.Tensor) or src.dim() < 2:
        return None
    if len(pad) > 2 and any(int(p) != 0 for p in pad[2:]):
        return None  # padded along other dimensions too: extra keys
    return vp.args[0], int(pad[0]), src.shape[-1], float(b.get("value") or 0.0)


def _transposed(it: VelocityInterpreter, kt: Any) -> Optional[AValue]:
    """The value of ``K`` when ``kt`` is ``K`` with its last two dimensions swapped (rows of ``K`` are keys)."""
    kt = strip_exact_casts(kt, it.g.env)
    t = target_name(kt)
    out = it.g.env.get(getattr(kt, "name", ""))
    if not isinstance(out, torch.Tensor) or out.dim() < 2:
        return None
    nd = out.dim()
    b = bind_args(kt) or {}
    if t == "aten.transpose" and {int(b["dim0"]) % nd, int(b["dim1"]) % nd} == {nd - 2, nd - 1}:
        return it.value(kt.args[0])
    if t == "aten.t" and nd == 2:
        return it.value(kt.args[0])
    if t == "aten.permute" and [int(d) % nd for d in b["dims"]][-2:] == [nd - 1, nd - 2] and \
            [int(d) % nd for d in b["dims"]][:-2] == list(range(nd - 2)):
        return it.value(kt.args[0])
    return None


def _kernel_weights(it: VelocityInterpreter, m: torch.fx.Node) -> Optional[Tuple[Any, ...]]:
    """The weights of ``M = W VP``: ``("qk", Q, K, VP, d_k)`` for ``M = Q (K^T VP)`` with ``Q, K >= 0``, or
    ``("w", W, None, VP, 0)`` for ``M = W VP`` with ``W >= 0``; ``None`` otherwise."""
    if target_name(m) not in _MATMULS or len(m.args) != 2:
        return None
    left, right = m.args
    inner = strip_exact_casts(right, it.g.env)
    nonneg = lower_bound(it, left)
    if nonneg is None or nonneg < 0:
        return None
    if target_name(inner) in _MATMULS and len(inner.args) == 2:
        kt, vp = inner.args
        lk = lower_bound(it, kt)
        k = _transposed(it, kt)
        q = it.value(left)
        if lk is not None and lk >= 0 and isinstance(q, AValue):
            kv = k if k is not None else _columns_of(it.value(kt))
            if kv is not None:
                return "qk", q, kv, vp, q.shape[-1]
    w = it.value(left)
    return ("w", w, None, right, 0) if isinstance(w, AValue) else None


def _columns_of(kt: Any) -> Optional[AValue]:
    """A stand-in for the rows of ``K`` read from ``K^T`` when it is not a plain transpose: a column of ``K^T`` has
    norm at most ``sqrt(d_k)`` times its largest entry, and its derivative ``sqrt(d_k)`` times ``K^T``'s row bound."""
    if not isinstance(kt, AValue) or kt.entry_bound() is None:
        return None
    f = math.sqrt(kt.shape[-2]) if kt.ndim >= 2 else 1.0
    return AValue(exps=kt.exps, shape=tuple(kt.shape[:-2]) + (kt.shape[-1], kt.shape[-2]),
                  growth=kt.entry_bound().scale(f), max_abs=kt.entry_bound(),
                  jacobian=None if kt.jacobian is None else kt.jacobian.scale(f), rule="keys of K^T")


def recognize_linear_attention(it: VelocityInterpreter, n: torch.fx.Node, shape: Sequence[int]) -> Optional[AValue]:
    """``M[..., cols] / (M[..., c0] + eps)`` with ``M = W [V | c]`` (module docstring) -> the bound of a weighted mean
    of the value rows; ``None`` when ``n`` is not that form."""
    if len(n.args) < 2 or not isinstance(n.args[1], torch.fx.Node):
        return None
    parts = _plus_eps(it, strip_exact_casts(n.args[1], it.g.env))
    if parts is None:
        return None
    den, eps = _columns(it, parts[0]), parts[1]
    num = _columns(it, n.args[0])
    if den is None or num is None or strip_exact_casts(den[0], it.g.env) is not strip_exact_casts(num[0], it.g.env):
        return None
    m = strip_exact_casts(num[0], it.g.env)
    weights = _kernel_weights(it, m)
    if weights is None:
        return None
    kind, q, k, vp, d_k = weights
    padded = _padded_values(it, vp)
    if padded is None:
        return None
    v_node, left, width, c = padded
    if not c > 0 or len(den[1]) != 1 or any(left <= col < left + width for col in den[1]) or \
            not all(left <= col < left + width for col in num[1]):
        return None  # the denominator must read the padding's constant column, the numerator the values
    v = it.value(v_node)
    if not isinstance(v, AValue) or v.growth is None:
        return None
    keys = v.shape[-2] if v.ndim >= 2 else 1
    u = unit_roundoff(it.g.env[m.name].dtype)
    rf = (1.0 + 2.0 * (math.sqrt(len(num[1])) + 2.0) * (keys + d_k + 3) * u) / c
    growth, entries = v.growth.scale(rf), None if v.entry_bound() is None else v.entry_bound().scale(rf)
    jacobian = _jacobian(kind, q, k, v, keys, eps, c)
    logits = E.product(q.exps, k.exps) if kind == "qk" else q.exps
    sigma = None if None in (logits.sigma, v.exps.q, v.exps.sigma) else max(logits.sigma + v.exps.q, v.exps.sigma)
    return AValue(exps=Exponents(v.exps.q, sigma), shape=tuple(shape), growth=growth, max_abs=entries,
                  jacobian=jacobian, deps=(v_node.name,),
                  rule=f"normalized linear attention (kernel weights >= 0, denominator >= eps = {eps:.3g}): "
                       "a weighted mean of the values")


def _jacobian(kind: str, q: AValue, k: Optional[AValue], v: AValue, keys: int, eps: float, c: float) -> Optional[Poly]:
    """``J_V / c + (2 / eps) (sum_j |dW_ij|) G_V`` (module docstring): ``sum_j |dW_ij| <= keys (J_Q G_K + G_Q J_K)``
    for ``W = Q K^T``, ``<= sqrt(keys) J_W`` for a given ``W``."""
    if v.jacobian is None or q.jacobian is None or q.growth is None:
        return None
    if kind == "qk":
        if k is None or k.jacobian is None or k.growth is None:
            return None
        dw = (q.jacobian * k.growth + q.growth * k.jacobian).scale(float(keys))
    else:
        dw = q.jacobian.scale(math.sqrt(keys))
    return v.jacobian.scale(1.0 / c) + (dw * v.growth).scale(2.0 / eps)
