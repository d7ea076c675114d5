"""certblocks.zoo: whole backbones built from certified blocks, with a registry.

``create_model(name, **overrides)`` builds a registered model; ``list_models()`` lists them;
``register_model`` registers a new entry point.  Every zoo model has ``.certificate(dtype, ...)``
(a :class:`~certblocks.StackCertificate` over its residual updates, named by module path) and
refuses at construction, with :class:`~certblocks.CertificationError`, a configuration that is not
certified at its depth for its certification dtype (default ``"bf16"``) unless ``certify=False``.  Every zoo model
has ``save_pretrained(dir)`` / ``from_pretrained(dir)`` (safetensors weights and a ``config.json`` with the model's
name and constructor arguments: :mod:`._hub`).

Families: ``gpt2_qknorm_*`` (:mod:`.gpt2`), ``gpt2_dyt_*`` (:mod:`.gpt2_dyt`, certified in pure fp16),
``patchtst_*`` (:mod:`.patchtst`), ``mamba_forecaster_*`` (:mod:`.mamba_forecaster`), ``toto_style`` (:mod:`.toto`)
and, when timm is installed, ``certblocks_vit_*_patch16_224`` and ``certblocks_vit_dyt_*_patch16_224`` registered in
timm too (:mod:`.vit`, :mod:`.vit_dyt`; importing this package imports timm to register them).
"""

from ._base import DEFAULT_CERT_DTYPE, ZooModel
from ._hub import ZooOutput
from ._registry import ModelEntry, create_model, list_models, model_entry, register_model
from .gpt2 import GPT2LoadReport, GPT2QKNorm
from .gpt2_dyt import GPT2DyT
from .mamba_forecaster import MambaForecaster
from .patchtst import PatchTSTForecaster
from .toto import TotoStyle

__all__ = [
    "DEFAULT_CERT_DTYPE",
    "GPT2DyT",
    "GPT2LoadReport",
    "GPT2QKNorm",
    "MambaForecaster",
    "ModelEntry",
    "PatchTSTForecaster",
    "TotoStyle",
    "ZooModel",
    "ZooOutput",
    "create_model",
    "list_models",
    "model_entry",
    "register_model",
]

import importlib.util as _ilu

if _ilu.find_spec("timm") is not None:  # register certblocks_vit_* in timm
    from . import vit as _vit  # noqa: F401
    from . import vit_dyt as _vit_dyt  # noqa: F401
