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

Norm convention (THEORY.md): ``||X|| = max_t ||X_t||_2`` (max over tokens of the Euclidean norm of a
token); the Jacobian bound is a bound on the operator norm induced by that norm on input and output.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Dict, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from .. import bounds
from .. import kernels as _kernels
from .._validation import check_bool, check_cert_args, check_finite, check_int, check_real
from ..bounds import Poly
from ..certificate import BlockCertificate
from ..exponents import LINEAR_GROWTH_MAMBA, MAMBA_SSM, Exponents

__all__ = ["LinearGrowthMamba", "Mamba", "DEFAULT_EPS", "SILU_LIPSCHITZ"]

#: Default ``eps`` of the per-token normalization ``x / sqrt(||x||^2 + eps)`` (LayerNorm's default).
DEFAULT_EPS: float = 1e-5
#: ``sup |SiLU'(s)|`` (1.0998..., rounded up), from the bounds layer.
SILU_LIPSCHITZ: float = bounds.lipschitz("silu")


def _normalize_tokens(x: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
    """``x / sqrt(||x||^2 + eps)`` along ``dim``, computed in at least float32, returned in x's dtype.

    Finite for an all-zero token (gives zero) and for any finite fp16 input (the sum of squares is
    accumulated in float32, so it does not overflow where fp16 would).  A token whose entries reach
    ~1e19 (possible in bf16/fp32 only) overflows the float32 sum of squares and maps to zero (finite).
    """
    xf = x if x.dtype == torch.float64 else x.float()
    return (xf * torch.rsqrt(xf.square().sum(dim, keepdim=True) + eps)).to(x.dtype)


class _MambaMixer(nn.Module):
    """Shared body of :class:`Mamba` and :class:`LinearGrowthMamba` (not public)."""

    exponents: ClassVar[Exponents]
    _gate: ClassVar[str]
    _normalized: ClassVar[bool]

    def __init__(
        self,
        d_model: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: Union[int, float] = 2,
        dt_rank: Union[int, str] = "auto",
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init: str = "random",
        dt_scale: float = 1.0,
        dt_init_floor: float = 1e-4,
        conv_bias: bool = True,
        bias: bool = False,
        layer_idx: int | None = None,
        eps: float = DEFAULT_EPS,
        device: Union[torch.device, str] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_int("d_model", d_model)
        check_int("d_state", d_state)
        check_int("d_conv", d_conv)
        check_real("expand", expand, positive=True)
        d_inner = int(expand * d_model)
        if d_inner < 1:
            raise ValueError(f"expand * d_model must be >= 1, got expand={expand!r}, d_model={d_model}")
        if dt_rank == "auto":
            rank = math.ceil(d_model / 16)
        elif isinstance(dt_rank, str):
            raise ValueError(f"dt_rank must be 'auto' or an int >= 1, got {dt_rank!r}")
        else:
            rank = check_int("dt_rank", dt_rank)
        lo = check_real("dt_min", dt_min, positive=True)
        hi = check_real("dt_max", dt_max, positive=True)
        if lo > hi:
            raise ValueError(f"dt_min must be <= dt_max, got dt_min={dt_min!r}, dt_max={dt_max!r}")
        if dt_init not in ("random", "constant"):
            raise ValueError(f"dt_init must be 'random' or 'constant', got {dt_init!r}")
        check_real("dt_scale", dt_scale)
        check_real("dt_init_floor", dt_init_floor, nonnegative=True)
        check_bool("conv_bias", conv_bias)
        check_bool("bias", bias)
        if layer_idx is not None:
            check_int("layer_idx", layer_idx, minimum=0)
        self.eps = check_real("eps", eps, positive=True)
        if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in _kernels.FLOAT_DTYPES):
            raise TypeError(f"dtype must be one of {_kernels.FLOAT_DTYPES} or None, got {dtype!r} (the selective-scan "
                            "kernels compute in float32; certificates are computed in float64 whatever the dtype)")
        factory_kwargs: Dict[str, Any] = {"device": device, "dtype": dtype}

        self.d_model = d_model
        self.d_state = d_state
        self.d_conv = d_conv
        self.expand = expand
        self.d_inner = d_inner
        self.dt_rank = rank
        self.layer_idx = layer_idx
        #: backend of :func:`certblocks.kernels.selective_scan` ("auto", "torch", "triton", "reference");
        #: a plain attribute (not a constructor argument, to keep mamba_ssm's signature).
        self.backend = "auto"

        # The draws below follow mamba_ssm.Mamba's order, so one seed gives the same weights.
        self.in_proj = nn.Linear(d_model, d_inner * 2, bias=bias, **factory_kwargs)
        self.conv1d = nn.Conv1d(d_inner, d_inner, kernel_size=d_conv, groups=d_inner, padding=d_conv - 1,
                                bias=conv_bias, **factory_kwargs)
        self.x_proj = nn.Linear(d_inner, rank + 2 * d_state, bias=False, **factory_kwargs)
        self.dt_proj = nn.Linear(rank, d_inner, bias=True, **factory_kwargs)

        # dt_proj: weight uniform (or constant) at scale rank^-1/2, bias = softplus^-1 of a
        # log-uniform dt in [dt_min, dt_max] (floored at dt_init_floor).
        std = rank**-0.5 * dt_scale
        with torch.no_grad():
            if dt_init == "constant":
                self.dt_proj.weight.fill_(std)
            else:
                self.dt_proj.weight.uniform_(-std, std)
            dt = torch.exp(torch.rand(d_inner, **factory_kwargs) * (math.log(hi) - math.log(lo)) + math.log(lo))
            dt = dt.clamp(min=dt_init_floor)
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

        # S4D-real A = -(1, 2, ..., d_state) per channel, stored as log in float32; D = 1 in float32.
        a = torch.arange(1, d_state + 1, dtype=torch.float32, device=device).expand(d_inner, d_state)
        self.A_log = nn.Parameter(torch.log(a).contiguous())
        self.D = nn.Parameter(torch.ones(d_inner, device=device))
        self.out_proj = nn.Linear(d_inner, d_model, bias=bias, **factory_kwargs)
        self._tag_parameters()

    def _tag_parameters(self) -> None:
        self.A_log._no_weight_decay = True  # type: ignore[attr-defined]
        self.D._no_weight_decay = True  # type: ignore[attr-defined]
        self.dt_proj.bias._no_reinit = True  # type: ignore[attr-defined]

    def extra_repr(self) -> str:
        s = (f"d_model={self.d_model}, d_state={self.d_state}, d_conv={self.d_conv}, expand={self.expand}, "
             f"d_inner={self.d_inner}, dt_rank={self.dt_rank}, gate={self._gate}")
        if self._normalized:
            s += f", eps={self.eps:g}"
        return s

    # ------------------------------------------------------------------ forward
    def _param_input(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """What ``x_proj`` reads: ``x`` (free block) or ``x / sqrt(||x||^2 + eps)`` per token."""
        return _normalize_tokens(x, dim, self.eps) if self._normalized else x

    def _check_hidden(self, hidden_states: object, name: str = "hidden_states") -> torch.Tensor:
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.d_model:
            raise ValueError(f"{name} must have shape (batch, seqlen, d_model={self.d_model}), "
                             f"got {tuple(hidden_states.shape)}")
        if hidden_states.dtype not in _kernels.FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {hidden_states.dtype}; allowed: {_kernels.FLOAT_DTYPES} (the "
                            "selective-scan kernels compute in float32)")
        weight = self.in_proj.weight
        if hidden_states.dtype != weight.dtype and not torch.is_autocast_enabled(hidden_states.device.type):
            raise TypeError(f"{name}.dtype {hidden_states.dtype} differs from the block's parameters ({weight.dtype}); "
                            f"cast the block with .to({hidden_states.dtype}) or run under torch.autocast")
        return hidden_states

    def forward(self, hidden_states: torch.Tensor, inference_params: Any | None = None, *,
                attention_mask: torch.Tensor | None = None, cache: Any | None = None) -> torch.Tensor:
        """Apply the mixer.

        Args:
            hidden_states: ``(batch, seqlen, d_model)``.
            inference_params: optional mamba_ssm ``InferenceParams``-like object (attributes
                ``key_value_memory_dict`` and ``seqlen_offset``); the states of this layer
                (``layer_idx``) are created there, filled by a prefill (``seqlen_offset == 0``) and
                advanced by one token per call afterwards, as in ``mamba_ssm.Mamba``.
            attention_mask: optional ``(batch, seqlen)`` padding mask (1 = token, 0 = padding), applied
                as HF ``MambaMixer`` does: to the input and to the conv output.
            cache: accepted so that the block can replace an HF ``MambaMixer`` inside ``MambaBlock``;
                only ``None`` is supported (run HF models with ``use_cache=False``, or decode with
                ``inference_params`` / :meth:`step`).

        Returns:
            ``(batch, seqlen, d_model)``, the velocity (no residual added).
        """
        self._check_hidden(hidden_states)
        batch, seqlen, _ = hidden_states.shape
        if seqlen == 0:  # nothing to scan (the states, if any, are left as they are)
            return hidden_states.new_zeros((batch, 0, self.d_model))
        if cache is not None:
            raise ValueError(f"cache={type(cache).__name__}: transformers caches are not supported by "
                             f"{type(self).__name__}; call the HF model with use_cache=False, or decode with "
                             "inference_params (mamba_ssm) or step()")
        mask = None
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, seqlen):
                got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
                raise ValueError(f"attention_mask must be a tensor of shape (batch, seqlen) = {(batch, seqlen)}, "
                                 f"got {got}")
            mask = attention_mask[:, None, :]  # (B, 1, L)
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        conv_state = ssm_state = None
        if inference_params is not None:
            conv_state, ssm_state = self._get_states_from_cache(inference_params, batch)
            if inference_params.seqlen_offset > 0:
                out, _, _ = self.step(hidden_states, conv_state, ssm_state)
                return out

        xz = self.in_proj(hidden_states).transpose(1, 2)  # (B, 2 d_inner, L)
        x, z = xz.chunk(2, dim=1)  # (B, d_inner, L) each
        if conv_state is not None:
            conv_state.copy_(F.pad(x, (self.d_conv - seqlen, 0)))  # last d_conv inputs (zero-padded)
        x = F.silu(self.conv1d(x)[..., :seqlen])  # (B, d_inner, L): the scan input u
        if mask is not None:
            x = (x * mask).to(z.dtype)

        p = self._param_input(x, dim=1)
        x_dbl = self.x_proj(p.transpose(1, 2))  # (B, L, dt_rank + 2 d_state)
        dt, B, C = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight).transpose(1, 2)  # (B, d_inner, L), bias added in the scan
        B = B.transpose(1, 2).contiguous()  # (B, d_state, L)
        C = C.transpose(1, 2).contiguous()
        A = -torch.exp(self.A_log.float())  # (d_inner, d_state)
        y = _kernels.selective_scan(
            x, dt, A, B, C, self.D.float(), z=z, delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
            gate=self._gate, return_last_state=ssm_state is not None, backend=self.backend,
        )
        if ssm_state is not None:
            y, last_state = y
            ssm_state.copy_(last_state)
        return self.out_proj(y.transpose(1, 2))  # (B, L, d_model)

    # ------------------------------------------------------------------ decoding
    def step(self, hidden_states: torch.Tensor, conv_state: torch.Tensor,
             ssm_state: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Advance one token; ``conv_state`` and ``ssm_state`` are updated in place.

        Args:
            hidden_states: ``(batch, 1, d_model)``.
            conv_state: ``(batch, d_inner, d_conv)``, the last ``d_conv`` conv inputs.
            ssm_state: ``(batch, d_inner, d_state)``.

        Returns:
            ``(out, conv_state, ssm_state)`` with ``out`` of shape ``(batch, 1, d_model)``.
        """
        self._check_hidden(hidden_states)
        batch = hidden_states.shape[0]
        if hidden_states.shape[1] != 1:
            raise ValueError(f"step decodes one token at a time: hidden_states must have shape (batch, 1, "
                             f"{self.d_model}), got {tuple(hidden_states.shape)}")
        for name, st, shape in (("conv_state", conv_state, (batch, self.d_inner, self.d_conv)),
                                ("ssm_state", ssm_state, (batch, self.d_inner, self.d_state))):
            if not isinstance(st, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(st).__name__}")
            if tuple(st.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(st.shape)}")
        dtype = hidden_states.dtype
        xz = self.in_proj(hidden_states.squeeze(1))  # (B, 2 d_inner)
        x, z = xz.chunk(2, dim=-1)  # (B, d_inner)
        conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
        conv_state[:, :, -1] = x
        x = torch.sum(conv_state * self.conv1d.weight[:, 0, :], dim=-1)  # (B, d_inner)
        if self.conv1d.bias is not None:
            x = x + self.conv1d.bias
        x = F.silu(x).to(dtype)
        x_db = self.x_proj(self._param_input(x, dim=-1))  # (B, dt_rank + 2 d_state)
        dt, B, C = torch.split(x_db, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight)  # (B, d_inner)
        A = -torch.exp(self.A_log.float())
        y = _kernels.selective_state_update(ssm_state, x, dt, A, B, C, self.D.float(), z=z,
                                            dt_bias=self.dt_proj.bias.float(), dt_softplus=True, gate=self._gate)
        return self.out_proj(y).unsqueeze(1), conv_state, ssm_state

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype: torch.dtype | None = None,
                                 **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """Zero ``(conv_state, ssm_state)`` for ``batch_size`` sequences (as ``mamba_ssm.Mamba``).

        ``max_seqlen`` is accepted for interface compatibility (the states do not depend on it).
        """
        check_int("batch_size", batch_size)
        check_int("max_seqlen", max_seqlen, minimum=0)
        device = self.out_proj.weight.device
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        ssm_dtype = self.dt_proj.weight.dtype if dtype is None else dtype
        conv_state = torch.zeros(batch_size, self.d_inner, self.d_conv, device=device, dtype=conv_dtype)
        ssm_state = torch.zeros(batch_size, self.d_inner, self.d_state, device=device, dtype=ssm_dtype)
        return conv_state, ssm_state

    def _get_states_from_cache(self, inference_params: Any, batch_size: int,
                               initialize_states: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.layer_idx is None:
            raise ValueError("inference_params needs the block's layer_idx (got layer_idx=None)")
        cache = inference_params.key_value_memory_dict
        if self.layer_idx not in cache:
            cache[self.layer_idx] = self.allocate_inference_cache(batch_size, 0)
        conv_state, ssm_state = cache[self.layer_idx]
        if initialize_states:
            conv_state.zero_()
            ssm_state.zero_()
        return conv_state, ssm_state

    # ------------------------------------------------------------------ conversion
    @classmethod
    def _from_module(cls, src: nn.Module, **extra: Any) -> _MambaMixer:
        if not isinstance(src, nn.Module):
            raise TypeError(f"src must be an nn.Module (mamba_ssm.Mamba, transformers MambaMixer, or a certblocks "
                            f"Mamba block), got {type(src).__name__}")
        act = getattr(src, "activation", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"src uses the activation {act!r}; only 'silu' (mamba_ssm, HF hidden_act='silu') "
                             "is supported")
        sd = src.state_dict()
        need = ("in_proj.weight", "conv1d.weight", "x_proj.weight", "dt_proj.weight", "dt_proj.bias", "A_log", "D",
                "out_proj.weight")
        missing = [k for k in need if k not in sd]
        if missing:
            hint = " (pass its .mixer: the mixer of a mamba_ssm Block / HF MambaBlock)" if hasattr(src, "mixer") else ""
            raise ValueError(f"src ({type(src).__name__}) is not a Mamba mixer: its state_dict lacks {missing}{hint}")
        two_inner, d_model = sd["in_proj.weight"].shape
        d_inner, d_state = sd["A_log"].shape
        d_conv = sd["conv1d.weight"].shape[-1]
        dt_rank = sd["dt_proj.weight"].shape[1]
        if two_inner != 2 * d_inner or sd["x_proj.weight"].shape[0] != dt_rank + 2 * d_state:
            raise ValueError(f"src ({type(src).__name__}) has inconsistent shapes: in_proj "
                             f"{tuple(sd['in_proj.weight'].shape)}, A_log {(d_inner, d_state)}, "
                             f"x_proj {tuple(sd['x_proj.weight'].shape)}, dt_rank {dt_rank}")
        expand: Union[int, float]
        if d_inner % d_model == 0:
            expand = d_inner // d_model
        else:
            expand = d_inner / d_model
            while int(expand * d_model) < d_inner:
                expand = math.nextafter(expand, math.inf)
        has_bias = "in_proj.bias" in sd and sd["in_proj.bias"] is not None
        conv_bias = "conv1d.bias" in sd and sd["conv1d.bias"] is not None
        layer_idx = getattr(src, "layer_idx", None)
        if not (isinstance(layer_idx, int) and not isinstance(layer_idx, bool) and layer_idx >= 0):
            layer_idx = None
        blk = cls(d_model, d_state=d_state, d_conv=d_conv, expand=expand, dt_rank=dt_rank, conv_bias=conv_bias,
                  bias=has_bias, layer_idx=layer_idx, device="meta", **extra)
        blk.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=True, assign=True)
        blk._tag_parameters()
        blk.train(src.training)
        return blk

    # ------------------------------------------------------------------ certificate helpers
    def _weights64(self) -> Dict[str, torch.Tensor]:
        """Detached float64 CPU copies of the weights, split as the forward uses them."""
        g = lambda t: t.detach().to(device="cpu", dtype=torch.float64)
        W_in = g(self.in_proj.weight)
        b_in = g(self.in_proj.bias) if self.in_proj.bias is not None else W_in.new_zeros(2 * self.d_inner)
        Wxp = g(self.x_proj.weight)
        r, n = self.dt_rank, self.d_state
        return {
            "W_x": W_in[: self.d_inner], "W_z": W_in[self.d_inner:],
            "b_x": b_in[: self.d_inner], "b_z": b_in[self.d_inner:],
            "conv_w": g(self.conv1d.weight)[:, 0, :],
            "conv_b": g(self.conv1d.bias) if self.conv1d.bias is not None else W_in.new_zeros(self.d_inner),
            "W_dt": Wxp[:r], "W_B": Wxp[r: r + n], "W_C": Wxp[r + n:],
            "dt_w": g(self.dt_proj.weight), "dt_b": g(self.dt_proj.bias),
            "A": -torch.exp(g(self.A_log)), "D": g(self.D),
            "W_out": g(self.out_proj.weight),
            "b_out": g(self.out_proj.bias) if self.out_proj.bias is not None else W_in.new_zeros(self.d_model),
        }

    @staticmethod
    def _common_constants(w: Dict[str, torch.Tensor], seq_len: int) -> Dict[str, float]:
        """Norms shared by both certificates (float64; see the certificate docstrings).

        ``a``, ``b_c``: ``||conv(in_proj_x(X))_t|| <= a ||X|| + b_c`` for every token t.  The conv output
        is ``c_t = sum_k A_k X_{t-K+1+k} + (bias part)`` with ``A_k = diag(w_k) W_x``; ``a`` is the smaller
        of ``sum_k ||A_k||`` and ``sqrt(K') ||[A_j .. A_{K-1}]||`` (Cauchy-Schwarz over the window; only the
        last ``K' = min(K, seq_len)`` taps ever see a token), and ``b_c`` the largest norm of the bias part
        over the zero-padded windows, ``max_j ||sum_{k>=j} w_k * b_x + b_conv||``.
        """
        cw = w["conv_w"]  # (d_inner, K)
        K = cw.shape[1]
        j0 = max(0, K - seq_len)
        blocks = [cw[:, k, None] * w["W_x"] for k in range(j0, K)]
        a = min(math.fsum(bounds.op_norm(m) for m in blocks),
                math.sqrt(K - j0) * bounds.op_norm(torch.cat(blocks, 1)))
        tails = torch.flip(torch.cumsum(torch.flip(cw * w["b_x"][:, None], [1]), 1), [1])  # sum_{k>=j}
        b_c = bounds.row_norm_max((tails + w["conv_b"][:, None]).T)
        M = w["dt_w"] @ w["W_dt"]  # (d_inner, d_inner): delta_pre = M x_param + dt_b
        return {
            "a": a, "b_c": b_c, "Wz": bounds.op_norm(w["W_z"]), "bz": bounds.vec_norm(w["b_z"]),
            "WB": bounds.op_norm(w["W_B"]), "WC": bounds.op_norm(w["W_C"]), "Wout": bounds.op_norm(w["W_out"]),
            "bout": bounds.vec_norm(w["b_out"]), "Dmax": bounds.vec_inf_norm(w["D"]),
            "M_rows_max": bounds.row_norm_max(M), "b_dt_pos_max": float(w["dt_b"].clamp(min=0).max()),
        }

    def _cert_name(self) -> str:
        return type(self).__name__ + ("" if self.layer_idx is None else f"[{self.layer_idx}]")

    def _check_cert_args(self, seq_len: object, r0: object) -> Tuple[int, float | None]:
        L, r = check_cert_args(seq_len, r0, block=type(self).__name__, needs_seq_len=True)  # type: ignore[arg-type]
        check_finite(self)
        assert L is not None
        return L, r

    def _rounded(self, value: float, seq_len: int) -> float:
        """``value`` raised to cover the float64 rounding of the certificate's own arithmetic.

        Every coefficient is a sum of non-negative terms (products, exponentials and geometric sums of the
        norms) built in at most ``8 seq_len d_inner d_state`` float64 operations, each with a relative error
        of at most the unit roundoff.
        """
        return bounds.rounded_up(value, 8 * seq_len * self.d_inner * self.d_state)


def _geo(n: int, rate_log: torch.Tensor) -> torch.Tensor:
    """``sum_{k=0}^{n-1} exp(k * rate_log)`` elementwise (``rate_log <= 0``), at most ``n``."""
    den = -torch.expm1(rate_log)
    num = -torch.expm1(n * rate_log)
    safe = torch.where(den > 0, num / den.clamp(min=1e-300), torch.full_like(den, float(n)))
    return torch.clamp(safe, max=float(n))


def _decay_sums(dmax: torch.Tensor, mrow: torch.Tensor, A: torch.Tensor, dmin: torch.Tensor,
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


class Mamba(_MambaMixer):
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
        w = self._weights64()
        k = self._common_constants(w, L)
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
        xproj = U.scale(bounds.op_norm(torch.cat([w["W_dt"], w["W_B"], w["W_C"]])))
        state = _prod(Bn, Delta, U).scale(float(L))
        x_half = _poly(bounds.vec_norm(w["b_x"]), bounds.op_norm(w["W_x"]))
        peak = bounds.fold_peak([x_half, Z, U, xproj, Delta, Bn, Cn, state, Y, Z * Y, growth, Poly.const(1.0)],
                                "selective-scan state and output (degree 5 in ||x||)")
        r = lambda v: self._rounded(v, L)  # noqa: E731
        return BlockCertificate(
            5, 5, c=r(c), b=r(b), l1=r(l1), l0=r(l0), name=self._cert_name(),
            peak=dataclasses.replace(peak, c=r(peak.c), b=r(peak.b)),
            culprit="selective scan of the un-normalized x: delta*B*x (q=3), C*h (q=4), SiLU(z) gate (q=5)",
            fix="use LinearGrowthMamba (same weights): x_proj reads x/||x|| per token and the gate is sigmoid(z)",
        )


class LinearGrowthMamba(_MambaMixer):
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
        k = self._common_constants(w, L)
        M = w["dt_w"] @ w["W_dt"]
        mrow = M.norm(dim=1) * (1.0 + 2.0 * bounds.UNIT_ROUNDOFF * M.shape[1])  # rounded up
        dmax = F.softplus(w["dt_b"] + mrow)
        dmin = F.softplus(w["dt_b"] - mrow)
        S, S_M, S_A = _decay_sums(dmax, mrow, w["A"], dmin, L)
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
        xproj = bounds.op_norm(torch.cat([w["W_dt"], w["W_B"], w["W_C"]]))
        consts = [xproj, float(mrow.max() + w["dt_b"].abs().max()), float(dmax.max()), 1.0]  # 1: decays, gate
        peak = bounds.fold_peak([_poly(bounds.vec_norm(w["b_x"]), bounds.op_norm(w["W_x"])), _poly(k["bz"], k["Wz"]),
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
