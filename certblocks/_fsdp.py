"""FSDP2 (``torch.distributed.fsdp.fully_shard``) models: certified and monitored one unit unsharded at a time.

Under FSDP2 each ``fully_shard``-ed module (a *unit*: usually one transformer block, and the root for what is left:
the embedding, the final norm, the head) holds ``1 / world`` of its parameters on each rank, as ``DTensor`` shards,
between the forward and backward passes that gather them.  Certifying the weights (docs/theory.md section 6: each
segment's coefficients are read off its own weights) needs a segment's weights whole, and only those: so the
weights are gathered one unit at a time with the unit's own ``unshard()`` and freed with its ``reshard()``.

:class:`Units` does the gathering: ``hold(units)`` reshards the units it holds that are not asked for, then unshards
the asked ones (an all-gather: every rank of the unit's mesh must make the same calls in the same order, which the
callers below guarantee by running the same code on every rank, in the same order), so that at most the units of
one read are unsharded at a time.  A unit the user left unsharded is read as it is and left so.

:func:`certify_fsdp` is :func:`certblocks.checkpoint.certify_ranks` on an FSDP2 model: the graph is captured on a
skeleton (the model's modules with unbacked parameters of the global shapes, no FSDP hooks), run once on the
example as :func:`certblocks.checkpoint.certify_checkpoint` runs it (each weight read from its unit, unsharded when
the run reaches it), then each unit is unsharded in turn and the ranks share its segments' certification.  The
monitor (:class:`certblocks.CertificateMonitor`) uses :class:`Units` around each update's weight figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Type

import torch
from torch import nn

from ._validation import NonFiniteWeightError

__all__ = ["is_fsdp", "Units", "certify_fsdp"]


def _fsdp_module_class() -> Optional[type]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return None
    return FSDPModule


def is_fsdp(model: Any) -> bool:
    """Whether ``model`` (an ``nn.Module``) holds an FSDP2 unit (``fully_shard`` applied to it or to a submodule)."""
    cls = _fsdp_module_class()
    return cls is not None and isinstance(model, nn.Module) and any(isinstance(m, cls) for m in model.modules())


def _sharded(unit: nn.Module) -> bool:
    """The unit's own parameters are registered as their shards (``DTensor``): it is not unsharded now."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for m in _managed(unit) for p in m.parameters(recurse=False))


def _managed(unit: nn.Module) -> Iterator[nn.Module]:
    """The modules whose own parameters ``unit`` manages: its subtree, less the subtrees of nested units."""
    cls = _fsdp_module_class()
    stack = [unit]
    while stack:
        m = stack.pop()
        yield m
        stack.extend(c for c in m.children() if not (cls is not None and isinstance(c, cls)))


