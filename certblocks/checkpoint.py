"""Certify a Hugging Face checkpoint directory layer by layer, without loading it whole.

:func:`certify_checkpoint` reads ``config.json`` and the safetensors files of a checkpoint (one
``model.safetensors``, or shards listed in ``model.safetensors.index.json``) and returns the same
:class:`~certblocks.trace.ModelCertificate` as :func:`certblocks.certify` on the loaded model
(``AutoModelForCausalLM.from_pretrained(path)``, eval mode, the same token ids): the same chain of segments (stem,
updates, maps, head; docs/theory.md section 6), the same coefficients, the same verdict of ``.stack(dtype)``.

How, with at most a layer's weights in memory:

1. the model is built with its parameters on the meta device (no storage) and its buffers real (the rotary
   frequencies are computed at construction, not stored in the checkpoint), and its graph is captured with
   ``torch.export`` on the example token ids (:func:`certblocks.trace.capture.capture`: shapes only, no weight read);
2. the graph runs once on the example, node by node: each weight is read from the memory-mapped safetensors file
   when a node first needs it and dropped once the layer it belongs to is passed (a cache of
   :data:`KEEP_GROUPS` groups: the parameters under one ``...layers.K`` prefix, or one tensor outside the
   layers), so that the concrete value of every activation is the loaded model's;
3. each segment of the chain is certified (:func:`certblocks.trace.api.certify_segment`) reading its weights through
   the same cache, emptied after each segment, and the segments are assembled as :func:`certblocks.certify`
   assembles them.

A tensor read is a view of the memory-mapped file (no copy): its pages count in the process's resident memory once
touched and until the tensor is dropped, so the peak is about the largest group (a 1B Llama's 128256 x 2048 token
table) above the interpreter and its imports (benchmarks/results/checkpoint.md).

Under ``torch.distributed`` (``distributed=None`` and an initialized process group, or ``True``) the layers are
split into contiguous ranges, one per rank: the graph runs in stages (rank ``s`` computes its layers and broadcasts
the activations it computed), each rank certifies the segments of its layers, reading only their weights (a read of
another rank's weight raises), and the segments' certificates are gathered (``all_gather_object``): every rank
returns the certificate one process returns.  ``.stack`` under pure fp16 or amp-fp16 bounds every gradient of the
graph (its loss scale, :mod:`certblocks.trace.backward`) and reads every layer once more, one at a time, on each rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

from ._validation import NonFiniteWeightError, all_finite, check_int

__all__ = ["certify_checkpoint", "certify_ranks", "is_checkpoint", "CheckpointStats", "KEEP_GROUPS"]

#: How many groups of weights (one layer's, or one tensor outside the layers) the cache keeps: two, so that a head
#: (a norm, then the output projection) or a stem (token and position tables) is read once.  A new group is read only
#: after the least recently used one is dropped, a layer's matrices are never held with another group's (another
#: layer's, a token table), and the cache is emptied after each segment's certification.
KEEP_GROUPS = 2

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_LAYER = re.compile(r"^(.*?\.\d+)\.")  # "model.layers.3.mlp.up_proj.weight" -> "model.layers.3"


def is_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a directory holding a Hugging Face ``config.json`` and safetensors weights."""
    p = os.fspath(path)
    return os.path.isdir(p) and os.path.isfile(os.path.join(p, "config.json")) and (
        os.path.isfile(os.path.join(p, _INDEX)) or os.path.isfile(os.path.join(p, _SINGLE)))


@dataclass
class CheckpointStats:
    """What a certification read (:func:`certify_checkpoint`'s ``stats``).

    Attributes:
        reads: tensors read from the safetensors files (a tensor read again after it was dropped counts again).
        bytes_read: their size in bytes, in the dtype they were certified in.
        peak_bytes: the largest number of weight bytes held at once by the cache.
        read: the names of the tensors read (each once).
    """

    reads: int = 0
    bytes_read: int = 0
    peak_bytes: int = 0
    read: Set[str] = field(default_factory=set)


def _group(name: str) -> str:
    """The group a weight is cached with: its layer (``model.layers.3``), or the tensor itself outside the layers."""
    m = _LAYER.match(name)
    return m.group(1) if m else name


