"""timm registration: ``certblocks_vit_dyt_{tiny,small,base}_patch16_224``, ViTs certified in pure fp16.

Importing :mod:`certblocks.zoo` (with timm installed) registers three models through timm's ``register_model`` /
``generate_default_cfgs``, as :mod:`.vit` does for the QK-norm ViTs::

    import certblocks.zoo, timm
    m = timm.create_model("certblocks_vit_dyt_small_patch16_224", num_classes=10)

Their blocks are :class:`DyTViTBlock`, timm's pre-norm ``Block`` with every normalizer a
:class:`~certblocks.blocks.DyT` (``gamma * tanh(alpha x) + beta``, no ``eps``): ``x + ls1(attn(norm1(x)))`` with
:class:`~certblocks.blocks.QKDyTAttention` (a DyT on each head's queries and keys; timm names ``qkv``, ``q_norm``,
``k_norm``, ``proj``) and ``x + ls2(mlp(norm2(x)))`` (``fc1``, ``fc2``); the final ``norm`` is a DyT too.  Every
update is (0, 0) with a Jacobian bound that does not depend on the radius, so the fp16 budget covers ViT-Ti/S/B at
their default branch gains (timm's LayerScale ``ls1`` / ``ls2``, ``init_values``; docs/dyt.md).

``norm="layer"`` and ``qk_norm=None`` build the same architecture with LayerNorms and plain attention: the Pre-LN
ViT the accuracy comparison trains against (``benchmarks/experiments/dyt_accuracy.py``).

Certificate defaults: ``r0`` from the patch embedding (as :class:`~certblocks.zoo.vit.CertifiedVisionTransformer`),
``seq_len`` = 197 tokens, ``cert_dtype = "fp16"``.
"""

from __future__ import annotations

from functools import partial
from typing import Any, List, Optional, Tuple

import torch
from timm.layers import DropPath
from timm.models import VisionTransformer, build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn

from certblocks._validation import check_choice, check_real
from certblocks.blocks.attention import Attention
from certblocks.blocks.dyt import ALPHA_INIT, DyT, QKDyTAttention, dyt_linear_head
from certblocks.blocks.gain import LayerScale, check_init_values
from certblocks.blocks.mlp import MLP, activation_name
from certblocks.certificate import BlockCertificate

from ._base import normed_linear_head
from ._registry import register_model as zoo_register
from .gpt2_dyt import SHARP, pre_normed_velocities
from .vit import CertifiedVisionTransformer, _cfg, _check_timm_kwargs

__all__ = ["DyTViTBlock", "DyTVisionTransformer"]

#: The branch gains' initial value of the class, ViT-B's (at the class's ``alpha_init`` 0.5, ``qk_alpha_init`` 1): the
#: largest round value that certifies it in pure fp16 at initialization (docs/dyt.md); ViT-Ti and ViT-S register
#: sharper DyTs (``SHARP``: ``alpha_init`` 3, ``qk_alpha_init`` 10) with the largest round gains that certify them.
INIT_VALUES = 1e-2
#: The initial ``alpha`` of the query and key DyTs.
QK_ALPHA_INIT = 1.0
#: The certification dtype of the family.
CERT_DTYPE = "fp16"
_NORMS = ("dyt", "layer")


