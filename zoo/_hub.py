"""Saving and loading zoo models (``save_pretrained`` / ``from_pretrained``) and the output an HF ``Trainer`` reads.

``model.save_pretrained(dir)`` writes two files:

* ``config.json``: the model's registry name (when it was built by :func:`~certblocks.zoo.create_model`), its class
  and the arguments its constructor received (defaults included; a ``torch.dtype`` is written by name, a device is
  not written), and timm's ``pretrained_cfg`` when the model has one;
* ``model.safetensors`` (``model.pt`` when the ``safetensors`` package is missing): the ``state_dict``, each
  tensor in its own dtype.

A zoo model's ``state_dict`` holds a tied weight once, under its first name (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``, kept as the latter), and ``load_state_dict`` fills the other name from it: so that
checkpoints written by ``safetensors`` (which refuses two names for one tensor) -- ``save_pretrained``, and
``transformers.Trainer``'s checkpoints of a model that is not a ``PreTrainedModel`` -- work.  A checkpoint with
both names loads too.

``ZooModel.from_pretrained(dir)`` (or ``GPT2QKNorm.from_pretrained(dir)``) builds the class with those arguments
(``certify=False``: a checkpoint is loaded whatever its certificate; ``certify=True`` refuses weights that are not
certified in the model's ``cert_dtype``), gives each tensor the checkpoint's dtype and loads the weights with
``strict=True``: the loaded model computes what the saved one did, bit for bit.  Only classes of ``certblocks`` are
imported from a ``config.json``; another class must already be imported (or be the class ``from_pretrained`` is
called on).

:class:`ZooOutput` is what a model called the Hugging Face way (``labels=`` / ``input_ids=``, as ``Trainer`` calls
it) returns: a ``dict`` with ``loss`` (when labels were given) and ``logits``, readable as attributes (``out.loss``)
and by position (``out[0]``), as HF's ``ModelOutput``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import sys
from typing import Any, Dict, Type, TypeVar, Union, cast

import torch
from torch import nn

__all__ = ["HubMixin", "ZooOutput", "CONFIG_NAME", "WEIGHTS_NAME"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_TORCH_WEIGHTS_NAME = "model.pt"  # without the safetensors package
_FORMAT = 1
_DTYPE = "torch.dtype"  # {"torch.dtype": "bfloat16"} in config.json

M = TypeVar("M", bound="HubMixin")


class ZooOutput(dict):
    """A model's output called the Hugging Face way: ``{"loss": ..., "logits": ...}`` (``loss`` only with labels).

    ``out.loss`` / ``out.logits`` read the entries (``None`` when absent), ``out[0]`` the first present one (the loss
    when there is one: what ``transformers.Trainer`` takes when it does not read ``out["loss"]``), as HF's
    ``ModelOutput``.
    """

    _FIELDS = ("loss", "logits")

    def __getattr__(self, name: str) -> Any:
        if name in self._FIELDS:
            return self.get(name)
        raise AttributeError(f"ZooOutput has no attribute {name!r} (its entries: {list(self)})")

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, slice)):
            return self.to_tuple()[key]
        return super().__getitem__(key)

    def to_tuple(self) -> tuple:
        """The present entries in order (``(loss, logits)`` or ``(logits,)``)."""
        return tuple(self.values())


def _encode(name: str, value: Any) -> Any:
    """A constructor argument as JSON, or ``TypeError`` naming it."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {_DTYPE: str(value).replace("torch.", "")}
    if isinstance(value, (list, tuple)):
        return [_encode(name, v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _encode(f"{name}.{k}", v) for k, v in value.items()}
    raise TypeError(f"constructor argument {name}={value!r} ({type(value).__name__}) cannot be written to "
                    f"{CONFIG_NAME}; build the model with a value JSON can hold (a name, a number), or pass it again "
                    f"to from_pretrained(..., {name}=...)")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_DTYPE}:
            dtype = getattr(torch, str(value[_DTYPE]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{CONFIG_NAME}: unknown torch dtype {value[_DTYPE]!r}")
            return dtype
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _record_init(init: Any) -> Any:
    """``init`` that first records the arguments of the outermost constructor call (:meth:`HubMixin.hub_config`)."""
    sig = inspect.signature(init)

    @functools.wraps(init)
    def recording_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        if "_hub_kwargs" not in self.__dict__:  # the outermost call: the class the user built
            try:
                bound = sig.bind(self, *args, **kwargs)
            except TypeError:  # the constructor itself says what is wrong
                bound = None
            if bound is not None:
                bound.apply_defaults()
                recorded: Dict[str, Any] = {}
                for pname, param in list(sig.parameters.items())[1:]:
                    if param.kind is inspect.Parameter.VAR_KEYWORD:
                        recorded.update(bound.arguments.get(pname, {}))
                    elif param.kind is not inspect.Parameter.VAR_POSITIONAL:
                        recorded[pname] = bound.arguments[pname]
                self.__dict__["_hub_kwargs"] = recorded
            init(self, *args, **kwargs)
            if not self.__dict__.get("_hub_tie_hooks"):
                self.__dict__["_hub_tie_hooks"] = True
                self.register_state_dict_post_hook(_drop_tied)
                self.register_load_state_dict_pre_hook(_restore_tied)
            return
        init(self, *args, **kwargs)

    return recording_init


class HubMixin:
    """``save_pretrained`` / ``from_pretrained`` for :class:`~certblocks.zoo.ZooModel` (module docstring).

    Every subclass's constructor records the arguments it was called with (the outermost call only), so that
    :meth:`save_pretrained` can write them.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None and not hasattr(init, "__wrapped__"):
            cls.__init__ = _record_init(init)  # type: ignore[method-assign]

    def hub_config(self) -> Dict[str, Any]:
        """What ``config.json`` holds: the registry name, the class, the constructor's arguments (module doc).

        Raises:
            TypeError: a constructor argument that JSON cannot hold (named).
        """
        recorded = self.__dict__.get("_hub_kwargs")
        if recorded is None:
            raise TypeError(f"{type(self).__name__} did not record its constructor arguments (built without calling "
                            "its constructor?); it cannot be saved with save_pretrained")
        kwargs = {k: _encode(k, v) for k, v in recorded.items() if k != "device"}
        cfg: Dict[str, Any] = {"certblocks_zoo": _FORMAT, "model": self.__dict__.get("_hub_name"),
                               "class": f"{type(self).__module__}:{type(self).__qualname__}", "kwargs": kwargs}
        pretrained_cfg = getattr(self, "pretrained_cfg", None)
        if isinstance(pretrained_cfg, dict):
            cfg["pretrained_cfg"] = _encode("pretrained_cfg", pretrained_cfg)
        return cfg

    def save_pretrained(self, save_directory: Union[str, os.PathLike]) -> None:
        """Write ``config.json`` and the weights into ``save_directory`` (created if needed; module docstring).

        Raises:
            TypeError: a constructor argument that JSON cannot hold (named), or a directory that is a file.
        """
        path = os.fspath(save_directory)
        if os.path.isfile(path):
            raise TypeError(f"save_directory must be a directory, got the file {path!r}")
        cfg = self.hub_config()
        os.makedirs(path, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in cast(nn.Module, self).state_dict().items()}  # tied: once
        meta = {"format": "pt"}
        try:
            from safetensors.torch import save_file
        except ImportError:  # the package is optional: torch's own format
            torch.save({"state_dict": state, "metadata": meta}, os.path.join(path, _TORCH_WEIGHTS_NAME))
        else:
            save_file(state, os.path.join(path, WEIGHTS_NAME), metadata=meta)
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def from_pretrained(cls: Type[M], path: Union[str, os.PathLike], *, certify: bool = False,
                        device: Union[str, torch.device, None] = None, **overrides: Any) -> M:
        """The model :meth:`save_pretrained` wrote into ``path``, with its weights (in eval mode).

        Args:
            path: the directory.
            certify: refuse (:class:`~certblocks.CertificationError`) weights not certified in the model's
                ``cert_dtype`` (default: load whatever the certificate; ``.certificate()`` tells).
            device: where to build the model and load the weights (default: CPU).
            **overrides: constructor arguments replacing the saved ones (one JSON could not hold, e.g.).

        Raises:
            ValueError: no ``config.json`` or weights in ``path``, or weights that do not match the model.
            TypeError: the saved class is not ``cls`` or a subclass of it, or cannot be imported.
        """
        folder = os.fspath(path)
        cfg_path = os.path.join(folder, CONFIG_NAME)
        if not os.path.isfile(cfg_path):
            raise ValueError(f"{folder!r} has no {CONFIG_NAME}: not a directory written by save_pretrained")
        with open(cfg_path) as f:
            cfg = json.load(f)
        if not isinstance(cfg, dict) or "class" not in cfg or "kwargs" not in cfg:
            raise ValueError(f"{cfg_path} is not a certblocks zoo config (no 'class' and 'kwargs')")
        klass = _resolve(cfg["class"], cls)
        kwargs = _decode(cfg["kwargs"])
        kwargs.update(overrides)
        params = inspect.signature(klass.__init__).parameters  # type: ignore[misc]  # klass is a class
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        if "certify" in params or takes_any:
            kwargs["certify"] = False  # the weights are checked below, once loaded
        if device is not None and ("device" in params or takes_any):
            kwargs["device"] = device
        model = klass(**kwargs)
        if "pretrained_cfg" in cfg:
            model.pretrained_cfg = model.default_cfg = _decode(cfg["pretrained_cfg"])
        if cfg.get("model") is not None:
            model.__dict__["_hub_name"] = cfg["model"]
        state = _read_weights(folder, "cpu" if device is None else str(device))
        _load_exact(model, state)
        if certify:
            model._certify_or_refuse(True, model.cert_dtype)
        return model.eval()


def _tied_aliases(model: nn.Module) -> Dict[str, str]:
    """``{alias: name}`` for every parameter reachable under several names (the first name is kept)."""
    first: Dict[int, str] = {}
    aliases: Dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _drop_tied(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for alias in _tied_aliases(module):
        state_dict.pop(prefix + alias, None)


def _restore_tied(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                  missing_keys: Any, unexpected_keys: Any, error_msgs: Any) -> None:
    for alias, name in _tied_aliases(module).items():
        if prefix + alias not in state_dict and prefix + name in state_dict:
            state_dict[prefix + alias] = state_dict[prefix + name]


def _resolve(qualified: str, base: type) -> type:
    """The class ``module:qualname``; only ``certblocks`` modules are imported (another must already be)."""
    module, _, qualname = str(qualified).partition(":")
    if module not in sys.modules:
        if not module.startswith("certblocks."):
            raise TypeError(f"{CONFIG_NAME} names the class {qualified!r}; import its module first (only certblocks "
                            "modules are imported from a config file)")
        importlib.import_module(module)
    obj: Any = sys.modules[module]
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, type) or not issubclass(obj, base):
        raise TypeError(f"{CONFIG_NAME} names {qualified!r}, which is not {base.__name__} or a subclass of it")
    return obj


def _read_weights(folder: str, device: str) -> Dict[str, torch.Tensor]:
    """The saved state dict (a tied weight once: ``load_state_dict`` fills its other names)."""
    st, pt = os.path.join(folder, WEIGHTS_NAME), os.path.join(folder, _TORCH_WEIGHTS_NAME)
    if os.path.isfile(st):
        from safetensors import safe_open

        with safe_open(st, framework="pt", device=device) as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    if os.path.isfile(pt):
        return torch.load(pt, map_location=device, weights_only=True)["state_dict"]
    raise ValueError(f"{folder!r} has no {WEIGHTS_NAME} (or {_TORCH_WEIGHTS_NAME})")


def _load_exact(model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """Load ``state`` with ``strict=True``, each tensor in the checkpoint's dtype (bit-exact weights)."""
    own: Dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers(remove_duplicate=False))
    for name, t in state.items():
        mine = own.get(name)
        if mine is not None and mine.dtype != t.dtype and (mine.is_floating_point() or mine.is_complex()):
            mine.data = mine.data.to(t.dtype)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"the weights do not match {type(model).__name__} built from the saved arguments: "
                         f"{str(exc).strip().splitlines()[-1].strip()[:400]}") from None

