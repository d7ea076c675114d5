"""Token-wise feed-forward velocities: :class:`MLP` ((1, 0)) and :class:`GatedMLP` ((1, 1), or (2, 1) as SwiGLU).

Both act on each token separately, so the per-token norm ``||X|| = max_i ||x_i||_2`` of a
sequence reduces to the Euclidean norm of one token and the Jacobian's induced norm to the
largest spectral norm of a token's Jacobian.  Certificates bound the block with dropout
inactive (``eval()`` or ``p = 0``).

Names: ``fc1`` / ``fc2`` (timm ``Mlp`` / ``GluMlp`` and Toto's feed-forward), so those
state_dicts load by name; nanoGPT's ``c_fc`` / ``c_proj``, timm ``SwiGLU``'s split
``fc1_g`` / ``fc1_x`` and LLaMA's ``gate_proj`` / ``up_proj`` / ``down_proj`` are mapped by
``from_module``.

:class:`GatedMLP` layout (Toto 2.0, timm ``GluMlp`` with ``gate_last=True``): ``fc1`` maps
``dim -> 2 * hidden``; the FIRST half is the value ``a = W_g x + b_g``, the SECOND half the
gate's pre-activation ``u = W_u x + b_u``; ``v(x) = fc2(a * gate(u))``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Tuple, overload

import torch
import torch.nn.functional as F
from torch import nn

from .. import bounds
from .._validation import check_bool, check_cert_args, check_choice, check_finite, check_input, check_int, check_prob
from ..certificate import BlockCertificate
from ..exponents import Exponents
from ..fixes import Lever
from ..protocol import CapSlot, linear_cap_slots

__all__ = ["MLP", "GatedMLP", "activation_name"]

_ACTS = ("gelu", "gelu_tanh", "relu", "silu")
_GATES = ("sigmoid", "silu")


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    return F.silu(x)


@overload
def _f64(t: torch.Tensor) -> torch.Tensor: ...


@overload
def _f64(t: None) -> None: ...


def _f64(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().to(device="cpu", dtype=torch.float64)


@dataclass(frozen=True)
class MLPNorms:
    """The norms an :class:`MLP` certificate reads (upper bounds).

    Attributes:
        w1, w2: ``||W1||``, ``||W2||``.
        b1, b2: ``||b1||``, ``||b2||``.
        c: ``sup ||W2 diag(r) W1||`` over the activation's ratio range (at most ``max|r| w2 w1``).
        l0: ``sup ||W2 diag(d) W1||`` over its derivative range (at most ``Lip(phi) w2 w1``).
    """

    w1: float
    w2: float
    b1: float
    b2: float
    c: float
    l0: float


@dataclass(frozen=True)
class GatedNorms:
    """The norms a sigmoid-gated :class:`GatedMLP` certificate reads (upper bounds).

    Attributes:
        w2, wg, wu: ``||W2||``, ``||W_g||``, ``||W_u||``.
        rg: ``||W_g||_{2->inf}`` (largest row norm; at most ``wg``).
        bg, bu, b2: Euclidean norms of the biases.
        bg_inf: ``||b_g||_inf`` (at most ``bg``).
        c: ``sup ||W2 diag(s) W_g||`` over ``0 <= s <= 1`` (at most ``w2 wg``).
    """

    w2: float
    wg: float
    wu: float
    rg: float
    bg: float
    bu: float
    b2: float
    bg_inf: float
    c: float


def activation_name(mod: nn.Module) -> str:
    """Name of an activation module (``nn.GELU``, ``nn.SiLU``, ``nn.ReLU``, ``nn.Sigmoid``, HF activations)."""
    if isinstance(mod, nn.GELU):
        return "gelu_tanh" if mod.approximate == "tanh" else "gelu"
    if isinstance(mod, nn.SiLU):
        return "silu"
    if isinstance(mod, nn.ReLU):
        return "relu"
    if isinstance(mod, nn.Sigmoid):
        return "sigmoid"
    name = type(mod).__name__.lower()
    for key, act in (("silu", "silu"), ("swish", "silu"), ("sigmoid", "sigmoid"), ("newgelu", "gelu_tanh"),
                     ("gelutanh", "gelu_tanh"), ("pytorchgelutanh", "gelu_tanh"), ("gelu", "gelu"), ("relu", "relu")):
        if key in name:
            return act
    raise ValueError(f"unsupported activation module {type(mod).__name__}")


class MLP(nn.Module):
    """Two-layer perceptron ``fc2(act(fc1(x)))`` without normalization: exponents (1, 0).

    Args:
        dim: input and output width.
        hidden_dim: hidden width.
        act: ``"gelu"`` (default), ``"gelu_tanh"``, ``"relu"`` or ``"silu"``.
        bias: biases of both layers.
        dropout: dropout after the activation (training only; the certificate is for inference).
        device, dtype: as for torch layers.

    Certificate: with ``phi(z) = z g(z)``, ``0 <= g <= 1`` for all four activations,
    ``c = (||W2 W1|| + ||W2|| ||W1||) / 2``, ``b = ||W2|| ||b1|| + ||b2||``; the Jacobian
    ``W2 diag(phi') W1`` with ``phi'`` in ``[lo, hi]`` gives
    ``l0 = min(|m| ||W2 W1|| + h ||W2|| ||W1||, Lip(phi) ||W2|| ||W1||)``, ``l1 = 0``.
    """

    exponents: ClassVar[Exponents] = Exponents(1, 0)

    def __init__(self, dim: int, hidden_dim: int, act: str = "gelu", *, bias: bool = True, dropout: float = 0.0,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.dim = check_int("dim", dim)
        self.hidden_dim = check_int("hidden_dim", hidden_dim)
        self.act = check_choice("act", act, _ACTS)
        check_bool("bias", bias)
        dd = {"device": device, "dtype": dtype}
        self.fc1 = nn.Linear(dim, hidden_dim, bias=bias, **dd)
        self.fc2 = nn.Linear(hidden_dim, dim, bias=bias, **dd)
        self.dropout = nn.Dropout(check_prob("dropout", dropout))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden_dim={self.hidden_dim}, act={self.act!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., dim) -> (..., dim)``."""
        if not torch.jit.is_scripting():
            check_input(x, self.dim, self.fc1.weight)
        return self.fc2(self.dropout(_act(self.act, self.fc1(x))))

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Plain twin of :meth:`forward` (explicit formulas, no dropout)."""
        check_input(x, self.dim, self.fc1.weight)
        h = x @ self.fc1.weight.T
        if self.fc1.bias is not None:
            h = h + self.fc1.bias
        if self.act == "gelu":
            h = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
        elif self.act == "gelu_tanh":
            h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h**3)))
        elif self.act == "relu":
            h = h.clamp_min(0)
        else:
            h = h * torch.sigmoid(h)
        y = h @ self.fc2.weight.T
        return y if self.fc2.bias is None else y + self.fc2.bias

    # -- certificate ----------------------------------------------------------------------------------------
    def certificate(self, *, seq_len: Optional[int] = None, r0: Optional[float] = None) -> BlockCertificate:
        """Certificate from the current weights (token-wise: independent of ``seq_len``; ``r0`` unused)."""
        check_cert_args(seq_len, r0)
        check_finite(self)
        w1, w2 = _f64(self.fc1.weight), _f64(self.fc2.weight)
        n1, n2 = bounds.op_norm(self.fc1.weight), bounds.op_norm(self.fc2.weight)
        n21 = bounds.product_norm(w2, w1)
        act = bounds.activation(self.act)
        assert act.ratio is not None
        return self._certificate(MLPNorms(
            w1=n1, w2=n2, b1=bounds.vec_norm(self.fc1.bias), b2=bounds.vec_norm(self.fc2.bias),
            c=bounds.sandwich_norm(w2, w1, *act.ratio, a_norm=n2, b_norm=n1, ab_norm=n21),
            l0=bounds.sandwich_norm(w2, w1, *act.derivative, a_norm=n2, b_norm=n1, ab_norm=n21)))

    def levers(self) -> List[Lever]:
        """None: no parameter of this block scales its certificate in closed form (a branch gain is
        :class:`~certblocks.blocks.ScaledBranch`'s)."""
        return []

    def cap_slots(self) -> List[CapSlot]:
        """``fc1`` (keys ``a1``, ``beta1``) and ``fc2`` (``a2``, ``beta2``)."""
        return linear_cap_slots(self.fc1, (self.hidden_dim,), ("a1",), ("beta1",)) + \
            linear_cap_slots(self.fc2, (self.dim,), ("a2",), ("beta2",))

    def certificate_from_caps(self, caps: Mapping[str, float], *, seq_len: Optional[int] = None) -> BlockCertificate:
        """The certificate that holds while ``||W1|| <= a1``, ``||W2|| <= a2``, ``||b_i|| <= beta_i``."""
        act = bounds.activation(self.act)
        assert act.ratio is not None
        a1, a2 = caps["a1"], caps["a2"]
        return self._certificate(MLPNorms(w1=a1, w2=a2, b1=caps.get("beta1", 0.0), b2=caps.get("beta2", 0.0),
                                          c=max(map(abs, act.ratio)) * a2 * a1, l0=act.lipschitz * a2 * a1))

    def _certificate(self, n: MLPNorms) -> BlockCertificate:
        """The one formula behind :meth:`certificate` and :meth:`certificate_from_caps`."""
        b = n.w2 * n.b1 + n.b2
        # intermediates: h = W1 x + b1 and |act(h)| <= |h| entrywise (GELU, ReLU, SiLU); then the output
        peak = bounds.fold_peak([{1.0: n.w1, 0.0: n.b1}, {1.0: n.c, 0.0: b}], "hidden pre-activation W1 x + b1")
        e = type(self).exponents
        return BlockCertificate(e.q, e.sigma, c=n.c, b=b, l1=0.0, l0=n.l0, name="MLP",
                                culprit=f"Lipschitz activation {self.act}", peak=peak)

    @classmethod
    def from_module(cls, src: nn.Module, **overrides: Any) -> MLP:
        """Build from timm ``Mlp`` (``fc1``, ``act``, ``fc2``) or nanoGPT ``MLP`` (``c_fc``, ``gelu``, ``c_proj``).

        The converted block computes the same function.  ``overrides`` replace constructor arguments.
        """
        if not isinstance(src, nn.Module):
            raise TypeError(f"src must be an nn.Module, got {type(src).__name__}")
        if hasattr(src, "c_fc") and hasattr(src, "c_proj"):  # nanoGPT
            l1, l2 = src.c_fc, src.c_proj
            act_mod = getattr(src, "gelu", None) or getattr(src, "act", None)
            drop = getattr(getattr(src, "dropout", None), "p", 0.0)
        elif hasattr(src, "fc1") and hasattr(src, "fc2") and hasattr(src, "act"):  # timm Mlp
            l1, l2, act_mod = src.fc1, src.fc2, src.act
            if not isinstance(getattr(src, "norm", nn.Identity()), nn.Identity):
                raise ValueError("timm Mlp with a hidden norm layer is not supported")
            drop = getattr(getattr(src, "drop1", None), "p", 0.0)
        else:
            raise TypeError(f"cannot convert {type(src).__name__}: expected timm Mlp (fc1, act, fc2) or nanoGPT MLP "
                            "(c_fc, gelu, c_proj)")
        if not isinstance(l1, nn.Linear) or not isinstance(l2, nn.Linear):
            raise TypeError("the source's layers must be nn.Linear")
        if act_mod is None:
            raise ValueError(f"{type(src).__name__}: activation module not found")
        act = activation_name(act_mod)
        if (l1.bias is None) != (l2.bias is None):
            raise ValueError("the source's two layers must both have a bias or both have none")
        cfg: Dict[str, Any] = dict(dim=l1.in_features, hidden_dim=l1.out_features, act=act, bias=l1.bias is not None,
                                   dropout=float(drop), device=l1.weight.device, dtype=l1.weight.dtype)
        cfg.update(overrides)
        block = cls(**cfg)
        sd = {"fc1.weight": l1.weight, "fc2.weight": l2.weight}
        if l1.bias is not None:
            sd.update({"fc1.bias": l1.bias, "fc2.bias": l2.bias})
        block.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=True)
        return block


class GatedMLP(nn.Module):
    """Gated linear unit ``fc2((W_g x) * gate(W_u x))`` in Toto 2.0's layout.

    ``gate="sigmoid"`` (default) is the certified block, exponents (1, 1); ``gate="silu"`` is
    SwiGLU, exponents (2, 1), kept for comparison.

    Args:
        dim: input and output width.
        hidden_dim: hidden width (default ``4 * dim``); ``fc1`` maps ``dim -> 2 * hidden_dim``.
        gate: ``"sigmoid"`` or ``"silu"``.
        bias: biases of ``fc1`` and ``fc2``.
        device, dtype: as for torch layers.

    Certificate (``a = W_g x + b_g``, ``u = W_u x + b_u``, ``r_g = ||W_g||_{2->inf}``):

    * sigmoid: ``c = (||W2 W_g|| + ||W2|| ||W_g||) / 2``, ``b = ||W2|| ||b_g|| + ||b2||``;
      ``L(R) <= c + ||W2|| ||W_u|| (r_g R + ||b_g||_inf) / 4``.
    * silu: ``||v|| <= ||W2|| ||a||_inf ||u||`` (``|silu(u)| <= |u|``), a quadratic in ``||x||``
      written as ``c ||x||^2 + b`` with ``||x|| <= (1 + ||x||^2) / 2``;
      ``L(R) <= ||W2|| (||W_g|| ||u||_inf + 1.0999 ||W_u|| ||a||_inf)``.
    """

    exponents: Exponents = Exponents(1, 1)  # (2, 1) for gate="silu": set per instance

    def __init__(self, dim: int, hidden_dim: Optional[int] = None, *, gate: str = "sigmoid", bias: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.dim = check_int("dim", dim)
        self.hidden_dim = 4 * dim if hidden_dim is None else check_int("hidden_dim", hidden_dim)
        self.gate = check_choice("gate", gate, _GATES)
        check_bool("bias", bias)
        self.exponents = Exponents(1, 1) if gate == "sigmoid" else Exponents(2, 1)
        dd = {"device": device, "dtype": dtype}
        self.fc1 = nn.Linear(dim, 2 * self.hidden_dim, bias=bias, **dd)
        self.fc2 = nn.Linear(self.hidden_dim, dim, bias=bias, **dd)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden_dim={self.hidden_dim}, gate={self.gate!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., dim) -> (..., dim)``."""
        check_input(x, self.dim, self.fc1.weight)
        a, u = self.fc1(x).chunk(2, dim=-1)
        g = torch.sigmoid(u) if self.gate == "sigmoid" else F.silu(u)
        return self.fc2(a * g)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Plain twin of :meth:`forward` with explicit weight slices."""
        check_input(x, self.dim, self.fc1.weight)
        h = self.hidden_dim
        w, bb = self.fc1.weight, self.fc1.bias
        a = x @ w[:h].T + (0 if bb is None else bb[:h])
        u = x @ w[h:].T + (0 if bb is None else bb[h:])
        g = 1.0 / (1.0 + torch.exp(-u))
        if self.gate == "silu":
            g = u * g
        y = (a * g) @ self.fc2.weight.T
        return y if self.fc2.bias is None else y + self.fc2.bias

    # -- certificate ----------------------------------------------------------------------------------------
    def _split(self) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor],
                              torch.Tensor, Optional[torch.Tensor]]:
        h = self.hidden_dim
        w1, b1 = _f64(self.fc1.weight), _f64(self.fc1.bias)
        assert w1 is not None
        wg, wu = w1[:h], w1[h:]
        bg = None if b1 is None else b1[:h]
        bu = None if b1 is None else b1[h:]
        w2 = _f64(self.fc2.weight)
        assert w2 is not None
        return wg, wu, bg, bu, w2, _f64(self.fc2.bias)

    def certificate(self, *, seq_len: Optional[int] = None, r0: Optional[float] = None) -> BlockCertificate:
        """Certificate from the current weights (token-wise: independent of ``seq_len``; ``r0`` unused)."""
        check_cert_args(seq_len, r0)
        check_finite(self)
        wg, wu, bg, bu, w2, b2 = self._split()
        n2, ng, nu = bounds.op_norm(self.fc2.weight), bounds.op_norm(wg), bounds.op_norm(wu)
        if self.gate == "silu":
            return self._swiglu_certificate(wg, wu, bg, bu, n2, ng, nu, bounds.vec_norm(b2))
        return self._certificate(GatedNorms(
            w2=n2, wg=ng, wu=nu, rg=bounds.row_norm_max(wg), bg=bounds.vec_norm(bg), bu=bounds.vec_norm(bu),
            b2=bounds.vec_norm(b2), bg_inf=bounds.vec_inf_norm(bg),
            c=bounds.sandwich_norm(w2, wg, 0.0, 1.0, a_norm=n2, b_norm=ng)))

    def levers(self) -> List[Lever]:
        """None: no parameter of this block scales its certificate in closed form (a branch gain is
        :class:`~certblocks.blocks.ScaledBranch`'s)."""
        return []

    def cap_slots(self) -> List[CapSlot]:
        """``fc1`` in two row blocks (value ``ag``/``betag``, gate ``au``/``betau``) and ``fc2`` (``a2``, ``beta2``)."""
        h = self.hidden_dim
        return linear_cap_slots(self.fc1, (h, h), ("ag", "au"), ("betag", "betau")) + \
            linear_cap_slots(self.fc2, (self.dim,), ("a2",), ("beta2",))

    def certificate_from_caps(self, caps: Mapping[str, float], *, seq_len: Optional[int] = None) -> BlockCertificate:
        """The certificate that holds while every part of ``fc1`` and ``fc2`` is within its cap (either gate).

        A row norm of a part is at most its spectral norm, an entry of a bias at most its Euclidean norm.  For
        ``gate="silu"`` this is the ``(2, 1)`` certificate: a stack of SwiGLU updates is certified for a finite
        depth only (its radius grows doubly exponentially), which :func:`certblocks.enforce` plans for.
        """
        a2, ag, au, betag = caps["a2"], caps["ag"], caps["au"], caps.get("betag", 0.0)
        betau, beta2 = caps.get("betau", 0.0), caps.get("beta2", 0.0)
        if self.gate == "silu":
            return self._swiglu_from_norms(a2, ag, au, ag, au, betag, betau, betag, betau, beta2)
        return self._certificate(GatedNorms(w2=a2, wg=ag, wu=au, rg=ag, bg=betag, bu=betau,
                                            b2=beta2, bg_inf=betag, c=a2 * ag))

    def _certificate(self, n: GatedNorms) -> BlockCertificate:
        """The sigmoid-gated certificate from its norms: the formula behind both certificate methods.

        ``sigmoid(u)`` in ``[0, 1]``: ``v = W2 diag(s) (W_g x + b_g) + b2``; the Jacobian is
        ``W2 diag(s) W_g + W2 diag(a s') W_u`` with ``|a_k s'| <= (r_g R + ||b_g||_inf) / 4``.
        """
        quarter = bounds.SIGMOID_DERIVATIVE_MAX
        b = n.w2 * n.bg + n.b2
        l1 = n.w2 * n.wu * n.rg * quarter
        l0 = n.c + n.w2 * n.wu * n.bg_inf * quarter
        # intermediates: both halves of fc1 (a = W_g x + b_g, u = W_u x + b_u), 0 < sigmoid < 1, the output
        polys = [{1.0: math.hypot(n.wg, n.wu), 0.0: math.hypot(n.bg, n.bu)}, {0.0: 1.0}, {1.0: n.c, 0.0: b}]
        e = self.exponents
        return BlockCertificate(e.q, e.sigma, c=n.c, b=b, l1=l1, l0=l0, name="GatedMLP(sigmoid)",
                                culprit="sigmoid gate: Jacobian ~ ||W_g x|| sigmoid'(W_u x)",
                                peak=bounds.fold_peak(polys, "gate input W_g x, W_u x"))

    def _swiglu_certificate(self, wg: torch.Tensor, wu: torch.Tensor, bg: Optional[torch.Tensor],
                            bu: Optional[torch.Tensor], n2: float, ng: float, nu: float,
                            nb2: float) -> BlockCertificate:
        """SwiGLU ``(2, 1)``: ``||a * silu(u)|| <= min(||a||_inf ||u||_2, ||a||_2 ||u||_inf)``, each factor affine."""
        return self._swiglu_from_norms(n2, ng, nu, bounds.row_norm_max(wg), bounds.row_norm_max(wu),
                                       bounds.vec_norm(bg), bounds.vec_norm(bu), bounds.vec_inf_norm(bg),
                                       bounds.vec_inf_norm(bu), nb2)

    def _swiglu_from_norms(self, n2: float, ng: float, nu: float, rg: float, ru: float, bg2: float, bu2: float,
                           bgi: float, bui: float, nb2: float) -> BlockCertificate:
        """The SwiGLU certificate from its norms (``r``: largest row norm, ``b*2``/``b*i``: Euclidean / largest entry
        of a bias): the formula behind :meth:`certificate` and :meth:`certificate_from_caps`."""
        best = product = None
        for (p1, q1), (p2, q2) in (((rg, bgi), (nu, bu2)), ((ng, bg2), (ru, bui))):
            quad, lin, const = p1 * p2, p1 * q2 + q1 * p2, q1 * q2
            cand = (n2 * (quad + 0.5 * lin), n2 * (0.5 * lin + const) + nb2)  # ||x|| <= (1 + ||x||^2) / 2
            if best is None or cand[0] + cand[1] < best[0] + best[1]:
                best, product = cand, {2.0: quad, 1.0: lin, 0.0: const}
        assert best is not None and product is not None
        c, b = best
        lip = bounds.lipschitz("silu")
        polys = [{1.0: math.hypot(ng, nu), 0.0: math.hypot(bg2, bu2)}, {0.0: 1.0}, product, {2.0: c, 0.0: b}]
        return BlockCertificate(2, 1, c=c, b=b, l1=n2 * (ng * ru + lip * nu * rg), l0=n2 * (ng * bui + lip * nu * bgi),
                                name="GatedMLP(silu)", culprit="SwiGLU product (W_g x) * SiLU(W_u x): quadratic growth",
                                fix="use gate='sigmoid' (q 2 -> 1)",
                                peak=bounds.fold_peak(polys, "gated product (W_g x) * SiLU(W_u x)"))

    @classmethod
    def from_module(cls, src: nn.Module, *, gate: Optional[str] = None, **overrides: Any) -> GatedMLP:
        """Build from timm ``SwiGLU`` / ``SwiGLUPacked`` / ``GluMlp``, a Toto-style ``fc1``/``fc2`` GLU, or LLaMA MLP.

        Args:
            src: the module to replace.  Recognized layouts: timm ``SwiGLU`` (``fc1_g``, ``fc1_x``, ``fc2``),
                timm ``GluMlp`` / ``SwiGLUPacked`` (fused ``fc1``, ``gate_last``), a Toto-style module with fused
                ``fc1`` (value half first, gate half last) and ``fc2`` plus an ``act`` module (SiLU when absent),
                LLaMA-style ``gate_proj``, ``up_proj``, ``down_proj`` with ``act_fn`` (Gemma's GELU gate too) and
                Phi-3's fused ``gate_up_proj`` (gate half first), ``down_proj``.
            gate: ``None`` keeps the source's gate activation (the block then computes the same function; SiLU or
                sigmoid only); ``"sigmoid"`` swaps the source's gate (SiLU, GELU) for the certified sigmoid gate,
                same weights (the function changes).
            overrides: other constructor arguments.
        """
        if not isinstance(src, nn.Module):
            raise TypeError(f"src must be an nn.Module, got {type(src).__name__}")
        mod: Any = src  # a foreign module, read by duck typing
        if hasattr(src, "gate_proj") and hasattr(src, "up_proj") and hasattr(src, "down_proj"):  # LLaMA
            value, gate_l, out = mod.up_proj, mod.gate_proj, mod.down_proj
            act = activation_name(mod.act_fn) if hasattr(src, "act_fn") else "silu"
            wv, bv, wg_, bg_ = value.weight, value.bias, gate_l.weight, gate_l.bias
        elif hasattr(src, "gate_up_proj") and hasattr(src, "down_proj"):  # Phi-3: fused, gate half first
            out, w, bb = mod.down_proj, mod.gate_up_proj.weight, mod.gate_up_proj.bias
            act = activation_name(mod.activation_fn) if hasattr(src, "activation_fn") else "silu"
            h = w.shape[0] // 2
            if w.shape[0] != 2 * h or h != out.in_features:
                raise ValueError(f"gate_up_proj must map to 2 * down_proj.in_features, got {w.shape[0]} and "
                                 f"{out.in_features}")
            wg_, wv = w[:h], w[h:]
            bg_, bv = (None, None) if bb is None else (bb[:h], bb[h:])
        elif hasattr(src, "fc1_g") and hasattr(src, "fc1_x") and hasattr(src, "fc2"):  # timm SwiGLU
            _no_norm(src)
            value, gate_l, out = mod.fc1_x, mod.fc1_g, mod.fc2
            act = activation_name(mod.act)
            wv, bv, wg_, bg_ = value.weight, value.bias, gate_l.weight, gate_l.bias
        elif hasattr(src, "fc1") and hasattr(src, "fc2"):  # timm GluMlp / SwiGLUPacked / Toto-style
            _no_norm(src)
            if not isinstance(mod.fc1, nn.Linear):
                raise TypeError("fc1 must be an nn.Linear (timm GluMlp with use_conv=True is not supported)")
            out = mod.fc2
            act = activation_name(mod.act) if hasattr(src, "act") else "silu"
            w, bb = mod.fc1.weight, mod.fc1.bias
            h = w.shape[0] // 2
            if w.shape[0] != 2 * h or h != out.in_features:
                raise ValueError(f"fc1 must map to 2 * fc2.in_features, got {w.shape[0]} and {out.in_features}")
            first, last = (w[:h], w[h:]), (None if bb is None else bb[:h], None if bb is None else bb[h:])
            if getattr(mod, "gate_last", True):
                (wv, wg_), (bv, bg_) = first, last
            else:
                (wg_, wv), (bg_, bv) = first, last
        else:
            raise TypeError(f"cannot convert {type(src).__name__}: expected timm SwiGLU/SwiGLUPacked/GluMlp, a "
                            "Toto-style fc1/fc2 GLU or a LLaMA MLP (gate_proj, up_proj, down_proj)")
        if act not in _GATES and gate is None:  # a replaced gate (gate=...) may be any activation (Gemma's GeGLU)
            raise ValueError(f"gate activation {act!r} of {type(src).__name__} is not supported (allowed: {_GATES}); "
                             "pass gate='sigmoid' to replace it")
        if (bv is None) != (out.bias is None):
            raise ValueError("GatedMLP has one bias flag: fc1 and fc2 of the source must both have a bias or none")
        gate = act if gate is None else check_choice("gate", gate, _GATES)
        cfg: Dict[str, Any] = dict(dim=out.out_features, hidden_dim=out.in_features, gate=gate, bias=bv is not None,
                                   device=out.weight.device, dtype=out.weight.dtype)
        cfg.update(overrides)
        block = cls(**cfg)
        sd = {"fc1.weight": torch.cat([wv, wg_], 0), "fc2.weight": out.weight}
        if bv is not None:
            sd.update({"fc1.bias": torch.cat([bv, bg_], 0), "fc2.bias": out.bias})
        block.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=True)
        return block


def _no_norm(src: nn.Module) -> None:
    if not isinstance(getattr(src, "norm", nn.Identity()), nn.Identity):
        raise ValueError(f"{type(src).__name__} with a hidden norm layer is not supported")
