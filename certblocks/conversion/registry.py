"""The converter registry: :func:`register_converter` teaches :func:`~certblocks.conversion.convert` a source module,
like :func:`certblocks.trace.register_rule` teaches the tracer an op."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple, Union

from torch import nn

from .._validation import check_callable
from ..exponents import Exponents

__all__ = ["Converter", "register_converter", "unregister_converter", "registered_converters", "converter_for",
           "builtin"]


@dataclass(frozen=True)
class Converter:
    """One registered conversion (:func:`register_converter`).

    Attributes:
        name: the converter's name (unique in the registry).
        match: ``match(module) -> bool``: the source modules it converts.
        build: ``build(module, model) -> replacement``: the certified replacement of ``module`` (a module of
            ``model``, the model being converted) with its weights copied.
        kind: what the source is (``"attention"``, ``"mamba"``, ``"glu"`` for the built-in ones, any word for
            others); an attention or mixer (``"attention"``, ``"mamba"``) of a Hugging Face model whose
            replacement does not read HF's cache switches the model's ``use_cache`` off.
        exponents_before: the source's exponents ``(q, sigma)``, or ``exponents_before(module) -> Exponents``.
        exact: ``exact(module) -> bool``: the replacement computes the source's function (a source that is
            already certified: Qwen3's QK-norm attention); otherwise a replacement whose checkpoint has exactly the
            source's keys and shapes gets :data:`certblocks._adapters.MARKER`, so that the source's class refuses it.
        keeps_hf_cache: the replacement reads and writes HF's KV cache as the source did (or the source has none).
    """

    name: str
    match: Callable[[nn.Module], bool]
    build: Callable[[nn.Module, nn.Module], nn.Module]
    kind: str
    exponents_before: Union[Exponents, Callable[[nn.Module], Exponents]]
    exact: Callable[[nn.Module], bool] = field(default=lambda m: False)
    keeps_hf_cache: bool = False

    def before(self, module: nn.Module) -> Exponents:
        """The source's exponents."""
        e = self.exponents_before
        return e if isinstance(e, Exponents) else e(module)


_USER: List[Converter] = []
_BUILTIN: List[Converter] = []


def _matcher(match: Union[Callable[[nn.Module], bool], type, str]) -> Callable[[nn.Module], bool]:
    if isinstance(match, type):
        if not issubclass(match, nn.Module):
            raise TypeError(f"match must be an nn.Module subclass, a class name or a predicate, got {match!r}")
        return lambda m: isinstance(m, match)
    if isinstance(match, str):
        if not match:
            raise ValueError("match must be a non-empty class name")
        if "." in match:  # a qualified name: module.Class
            return lambda m: f"{type(m).__module__}.{type(m).__qualname__}" == match
        return lambda m: type(m).__name__ == match
    if callable(match):
        return match
    raise TypeError(f"match must be a predicate, an nn.Module subclass or a class name, got {type(match).__name__}")


def register_converter(match: Union[Callable[[nn.Module], bool], type, str],
                       build: Callable[[nn.Module, nn.Module], nn.Module], *, kind: str,
                       exponents_before: Union[Exponents, Tuple[float, float], Callable[[nn.Module], Exponents]],
                       name: Optional[str] = None, exact: Optional[Callable[[nn.Module], bool]] = None,
                       keeps_hf_cache: bool = False, replace: bool = False) -> Converter:
    """Teach :func:`convert` a new source module, like :func:`certblocks.trace.register_rule` teaches the tracer an op.

    Converters registered here are consulted before the built-in ones, in the order they were registered; the
    first whose ``match`` accepts a module converts it (and nothing under it is visited).

    Args:
        match: the source modules: a predicate ``match(module) -> bool``, an ``nn.Module`` subclass
            (``isinstance``) or a class name (``"MyAttention"``, or ``"pkg.mod.MyAttention"``).
        build: ``build(module, model) -> nn.Module``: the certified replacement with the source's weights (its
            ``exponents`` attribute, when it has one, is the swap's exponents after); ``model`` is the model being
            converted (for settings that live elsewhere in it).
        kind: what the source is: ``"attention"``, ``"mamba"``, ``"glu"`` or another word.
        exponents_before: the source's exponents, as :class:`~certblocks.Exponents`, a pair ``(q, sigma)`` or
            ``exponents_before(module) -> Exponents``.
        name: the converter's name (default: ``build``'s qualified name).
        exact: ``exact(module) -> bool``, the replacement computes the source's function (default: never).
        keeps_hf_cache: the replacement uses HF's KV cache as the source did.
        replace: replace a registered converter of the same name (else that is an error).

    Returns:
        The registered :class:`Converter`.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``name`` is already registered and ``replace`` is False.
    """
    check_callable("build", build, "callable(module, model) -> nn.Module")
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"kind must be a non-empty str, got {kind!r}")
    if isinstance(exponents_before, tuple) and not isinstance(exponents_before, Exponents):
        exponents_before = Exponents(*exponents_before)
    if not isinstance(exponents_before, Exponents) and not callable(exponents_before):
        raise TypeError(f"exponents_before must be an Exponents, a (q, sigma) pair or a callable, got "
                        f"{type(exponents_before).__name__}")
    check_callable("exact", exact, "callable(module) -> bool", optional=True)
    name = name or getattr(build, "__qualname__", None) or repr(build)
    conv = Converter(name, _matcher(match), build, kind, exponents_before, exact or (lambda m: False),
                     bool(keeps_hf_cache))
    taken = [i for i, c in enumerate(_USER) if c.name == name]
    if taken or any(c.name == name for c in _BUILTIN):
        if not replace:
            raise ValueError(f"a converter named {name!r} is already registered; pass replace=True to replace it")
        if taken:
            _USER[taken[0]] = conv
            return conv
    _USER.append(conv)
    return conv


def unregister_converter(name: str) -> Converter:
    """Remove the converter registered with :func:`register_converter` as ``name`` and return it.

    Raises:
        KeyError: no user converter of that name (the built-in ones cannot be removed; register one before them).
    """
    for i, c in enumerate(_USER):
        if c.name == name:
            return _USER.pop(i)
    raise KeyError(f"no converter named {name!r} was registered with register_converter; registered: "
                   f"{[c.name for c in _USER]}")


def registered_converters() -> List[Converter]:
    """Every converter in the order :func:`convert` consults them: the user's, then the built-in ones."""
    return list(_USER) + list(_BUILTIN)


def converter_for(module: nn.Module) -> Optional[Converter]:
    """The first registered converter whose ``match`` accepts ``module``, or ``None``."""
    return next((c for c in (*_USER, *_BUILTIN) if c.match(module)), None)


def builtin(match: Callable[[nn.Module], bool], kind: str, exponents_before: Any, *, exact: Any = None,
             keeps_hf_cache: bool = False) -> Callable[[Callable[[nn.Module, nn.Module], nn.Module]], Any]:
    def deco(build: Callable[[nn.Module, nn.Module], nn.Module]) -> Callable[[nn.Module, nn.Module], nn.Module]:
        _BUILTIN.append(Converter(build.__name__.lstrip("_"), match, build, kind, exponents_before,
                                  exact or (lambda m: False), keeps_hf_cache))
        return build

    return deco

