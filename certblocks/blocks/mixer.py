"""The selective-scan mixer shared by the Mamba blocks (:class:`~certblocks.blocks.Mamba`, ``LinearGrowthMamba``).

:class:`SelectiveScanMixer` holds everything the two blocks share: ``mamba_ssm.Mamba``'s constructor,
initialization (the same random draws in the same order) and state_dict, the forward on certblocks'
selective-scan kernels, decoding (``step``, ``inference_params``), conversion from ``mamba_ssm``/HF modules, and
the weight norms both certificates read (from the weights, or from caps on them for :func:`certblocks.enforce`).
The subclasses set the gate, whether ``x_proj`` reads normalized tokens, and their certificates.

Decay rates: the forward uses ``A = -exp(min(A_log, 88))`` (``-exp(A_log)`` as ``mamba_ssm`` for every
``A_log <= 88``, i.e. ``|A| <= 1.6e38``): an ``A_log`` beyond ~88.7 would make ``A = -inf`` in float32, and
``exp(delta A)`` NaN where ``delta`` underflows to 0 (and the gradient of ``exp`` NaN); the certificates read the
same ``A``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Dict, List, Mapping, Tuple, Union, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from .. import bounds
from .. import kernels as _kernels
from .._validation import check_bool, check_cert_args, check_choice, check_finite, check_int, check_real
from ..exponents import Exponents
from ..fixes import Lever
from ..protocol import CapSlot, linear_cap_slots, softplus_ceiling

__all__ = ["SelectiveScanMixer", "normalize_tokens", "decay_rates", "DEFAULT_EPS", "DT_BIAS_LOWER", "A_LOG_MAX"]

#: Default ``eps`` of the per-token normalization ``x / sqrt(||x||^2 + eps)`` (LayerNorm's default).
DEFAULT_EPS: float = 1e-5
#: The fixed lower end of ``dt_proj.bias`` under :func:`certblocks.enforce` (``softplus(-30) < 1e-13``: a
#: ``delta`` that small leaves the state unchanged); only the ``delta`` peak reads it.
DT_BIAS_LOWER: float = -30.0
#: The largest ``A_log`` the forward uses (``exp(88) = 1.65e38``: finite in float32).
A_LOG_MAX: float = 88.0


def decay_rates(A_log: torch.Tensor) -> torch.Tensor:
    """``A = -exp(min(A_log, A_LOG_MAX))`` in at least float32: finite, and so is its gradient."""
    a = A_log if A_log.dtype == torch.float64 else A_log.float()
    return -torch.exp(a.clamp(max=A_LOG_MAX))


def normalize_tokens(x: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
    """``x / sqrt(||x||^2 + eps)`` along ``dim``, computed in at least float32, returned in x's dtype.

    Finite for an all-zero token (gives zero) and for any finite fp16 input (the sum of squares is
    accumulated in float32, so it does not overflow where fp16 would).  A token whose entries reach
    ~1e19 (possible in bf16/fp32 only) overflows the float32 sum of squares and maps to zero (finite).
    """
    xf = x if x.dtype == torch.float64 else x.float()
    return (xf * torch.rsqrt(xf.square().sum(dim, keepdim=True) + eps)).to(x.dtype)


class SelectiveScanMixer(nn.Module):
    """Shared body of the two Mamba blocks (see the module docstring); not meant to be built directly."""

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
        check_choice("dt_init", dt_init, ("random", "constant"))
        check_real("dt_scale", dt_scale)
        check_real("dt_init_floor", dt_init_floor, nonnegative=True)
        check_bool("conv_bias", conv_bias)
        check_bool("bias", bias)
        check_int("layer_idx", layer_idx, minimum=0, optional=True)
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
        return normalize_tokens(x, dim, self.eps) if self._normalized else x

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
        A = decay_rates(self.A_log)  # (d_inner, d_state)
        y = _kernels.selective_scan(
            x, dt, A, B, C, self.D.float(), z=z, delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
            gate=self._gate, return_last_state=ssm_state is not None, backend=self.backend,
        )
        if ssm_state is not None:
            y, last_state = y
            ssm_state.copy_(last_state)
        return self.out_proj(cast(torch.Tensor, y).transpose(1, 2))  # (B, L, d_model)

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
        A = decay_rates(self.A_log)
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
    def _from_module(cls, src: nn.Module, **extra: Any) -> SelectiveScanMixer:
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
            "A": decay_rates(g(self.A_log)), "D": g(self.D),
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
            "Wx": bounds.op_norm(w["W_x"]), "bx": bounds.vec_norm(w["b_x"]),
            "xproj": bounds.op_norm(torch.cat([w["W_dt"], w["W_B"], w["W_C"]])),
            "dt_b_abs_max": bounds.vec_inf_norm(w["dt_b"]),
        }

    # ------------------------------------------------------------------ enforce
    def levers(self) -> List[Lever]:
        """None: no parameter of this block scales its certificate in closed form (a branch gain is
        :class:`~certblocks.blocks.ScaledBranch`'s)."""
        return []

    def cap_slots(self) -> List[CapSlot]:
        """The tensors both certificates read, for :func:`certblocks.enforce` (keys of :meth:`_constants_from_caps`).

        ``in_proj`` in two row blocks (``a_x``, ``a_z``; biases ``beta_x``, ``beta_z``), the conv taps (largest
        absolute entry ``w_conv``) and bias (``beta_conv``), ``x_proj`` in three row blocks (``a_dt``, ``a_B``,
        ``a_C``), ``dt_proj.weight`` (``a_dtw``), ``dt_proj.bias`` (``"softplus"``: ``max softplus(b) <= delta_b``,
        entries at least :data:`DT_BIAS_LOWER`), ``D`` (largest absolute entry ``D``), ``out_proj`` (``a_out``,
        ``beta_out``).  ``A_log`` is not capped: every decay ``exp(delta A)`` is at most 1 whatever it is, and the
        worst case takes that bound.
        """
        n, r = self.d_inner, self.dt_rank
        slots = linear_cap_slots(self.in_proj, (n, n), ("a_x", "a_z"), ("beta_x", "beta_z"))
        slots.append(CapSlot(self.conv1d, "weight", "clamp", (n,), ("w_conv",)))
        if self.conv1d.bias is not None:
            slots.append(CapSlot(self.conv1d, "bias", "vector", (n,), ("beta_conv",)))
        slots += [CapSlot(self.x_proj, "weight", "matrix", (r, self.d_state, self.d_state), ("a_dt", "a_B", "a_C")),
                  CapSlot(self.dt_proj, "weight", "matrix", (n,), ("a_dtw",)),
                  CapSlot(self.dt_proj, "bias", "softplus", (n,), ("delta_b",), lower=DT_BIAS_LOWER),
                  CapSlot(self, "D", "clamp", (n,), ("D",))]
        return slots + linear_cap_slots(self.out_proj, (self.d_model,), ("a_out",), ("beta_out",))

    def _constants_from_caps(self, caps: Mapping[str, float], seq_len: int) -> Dict[str, float]:
        """The norms of :meth:`_common_constants` bounded by caps on the tensors of :meth:`cap_slots` (float64).

        ``||diag(w_k) W_x|| <= w_conv a_x`` gives ``a <= K' w_conv a_x`` and ``b_c <= K w_conv beta_x + beta_conv``;
        the rows of ``M = dt_proj.weight W_dt`` have norms ``<= a_dtw a_dt``; a stack of row blocks has norm
        ``<= sqrt(sum of their squares)``; the ``delta`` bias lies in ``[DT_BIAS_LOWER, softplus^-1(delta_b)]``.
        Each quantity is raised by the rounding of its few float64 operations.
        """
        cap = lambda key: float(caps.get(key, 0.0))  # noqa: E731  (absent: a bias-free layer)
        K = self.d_conv
        kk = min(K, seq_len)
        up = bounds.rounded_up
        hi = softplus_ceiling(cap("delta_b"))
        return {
            "a": up(kk * cap("w_conv") * cap("a_x"), 2),
            "b_c": up(K * cap("w_conv") * cap("beta_x") + cap("beta_conv"), 3),
            "Wz": cap("a_z"), "bz": cap("beta_z"), "WB": cap("a_B"), "WC": cap("a_C"), "Wout": cap("a_out"),
            "bout": cap("beta_out"), "Dmax": cap("D"), "M_rows_max": up(cap("a_dtw") * cap("a_dt")),
            "b_dt_pos_max": max(hi, 0.0), "Wx": cap("a_x"), "bx": cap("beta_x"),
            "xproj": up(math.sqrt(cap("a_dt") ** 2 + cap("a_B") ** 2 + cap("a_C") ** 2), 5),
            "dt_b_abs_max": max(abs(hi), abs(DT_BIAS_LOWER)), "dt_b_max": hi,
        }

    def _cert_name(self) -> str:
        name = parametrize.type_before_parametrizations(self).__name__  # enforce parametrizes D on the block itself
        return name + ("" if self.layer_idx is None else f"[{self.layer_idx}]")

    def _check_cert_args(self, seq_len: object, r0: object) -> Tuple[int, float | None]:
        L, r = check_cert_args(seq_len, r0, block=parametrize.type_before_parametrizations(self).__name__,  # type: ignore[arg-type]
                               needs_seq_len=True)
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