class _Weights:
    """The checkpoint's tensors by state-dict name, read on demand from the memory-mapped safetensors files and kept
    in a cache of :data:`KEEP_GROUPS` groups (least recently used dropped first).

    Args:
        directory: the checkpoint directory.
        aliases: state-dict name -> the names of the same tensor (tied weights: one of them is stored).
        buffers: the model's buffers as constructed (used when the checkpoint does not store them).
        dtype: the dtype the weights are certified in (``from_pretrained`` casts the stored ones to it).
        allowed: the names this process may read (``None``: every one); another raises ``RuntimeError``.
    """

    def __init__(self, directory: str, aliases: Dict[str, List[str]], buffers: Dict[str, torch.Tensor],
                 dtype: torch.dtype, allowed: Optional[Set[str]] = None) -> None:
        from safetensors import safe_open

        index = os.path.join(directory, _INDEX)
        if os.path.isfile(index):
            with open(index) as fh:
                weight_map: Dict[str, str] = json.load(fh)["weight_map"]
        else:
            with safe_open(os.path.join(directory, _SINGLE), framework="pt") as fh:
                weight_map = {k: _SINGLE for k in fh.keys()}
        self.directory, self.weight_map, self.aliases, self.buffers = directory, weight_map, aliases, buffers
        self.dtype, self.allowed = dtype, allowed
        self._cache: OrderedDict[str, Dict[str, torch.Tensor]] = OrderedDict()
        self.stats = CheckpointStats()

    def key(self, name: str) -> Optional[str]:
        """The checkpoint key holding ``name`` (itself or a tied alias), ``None`` when it is not stored."""
        return next((k for k in [name, *self.aliases.get(name, [])] if k in self.weight_map), None)

    def _read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        key = self.key(name)
        if key is None:
            if name in self.buffers:  # a buffer the checkpoint does not store: its value as constructed
                return self.buffers[name]
            raise KeyError(f"{name!r} is neither in the checkpoint {self.directory!r} nor a buffer of the model")
        # opened for each read: a file kept open keeps the pages read from it mapped (resident) in this process
        with safe_open(os.path.join(self.directory, self.weight_map[key]), framework="pt", device="cpu") as fh:
            t = fh.get_tensor(key)
        if t.is_floating_point() and name not in self.buffers:
            t = t.to(self.dtype)
        if (t.is_floating_point() or t.is_complex()) and not all_finite(t):
            raise NonFiniteWeightError([(name, int((~torch.isfinite(t)).sum()))])
        return t

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name``, read when it is not in the cache."""
        grp = _group(name)
        held = self._cache.get(grp)
        if held is not None and name in held:
            self._cache.move_to_end(grp)
            return held[name]
        if self.allowed is not None and name not in self.allowed:
            raise RuntimeError(f"this rank read {name!r}, a weight of another rank's layers (the partition of the "
                               "checkpoint's layers across ranks is broken)")
        if held is None:  # room first: the dropped groups' pages are released before the new tensor is read
            self._make_room(grp != name)
        t = self._read(name)
        self.stats.reads += 1
        self.stats.bytes_read += t.numel() * t.element_size()
        self.stats.read.add(name)
        if held is None:
            held = self._cache[grp] = {}
        self._cache.move_to_end(grp)
        held[name] = t
        size = sum(v.numel() * v.element_size() for h in self._cache.values() for v in h.values())
        self.stats.peak_bytes = max(self.stats.peak_bytes, size)
        return t

    def _make_room(self, layer: bool) -> None:
        """Drop groups before a new one is read: a layer's group is never held with another group holding a matrix
        (the previous layer, a token table, an output projection), and at most :data:`KEEP_GROUPS` - 1 groups stay
        (least recently used dropped first).  Vectors (norms' weights, buffers) stay with a layer."""
        for grp, held in list(self._cache.items()):
            is_layer = any(n != grp for n in held)  # a layer's group is named by its prefix, another by its tensor
            if (layer or is_layer) and any(v.dim() >= 2 for v in held.values()):
                del self._cache[grp]
        while len(self._cache) >= KEEP_GROUPS:
            self._cache.popitem(last=False)

    def drop(self) -> None:
        """Empty the cache."""
        self._cache.clear()


class _LazyEnv(dict):
    """A captured graph's ``env`` whose parameter and buffer placeholders hold meta tensors (shapes and dtypes) and
    are read from the checkpoint when a certificate asks for their value."""

    def __init__(self, env: Dict[str, Any], lazy: Dict[str, str], weights: _Weights) -> None:
        super().__init__(env)
        self.lazy, self.weights = lazy, weights

    def __getitem__(self, key: str) -> Any:
        if key in self.lazy:
            return self.weights.get(self.lazy[key])
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.lazy:
            return self.weights.get(self.lazy[key])
        return super().get(key, default)


# ------------------------------------------------------------------------------------------------ the skeleton
@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside hold their parameters on the meta device (no storage) and their buffers as computed."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and p.device.type != "meta":
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _skeleton(directory: str, dtype: Optional[torch.dtype]) -> Tuple[nn.Module, torch.dtype]:
    """The causal-LM model of the checkpoint's config, parameters on the meta device, in eval mode."""
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - transformers is in the test environment
        raise ImportError("certifying a checkpoint needs transformers (pip install 'certblocks[hf]')") from exc
    config = transformers.AutoConfig.from_pretrained(directory)
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with _parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), dtype


