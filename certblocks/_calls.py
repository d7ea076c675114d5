"""How certblocks calls a model and its updates: a batch as arguments, the wrappers around a model, where an
update's residual-stream state is among its arguments, and its output (:mod:`certblocks.model` re-exports these)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, Dict, Optional, Tuple, Union

from torch import Tensor, nn

__all__ = ["as_args", "unwrap", "state_of", "with_state", "without_state", "velocity_output", "replace_output",
           "Where"]

#: Keyword arguments that carry mutable state (KV caches) rather than inputs: left out when an update is called
#: again on its captured state (the call in the training forward started from an empty cache for its layer).
_STATEFUL_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache", "cache_params", "inference_params")



def as_args(batch: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """A batch as a model's arguments ``(args, kwargs)``.

    Args:
        batch: a tensor (the one positional argument), a tuple or list of positional arguments, or a mapping of
            keyword arguments (a ``dict``, HF ``BatchEncoding``, any object with ``keys()`` and ``__getitem__``).

    Raises:
        TypeError: ``batch`` is none of these.
    """
    if isinstance(batch, Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping) or (callable(getattr(batch, "keys", None)) and hasattr(batch, "__getitem__")):
        return (), {k: batch[k] for k in batch.keys()}
    if isinstance(batch, (list, tuple)):
        return tuple(batch), {}
    raise TypeError(f"batch must be a tensor, a tuple of positional arguments or a mapping of keyword arguments, "
                    f"got {type(batch).__name__}")


def unwrap(model: Any) -> Any:
    """The module inside ``DistributedDataParallel``, ``DataParallel``, FSDP (``.module``) and ``torch.compile``
    (``_orig_mod``) wrappers, nested ones too; anything else is returned as it is."""
    while isinstance(model, nn.Module):
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None) if type(model).__name__ in (
                "DistributedDataParallel", "DataParallel", "FullyShardedDataParallel") else None
        if not isinstance(inner, nn.Module):
            return model
        model = inner
    return model


@functools.cache
def _first_parameter(cls: type[nn.Module]) -> Optional[str]:
    """The name of the first argument of ``cls.forward`` after ``self`` (``"hidden_states"``, ``"x"``)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    first = next(iter(params), None)
    if first is None or first.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        return None
    return first.name


Where = Union[int, str]


def state_of(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[Tensor, Where]]:
    """The state ``X_k`` a call of a velocity received, and where: ``(x, 0)`` when it is the first positional
    argument, ``(x, name)`` when it came as the keyword of the forward's first parameter (HF decoder layers call
    ``self_attn(hidden_states=...)``); ``None`` when the call has no tensor there."""
    if args:
        return (args[0], 0) if isinstance(args[0], Tensor) else None
    name = _first_parameter(type(module))  # type: ignore[arg-type]  # mypy reads Module.__hash__ as unbound
    if name is not None and isinstance(kwargs.get(name), Tensor):
        return kwargs[name], name
    return None


def with_state(args: Tuple[Any, ...], kwargs: Dict[str, Any], where: Where, x: Tensor
               ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The call's arguments with the state ``x`` put back where :func:`state_of` found it (``args`` / ``kwargs``
    are the other arguments, as :func:`without_state` returns them)."""
    if where == 0:
        return (x, *args), kwargs
    return args, {**kwargs, str(where): x}


def without_state(args: Tuple[Any, ...], kwargs: Dict[str, Any], where: Where, *, stateless: bool = True
                  ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The call's other arguments (``stateless``: without the KV-cache keywords, which hold state, not inputs)."""
    rest_args = tuple(args[1:]) if where == 0 else tuple(args)
    rest = {k: v for k, v in kwargs.items() if k != where and not (stateless and k in _STATEFUL_KWARGS)}
    return rest_args, rest


def velocity_output(out: Any) -> Optional[Tensor]:
    """The velocity ``v(X)`` in a module's output: the output itself, or the first element of a tuple/list (HF
    attentions return ``(output, weights)``); ``None`` when there is no tensor there."""
    if isinstance(out, (tuple, list)):
        out = out[0] if out else None
    return out if isinstance(out, Tensor) else None


def replace_output(out: Any, y: Tensor) -> Any:
    """``out`` with its velocity (:func:`velocity_output`) replaced by ``y``."""
    if isinstance(out, tuple):
        return (y, *out[1:])
    if isinstance(out, list):
        return [y, *out[1:]]
    return y
