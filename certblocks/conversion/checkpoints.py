"""Reading converted checkpoints back: :func:`load_converted` rebuilds the converted architecture and loads strictly."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch import nn

from .api import CONFIG_KEY, convert

__all__ = ["load_converted"]


def load_converted(source: Union[str, os.PathLike, nn.Module], checkpoint: Any = None, *,
                   remove_norms: Optional[bool] = None, filter_fn: Optional[Callable[[str, nn.Module], bool]] = None,
                   dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Rebuild a converted model and load its checkpoint strictly: the round trip of :func:`convert`'s checkpoints.

    A converted model's ``state_dict`` has its source's names and layouts (:mod:`certblocks._adapters`), plus the
    tensors the source lacks (QK-norm scales, inserted gains, :data:`certblocks._adapters.MARKER`) and minus the
    norms ``remove_norms`` took out.  To read it back, the source architecture is built and converted the same way,
    then the weights are loaded:

    * ``load_converted(path)``: ``path`` is a directory written by ``save_pretrained`` of a converted Hugging Face
      model; its ``config.json`` names the class (``architectures``) and holds what :func:`convert` did
      (``certblocks_conversion``), so the model is rebuilt from the config, converted as recorded and loaded;
    * ``load_converted(model, checkpoint, remove_norms=..., filter_fn=...)``: ``model`` is a freshly built source
      model of the converted one's architecture (``timm.create_model(name, ...)``, ``mamba_ssm.Mamba(...)``, your
      own); it is converted in place as recorded in its HF config when it has one, else with ``remove_norms`` and
      ``filter_fn`` as given to :func:`convert`, and ``checkpoint`` is loaded: a state dict, a ``.safetensors`` file,
      a ``torch.save`` file (read with ``weights_only=True``) or a directory of ``model.safetensors`` (sharded or
      not) or ``pytorch_model.bin``.

    Loading is strict: a missing or unexpected tensor raises (tied weights that ``save_pretrained`` leaves out are
    not missing).  The source's own class loading a converted checkpoint is never silently another function: with
    ``load_state_dict(strict=True)`` it raises on the tensors it lacks (HF's ``from_pretrained``, which is not
    strict, lists them as unexpected keys in its load report and warning).

    Args:
        source: an HF directory, or a freshly built source model.
        checkpoint: the weights (with a model ``source``; ignored for a directory, whose weights are read).
        remove_norms: as given to :func:`convert` (default: as recorded, else False).
        filter_fn: as given to :func:`convert` (default: as recorded, else every known module).
        dtype: the dtype of the loaded model (default: the checkpoint's, when all its floating tensors share one).

    Returns:
        The converted model with the checkpoint's weights (in eval mode when built from a directory).

    Raises:
        ValueError: a checkpoint that does not match the converted architecture (missing, unexpected or misshapen
            tensors), a recorded module that no registered converter converts, a directory without a config, or
            one whose config records no conversion (a checkpoint of the unconverted model).
        TypeError: arguments of the wrong type.
    """
    if isinstance(source, nn.Module):
        model, state = source, _read_checkpoint(checkpoint)
    elif isinstance(source, (str, os.PathLike)):
        model, state = _build_from_config(os.fspath(source)), _read_checkpoint(os.fspath(source))
    else:
        raise TypeError(f"source must be a directory or an nn.Module, got {type(source).__name__}")
    record = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if not isinstance(record, dict) and not isinstance(source, nn.Module):
        raise ValueError(f"{os.fspath(source)!r}: its config.json records no conversion ({CONFIG_KEY!r}), so it is "
                         f"not a checkpoint of a converted model: load it with {type(model).__name__}.from_pretrained "
                         "(then certblocks.convert it), or pass a freshly built source model: "
                         "load_converted(model, checkpoint)")
    if isinstance(record, dict):
        wanted = set(record.get("converted", {})) | set(record.get("norms", []))
        rep = convert(model, inplace=True, remove_norms=bool(record.get("norms")) if remove_norms is None
                      else remove_norms, norm=record.get("norm"),
                      filter_fn=filter_fn or (lambda path, m: path in wanted))
        done = {s.path for s in rep.swaps}
        lost = sorted(wanted - done)
        if lost:
            raise ValueError(f"the checkpoint was converted at {lost}, which no registered converter converts now "
                             "(register the converters used when it was saved)")
    else:
        convert(model, inplace=True, remove_norms=bool(remove_norms), filter_fn=filter_fn)
    floating = {t.dtype for t in state.values() if isinstance(t, torch.Tensor) and t.is_floating_point()}
    target = dtype if dtype is not None else (floating.pop() if len(floating) == 1 else None)
    if target is not None:
        model.to(target)
    _load_strict(model, state)
    return model


def _read_checkpoint(checkpoint: Any) -> Dict[str, torch.Tensor]:
    """A state dict from a mapping, a file or an HF-style directory (module docstring of :func:`load_converted`)."""
    import json
    from collections.abc import Mapping

    if isinstance(checkpoint, Mapping):
        return dict(checkpoint)
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"checkpoint must be a state dict, a file or a directory, got {type(checkpoint).__name__}")
    path = os.fspath(checkpoint)
    if os.path.isdir(path):
        for index, single in (("model.safetensors.index.json", "model.safetensors"),
                              ("pytorch_model.bin.index.json", "pytorch_model.bin")):
            if os.path.isfile(os.path.join(path, index)):
                with open(os.path.join(path, index)) as f:
                    files = sorted(set(json.load(f)["weight_map"].values()))
                out: Dict[str, torch.Tensor] = {}
                for name in files:
                    out.update(_read_checkpoint(os.path.join(path, name)))
                return out
            if os.path.isfile(os.path.join(path, single)):
                return _read_checkpoint(os.path.join(path, single))
        raise ValueError(f"checkpoint directory {path!r} has no model.safetensors or pytorch_model.bin")
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path!r}: no such file or directory")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {path!r} holds a {type(state).__name__}, not a state dict")
    return state


def _build_from_config(path: str) -> nn.Module:
    """The HF model class named in ``path``'s ``config.json``, built from that config (random weights)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path!r} has no config.json: pass a freshly built source model and the checkpoint, "
                         "load_converted(model, checkpoint)")
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        raise ValueError(f"{path}/config.json names no transformers class in 'architectures' ({archs}); pass a "
                         "freshly built source model: load_converted(model, checkpoint)")
    return cls(config).eval()


def _load_strict(model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """``model.load_state_dict(state)``; a tensor missing from ``state`` is allowed only when it is tied to one
    present (``save_pretrained`` saves a tied weight once)."""
    result = model.load_state_dict(state, strict=False)
    groups: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    tied = {name: names for names in groups.values() for name in names if len(names) > 1}
    missing = [k for k in result.missing_keys if not any(t in state for t in tied.get(k, ()))]
    if missing or result.unexpected_keys:
        raise ValueError(f"the checkpoint does not match the converted {type(model).__name__}: missing "
                         f"{missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected "
                         f"{result.unexpected_keys[:8]}{' ...' if len(result.unexpected_keys) > 8 else ''}")