def _aliases(model: nn.Module) -> Dict[str, List[str]]:
    """Each parameter's name -> the other names of the same tensor (tied embeddings)."""
    by_id: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {n: [m for m in names if m != n] for names in by_id.values() for n in names if len(names) > 1}


def _unbacked_parameters(model: nn.Module) -> None:
    """Give every meta parameter CPU storage that is allocated but never written (``torch.empty``): the operating
    system backs a page only once it is written, so the capture's run on these weights (zero pages) costs no
    memory, and the graph is exported for the CPU exactly as the loaded model's is (a capture on the meta device
    gives other strides, hence other nodes).  Tied parameters stay tied."""
    new: Dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.device.type == "meta":
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                mod._parameters[name] = new[id(p)]


# ------------------------------------------------------------------------------------------------ the run
def _run_nodes(g: Any, nodes: Sequence[torch.fx.Node]) -> Dict[str, Any]:
    """Run ``nodes`` of the graph concretely, in order, reading their arguments from ``g.env`` (weights through the
    checkpoint's cache); their values are written to ``g.env`` and returned."""
    interp = torch.fx.Interpreter(g.ep.graph_module, garbage_collect_values=False)
    out: Dict[str, Any] = {}
    with torch.no_grad():
        for n in nodes:
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: g.env[a.name])
            if n.op == "output":
                val = args[0]
            else:
                val = getattr(interp, n.op)(n.target, args, kwargs)
            g.env[n.name] = out[n.name] = val
    return out


