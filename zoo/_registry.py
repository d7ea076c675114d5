"""The zoo's registry: ``register_model``, ``create_model``, ``list_models``.

A registered entry point is a function returning an ``nn.Module`` built from keyword
arguments; ``create_model(name, **overrides)`` calls it with the overrides.  Each entry
records its family (``"gpt2_qknorm"``, ``"patchtst"``, ...) and whether it is a small
configuration meant for tests (``test=True``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, TypeVar

from torch import nn

__all__ = ["ModelEntry", "register_model", "create_model", "list_models", "model_entry"]

F = TypeVar("F", bound=Callable[..., nn.Module])


@dataclass(frozen=True)
class ModelEntry:
    """One registered model.

    Attributes:
        name: the registry name (the entry point's ``__name__`` unless given).
        family: the model family (used by the CLI to group models).
        fn: the entry point, ``fn(**overrides) -> nn.Module``.
        test: a small configuration meant for tests.
        description: one line (the entry point's first docstring line by default).
        baseline: a comparison baseline (an uncertified or normalized variant kept to compare against):
            :func:`create_model` builds it with ``certify=False`` unless told otherwise, and the tables show
            its verdict.
    """

    name: str
    family: str
    fn: Callable[..., nn.Module]
    test: bool = False
    description: str = ""
    baseline: bool = False


_REGISTRY: Dict[str, ModelEntry] = {}


def register_model(fn: Optional[F] = None, *, name: Optional[str] = None, family: str = "",
                   test: bool = False, baseline: bool = False) -> Any:
    """Register a model entry point (usable as ``@register_model`` or ``@register_model(family=...)``).

    Args:
        fn: the entry point, a callable ``(**overrides) -> nn.Module``.
        name: registry name (default: ``fn.__name__``).
        family: the model family.
        test: mark the entry as a small test configuration.
        baseline: mark the entry as a comparison baseline (built with ``certify=False`` by default).

    Raises:
        ValueError: the name is already registered to another function.
    """

    def deco(f: F) -> F:
        if not callable(f):
            raise TypeError(f"register_model needs a callable, got {type(f).__name__}")
        key = name or f.__name__
        if key in _REGISTRY and _REGISTRY[key].fn is not f:
            raise ValueError(f"model name {key!r} is already registered (by {_REGISTRY[key].fn.__module__})")
        doc = (f.__doc__ or "").strip().splitlines()
        _REGISTRY[key] = ModelEntry(key, family or key, f, bool(test), doc[0].strip() if doc else "", bool(baseline))
        return f

    if fn is not None:
        return deco(fn)
    return deco


def model_entry(name: str) -> ModelEntry:
    """The :class:`ModelEntry` of a registered name (``KeyError`` lists the names)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    try:
        return _REGISTRY[name]
    except KeyError:
        close = [n for n in _REGISTRY if n.startswith(name.split("_")[0])]
        raise KeyError(f"unknown model {name!r}; registered: {sorted(_REGISTRY)}"
                       + (f" (did you mean one of {close}?)" if close else "")) from None


def create_model(name: str, **overrides: Any) -> nn.Module:
    """Build a registered zoo model.

    Args:
        name: a name from :func:`list_models`.
        **overrides: constructor arguments replacing the registered configuration's
            (e.g. ``n_layer=2``, ``certify=False``, ``cert_dtype="fp16"``).  A comparison baseline is built
            with ``certify=False`` unless ``certify`` is given.

    Raises:
        KeyError: unknown name.
        certblocks.CertificationError: the configuration is not certified at its depth for its
            certification dtype (pass ``certify=False`` to build it anyway).
    """
    entry = model_entry(name)
    if entry.baseline:
        overrides.setdefault("certify", False)
    model = entry.fn(**overrides)
    if isinstance(model, nn.Module):
        model.__dict__["_hub_name"] = name  # written by save_pretrained (certblocks.zoo._hub)
    return model


def list_models(pattern: str = "*", *, family: Optional[str] = None, include_test: bool = False) -> List[str]:
    """Sorted names of the registered models.

    Args:
        pattern: a glob (``"patchtst_*"``).
        family: only this family.
        include_test: also list the small test configurations.
    """
    out = [e.name for e in _REGISTRY.values()
           if fnmatch.fnmatchcase(e.name, pattern) and (family is None or e.family == family)
           and (include_test or not e.test)]
    return sorted(out)
