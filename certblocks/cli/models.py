"""MODEL arguments of ``certblocks certify`` and ``certblocks convert``: a string -> a module and an input.

Random weights, nothing downloaded. torch, timm and transformers are imported when a model is built,
never when this module is imported (``--help`` stays light).  A MODEL of an unknown form, an unknown ``hf:`` name or
an unknown zoo name is refused before torch is imported, with the names it is close to ("did you mean");
``timm:`` names are checked by timm's registry before anything is built.
"""

from __future__ import annotations

import difflib
import importlib
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple

from ._common import UsageError

if TYPE_CHECKING:
    import torch

__all__ = ["ModelSpecError", "load_model", "load_backbone", "check_spec", "ZOO_NAMES", "HF_MODELS", "HF_BACKBONES"]

_FORMS = "timm:<name>, hf:gpt2, hf:mamba, hf:llama or module:pkg.mod:factory"

#: The names ``certblocks.zoo.list_models(include_test=True)`` gives: a zoo MODEL is checked against them without
#: importing torch (``tests/zoo/test_zoo_cli.py`` keeps them in step with the registry).
ZOO_NAMES = (
    "certblocks_vit_base_patch16_224", "certblocks_vit_dyt_base_patch16_224", "certblocks_vit_dyt_small_patch16_224",
    "certblocks_vit_dyt_test", "certblocks_vit_dyt_tiny_patch16_224", "certblocks_vit_small_patch16_224",
    "certblocks_vit_test", "certblocks_vit_tiny_patch16_224", "gpt2_dyt_124m", "gpt2_dyt_mini", "gpt2_dyt_test",
    "gpt2_dyt_tiny", "gpt2_qknorm_124m", "gpt2_qknorm_mini", "gpt2_qknorm_test", "gpt2_qknorm_tiny",
    "mamba_forecaster_free", "mamba_forecaster_free_test", "mamba_forecaster_lg", "mamba_forecaster_lg_test",
    "mamba_forecaster_periln", "mamba_forecaster_periln_test", "mamba_forecaster_preln", "mamba_forecaster_preln_test",
    "mamba_forecaster_rms", "mamba_forecaster_rms_test", "patchtst_noln", "patchtst_noln_test", "patchtst_periln",
    "patchtst_periln_test", "patchtst_preln", "patchtst_preln_test", "patchtst_rms", "patchtst_rms_test", "toto_style",
    "toto_style_test",
)
#: ``hf:<name>`` of ``certify`` and ``trajectory``.
HF_MODELS = ("gpt2", "gpt2-small", "gpt2-124m", "mamba", "mamba-130m", "llama")
#: ``hf:<name>`` of ``convert``.
HF_BACKBONES = ("gpt2", "llama", "mamba")
_PREFIXES = ("timm", "hf", "module")


def _did_you_mean(spec: str, candidates: Sequence[str]) -> str:
    """``"; did you mean X or Y?"`` from the candidates close to ``spec`` (and ``timm:x`` for ``timm-x``), or ``""``."""
    close = []
    for p in _PREFIXES:  # timm-vit_tiny, hf/gpt2, module.pkg: the prefix with another separator
        rest = spec[len(p) + 1:]
        if spec.lower().startswith(p) and len(spec) > len(p) + 1 and spec[len(p)] in "-_/. =" and rest:
            close.append(f"{p}:{rest}")
    close += difflib.get_close_matches(spec, list(candidates), n=3, cutoff=0.6)
    close = list(dict.fromkeys(close))
    return f"; did you mean {' or '.join(close)}?" if close else ""


def check_spec(spec: str, *, zoo: bool = True, hf: Sequence[str] = HF_MODELS) -> None:
    """Check MODEL's form without importing torch.

    Args:
        spec: the MODEL argument.
        zoo: zoo names are allowed (``certify``, ``trajectory``; not ``convert``).
        hf: the allowed ``hf:<name>``.

    Raises:
        ModelSpecError: an unknown form or name, with the close ones.
    """
    if not isinstance(spec, str) or not spec:
        raise ModelSpecError(f"MODEL must be a non-empty string, got {spec!r}")
    if spec.startswith("timm:"):
        if not spec[5:]:
            raise ModelSpecError("timm:<name> needs a model name, e.g. timm:vit_tiny_patch16_224")
        return
    if spec.startswith("hf:"):
        name = spec[3:].lower()
        if name not in hf:
            canonical = [n for n in hf if "-" not in n]  # hf:gpt2-small, hf:gpt2-124m, hf:mamba-130m: aliases
            aliases = [n for n in hf if "-" in n]
            allowed = ", ".join(f"hf:{n}" for n in canonical) + (
                f" (aliases {', '.join(f'hf:{n}' for n in aliases)})" if aliases else "")
            raise ModelSpecError(f"hf:{name} is not supported; allowed: {allowed}; random weights from the default "
                                 "config, hf:llama GPT-2-small-sized" + _did_you_mean(spec, [f"hf:{n}" for n in hf]))
        return
    if spec.startswith("module:") or (zoo and spec in ZOO_NAMES):
        return
    known = [f"hf:{n}" for n in hf] + ["timm:", "module:"] + (list(ZOO_NAMES) if zoo else [])
    if zoo:
        raise ModelSpecError(f"{spec!r} is not {_FORMS}, nor a zoo model ('certblocks zoo --names-only --test' lists "
                             "them)" + _did_you_mean(spec, known))
    raise ModelSpecError(f"MODEL must be timm:NAME (e.g. timm:vit_tiny_patch16_224), "
                         f"{', '.join(f'hf:{n}' for n in hf)}, got {spec!r}" + _did_you_mean(spec, known))