def _owners(g: Any, groups: Sequence[str], world: int) -> Dict[str, int]:
    """The rank that computes each node: a node inside layer ``i`` (its module stack holds the layer's path) belongs
    to rank ``i * world // len(groups)``; any other node to the rank of the last layer node before it (rank 0 before
    the first)."""
    rank_of = {grp: i * world // len(groups) for i, grp in enumerate(groups)}
    owners: Dict[str, int] = {}
    current = 0
    for n in g.nodes:
        for path, _ in g.module_stack(n):
            if path in rank_of:
                current = rank_of[path]
                break
        owners[n.name] = current
    return owners


def _placeholder_names(g: Any, nodes: Sequence[torch.fx.Node], lazy: Dict[str, str]) -> Set[str]:
    """The weights (state-dict names) the nodes read."""
    return {lazy[a.name] for n in nodes for a in n.all_input_nodes if a.name in lazy}


# ------------------------------------------------------------------------------------------------ the function
def certify_checkpoint(path: Union[str, os.PathLike], *, seq_len: int = 8, example_input: Any = None,
                       weights_dtype: Optional[torch.dtype] = None, distributed: Optional[bool] = None,
                       group: Any = None, stats: Optional[CheckpointStats] = None) -> Any:
    """Certify a Hugging Face causal-LM checkpoint directory one layer at a time (module docstring).

    Args:
        path: the directory: ``config.json`` and ``model.safetensors`` or ``model.safetensors.index.json`` with its
            shards.
        seq_len: the length of the example token ids (the certificate holds at that length), when ``example_input``
            is not given: ids drawn as ``certblocks certify hf:...`` draws them (``torch.Generator`` seeded 0).
        example_input: the batch to capture the graph on (token ids ``(batch, seq)``, or a tuple / mapping of
            arguments as :func:`certblocks.certify` takes them).
        weights_dtype: the dtype the weights are certified in; ``None``: the config's ``dtype``, as
            ``from_pretrained`` loads them by default (float32 when the config names none).
        distributed: split the layers across the ranks of ``torch.distributed`` (``None``: when a process group is
            initialized with more than one rank).
        group: the process group (``None``: the default one).
        stats: filled with what was read (:class:`CheckpointStats`).

    Returns:
        The :class:`~certblocks.trace.ModelCertificate` of the model (``.stack(dtype, r0=...)`` certifies it in a
        dtype), identical to :func:`certblocks.certify` on the model loaded whole.

    Raises:
        ValueError: ``path`` is not a checkpoint directory, ``seq_len`` is not an integer >= 1, or the model is not
            one chain of residual updates (the layer-by-layer reading needs the chain).
        NonFiniteWeightError: a weight holds NaN or inf (named by its path).
        certblocks.trace.CaptureError: ``torch.export`` cannot capture the model.
    """
    from .model import as_args
    from .trace.capture import capture

    directory = os.fspath(path)
    if not is_checkpoint(directory):
        raise ValueError(f"path must be a Hugging Face checkpoint directory (config.json and {_SINGLE} or {_INDEX}), "
                         f"got {directory!r}")
    if weights_dtype is not None and not (isinstance(weights_dtype, torch.dtype) and weights_dtype.is_floating_point):
        raise TypeError(f"weights_dtype must be a floating torch.dtype or None, got {weights_dtype!r}")
    rank, world = _process_group(distributed, group)
    model, dtype = _skeleton(directory, weights_dtype)
    if example_input is None:
        check_int("seq_len", seq_len)
        vocab = int(getattr(model, "config").vocab_size)  # noqa: B009 - an HF model's config (typed as a Module)
        example_input = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(0))
    args, kwargs = as_args(example_input)
    buffers = dict(model.named_buffers())  # as constructed: the checkpoint may not store them (rotary frequencies)
    _unbacked_parameters(model)
    g = capture(model, args, kwargs)  # its run reads unwritten pages: every value is recomputed below
    lazy = {ph: name for ph, name in g.params.items()}
    weights = _Weights(directory, _aliases(model), buffers, dtype)
    g.env = _LazyEnv(g.env, lazy, weights)  # the weights' entries keep their unwritten tensors (shapes, dtypes)
    user = {ph.name: x for ph, x in zip(g.user_inputs, _flat_inputs(g, args, kwargs))}
    for name, x in user.items():
        g.env[name] = x
    compute = [n for n in g.nodes if n.op != "placeholder"]
    groups = list(dict.fromkeys(_group(w) for w in lazy.values() if _LAYER.match(w)))
    if world == 1 or not groups:
        _run_nodes(g, compute)
        owners: Dict[str, int] = {n.name: rank for n in g.nodes}  # no layers to split: every rank certifies all
        world = 1
    else:
        owners = _owners(g, groups, world)
        weights.allowed = _placeholder_names(g, [n for n in compute if owners[n.name] == rank], lazy)
        _run_staged(g, compute, owners, rank, world, group)
    weights.drop()
    what = f"{type(model).__name__} in {directory!r}"
    rep = _certify_owned(g, type(model).__name__, what, owners, rank, world, group, weights)
    weights.drop()
    if stats is not None:
        stats.reads, stats.bytes_read = weights.stats.reads, weights.stats.bytes_read
        stats.peak_bytes, stats.read = weights.stats.peak_bytes, set(weights.stats.read)
    return rep


def _certify_owned(g: Any, model_name: str, what: str, owners: Dict[str, int], rank: int, world: int, group: Any,
                   weights: Optional[_Weights] = None, certify: Optional[Callable[[Any, Any], Dict[int, Any]]] = None
                   ) -> Any:
    """The chain of the graph (every value computed), this rank's segments certified (those whose output node it
    owns, or ``certify(g, chain)``'s: an FSDP2 model's, :mod:`certblocks._fsdp`), gathered from every rank and
    assembled (:func:`certblocks.trace.api._certify_chain`)."""
    from .trace.api import _certify_chain, certify_segment
    from .trace.chain import model_chain
    from .trace.residual import find_residual_updates

    ups = find_residual_updates(g)
    chain = model_chain(g, ups) if ups else None
    if chain is None or not chain.segments:
        why = chain.notes[0] if chain is not None and chain.notes else "it has no residual update on one path"
        raise ValueError(f"{what} is not one chain of residual updates ({why}): certify the loaded model with "
                         "certblocks.certify instead")
    if certify is not None:
        certs = certify(g, chain)
        if weights is not None:
            weights.drop()
    else:
        certs = {}
        for k, s in enumerate(chain.segments):
            if owners[s.end.name] == rank:
                certs[k] = certify_segment(g, s, k)
                if weights is not None:  # the next segment reads other weights (a tied table: the stem's and the
                    weights.drop()  # head's, far apart): no two segments' tensors held at once
    if world > 1:
        import torch.distributed as dist

        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, certs, group=group)
        certs = {k: tc for part in gathered for k, tc in part.items()}
        if weights is not None:
            weights.allowed = None  # the outputs and the loss-scale pass (.stack in fp16) read every layer again
    return _certify_chain(g, chain, model_name, certified=[certs[k] for k in range(len(chain.segments))])


