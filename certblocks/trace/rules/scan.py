"""The selective-scan rule: ``certblocks::selective_scan`` (Mamba's recurrence) as one primitive.

``h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t``, ``y_t = C_t h_t (+ D u_t)``, gated by ``sigmoid(z)``
or ``SiLU(z)``.  With ``A`` a constant ``<= 0`` and ``delta >= 0`` (after its bias and softplus)
``exp(delta A)`` is bounded; the exponents follow from docs/theory.md section 2 (the plain Mamba block is
at ``q = 5``), the coefficients from max-abs bounds of the recurrence over the ``L`` steps.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

import torch

from ... import exponents as E
from ...bounds.activations import SIGMOID_DERIVATIVE_MAX, activation
from ...bounds.poly import Poly
from ..values import AValue, max_abs
from .registry import register_rule

if TYPE_CHECKING:
    from ..interp import VelocityInterpreter


@register_rule("certblocks.selective_scan",
               reads=("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "gate", "cu_seqlens",
                      "return_last_state", "backend"))
def selective_scan(it: VelocityInterpreter, n: torch.fx.Node, v: Dict[str, Any],
                   shape: Tuple[int, ...]) -> List[AValue]:
    u, delta, A, B, C = v["u"], v["delta"], v["A"], v["B"], v["C"]
    D, z, bias = v.get("D"), v.get("z"), v.get("delta_bias")
    softplus, gate = bool(v.get("delta_softplus")), v.get("gate")
    conc = it.g.env.get(n.name)
    shapes = [tuple(t.shape) for t in conc] if isinstance(conc, (tuple, list)) else [it.shape_of(n)]
    out_shape = shapes[0]
    deps = it.deps_of(n)

    def unknown(why: str) -> List[AValue]:
        return [AValue.unknown(out_shape, "selective_scan", why, deps)] + \
            [AValue.unknown(s, "selective_scan state", why, deps) for s in shapes[1:]]

    if not A.const or A.sign not in ("-", "0"):
        return unknown("selective_scan: A is not a constant <= 0, so exp(delta*A) is not bounded")
    # delta after bias and softplus
    d_entries, d_jac, d_sign = delta.entry_bound(), delta.jacobian, delta.sign
    if bias is not None and isinstance(bias, AValue):
        if not bias.const:
            return unknown("selective_scan: delta_bias depends on the input")
        d_entries = None if d_entries is None else d_entries + Poly.const(max_abs(bias.value))
        d_sign = d_sign if bias.sign in (d_sign, "0") else None
    if softplus:
        d_entries = None if d_entries is None else d_entries + Poly.const(activation("softplus").offset)
        d_sign = "+"
    if d_sign not in ("+", "0"):
        return unknown("selective_scan: delta is not provably >= 0 (use delta_softplus or a nonnegative delta)")
    steps = u.shape[-1]
    d_state = A.shape[-1]
    a_max = max_abs(A.value)
    # exponents from the recurrence h_t = exp(delta A) h + (delta B) u, y = C h (+ D u), gate
    abar = E.exp_of_nonpositive(delta.exps)
    bu = E.product(delta.exps, B.exps, u.exps) if not B.const else E.product(delta.exps, u.exps)
    h = E.add(bu, E.product(abar, bu))
    y = E.product(C.exps, h) if not C.const else h
    if D is not None and isinstance(D, AValue):
        y = E.add(y, u.exps)
    g_entries = g_jac = None
    if z is not None and isinstance(z, AValue):
        if gate == "sigmoid":
            gex = E.compose(E.SATURATING, z.exps)
            g_entries = Poly.const(activation("sigmoid").saturation)
            g_jac = None if z.jacobian is None else z.jacobian.scale(SIGMOID_DERIVATIVE_MAX)
        elif gate in ("silu", None):
            silu = activation("silu")
            gex = E.compose(E.LIPSCHITZ, z.exps)
            g_entries = None if z.entry_bound() is None else z.entry_bound().scale(silu.slope)
            g_jac = None if z.jacobian is None else z.jacobian.scale(silu.lipschitz)
        else:
            return unknown(f"selective_scan: gate {gate!r} has no rule")
        y = E.product(y, gex) if not z.const else y
    # coefficients (max-abs form): |h| <= L |delta| |B| |u|,  |y| <= N |C| |h| + |D||u|
    u_m, b_m, c_m = u.entry_bound(), B.entry_bound(), C.entry_bound()
    growth = jacobian = None
    if None not in (u_m, b_m, c_m, d_entries, d_jac, u.jacobian, B.jacobian, C.jacobian):
        h_m = (d_entries * b_m * u_m).scale(steps)
        h_j = (d_jac * b_m * u_m + d_entries * B.jacobian * u_m + d_entries * b_m * u.jacobian).scale(steps) + \
            (d_jac * d_entries * b_m * u_m).scale(steps * steps * a_max)
        y_m = (c_m * h_m).scale(d_state)
        y_j = (C.jacobian * h_m + c_m * h_j).scale(d_state)
        if D is not None and isinstance(D, AValue):
            if D.const:
                dm = max_abs(D.value)
                y_m = y_m + u_m.scale(dm)
                y_j = y_j + u.jacobian.scale(dm)
            else:
                y_m = y_j = None
        if y_m is not None and z is not None and isinstance(z, AValue):
            if g_entries is None or g_jac is None:
                y_m = y_j = None
            else:
                y_j = y_j * g_entries + y_m * g_jac
                y_m = y_m * g_entries
        if y_m is not None:
            f = math.sqrt(out_shape[-1])
            growth, jacobian = y_m.scale(f), y_j.scale(f)
    out = AValue(exps=y, shape=out_shape, growth=growth,
                 max_abs=None if growth is None else growth.scale(1.0 / math.sqrt(out_shape[-1])),
                 jacobian=jacobian, rule="selective scan (recurrence rule)", deps=deps)
    state = [AValue(exps=h, shape=s, rule="selective scan state", deps=deps) for s in shapes[1:]]
    return [out] + state