class ModelSpecError(UsageError):
    """MODEL could not be resolved to a module (exit status 2 on the command line)."""


def _example_ids(vocab: int, seq_len: int) -> torch.Tensor:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (1, seq_len), generator=g)


def _timm_model(name: str, **kwargs: Any) -> Any:
    try:
        import timm
    except ImportError as exc:
        raise ModelSpecError("timm:<name> needs timm (pip install 'certblocks[timm]')") from exc
    if name.startswith("certblocks_"):
        importlib.import_module("certblocks.zoo")  # registers certblocks_vit_* in timm
    if not timm.is_model(name):  # the registry, before building anything
        hint = _did_you_mean(name, timm.list_models())
        raise ModelSpecError(f"timm could not create {name!r}: timm has no such model"
                             + hint.replace("did you mean ", "did you mean timm:").replace(" or ", " or timm:"))
    try:
        return timm.create_model(name, pretrained=False, **kwargs)
    except Exception as exc:  # timm raises RuntimeError for an unknown name, TypeError for an unknown kwarg
        raise ModelSpecError(f"timm could not create {name!r}: {exc}") from exc


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ModelSpecError("hf:<name> needs transformers (pip install 'certblocks[hf]')") from exc
    return transformers


def load_model(spec: str, seq_len: int = 8) -> Tuple[torch.nn.Module, Any]:
    """Resolve ``certblocks certify``'s MODEL to ``(module, example_input)``.

    Args:
        spec: ``timm:<name>`` (on a random image of the model's input size), ``hf:gpt2`` / ``hf:mamba``
            (the default config's base model, on ``seq_len`` random token ids), ``hf:llama`` (a GPT-2-small-sized
            Llama base model, as ``certblocks convert hf:llama``), ``module:pkg.mod:factory``
            (``factory()`` returns ``(module, example_input)`` or a module with an ``example_input``), or a
            zoo name.
        seq_len: the sequence length of token inputs.

    Raises:
        ModelSpecError: the spec names nothing that can be built, or building it failed.
    """
    check_spec(spec)
    if seq_len < 1:
        raise ModelSpecError(f"--seq-len must be >= 1, got {seq_len}")
    import torch

    torch.manual_seed(0)
    if spec.startswith("timm:"):
        model = _timm_model(spec[5:])
        cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
        size = tuple(cfg.get("input_size", (3, 224, 224)))
        return model.eval(), torch.randn(1, *size)
    if spec.startswith("hf:"):
        name = spec[3:].lower()  # one of HF_MODELS (check_spec)
        tr = _transformers()
        if name.startswith("gpt2"):
            cfg = tr.GPT2Config()
            return tr.GPT2Model(cfg).eval(), _example_ids(cfg.vocab_size, seq_len)
        if name.startswith("mamba"):
            cfg = tr.MambaConfig()
            return tr.MambaModel(cfg).eval(), _example_ids(cfg.vocab_size, seq_len)
        cfg = _llama_config(tr, 12)
        return tr.LlamaModel(cfg).eval(), _example_ids(cfg.vocab_size, seq_len)
    if spec.startswith("module:"):
        return _from_factory(spec)
    return _from_zoo(spec, seq_len)


def _from_factory(spec: str) -> Tuple[torch.nn.Module, Any]:
    import torch

    rest = spec[len("module:"):]
    if rest.count(":") != 1:
        raise ModelSpecError(f"module:... must be module:pkg.mod:factory, got {spec!r}")
    mod_name, fn_name = rest.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as exc:  # ImportError, or whatever the module raises while it loads
        raise ModelSpecError(f"cannot import {mod_name!r}: {type(exc).__name__}: {exc}") from exc
    fn = getattr(mod, fn_name, None)
    if fn is None or not callable(fn):
        raise ModelSpecError(f"{mod_name} has no callable {fn_name!r}")
    try:
        res = fn()
    except Exception as exc:  # the factory is the user's code: report it, do not crash
        raise ModelSpecError(f"{spec}: {mod_name}.{fn_name}() raised {type(exc).__name__}: {exc}; the factory takes "
                             "no argument and returns a module or (module, example_input)") from exc
    if isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], torch.nn.Module):
        return res[0].eval(), res[1]
    if isinstance(res, torch.nn.Module):
        ex = getattr(res, "example_input", None)
        ex = ex() if callable(ex) else ex
        if ex is None:
            raise ModelSpecError(f"{spec}: the factory returned a module without an example input; return "
                                 "(module, example_input) or give the module an `example_input` attribute")
        return res.eval(), ex
    raise ModelSpecError(f"{spec}: the factory must return a module or (module, example_input), got "
                         f"{type(res).__name__}")