def certify_ranks(module: nn.Module, example_input: Any, *, group: Any = None) -> Any:
    """Certify an in-memory model from its graph with the layers split across the ranks of ``torch.distributed``.

    Every rank holds the model (as under DDP) and captures its graph on ``example_input`` (the same on every rank);
    rank ``r`` certifies the segments of its contiguous range of layers and the segments' certificates are gathered
    (``all_gather_object``): every rank returns :func:`certblocks.certify`'s certificate (``residual="auto"``), in
    about ``1 / world`` of its time.  Without an initialized process group: :func:`certblocks.certify` itself.
    An FSDP2 model (``fully_shard``) is certified with one unit unsharded at a time, the ranks sharing each unit's
    segments (:func:`certblocks._fsdp.certify_fsdp`).

    Args:
        module: the model (in eval mode for a certificate of the model as it runs in inference: dropout off).
        example_input: a batch (a tensor, a tuple of positional arguments, a mapping of keyword arguments).
        group: the process group (``None``: the default one).

    Raises:
        ValueError: the model is not one chain of residual updates.
        NonFiniteWeightError: a weight holds NaN or inf.
        certblocks.trace.CaptureError: ``torch.export`` cannot capture the model.
    """
    from ._validation import check_finite
    from .model import as_args
    from .trace.capture import capture

    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    from ._fsdp import certify_fsdp, is_fsdp

    if is_fsdp(module):  # sharded: one unit unsharded at a time (certblocks._fsdp)
        return certify_fsdp(module, example_input, group=group)
    rank, world = _process_group(None, group)
    check_finite(module)
    args, kwargs = as_args(example_input)
    g = capture(module, args, kwargs)
    groups = list(dict.fromkeys(_group(w) for w in g.params.values() if _LAYER.match(w)))
    if groups and world > 1:
        owners = _owners(g, groups, world)
    else:  # one process, or no layers to split: every rank certifies every segment
        owners, world = {n.name: rank for n in g.nodes}, 1
    return _certify_owned(g, type(module).__name__, type(module).__name__, owners, rank, world, group)


def _flat_inputs(g: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[Any]:
    """The user inputs in the order of the graph's user placeholders (as the capture ran them)."""
    from .trace.capture import _user_leaves

    kw = dict(kwargs)
    if "use_cache" not in kw:
        kw["use_cache"] = False
    leaves, _ = torch.utils._pytree.tree_flatten((tuple(args), kw))
    return _user_leaves(g.ep, leaves)


def _process_group(distributed: Optional[bool], group: Any) -> Tuple[int, int]:
    """``(rank, world size)`` of the certification (``(0, 1)``: one process)."""
    if distributed is not None and not isinstance(distributed, bool):
        raise TypeError(f"distributed must be True, False or None, got {distributed!r}")
    import torch.distributed as dist

    ready = dist.is_available() and dist.is_initialized()
    if distributed and not ready:
        raise ValueError("distributed=True needs an initialized torch.distributed process group "
                         "(torch.distributed.init_process_group)")
    if not ready or distributed is False:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _run_staged(g: Any, compute: Sequence[torch.fx.Node], owners: Dict[str, int], rank: int, world: int,
                group: Any) -> None:
    """The graph's run split across ranks: stage ``s``, rank ``s`` computes its nodes and broadcasts their values
    (weights excluded: activations only), which every rank writes to its ``env``."""
    import torch.distributed as dist

    for s in range(world):
        box: List[Any] = [None]
        if rank == s:
            box[0] = _run_nodes(g, [n for n in compute if owners[n.name] == s])
        src = dist.get_global_rank(group, s) if group is not None else s
        dist.broadcast_object_list(box, src=src, group=group)
        if rank != s:
            for name, val in box[0].items():
                g.env[name] = val