class DyTViTBlock(nn.Module):
    """timm's pre-norm ViT block with DyT normalizers: ``x + ls1(attn(norm1(x)))`` then ``x + ls2(mlp(norm2(x)))``.

    Takes timm ``Block``'s constructor arguments; ``norm`` (``"dyt"`` or ``"layer"``), ``qk_norm`` (``"dyt"`` or
    ``None``), ``alpha_init`` and ``qk_alpha_init`` choose the normalizers, ``init_values`` the branch gains
    (:class:`~certblocks.LayerScale`; ``None``: no gains).  timm's ``norm_layer``, ``mlp_layer`` and ``qk_norm``
    defaults are ignored here (:class:`DyTVisionTransformer` refuses arguments that would change them).
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = False,
                 proj_bias: bool = True, proj_drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0,
                 act_layer: Any = nn.GELU, init_values: Optional[float] = None, norm: str = "dyt",
                 qk_norm_kind: Optional[str] = "dyt", alpha_init: float = ALPHA_INIT,
                 qk_alpha_init: float = QK_ALPHA_INIT, device=None, dtype=None, **_timm_defaults: Any) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        make = (lambda: DyT(dim, alpha_init, **dd)) if norm == "dyt" else (lambda: nn.LayerNorm(dim, eps=1e-6, **dd))
        attn_kw = dict(causal=False, qkv_bias=bool(qkv_bias), proj_bias=bool(proj_bias), attn_dropout=attn_drop,
                       resid_dropout=proj_drop, naming="timm", **dd)
        self.norm1 = make()
        self.attn = QKDyTAttention(dim, num_heads, qk_alpha_init=qk_alpha_init, **attn_kw) if qk_norm_kind == "dyt" \
            else Attention(dim, num_heads, **attn_kw)
        self.ls1 = LayerScale(dim, init_values, **dd) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = make()
        act = activation_name(act_layer() if isinstance(act_layer, type) else act_layer)
        self.mlp = MLP(dim, int(dim * mlp_ratio), act, bias=bool(proj_bias), dropout=proj_drop, **dd)
        self.ls2 = LayerScale(dim, init_values, **dd) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False
                ) -> torch.Tensor:
        if isinstance(is_causal, bool) and is_causal:  # a torch.fx-traced flag is not a bool: not checked
            raise ValueError("DyTViTBlock is bidirectional; is_causal=True is not supported")
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    def velocities(self, prefix: str) -> List[Tuple[str, nn.Module]]:
        """``(path, velocity)`` of the two updates, each a :class:`~certblocks.blocks.PreNormed` view."""
        return pre_normed_velocities(self, prefix, (("norm1", "attn", "ls1"), ("norm2", "mlp", "ls2")))


class DyTVisionTransformer(CertifiedVisionTransformer):
    """timm ``VisionTransformer`` built from :class:`DyTViTBlock` with a DyT final norm, certified in pure fp16.

    Args:
        init_values: the branch gains' initial value (``None`` or 0: no gains).
        norm: ``"dyt"`` (default) or ``"layer"`` (the Pre-LN baseline: LayerNorms, eps 1e-6 as timm's ViTs).
        qk_norm: ``"dyt"`` (default) or ``None`` (plain attention).
        alpha_init: the initial ``alpha`` of the block and final DyTs.
        qk_alpha_init: the initial ``alpha`` of the query and key DyTs.
        certify: refuse a configuration not certified in ``cert_dtype``.
        cert_dtype: certification dtype (default ``"fp16"``).
        **kwargs: timm ``VisionTransformer``'s (those :class:`~certblocks.zoo.vit.CertifiedVisionTransformer` takes).
    """

    def __init__(self, *args: Any, init_values: Optional[float] = INIT_VALUES, norm: str = "dyt",
                 qk_norm: Any = "dyt", alpha_init: float = ALPHA_INIT, qk_alpha_init: float = QK_ALPHA_INIT,
                 certify: bool = True, cert_dtype: Any = None, **kwargs: Any) -> None:
        if args:
            raise TypeError("DyTVisionTransformer takes keyword arguments only (timm's names)")
        if qk_norm is True:  # timm's flag (its default is False: taken as ours, "dyt")
            qk_norm = "dyt"
        if qk_norm is False:
            qk_norm = None
        _check_timm_kwargs(kwargs)
        if init_values:  # None or 0: no gains
            check_init_values(init_values)
        check_choice("norm", norm, _NORMS)
        check_choice("qk_norm", qk_norm, ("dyt", None))
        alpha_init = check_real("alpha_init", alpha_init, gt=0.0)
        qk_alpha_init = check_real("qk_alpha_init", qk_alpha_init, gt=0.0)
        kwargs["block_fn"] = partial(DyTViTBlock, norm=norm, qk_norm_kind=qk_norm, alpha_init=alpha_init,
                                     qk_alpha_init=qk_alpha_init)
        kwargs["norm_layer"] = partial(DyT, alpha_init=alpha_init) if norm == "dyt" else \
            partial(nn.LayerNorm, eps=1e-6)
        VisionTransformer.__init__(self, init_values=init_values, **kwargs)
        self.init_values = init_values
        self.norm_kind, self.qk_norm_kind = norm, qk_norm
        self.alpha_init, self.qk_alpha_init = alpha_init, qk_alpha_init
        self._certify_or_refuse(certify, CERT_DTYPE if cert_dtype is None else cert_dtype)

    def head_certificate(self) -> Optional[BlockCertificate]:
        """``head(fc_norm(pool(norm(x))))`` with DyT norms (:func:`~certblocks.blocks.dyt.dyt_linear_head`) or
        LayerNorms; ``None`` when a part is none of these."""
        norms = [m for m in (self.norm, self.fc_norm) if not isinstance(m, nn.Identity)]
        head = None if isinstance(self.head, nn.Identity) else self.head
        if (getattr(self, "attn_pool", None) is not None or not norms
                or (head is not None and not isinstance(head, nn.Linear))):
            return None
        if all(isinstance(m, DyT) for m in norms):
            return dyt_linear_head(norms, head, "norm+head")
        if all(isinstance(m, (nn.LayerNorm, nn.RMSNorm)) for m in norms):
            return normed_linear_head(norms, head, "norm+head")
        return None


default_cfgs = generate_default_cfgs({
    "certblocks_vit_dyt_tiny_patch16_224.untrained": _cfg(),
    "certblocks_vit_dyt_small_patch16_224.untrained": _cfg(),
    "certblocks_vit_dyt_base_patch16_224.untrained": _cfg(),
})


def _create_dyt(variant: str, pretrained: bool, **kwargs: Any) -> DyTVisionTransformer:
    if pretrained:
        raise ValueError(f"{variant} has no pretrained weights (certblocks downloads nothing); build it with "
                         "pretrained=False, or convert a timm ViT with certblocks.convert(model, norm='dyt')")
    # features_only=True: timm's FeatureGetterNet over forward_intermediates(), the last 3 blocks by default
    feature_cfg = {"out_indices": kwargs.pop("out_indices", 3), "feature_cls": "getter",
                   **kwargs.pop("feature_cfg", {})}
    return build_model_with_cfg(DyTVisionTransformer, variant, pretrained, feature_cfg=feature_cfg, **kwargs)


@register_model
def certblocks_vit_dyt_tiny_patch16_224(pretrained: bool = False, **kwargs: Any) -> DyTVisionTransformer:
    """ViT-Ti/16 with DyT normalizers and DyT on queries and keys, certified in pure fp16 (certblocks)."""
    args = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3, init_values=5e-3, **SHARP)
    return _create_dyt("certblocks_vit_dyt_tiny_patch16_224", pretrained, **dict(args, **kwargs))


@register_model
def certblocks_vit_dyt_small_patch16_224(pretrained: bool = False, **kwargs: Any) -> DyTVisionTransformer:
    """ViT-S/16 with DyT normalizers and DyT on queries and keys, certified in pure fp16 (certblocks)."""
    args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6, init_values=1e-3, **SHARP)
    return _create_dyt("certblocks_vit_dyt_small_patch16_224", pretrained, **dict(args, **kwargs))


@register_model
def certblocks_vit_dyt_base_patch16_224(pretrained: bool = False, **kwargs: Any) -> DyTVisionTransformer:
    """ViT-B/16 with DyT normalizers and DyT on queries and keys, certified in pure fp16 (certblocks)."""
    args = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12)
    return _create_dyt("certblocks_vit_dyt_base_patch16_224", pretrained, **dict(args, **kwargs))


for _fn in (certblocks_vit_dyt_tiny_patch16_224, certblocks_vit_dyt_small_patch16_224,
            certblocks_vit_dyt_base_patch16_224):
    zoo_register(_fn, family="vit_dyt")


@zoo_register(family="vit_dyt", test=True)
def certblocks_vit_dyt_test(**overrides: Any) -> DyTVisionTransformer:
    """DyT ViT, test size (32 px, patch 8, width 32, 2 blocks, 2 heads, 10 classes)."""
    args = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10, init_values=1e-1)
    return _create_dyt("certblocks_vit_dyt_tiny_patch16_224", False, **dict(args, **overrides))