class Units:
    """The FSDP2 units of a model, unsharded a few at a time (module docstring).

    Args:
        model: the model (its root: the module ``fully_shard`` was applied to last).

    Attributes:
        units: the units in module order, one per FSDP state (``fully_shard([a, b])`` is one unit).
        owner: each module -> the unit that manages its own parameters (``None`` for a module no unit manages).
        held: the units this object unsharded and has not resharded yet.
    """

    def __init__(self, model: nn.Module) -> None:
        cls = _fsdp_module_class()
        if cls is None or not is_fsdp(model):
            raise TypeError(f"model must hold FSDP2 units (torch.distributed.fsdp.fully_shard), got "
                            f"{type(model).__name__} without one")
        self.model = model
        self.owner: Dict[nn.Module, Optional[nn.Module]] = {}
        first: Dict[int, nn.Module] = {}  # id of an FSDP state -> the first module of that state
        self.units: List[nn.Module] = []

        def walk(m: nn.Module, current: Optional[nn.Module]) -> None:
            if isinstance(m, cls):
                state = id(m._get_fsdp_state())  # type: ignore[operator]  # an FSDPModule (a private method of torch)
                if state not in first:
                    first[state] = m
                    self.units.append(m)
                current = first[state]
            self.owner[m] = current
            for c in m.children():
                walk(c, current)

        walk(model, None)
        self._order = {id(u): i for i, u in enumerate(self.units)}
        self.held: List[nn.Module] = []

    def of_modules(self, modules: Sequence[nn.Module]) -> Tuple[nn.Module, ...]:
        """The units managing the parameters of ``modules`` and their submodules, in unit order."""
        found: Dict[int, nn.Module] = {}
        for mod in modules:
            for m in mod.modules():
                u = self.owner.get(m)
                if u is not None and next(m.parameters(recurse=False), None) is not None:
                    found[id(u)] = u
        return tuple(sorted(found.values(), key=lambda u: self._order[id(u)]))

    def of_names(self, names: Sequence[str]) -> Tuple[nn.Module, ...]:
        """The units managing the parameters named ``names`` (state-dict names in :attr:`model`)."""
        return self.of_modules([self.model.get_submodule(n.rpartition(".")[0]) for n in names])

    def outside(self, modules: Sequence[nn.Module]) -> Tuple[nn.Module, ...]:
        """The units that manage a parameter and none of ``modules``' (a model's embedding and head)."""
        inside = {id(u) for u in self.of_modules(modules)}
        return tuple(u for u in self.of_modules([self.model]) if id(u) not in inside)

    def hold(self, units: Sequence[nn.Module]) -> None:
        """Unshard ``units`` (the ones sharded now), resharding first the units held that are not among them."""
        want = {id(u) for u in units}
        for u in [u for u in self.held if id(u) not in want]:
            u.reshard()  # type: ignore[operator]  # an FSDPModule
        self.held = [u for u in self.held if id(u) in want]
        for u in sorted(units, key=lambda u: self._order[id(u)]):
            if all(u is not h for h in self.held) and _sharded(u):
                u.unshard()  # type: ignore[operator]  # an FSDPModule: an all-gather over its mesh
                self.held.append(u)

    def release(self) -> None:
        """Reshard every unit held."""
        self.hold(())

    @contextlib.contextmanager
    def holding(self, units: Sequence[nn.Module]) -> Iterator[None]:
        """``units`` unsharded inside (kept so after: the next :meth:`hold` reshards them only if it needs others)."""
        self.hold(units)
        yield

    def certificates(self, ups: Any) -> List[Any]:
        """``ups.certificates(cached=False)`` of a :class:`~certblocks.model.CertifiedModel` with each update's
        units unsharded while its certificate is computed (one update after the other)."""
        fixed = ups.fixed or [None] * len(ups.modules)
        out: List[Any] = []
        for name, m, f in zip(ups.names, ups.modules, fixed):
            self.hold(self.of_modules([m]) if f is None else ())
            one = dataclasses.replace(ups, names=[name], modules=[m], fixed=[f])
            out.extend(one.certificates(cached=False))
        return out


