"""Branch gains: :class:`LayerScale` (a learnable per-channel ``gamma``) and :class:`ScaledBranch` (its certificate).

A residual update ``X + gamma * v(X)`` with a per-channel gain ``gamma`` (CaiT's and timm's ``LayerScale``,
``init_values``) is the paper's residual step ``dt`` made learnable and per channel.  In the per-token norm
``||gamma * y|| <= ||gamma||_inf ||y||``, so with ``g = max_i |gamma_i|`` the update's certificate is the
branch's with every coefficient times ``g``::

    c -> g c,  b -> g b,  l1 -> g l1,  l0 -> g l0    (exponents unchanged)

and the peak (every entry the branch computes, then ``gamma * v``) is the branch's, times ``g`` when
``g > 1``.  A small ``init_values`` thus buys depth exactly as a small ``dt`` does: the backward bound of
each update is ``log(1 + g (l0 + l1 R))``, which shrinks with ``g`` (docs/zoo.md, "Certified by default").

:class:`ScaledBranch` is the velocity ``gain(branch(x))`` of an update whose branch and gain are two
children of one block (timm's ``blk.attn`` and ``blk.ls1``): a view built by a model's
``residual_updates()``, not registered in the model, so it adds nothing to the model's ``state_dict``.

:func:`gain_param_groups` gives the gains their own optimizer group.  A gain certified at a small ``init_values``
(5e-3 on the fp16-certified ViT-Ti) moves by about the learning rate per Adam step, so over a short run the branches
stay near zero; trained at 30 times the rate, the digits ViT-Ti went from 80% to 91% (DyT) and from 94% to 96%
(QK-norm) test accuracy in 6 epochs (benchmarks/results/dyt.md).  The certificate is one of the initial weights:
the gains leave it as they grow unless ``certblocks.enforce`` caps them.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import bounds
from .._validation import check_cert_args, check_int, check_real
from ..certificate import BlockCertificate
from ..exponents import Exponents
from ..fixes import Lever
from ..protocol import CapSlot, EnforceableBlock

__all__ = ["LayerScale", "ScaledBranch", "scaled_certificate", "gained_velocities", "gain_param_groups"]


class LayerScale(nn.Module):
    """A learnable per-channel gain ``x -> gamma * x`` over the last dimension (timm's ``LayerScale``).

    Args:
        dim: number of channels.
        init_values: the initial value of every entry of ``gamma`` (finite, > 0).
        device, dtype: as for torch layers.

    The parameter is named ``gamma``, as in timm, so that a timm ViT's ``ls1.gamma`` / ``ls2.gamma`` load.
    """

    def __init__(self, dim: int, init_values: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        check_int("dim", dim)
        self.init_values = check_init_values(init_values)
        self.gamma = nn.Parameter(torch.full((dim,), self.init_values, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma

    def bound(self) -> float:
        """``max_i |gamma_i|``, the gain in the per-token norm (exact)."""
        return bounds.vec_inf_norm(self.gamma)

    def extra_repr(self) -> str:
        return f"dim={self.gamma.shape[0]}, init_values={self.init_values:g}"


def check_init_values(value: Any) -> float:
    """``value`` as a float if it is a finite number > 0, else ``ValueError`` naming ``init_values``."""
    return check_real("init_values", value, gt=0.0, note="the branch gains' initial value; None: no gains")


def scaled_certificate(cert: BlockCertificate, gain: float) -> BlockCertificate:
    """The certificate of ``gamma * v`` for ``v`` certified by ``cert`` and ``max |gamma| <= gain`` (module doc)."""
    g = float(gain)
    if not (g >= 0.0 and g < float("inf")):
        raise ValueError(f"gain must be finite and >= 0, got {gain!r}")

    def up(x: float) -> float:
        return bounds.rounded_up(x * g)

    return cert.with_output_scaled(g, up)


class ScaledBranch(nn.Module):
    """The velocity ``gain(branch(x))``: a certified branch followed by its :class:`LayerScale`.

    Args:
        branch: a certified block (:class:`~certblocks.protocol.CertifiedBlock`).
        gain: its :class:`LayerScale`.
        names: the two modules' attribute names in their block (``("attn", "ls1")``): they name the
            children here, so that a parameter's path reads as in the model.
    """

    def __init__(self, branch: nn.Module, gain: LayerScale, names: tuple = ("branch", "gain")) -> None:
        super().__init__()
        if not isinstance(gain, LayerScale):
            raise TypeError(f"gain must be a LayerScale, got {type(gain).__name__}")
        if not callable(getattr(branch, "certificate", None)):
            raise TypeError(f"branch must be a certified block (with certificate()), got {type(branch).__name__}")
        self.names = (str(names[0]), str(names[1]))
        self.add_module(self.names[0], branch)
        self.add_module(self.names[1], gain)

    @property
    def branch(self) -> Any:  # an nn.Module with the CertifiedBlock methods (no intersection type in typing)
        return getattr(self, self.names[0])

    @property
    def gain(self) -> LayerScale:
        return getattr(self, self.names[1])

    @property
    def exponents(self) -> Exponents:
        """The branch's exponents (a constant gain changes no exponent)."""
        return self.branch.exponents

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.gain(self.branch(x, *args, **kwargs))

    def certificate(self, *, seq_len: Optional[int] = None, r0: Optional[float] = None) -> BlockCertificate:
        """The branch's certificate scaled by ``max |gamma|`` (module docstring)."""
        check_cert_args(seq_len, r0)
        return scaled_certificate(self.branch.certificate(seq_len=seq_len, r0=r0), self.gain.bound())

    def velocity_io(self) -> Tuple[nn.Module, nn.Module]:
        """``(branch, gain)``: the modules a model's forward calls for this update (this view is not called
        itself): the branch receives the state ``X_k``, the gain returns ``v(X_k)``."""
        return self.branch, self.gain

    def gain_bound(self) -> float:
        """``max |gamma|`` of the gain (its certificate's scale)."""
        return self.gain.bound()

    def levers(self) -> List[Lever]:
        """The branch's levers (they scale coefficients, which commutes with the gain) and ``init_values``: the
        certificate at a gain ``v`` is this one scaled by ``v / max |gamma|``."""
        out = list(getattr(self.branch, "levers", lambda: [])())
        g = self.gain.bound()
        if g > 0:
            out.append(Lever("init_values", g, False, lambda cert, v: scaled_certificate(cert, v / g)))
        return out

    def cap_slots(self) -> List[CapSlot]:
        """The branch's slots and the gain (``"gain"``, a clamp of ``gamma``)."""
        branch = self._enforceable()
        return branch.cap_slots() + [CapSlot(self.gain, "gamma", "clamp", (self.gain.gamma.shape[0],), ("gain",))]

    def certificate_from_caps(self, caps: Mapping[str, float], *, seq_len: Optional[int] = None) -> BlockCertificate:
        """The branch's worst case at its caps, scaled by the gain's cap."""
        return scaled_certificate(self._enforceable().certificate_from_caps(caps, seq_len=seq_len), caps["gain"])

    def _enforceable(self) -> EnforceableBlock:
        branch = self.branch
        if not isinstance(branch, EnforceableBlock):
            raise TypeError(f"{type(branch).__name__} has no cap_slots() / certificate_from_caps()")
        return branch


def gained_velocities(block: nn.Module, prefix: str, pairs: tuple = (("attn", "ls1"), ("mlp", "ls2"))) -> List[tuple]:
    """``(path, velocity)`` of a block's updates, each a ``(branch, gain)`` pair of its children: the branch itself,
    or a :class:`ScaledBranch` when its gain is a :class:`LayerScale` (not an identity)."""
    out = []
    for branch, ls in pairs:
        m, gain = getattr(block, branch), getattr(block, ls)
        out.append((f"{prefix}{branch}", ScaledBranch(m, gain, (branch, ls)) if isinstance(gain, LayerScale) else m))
    return out


def gain_param_groups(model: nn.Module, lr: float, *, weight_decay: float = 0.0, gain_lr_scale: float = 30.0,
                      no_decay: Sequence[str] = ()) -> List[dict]:
    """Optimizer parameter groups with every :class:`LayerScale` gain in a group of its own.

    Args:
        model: the model whose trainable parameters are grouped.
        lr: the base learning rate (the groups' ``"lr"``; a ``torch.optim.lr_scheduler`` scales each group's own).
        weight_decay: on the matrices (parameters with 2 or more dimensions) other than the gains; none on the
            vectors (biases, normalizer scales) and none on the gains.
        gain_lr_scale: the gains' learning rate as a multiple of ``lr`` (finite, > 0).
        no_decay: names of matrices kept out of weight decay (a ViT's ``"pos_embed"``, ``"cls_token"``).

    Returns:
        Up to three groups ``{"params", "lr", "weight_decay"}``: the matrices, the other parameters, the gains (at
        ``lr * gain_lr_scale``); empty groups are left out.  Every trainable parameter is in exactly one group.

    Example::

        opt = torch.optim.AdamW(gain_param_groups(model, 1e-3, weight_decay=0.05), lr=1e-3)
    """
    lr = check_real("lr", lr, gt=0.0)
    weight_decay = check_real("weight_decay", weight_decay, ge=0.0)
    gain_lr_scale = check_real("gain_lr_scale", gain_lr_scale, gt=0.0)
    gains = {id(m.gamma) for m in model.modules() if isinstance(m, LayerScale)}
    groups: List[dict] = [{"params": [], "lr": lr, "weight_decay": weight_decay},
                          {"params": [], "lr": lr, "weight_decay": 0.0},
                          {"params": [], "lr": lr * gain_lr_scale, "weight_decay": 0.0}]
    for name, p in model.named_parameters():  # each shared (tied) parameter once
        if p.requires_grad:
            groups[2 if id(p) in gains else 0 if p.ndim >= 2 and name not in no_decay else 1]["params"].append(p)
    return [g for g in groups if g["params"]]
