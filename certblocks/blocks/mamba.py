"""Mamba mixers on certblocks' own selective-scan kernels: the free block and the linear-growth block.

Both classes are *velocities* ``v`` (mixers like ``mamba_ssm.Mamba``: no residual, no norm inside),
input and output ``(batch, seqlen, d_model)``.  They have ``mamba_ssm.Mamba``'s constructor arguments
(without ``use_fast_path``, which has no meaning here, plus ``eps``), its initialization (same random
draws in the same order: one seed gives the same weights) and its state_dict
(``in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj``), so checkpoints of ``mamba_ssm.Mamba`` and of
HF ``transformers`` ``MambaMixer`` load with ``strict=True``.

* :class:`Mamba` -- the original block (SiLU gate, ``x_proj`` reads the conv output ``x``).
  Exponents ``(q, sigma) = (5, 5)``: ``x, z = W_in u`` (1); ``x <- SiLU(conv x)`` (1);
  ``delta, B, C`` from ``x`` (1 each); ``delta * B * x`` (3); ``C h`` (4); ``* SiLU(z)`` (5).
* :class:`LinearGrowthMamba` -- two parameter-free changes, same weights: ``x_proj`` reads the conv
  output normalized per token, ``p = x / sqrt(||x||^2 + eps)`` (the scan input stays ``x``), and the
  output gate is ``sigmoid(z)``.  Then ``delta, B, C`` are bounded, ``h`` and ``y`` are linear in ``x``,
  the gate is bounded: exponents ``(1, 1)``.

Norm convention (docs/theory.md section 1): ``||X|| = max_t ||X_t||_2`` (max over tokens of the Euclidean norm of a
token); the Jacobian bound is a bound on the operator norm induced by that norm on input and output.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Dict, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import bounds
from .._validation import check_cert_args
from ..bounds import Poly
from ..certificate import BlockCertificate
from ..exponents import LINEAR_GROWTH_MAMBA, MAMBA_SSM, Exponents
from .mixer import DEFAULT_EPS, SelectiveScanMixer

__all__ = ["LinearGrowthMamba", "Mamba", "DEFAULT_EPS", "SILU_LIPSCHITZ", "decay_sums"]

#: ``sup |SiLU'(s)|`` (1.0998..., rounded up), from the bounds layer.
SILU_LIPSCHITZ: float = bounds.lipschitz("silu")


def _geo(n: int, rate_log: torch.Tensor) -> torch.Tensor:
    """``sum_{k=0}^{n-1} exp(k * rate_log)`` elementwise (``rate_log <= 0``), at most ``n``."""
    den = -torch.expm1(rate_log)
    num = -torch.expm1(n * rate_log)
    safe = torch.where(den > 0, num / den.clamp(min=1e-300), torch.full_like(den, float(n)))
    return torch.clamp(safe, max=float(n))


def decay_sums(dmax: torch.Tensor, mrow: torch.Tensor, A: torch.Tensor, dmin: torch.Tensor,
                seq_len: int, exact_terms: int = 1024) -> Tuple[float, float, float]:
    """Sums over the lag ``k = t - s`` (``0 .. seq_len-1``) used by the linear-growth certificate.

    Each returned ``S_*`` bounds ``sup ||(sum_s w_s[i] |xi_s[i]|)_i||_2`` over vectors with
    ``||xi_s|| <= 1`` and nonnegative weights of one of three kinds (``T_s = sum_{r=s+1}^t delta_r``,
    ``a_i = min_n |A_in|``, ``delta`` in ``[dmin, dmax]``):

    * ``S``:   ``w_s[i] = delta_s[i] exp(-a_i T_s)``
    * ``S_M``: ``w_s[i] = mrow_i min(1, delta_s[i]) exp(-a_i T_s)``
    * ``S_A``: ``w_s[i] = mrow_i delta_s[i] min(1/e, (2/e) exp(-a_i T_s / 2))`` (zero for ``s = t``)

    Two bounds are combined (the minimum is taken):

    1. pointwise ``w_s[i] <= p_i(k)`` with ``g_i = exp(-dmin_i a_i)`` (``p = dmax_i g_i^k`` for ``S``), and the
       triangle inequality over s: ``sum_k max_i p_i(k)``;
    2. per-channel masses ``W_i >= sum_s w_s[i]`` from ``sum_s delta_s exp(-a T_s) <= 1/a + dmax`` (the sum is a
       Riemann sum of ``int_0^inf exp(-a tau) d tau``, each interval contributing at most ``1 + a dmax``
       times its integral) and Cauchy-Schwarz: ``(sum_s w_s[i] |xi_s[i]|)^2 <= W_i sum_s w_s[i] xi_s[i]^2``,
       hence the bound ``sqrt(min(sum_k max_i W_i p_i(k), sum_i W_i^2))``.

    The first ``exact_terms`` lags are summed exactly (in chunks), the tail with the slowest decay.
    """
    inv_e = math.exp(-1.0)
    L = seq_len
    logg = (dmin[:, None] * A).max(dim=1).values  # (d,) log g_i = -dmin_i a_i <= 0
    a = A.abs().min(dim=1).values  # (d,) slowest state of each channel
    geo_full, geo_half = _geo(L, logg), _geo(L, 0.5 * logg)
    # pointwise coefficients p_i(k) = coef_i * g_i^(k * rate) (S_A also capped at 1/e * mrow dmax)
    cS, cM, cA = dmax, mrow * dmax.clamp(max=1.0), mrow * dmax
    # per-channel masses
    WS = torch.minimum(1.0 / a + dmax, dmax * geo_full)
    WM = mrow * torch.minimum(WS, dmax.clamp(max=1.0) * geo_full)
    WA = mrow * torch.minimum(2 * inv_e * (2.0 / a + dmax),
                              torch.minimum(inv_e * dmax * L, 2 * inv_e * dmax * geo_half))
    K0 = min(L, exact_terms)
    chunk = max(1, min(K0, (1 << 22) // max(1, logg.numel())))
    sums = torch.zeros(6, dtype=torch.float64)  # S, S_M, S_A and their mass-weighted twins
    for k0 in range(0, K0, chunk):
        k = torch.arange(k0, min(K0, k0 + chunk), dtype=torch.float64)[:, None]  # (K, 1)
        gk = torch.exp(k * logg[None, :])  # (K, d)
        ga = torch.clamp(2 * inv_e * torch.exp(0.5 * k * logg[None, :]), max=inv_e)
        ga = torch.where(k > 0, ga, torch.zeros_like(ga))
        for j, (coef, w, g) in enumerate(((cS, WS, gk), (cM, WM, gk), (cA, WA, ga))):
            pk = coef * g
            sums[j] += pk.max(dim=1).values.sum()
            sums[3 + j] += (w * pk).max(dim=1).values.sum()
    if L > K0:
        lg = logg.max()
        tail_full = float(torch.exp(K0 * lg) * _geo(L - K0, lg))
        tail_half = float(torch.exp(0.5 * K0 * lg) * _geo(L - K0, 0.5 * lg))
        tail_A = min(2 * inv_e * tail_half, inv_e * (L - K0))
        for j, (coef, w, t) in enumerate(((cS, WS, tail_full), (cM, WM, tail_full), (cA, WA, tail_A))):
            sums[j] += float(coef.max()) * t
            sums[3 + j] += float((w * coef).max()) * t
    out = []
    for j, w in enumerate((WS, WM, WA)):
        out.append(min(float(sums[j]), math.sqrt(min(float(sums[3 + j]), float((w * w).sum())))))
    return out[0], out[1], out[2]


def _poly(*coefficients: float) -> Poly:
    """``sum_k coefficients[k] R^k``."""
    return Poly({float(k): a for k, a in enumerate(coefficients)})


def _prod(*ps: Poly) -> Poly:
    out = Poly.const(1.0)
    for p in ps:
        out = out * p
    return out


class Mamba(SelectiveScanMixer):
    """The original Mamba mixer (free velocity, exponents ``(q, sigma) = (5, 5)``) on certblocks kernels.

    Same constructor, initialization, state_dict, forward and decoding as ``mamba_ssm.Mamba``
    (``use_fast_path`` has no meaning here), but runs on a CPU-only machine and under
    ``torch.compile``: the scan is :func:`certblocks.kernels.selective_scan` with ``gate="silu"``.
    Kept for experiments and comparisons: its growth is ``O(||x||^5)`` and a deep stack of it overflows
    in fp16; use :class:`LinearGrowthMamba` to train.

    Args:
        d_model: model width (input and output features).
        d_state: SSM state size ``N``.
        d_conv: depthwise causal convolution width.
        expand: ``d_inner = int(expand * d_model)``.
        dt_rank: rank of the ``delta`` projection, ``"auto"`` = ``ceil(d_model / 16)``.
        dt_min, dt_max: range of the initial ``delta = softplus(dt_proj.bias)`` (log-uniform).
        dt_init: ``"random"`` (uniform) or ``"constant"`` initialization of ``dt_proj.weight``.
        dt_scale: scale of that initialization (``dt_scale * dt_rank^-1/2``).
        dt_init_floor: lower clamp of the initial ``delta``.
        conv_bias: bias in ``conv1d``.
        bias: biases in ``in_proj`` and ``out_proj``.
        layer_idx: index of the layer in the cache of ``inference_params``.
        eps: unused by this block (no normalization); accepted so both blocks share a constructor.
        device, dtype: factory arguments of the parameters (``A_log`` and ``D`` stay float32).
    """

    exponents: ClassVar[Exponents] = MAMBA_SSM
    _gate: ClassVar[str] = "silu"
    _normalized: ClassVar[bool] = False

    @classmethod
    def from_module(cls, src: nn.Module) -> Mamba:
        """Build from a ``mamba_ssm.Mamba``, an HF ``MambaMixer`` or a certblocks Mamba block (weights copied).

        Hyperparameters are read from the weights' shapes; the result lives on ``src``'s device with
        ``src``'s parameter dtypes, nothing is re-initialized, and ``src`` is left unchanged.
        """
        return cls._from_module(src)  # type: ignore[return-value]

    def certificate(self, *, seq_len: int | None = None, r0: float | None = None) -> BlockCertificate:
        """Certificate ``(5, 5)`` with coefficients from the current weights, for sequences of ``seq_len``.

        Notation: rho = ||X|| (max over tokens of the token's l2 norm), ||W|| spectral norms
        (float64), ``W_x, W_z`` the two halves of ``in_proj``, ``W_dt, W_B, W_C`` the row blocks of
        ``x_proj``, ``M = dt_proj.weight @ W_dt``, ``m = max_i ||M_i||``, ``d0 = log 2 + max_i max(b_dt,i, 0)``,
        ``L = seq_len``.

        Forward.  ``x_t = W_x X_t + b_x`` and the depthwise causal conv over a window of ``d_conv`` tokens,
        ``c_t = sum_k diag(w_k) x_{t-K+1+k} + b_conv``, form one linear map of the window:
        ``||c_t|| <= a rho + b_c`` with ``a = min(sum_k ||diag(w_k) W_x||, sqrt(K) ||[diag(w_k) W_x]_k||)``
        (triangle inequality, or Cauchy-Schwarz over the window) and ``b_c`` the largest norm of the bias
        part over the (zero-padded) windows; ``|SiLU(s)| <= |s|`` gives ``||u_t|| <= U = a rho + b_c``.
        ``||B_t|| <= ||W_B|| U``, ``||C_t|| <= ||W_C|| U``, ``0 < delta_ti <= softplus(s) <= log 2 +
        max(s, 0) <= d0 + m U``.  ``|exp(delta A)| <= 1`` so ``||h_t[i, :]|| <= sum_{s<=t} delta_si ||B_s||
        |u_si|`` (at most L terms) and, by the triangle inequality over ``s``,
        ``||y_t|| <= ||W_C|| U ||W_B|| U L (d0 + m U) U + max|D| U =: Y`` (degree 4); the gate
        ``|SiLU(z)| <= |z|`` gives ``||yhat_t|| <= (||W_z|| rho + ||b_z||) Y`` (degree 5); then ``out_proj``.
        The polynomial is folded into ``c rho^5 + b`` with ``rho^k <= t^(k-5) rho^5 + t^k`` for
        ``t = r0`` (``t = 1`` when ``r0`` is None): sound for every rho, tightest near ``r0``.

        Jacobian (operator norm induced by the per-token norm, i.e. a bound on ``max_t ||(J V)_t||``
        over ``max_s ||V_s|| <= 1``; R = radius of the ball).  Perturbation sizes: ``||du|| <= e_u =
        1.1 a`` (SiLU' <= 1.1), ``||dz|| <= ||W_z||``, ``|d delta_i| <= m e_u`` (softplus' <= 1),
        ``||dB|| <= ||W_B|| e_u``, ``||dC|| <= ||W_C|| e_u``.  Differentiating
        ``y_t = sum_s C_t (prod_{r=s+1}^t exp(delta_r A)) delta_s B_s u_s + D u_t`` term by term
        (u, C, B, delta_s, and the decay factors) gives ``dY``.  For the decay factors
        ``exp(A_in sum_r delta_r)``: ``sigmoid <= softplus`` gives ``|d delta_r| <= delta_r m e_u``, so
        ``|A_in| sum_r |d delta_r| exp(-|A_in| sum_r delta_r) <= m e_u z exp(-z) <= m e_u / e``
        (``z = |A_in| sum_r delta_r``).  Altogether
        ``dY = ||W_C|| U ||W_B|| U L Delta e_u + max|D| e_u + (||W_C|| e_u ||W_B|| U + ||W_C|| U ||W_B|| e_u)
        L Delta U + ||W_C|| U ||W_B|| U L m e_u U + ||W_C|| U ||W_B|| U L Delta U m e_u / e`` with
        ``Delta = d0 + m U``; the gate gives ``||dyhat|| <= 1.1 ||W_z|| Y + (||W_z|| R + ||b_z||) dY``, then
        ``||W_out||``.  Degree 5 in R; ``l1`` = sum of the coefficients of degrees 1..5, ``l0`` = the
        constant (valid since ``R^k <= max(R, 1)^5``).  Very loose; meant for comparisons.

        Args:
            seq_len: the sequence length the certificate is for (the state sums at most this many steps);
                required: ``ValueError`` when missing.
            r0: optional scale at which the folding of the growth polynomial is tightest.
        """
        L, r0f = self._check_cert_args(seq_len, r0)
        return self._certificate(self._common_constants(self._weights64(), L), L, r0f)

    def certificate_from_caps(self, caps: Mapping[str, float], *, seq_len: Optional[int] = None) -> BlockCertificate:
        """The certificate that holds while every tensor of :meth:`cap_slots` is within its cap, for sequences of at
        most ``seq_len`` tokens (the norms of :meth:`certificate` replaced by their bounds from the caps; folded at
        ``t = 1``, as :meth:`certificate` without ``r0``)."""
        L, _ = check_cert_args(seq_len, None, block=self._cert_name(), needs_seq_len=True)
        assert L is not None
        return self._certificate(self._constants_from_caps(caps, L), L, None)

    def _certificate(self, k: Dict[str, float], L: int, r0f: Optional[float]) -> BlockCertificate:
        """The one formula behind :meth:`certificate` and :meth:`certificate_from_caps`, from the norms ``k``."""
        U = _poly(k["b_c"], k["a"])
        Z = _poly(k["bz"], k["Wz"])
        Delta = _poly(k["b_dt_pos_max"] + math.log(2.0)) + U.scale(k["M_rows_max"])
        Bn, Cn = U.scale(k["WB"]), U.scale(k["WC"])
        Y = _prod(Cn, Bn, Delta, U).scale(float(L)) + U.scale(k["Dmax"])
        growth = (Z * Y).scale(k["Wout"]) + Poly.const(k["bout"])
        c, b = growth.collapse_growth(5, r0f if r0f else 1.0)

        e_u = SILU_LIPSCHITZ * k["a"]
        dDelta = k["M_rows_max"] * e_u
        dY = (_prod(Cn, Bn, Delta).scale(float(L) * e_u) + Poly.const(k["Dmax"] * e_u)
              + _prod(Bn, Delta, U).scale(float(L) * k["WC"] * e_u)
              + _prod(Cn, Delta, U).scale(float(L) * k["WB"] * e_u)
              + _prod(Cn, Bn, U).scale(float(L) * dDelta)
              + _prod(Cn, Bn, Delta, U).scale(float(L) * dDelta * math.exp(-1.0)))
        jac = (Y.scale(SILU_LIPSCHITZ * k["Wz"]) + Z * dY).scale(k["Wout"])
        l1, l0 = jac.collapse_jacobian(5)
        # intermediates: in_proj (x and z halves), the scan input U, x_proj's outputs (delta before and
        # after softplus, B, C), the state h_t (at most L steps of delta B u), y, the gated y, the output
        xproj = U.scale(k["xproj"])
        state = _prod(Bn, Delta, U).scale(float(L))
        x_half = _poly(k["bx"], k["Wx"])
        peak = bounds.fold_peak([x_half, Z, U, xproj, Delta, Bn, Cn, state, Y, Z * Y, growth, Poly.const(1.0)],
                                "selective-scan state and output (degree 5 in ||x||)")
        r = lambda v: self._rounded(v, L)  # noqa: E731
        return BlockCertificate(
            5, 5, c=r(c), b=r(b), l1=r(l1), l0=r(l0), name=self._cert_name(),
            peak=dataclasses.replace(peak, c=r(peak.c), b=r(peak.b)),
            culprit="selective scan of the un-normalized x: delta*B*x (q=3), C*h (q=4), SiLU(z) gate (q=5)",
            fix="use LinearGrowthMamba (same weights): x_proj reads x/||x|| per token and the gate is sigmoid(z)",
        )


class LinearGrowthMamba(SelectiveScanMixer):
    """Mamba mixer with linear growth: exponents ``(q, sigma) = (1, 1)``, same weights as ``mamba_ssm.Mamba``.

    Two parameter-free changes to ``mamba_ssm.Mamba`` (state_dicts load unchanged, ``strict=True``):

    1. ``x_proj`` (which produces ``delta``, ``B``, ``C``) reads the conv output normalized per token,
       ``p_t = x_t / sqrt(||x_t||^2 + eps)`` (``||p_t|| < 1``; an all-zero token gives ``p_t = 0``),
       while the scan input ``u = x`` is not normalized;
    2. the output gate is ``sigmoid(z)`` instead of ``SiLU(z)``.

    The selective scan runs on :func:`certblocks.kernels.selective_scan` (``gate="sigmoid"``), the
    decode step on :func:`certblocks.kernels.selective_state_update`.

    Args:
        d_model: model width (input and output features).
        d_state: SSM state size ``N``.
        d_conv: depthwise causal convolution width.
        expand: ``d_inner = int(expand * d_model)``.
        dt_rank: rank of the ``delta`` projection, ``"auto"`` = ``ceil(d_model / 16)``.
        dt_min, dt_max: range of the initial ``delta = softplus(dt_proj.bias)`` (log-uniform).
        dt_init: ``"random"`` (uniform) or ``"constant"`` initialization of ``dt_proj.weight``.
        dt_scale: scale of that initialization (``dt_scale * dt_rank^-1/2``).
        dt_init_floor: lower clamp of the initial ``delta``.
        conv_bias: bias in ``conv1d``.
        bias: biases in ``in_proj`` and ``out_proj``.
        layer_idx: index of the layer in the cache of ``inference_params``.
        eps: ``eps > 0`` of the normalization ``x / sqrt(||x||^2 + eps)``; default ``1e-5``
            (LayerNorm's).  The Jacobian certificate grows like ``1/sqrt(eps)``.
        device, dtype: factory arguments of the parameters (``A_log`` and ``D`` stay float32).
    """

    exponents: ClassVar[Exponents] = LINEAR_GROWTH_MAMBA
    _gate: ClassVar[str] = "sigmoid"
    _normalized: ClassVar[bool] = True

    @classmethod
    def from_module(cls, src: nn.Module, *, eps: float = DEFAULT_EPS) -> LinearGrowthMamba:
        """Build from a ``mamba_ssm.Mamba``, an HF ``MambaMixer`` or a certblocks Mamba block (weights copied).

        Hyperparameters are read from the weights' shapes; the result lives on ``src``'s device with
        ``src``'s parameter dtypes, nothing is re-initialized, and ``src`` is left unchanged.

        Args:
            src: the mixer to convert (its activation must be SiLU).
            eps: the normalization's ``eps``.
        """
        return cls._from_module(src, eps=eps)  # type: ignore[return-value]

    def certificate(self, *, seq_len: int | None = None, r0: float | None = None) -> BlockCertificate:
        """Certificate ``(1, 1)`` with coefficients from the current weights, for sequences of ``seq_len``.

        Notation as in :meth:`Mamba.certificate`; rho = ||X||, per-token norm.  Here ``p_t =
        N(u_t) = u_t / sqrt(||u_t||^2 + eps)`` feeds ``x_proj``, so ``||p_t|| < 1`` whatever X is.

        Forward.  ``||u_t|| <= U = a rho + b_c`` (in_proj and the conv over a window of d_conv tokens as
        one linear map, ``|SiLU(s)| <= |s|``; ``a``, ``b_c`` as in :meth:`Mamba.certificate`).
        ``||B_t|| <= ||W_B||``, ``||C_t|| <= ||W_C||``; per channel ``delta_ti = softplus(M_i . p_t + b_i)``
        lies in ``[dmin_i, dmax_i] = [softplus(b_i - ||M_i||), softplus(b_i + ||M_i||)]``.  Since ``A < 0``,
        the decay over k steps is ``<= g_in^k``, ``g_in = exp(dmin_i A_in) <= 1``, ``g_i = max_n g_in``.
        Then ``|sum_n C_tn h_tin| <= sum_s g_i^(t-s) dmax_i ||C_t|| ||B_s|| |u_si|`` and, by the
        triangle inequality over s (at most L = seq_len steps),
        ``||y_t|| <= (||W_C|| ||W_B|| S + max|D|) U =: K1 U`` with ``S = sum_{k<L} max_i dmax_i g_i^k
        <= L max_i dmax_i``.  The gate ``0 < sigmoid < 1`` does not increase it; ``out_proj`` gives
        ``c = ||W_out|| K1 a``, ``b = ||W_out|| K1 b_c + ||b_out||``.  ``r0`` is not needed (the bound is
        affine in rho) and only validated.

        Jacobian (bound on the operator norm induced by the per-token norm; R = radius, ``e_u =
        1.1 a`` bounds ``||du_t||``, ``nu = 1/sqrt(eps)`` bounds ``||dN||``, and
        ``||dN(u)|| ||u|| <= ||u|| / sqrt(||u||^2 + eps) <= 1``):

        * through u (scan input and D):                 ``K1 e_u``
        * through B_s (``||dB_s|| |u_s| <= ||W_B|| e_u``): ``||W_C|| ||W_B|| S e_u``
        * through delta_s (``|d delta| = sigmoid(.) |M_i . dp| <= min(1, dmax_i) ||M_i|| ||dp||``, using
          ``sigmoid <= min(1, softplus)``): ``||W_C|| ||W_B|| S_M e_u``,
          ``S_M = sum_k max_i ||M_i|| min(1, dmax_i) g_i^k``
        * through C_t (``||dC_t|| <= ||W_C|| nu e_u``, ``||h_t|| <= ||W_B|| S U``): ``||W_C|| ||W_B|| nu e_u S U``
        * through the decays ``exp(A_in sum_{r=s+1}^t delta_r)``: ``|d delta_r| <= delta_r ||M_i|| nu e_u`` and
          ``z exp(-z) <= min(1/e, (2/e) exp(-z/2))`` with ``z = |A_in| sum_r delta_r >= |A_in| dmin_i (t - s)``
          give ``||W_C|| ||W_B|| nu e_u S_A U``, ``S_A = sum_{k>=1} max_i ||M_i|| dmax_i min(1/e, (2/e) g_i^(k/2))``
        * through the gate (``sigmoid' <= 1/4``): ``||W_z|| K1 U / 4``

        summed and multiplied by ``||W_out||``: ``L(R) <= l1 max(R, 1) + l0`` with the R-coefficient of U
        in ``l1``.  The C_t and decay terms are the reason sigma = 1 (a token with ``u_t ~ 0`` and a large
        state); they scale like ``1/sqrt(eps)``.  Sums over lags beyond 1024 are bounded by geometric
        series with the slowest decay.

        Args:
            seq_len: the sequence length the certificate is for; required (``ValueError`` when missing).
            r0: accepted for a uniform interface; validated, not used (the growth bound is affine).
        """
        L, _ = self._check_cert_args(seq_len, r0)
        w = self._weights64()
        M = w["dt_w"] @ w["W_dt"]
        mrow = M.norm(dim=1) * (1.0 + 2.0 * bounds.UNIT_ROUNDOFF * M.shape[1])  # rounded up
        dmax = F.softplus(w["dt_b"] + mrow)
        dmin = F.softplus(w["dt_b"] - mrow)
        return self._certificate(self._common_constants(w, L), L, dmax, mrow, w["A"], dmin)

    def certificate_from_caps(self, caps: Mapping[str, float], *, seq_len: Optional[int] = None) -> BlockCertificate:
        """The certificate that holds while every tensor of :meth:`cap_slots` is within its cap, for sequences of at
        most ``seq_len`` tokens.

        The norms of :meth:`certificate` are replaced by their bounds from the caps (``||M_i|| <= m = a_dtw a_dt``,
        ``delta <= dmax = softplus(softplus^-1(delta_b) + m)``) and the decays by their bound 1 (``dmin = 0``, which
        holds whatever ``A_log``): ``S = L dmax``, ``S_M = L m min(1, dmax)``, ``S_A = (L - 1) m dmax / e``.
        """
        L, _ = check_cert_args(seq_len, None, block=self._cert_name(), needs_seq_len=True)
        assert L is not None
        k = self._constants_from_caps(caps, L)
        n, m = self.d_inner, k["M_rows_max"]
        f64: Dict[str, Any] = {"dtype": torch.float64}
        dmax = F.softplus(torch.full((n,), k["dt_b_max"] + m, **f64))
        return self._certificate(k, L, dmax, torch.full((n,), m, **f64), torch.zeros(n, self.d_state, **f64),
                                 torch.zeros(n, **f64))

    def _certificate(self, k: Dict[str, float], L: int, dmax: torch.Tensor, mrow: torch.Tensor, A: torch.Tensor,
                     dmin: torch.Tensor) -> BlockCertificate:
        """The one formula behind :meth:`certificate` and :meth:`certificate_from_caps`: from the norms ``k`` and, per
        channel, the range ``[dmin, dmax]`` of ``delta``, the row norms ``mrow`` of ``M`` and the decay rates ``A``."""
        S, S_M, S_A = decay_sums(dmax, mrow, A, dmin, L)
        a, b_c = k["a"], k["b_c"]
        WCB = k["WC"] * k["WB"]
        K1 = WCB * S + k["Dmax"]
        c = k["Wout"] * K1 * a
        b = k["Wout"] * K1 * b_c + k["bout"]
        e_u = SILU_LIPSCHITZ * a
        nu = 1.0 / math.sqrt(self.eps)
        lin = (K1 + WCB * (S + S_M)) * e_u  # terms independent of U
        per_U = WCB * nu * e_u * (S + S_A) + bounds.SIGMOID_DERIVATIVE_MAX * k["Wz"] * K1  # multiplies U = a R + b_c
        l1 = k["Wout"] * per_U * a
        l0 = k["Wout"] * (lin + per_U * b_c)
        # intermediates: in_proj (x and z halves), the scan input U = a R + b_c, x_proj's outputs from the
        # normalized p (||p|| < 1: delta before softplus <= max ||M_i|| + |dt_b|, after <= dmax, B, C), the
        # state ||h_t|| <= ||W_B|| S U, y and the gated y (<= K1 U), the output
        consts = [k["xproj"], float(mrow.max()) + k["dt_b_abs_max"], float(dmax.max()), 1.0]  # 1: decays, gate
        peak = bounds.fold_peak([_poly(k["bx"], k["Wx"]), _poly(k["bz"], k["Wz"]),
                                 _poly(b_c, a), _poly(max(consts)), _poly(k["WB"] * S * b_c, k["WB"] * S * a),
                                 _poly(K1 * b_c, K1 * a), _poly(b, c)],
                                "selective-scan state h_t (at most seq_len steps of delta B u)")
        r = lambda v: self._rounded(v, L)  # noqa: E731
        return BlockCertificate(
            1, 1, c=r(c), b=r(b), l1=r(l1), l0=r(l0), name=self._cert_name(),
            peak=dataclasses.replace(peak, c=r(peak.c), b=r(peak.b)),
            culprit="selective scan: C_t and the decays read x_t/||x_t|| while the state holds un-normalized x "
                    "(sigma = 1)",
        )
