"""mamba-ssm on a machine without CUDA: what a CPU run of ``mamba_ssm``'s models needs, in one place.

``mamba_ssm`` imports its compiled CUDA extension ``selective_scan_cuda`` eagerly
(``mamba_ssm.ops.selective_scan_interface``), so ``import mamba_ssm`` fails where it was built without CUDA, even for
its pure-torch parts.  A CPU run of ``MambaLMHeadModel`` then needs three things:

1. a stand-in module named ``selective_scan_cuda`` in ``sys.modules`` before ``mamba_ssm`` is imported
   (:func:`install_selective_scan_stub`; only where the extension is missing);
2. a config without the fused Triton normalizations, which need CUDA: ``rms_norm=False, fused_add_norm=False``
   (:func:`mamba_cpu_config`);
3. for the model's own forward (not a converted one: :func:`certblocks.convert` replaces the mixers), the mixers'
   slow path with mamba-ssm's pure-torch reference scan ``selective_scan_ref`` in place of the CUDA scan
   (:func:`mamba_ssm_on_cpu` switches it on while inside and restores it on exit).

Use::

    from certblocks.testing import mamba_ssm_on_cpu

    with mamba_ssm_on_cpu() as config:
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

        model = MambaLMHeadModel(config(d_model=64, n_layer=2, vocab_size=256))
        logits = model(torch.randint(0, 256, (1, 16))).logits  # the slow path, on CPU

certblocks itself never imports ``mamba_ssm`` nor relies on the stand-in: its ``Mamba`` and ``LinearGrowthMamba``
take mamba-ssm's constructor arguments and state_dict without it.  The test suite installs the stand-in in
``tests/conftest.py`` with :func:`install_selective_scan_stub`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from typing import Any, Callable, Iterator

__all__ = ["install_selective_scan_stub", "is_selective_scan_stub", "mamba_cpu_config", "mamba_ssm_on_cpu"]

_EXTENSION = "selective_scan_cuda"

#: The slow-path switches of ``mamba_ssm.modules.mamba_simple`` (module attribute -> CPU value; ``"ref"``: the
#: reference scan).
_SLOW_PATH = {"selective_scan_fn": "ref", "causal_conv1d_fn": None, "causal_conv1d_update": None,
              "selective_state_update": None}


def is_selective_scan_stub(module: Any) -> bool:
    """``module`` is the stand-in :func:`install_selective_scan_stub` puts in place of the CUDA extension."""
    return bool(getattr(module, "__certblocks_stub__", False))


def install_selective_scan_stub() -> bool:
    """Put a stand-in ``selective_scan_cuda`` module in ``sys.modules`` when mamba-ssm's CUDA extension is missing.

    Call it before the first ``import mamba_ssm``.  The stand-in has no kernels: calling mamba-ssm's CUDA scan still
    fails (:func:`mamba_ssm_on_cpu` uses its reference scan instead); it only lets ``mamba_ssm`` import.

    Returns:
        True when the stand-in is in place (installed now or before), False when the real extension is importable
        or already imported (nothing is changed then).
    """
    have = sys.modules.get(_EXTENSION)
    if have is not None:
        return is_selective_scan_stub(have)
    if importlib.util.find_spec(_EXTENSION) is not None:
        return False
    stub = types.ModuleType(_EXTENSION, "certblocks.testing.mamba_cpu's stand-in for mamba-ssm's CUDA extension "
                                        "(no kernels: mamba_ssm imports on a machine without CUDA)")
    stub.__certblocks_stub__ = True  # type: ignore[attr-defined]
    sys.modules[_EXTENSION] = stub
    return True


def mamba_cpu_config(**kwargs: Any) -> Any:
    """A ``mamba_ssm.models.config_mamba.MambaConfig`` that runs on CPU: ``rms_norm=False, fused_add_norm=False``
    (the fused Triton normalizations need CUDA), the other fields as given.

    Raises:
        ValueError: ``rms_norm`` or ``fused_add_norm`` given True, or a Mamba-2 layer (``ssm_cfg={"layer":
            "Mamba2"}``: its chunked scan is a Triton kernel), which do not run on CPU.
    """
    for key in ("rms_norm", "fused_add_norm"):
        if kwargs.get(key, False) is not False:
            raise ValueError(f"{key} must be False on CPU (mamba-ssm's fused Triton norms need CUDA), got "
                             f"{kwargs[key]!r}")
    layer = (kwargs.get("ssm_cfg") or {}).get("layer", "Mamba1")
    if layer != "Mamba1":
        raise ValueError(f"ssm_cfg layer must be 'Mamba1' on CPU (Mamba-2's chunked scan is a Triton kernel), got "
                         f"{layer!r}")
    install_selective_scan_stub()
    from mamba_ssm.models.config_mamba import MambaConfig

    return MambaConfig(**{**kwargs, "rms_norm": False, "fused_add_norm": False})


@contextlib.contextmanager
def mamba_ssm_on_cpu(*, slow_path: bool = True) -> Iterator[Callable[..., Any]]:
    """mamba-ssm's models runnable on CPU while inside; yields :func:`mamba_cpu_config`.

    Installs the stand-in extension where the real one is missing (:func:`install_selective_scan_stub`) and, with
    ``slow_path``, makes ``mamba_ssm.Mamba`` (mamba-ssm 2.x's ``modules.mamba_simple``) take its pure-torch path:
    the reference scan ``selective_scan_ref`` for the CUDA scan, no ``causal_conv1d`` kernels, the torch decode
    step.  What it changed is restored on exit (the stand-in stays: ``mamba_ssm`` keeps its import).

    Raises:
        ModuleNotFoundError: mamba-ssm is not installed.
    """
    install_selective_scan_stub()
    saved = {}
    ms = None
    if slow_path:
        import mamba_ssm.modules.mamba_simple as ms  # type: ignore[no-redef]  # None without the slow path
        from mamba_ssm.ops.selective_scan_interface import selective_scan_ref

        for name, value in _SLOW_PATH.items():
            if hasattr(ms, name):
                saved[name] = getattr(ms, name)
                setattr(ms, name, selective_scan_ref if value == "ref" else value)
    try:
        yield mamba_cpu_config
    finally:
        for name, value in saved.items():
            setattr(ms, name, value)