def _from_zoo(spec: str, seq_len: int) -> Tuple[torch.nn.Module, Any]:
    try:
        zoo = importlib.import_module("certblocks.zoo")
    except ImportError:
        zoo = None
    create = getattr(zoo, "create_model", None) if zoo is not None else None
    if create is None:
        raise ModelSpecError(f"{spec!r} is not {_FORMS}, and the certblocks model zoo "
                             "(certblocks.zoo.create_model) is not available")
    try:
        model = create(spec, certify=False)  # built even past its budget: certify reports it (exit status 1)
    except Exception as exc:
        raise ModelSpecError(f"{spec!r} is not {_FORMS}, and the zoo could not build it: {exc}") from exc
    return model.eval(), _zoo_example(model, spec, seq_len)


def _zoo_example(model: torch.nn.Module, spec: str, seq_len: int) -> Any:
    """An example input for a zoo model: its ``example_input(seq_len)``, else a guess from its attributes."""
    import torch

    ex = getattr(model, "example_input", None)
    if ex is not None:
        return ex(seq_len) if callable(ex) else ex
    pe = getattr(model, "patch_embed", None)
    img = getattr(pe, "img_size", None)
    if img is not None:
        chans = getattr(getattr(pe, "proj", None), "in_channels", 3)
        h, w = (img, img) if isinstance(img, int) else tuple(img)
        return torch.randn(1, chans, h, w)
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)
    if isinstance(cfg, dict) and "input_size" in cfg:
        return torch.randn(1, *cfg["input_size"])
    vocab = getattr(model, "vocab_size", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int):
        return _example_ids(vocab, seq_len)
    raise ModelSpecError(f"zoo model {spec!r} has no example_input(seq_len) and its input cannot be guessed; use "
                         "module:pkg.mod:factory returning (module, example_input)")


def _llama_config(tr: Any, layers: int) -> Any:
    """A GPT-2-small-sized Llama: width 768, 12 heads, 4 key/value heads (RoPE, grouped-query attention, SwiGLU)."""
    return tr.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_attention_heads=12,
                          num_key_value_heads=4, num_hidden_layers=layers)


def load_backbone(spec: str, *, img_size: Optional[int] = None, layers: Optional[int] = None
                  ) -> Tuple[torch.nn.Module, Any]:
    """Resolve ``certblocks convert``'s MODEL to ``(model, example_input)``.

    Args:
        spec: ``timm:NAME`` (on a random image of the model's input size), ``hf:gpt2``, ``hf:llama`` (a
            GPT-2-small-sized Llama: width 768, 12 heads, 4 key/value heads) or ``hf:mamba`` (the causal-LM model with
            random weights, on 64 random token ids).
        img_size: the image size of a timm model, passed to timm only when given (default: the model's own).
        layers: the number of blocks/layers (None: the model's default), passed to timm as ``depth``.

    Raises:
        ModelSpecError: an unknown form, a bad size, or the model could not be built.
    """
    if layers is not None and layers < 1:
        raise ModelSpecError(f"--layers must be >= 1, got {layers}")
    if img_size is not None and img_size < 1:
        raise ModelSpecError(f"--img-size must be >= 1, got {img_size}")
    check_spec(spec, zoo=False, hf=HF_BACKBONES)
    import torch

    torch.manual_seed(0)
    if spec.startswith("timm:"):
        kw: dict = {}  # only what was given: not every timm model takes img_size or depth
        if img_size is not None:
            kw["img_size"] = img_size
        if layers is not None:
            kw["depth"] = layers
        model = _timm_model(spec[5:], **kw).eval()
        cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
        chans, *hw = tuple(cfg.get("input_size", (3, 224, 224)))
        size = (img_size, img_size) if img_size is not None else tuple(hw)
        return model, torch.randn(1, chans, *size)
    tr = _transformers()
    name = spec[3:].lower()
    if name == "gpt2":
        model = tr.GPT2LMHeadModel(tr.GPT2Config(n_layer=12 if layers is None else layers)).eval()
    elif name == "llama":
        model = tr.LlamaForCausalLM(_llama_config(tr, 12 if layers is None else layers)).eval()
    else:
        cfg = tr.MambaConfig(num_hidden_layers=24 if layers is None else layers, use_mambapy=False)
        model = tr.MambaForCausalLM(cfg).eval()
    return model, {"input_ids": torch.randint(0, 1000, (1, 64)), "use_cache": False}