# ------------------------------------------------------------------------------------------------ certify
class _UnitWeights:
    """The weights of an FSDP2 model by state-dict name for a captured graph's lazy ``env``
    (:class:`certblocks.checkpoint._LazyEnv`), read from the unsharded units.

    Modes: ``"follow"`` (a read unshards the units of the weight, resharding the others: every rank must read in the
    same order), ``"held"`` (only the units held now may be read: a rank's own certification, no collective; another
    read raises), ``"copy"`` (after :func:`certify_fsdp` returned: a read unshards the unit, copies the weight and
    reshards; ``.stack`` under fp16 reads every layer this way, and every rank must call it alike)."""

    def __init__(self, units: Units, names: Set[str], env: Dict[str, Any], device: torch.device,
                 dtypes: Dict[str, torch.dtype]) -> None:
        self.units, self.names, self.env, self.device, self.dtypes = units, names, env, device, dtypes
        self.mode = "follow"
        self.allowed: Optional[Set[str]] = None  # set by checkpoint._certify_owned; every rank reads every unit here
        self.checked: Set[str] = set()

    def _hold(self, units: Sequence[nn.Module]) -> None:
        """:meth:`Units.hold`, after copying the values of ``env`` that alias a unit about to be resharded (a view of
        a weight would dangle once its unit frees the gathered storage)."""
        leaving = [u for u in self.units.held if all(u is not w for w in units)]
        if leaving:
            ptrs = {p.untyped_storage().data_ptr() for u in leaving for m in _managed(u)
                    for p in m.parameters(recurse=False)}
            for key, v in list(dict.items(self.env)):
                if isinstance(v, torch.Tensor) and v.device.type != "meta" and v.untyped_storage().data_ptr() in ptrs:
                    dict.__setitem__(self.env, key, v.clone())
        self.units.hold(units)

    def get(self, name: str) -> torch.Tensor:
        units = self.units.of_names([name])
        if self.mode == "held" and any(all(u is not h for h in self.units.held) and _sharded(u) for u in units):
            raise RuntimeError(f"the certification of a segment read {name!r}, a weight of a unit that is not "
                               "unsharded now (the segments' units were misread)")
        if self.mode != "held":
            self._hold(units)
        t = self.units.model.get_parameter(name).detach()
        if name not in self.checked:
            if not bool(torch.isfinite(t).all()):
                raise NonFiniteWeightError([(name, int((~torch.isfinite(t)).sum()))])
            self.checked.add(name)
        if t.device != self.device or t.dtype != self.dtypes[name]:
            t = t.to(self.device, self.dtypes[name])
        elif self.mode == "copy":
            t = t.clone()
        if self.mode == "copy":
            self.units.release()
        return t

    def drop(self) -> None:
        """Reshard the units held (a rank's certification done, or the graph's run)."""
        self._hold(())


def _original_class(m: nn.Module) -> Type[nn.Module]:
    """The class ``fully_shard`` subclassed (``FSDPLlamaDecoderLayer`` -> ``LlamaDecoderLayer``)."""
    cls = _fsdp_module_class()
    return next(c for c in type(m).__mro__ if cls is None or not issubclass(c, cls))


_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _skeleton(model: nn.Module) -> nn.Module:
    """The model's modules in their own classes, without FSDP's hooks, each parameter a new CPU tensor of its global
    shape allocated and never written (:func:`certblocks.checkpoint._unbacked_parameters`: no memory until written),
    tied parameters tied; buffers shared with the model (FSDP2 does not shard them)."""
    params: Dict[int, nn.Parameter] = {}

    def clone(m: nn.Module) -> nn.Module:
        kind = _original_class(m)
        new = kind.__new__(kind)
        d = dict(m.__dict__)
        d["_parameters"] = {}
        for name, p in m._parameters.items():
            if p is not None and id(p) not in params:
                params[id(p)] = nn.Parameter(torch.empty(tuple(p.shape), dtype=p.dtype), requires_grad=p.requires_grad)
            d["_parameters"][name] = None if p is None else params[id(p)]
        d["_buffers"] = {k: None if b is None else b.detach().cpu() for k, b in m._buffers.items()}
        d["_modules"] = {k: None if c is None else clone(c) for k, c in m._modules.items()}
        for attr in _HOOKS:  # FSDP's own hooks (they gather and shard): the skeleton has no shards
            hooks = getattr(m, attr, None)
            if hooks is not None:
                d[attr] = hooks.__class__((k, h) for k, h in hooks.items()
                                          if not getattr(h, "__module__", "").startswith("torch.distributed"))
        for attr in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            if attr in d:
                keep = d["_forward_pre_hooks" if "pre" in attr else "_forward_hooks"]
                d[attr] = d[attr].__class__((k, v) for k, v in d[attr].items() if k in keep)
        new.__dict__.update(d)
        return new

    return clone(model)


def _cpu(a: Any) -> Any:
    return a.cpu() if isinstance(a, torch.Tensor) else a


def certify_fsdp(model: nn.Module, example_input: Any, *, group: Any = None) -> Any:
    """Certify an FSDP2-sharded model with at most one unit's parameters unsharded on a rank (module docstring).

    :func:`certblocks.checkpoint.certify_ranks` calls it for a model holding FSDP2 units; every rank of the model's
    process group must call it, with the same ``example_input``.  Every rank returns the
    :class:`~certblocks.trace.ModelCertificate` :func:`certblocks.certify` returns for the model unsharded in one
    process (its parameters in the dtype they are stored in: a ``MixedPrecisionPolicy``'s ``param_dtype`` is not
    applied), computed on the CPU.  Its ``.stack`` under fp16 (pure or amp) reads every layer once more, one unit
    at a time: every rank must call it alike (an unshard is collective).

    Args:
        model: the model, ``fully_shard`` applied to its blocks and its root (its units; the root alone works too,
            holding then the whole model unsharded while its segments are certified).
        example_input: a batch (a tensor, a tuple of positional arguments, a mapping of keyword arguments).
        group: the process group the segments are shared over (``None``: the default one).

    Raises:
        TypeError: ``model`` holds no FSDP2 unit.
        ValueError: the model is not one chain of residual updates.
        NonFiniteWeightError: a weight holds NaN or inf.
        certblocks.trace.CaptureError: ``torch.export`` cannot capture the model.
    """
    from .checkpoint import _certify_owned, _flat_inputs, _LazyEnv, _process_group, _run_nodes
    from .model import as_args
    from .trace.api import certify_segment
    from .trace.capture import capture

    units = Units(model)
    rank, world = _process_group(None, group)
    args, kwargs = as_args(example_input)
    args = tuple(_cpu(a) for a in args)
    kwargs = {k: _cpu(v) for k, v in kwargs.items()}
    units.release()  # nothing held by a previous call
    skeleton = _skeleton(model)  # in the model's mode (eval: dropout off)
    dtypes = {n: p.dtype for n, p in skeleton.named_parameters(remove_duplicate=False)}
    g = capture(skeleton, args, kwargs)  # on unwritten pages: every value is recomputed below
    lazy = {ph: name for ph, name in g.params.items() if name in dtypes}
    weights = _UnitWeights(units, set(lazy.values()), g.env, torch.device("cpu"), dtypes)
    g.env = _LazyEnv(g.env, lazy, weights)  # type: ignore[arg-type]  # its reads go through weights.get
    weights.env = g.env
    for ph, x in zip(g.user_inputs, _flat_inputs(g, args, kwargs)):
        g.env[ph.name] = x
    _run_nodes(g, [n for n in g.nodes if n.op != "placeholder"])  # every rank, the same reads: units in turn
    weights.drop()

    def certify_mine(gr: Any, chain: Any) -> Dict[int, Any]:
        """Each unit unsharded in turn (every rank), its segments certified round-robin over the ranks."""
        mine: Dict[int, Any] = {}
        weights.mode = "held"
        try:
            for k, seg in enumerate(chain.segments):
                lo, hi = gr.index[seg.start.name], gr.index[seg.end.name]
                names = {lazy[a.name] for n in gr.nodes[lo + 1:hi + 1] for a in n.all_input_nodes if a.name in lazy}
                weights._hold(units.of_names(sorted(names)))
                if k % world == rank:
                    mine[k] = certify_segment(gr, seg, k)
        finally:
            weights.mode = "follow"
        return mine

    name = type(skeleton).__name__
    rep = _certify_owned(g, name, f"{name} (FSDP2)", {}, rank, world, group, weights,  # type: ignore[arg-type]
                         certify=certify_mine)
    weights.drop()
    weights.mode = "copy"  # .stack(fp16) later: a unit gathered per read, nothing left unsharded
    return rep

