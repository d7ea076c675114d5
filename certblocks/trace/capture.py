"""Graph capture with ``torch.export`` (aten level) and one concrete run of the graph.

:func:`capture` exports a module (first ``strict=False``, then ``strict=True``), runs the
exported graph once on the example input keeping every node's value (constants of a velocity
are read from this run), and records module paths from the ``nn_module_stack`` metadata.

Under a precision policy (``precision=``, :mod:`certblocks.precision`; docs/theory.md section 7) the module is
captured as the policy runs it: parameters and floating inputs cast to the policy's dtypes, and with autocast the
graph is exported inside ``torch.autocast(device_type, dtype)`` and lowered again under it
(``run_decompositions``), which writes autocast's casts into the graph as explicit ``aten._to_copy`` nodes carrying
the module stack of the op that reads them.  The concrete run of that graph (outside autocast) holds each node's
value in the dtype the policy holds it in: :func:`held_dtype` reads it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import io
import logging
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ..budget import dtype_name
from ..precision import Precision, as_precision

__all__ = ["CapturedGraph", "capture", "CaptureError", "held_dtype", "torch_dtype"]

_PREFIX = "inner."


class CaptureError(RuntimeError):
    """``torch.export`` could not capture the module."""


def _flatten_output(o: Any) -> Tuple[torch.Tensor, ...]:
    if isinstance(o, torch.Tensor):
        return (o,)
    if isinstance(o, dict) or hasattr(o, "items"):
        out: List[torch.Tensor] = []
        for v in o.values() if isinstance(o, dict) else dict(o.items()).values():
            out.extend(_flatten_output(v))
        return tuple(out)
    if isinstance(o, (list, tuple)):
        out = []
        for v in o:
            out.extend(_flatten_output(v))
        return tuple(out)
    if dataclasses.is_dataclass(o) and not isinstance(o, type):  # an output dataclass that is not a mapping
        out = []
        for f in dataclasses.fields(o):
            out.extend(_flatten_output(getattr(o, f.name)))
        return tuple(out)
    return ()


class _Wrapper(nn.Module):
    """Calls the module and returns its tensors as a flat tuple (HF ModelOutput, caches...)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Tuple[torch.Tensor, ...]:
        return _flatten_output(self.inner(*args, **kwargs))


class CapturedGraph:
    """An exported graph with the concrete value of every node on the example input.

    Attributes:
        ep: the ``torch.export.ExportedProgram``.
        graph: its ``torch.fx.Graph``.
        nodes: the nodes in topological order.
        env: node name -> concrete value on the example input.
        user_inputs: the placeholder nodes of the user inputs (flattened).
        outputs: the output nodes (flattened).
        params: placeholder name -> state_dict name of parameters/buffers/constants.
        root: the module that was captured (under a policy that casts the parameters: the cast copy).
        strict: the ``strict`` flag that succeeded.
        precision: the :class:`~certblocks.precision.Precision` the graph was captured under (``None``: as the
            module is, every node in the dtype its own run gives).
    """

    def __init__(self, ep: Any, root: nn.Module, flat_inputs: Sequence[Any], strict: bool,
                 precision: Optional[Precision] = None) -> None:
        self.ep = ep
        self.root = root
        self.strict = strict
        self.precision = precision
        self.graph = ep.graph_module.graph
        self.nodes: List[torch.fx.Node] = list(self.graph.nodes)
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        sig = ep.graph_signature
        self.params: Dict[str, str] = {}
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        specs = list(sig.input_specs)
        args: List[Any] = []
        user_iter = iter(flat_inputs)
        self.user_inputs: List[torch.fx.Node] = []
        state = ep.state_dict
        consts = getattr(ep, "constants", {}) or {}
        for ph, spec in zip(placeholders, specs):
            kind = spec.kind.name
            if kind == "USER_INPUT":
                args.append(next(user_iter))
                self.user_inputs.append(ph)
            else:
                tgt = spec.target
                self.params[ph.name] = _strip_prefix(tgt)
                val = state[tgt] if tgt in state else consts.get(tgt)
                args.append(val)
        out_node = next(n for n in reversed(self.nodes) if n.op == "output")
        self.outputs = [a for a in _flat_nodes(out_node.args[0])]
        self.env: Dict[str, Any] = {}
        env = self.env

        class _Rec(torch.fx.Interpreter):
            def run_node(self, n: torch.fx.Node) -> Any:
                r = super().run_node(n)
                env[n.name] = r
                return r

        # a graph captured under a policy holds its casts as nodes: run it as written (a caller's autocast would cast
        # again); one captured as the module is runs in the caller's autocast, as the module would
        with torch.no_grad(), _no_autocast() if precision is not None else contextlib.nullcontext():
            _Rec(ep.graph_module, garbage_collect_values=False).run(*args)
        # ancestor bitsets (node i -> int with bit j set when node j is an ancestor-or-self)
        self._anc: Optional[List[int]] = None

    # structure ------------------------------------------------------------------------------
    def ancestors(self) -> List[int]:
        if self._anc is None:
            anc: List[int] = []
            for i, n in enumerate(self.nodes):
                m = 1 << i
                for a in n.all_input_nodes:
                    m |= anc[self.index[a.name]]
                anc.append(m)
            self._anc = anc
        return self._anc

    def is_ancestor(self, a: torch.fx.Node, b: torch.fx.Node) -> bool:
        """``a`` is an ancestor of ``b`` (or ``a is b``)."""
        return bool(self.ancestors()[self.index[b.name]] >> self.index[a.name] & 1)

    def between(self, x: torch.fx.Node, out: torch.fx.Node) -> Set[str]:
        """Names of the nodes that depend on ``x`` and feed ``out`` (both included)."""
        anc = self.ancestors()
        out_anc = anc[self.index[out.name]]
        ix = self.index[x.name]
        res = set()
        for i, n in enumerate(self.nodes):
            if (out_anc >> i) & 1 and (anc[i] >> ix) & 1:
                res.add(n.name)
        return res

    def depends_on_input(self) -> Set[str]:
        dep: Set[str] = {n.name for n in self.user_inputs}
        for n in self.nodes:
            if n.name in dep:
                continue
            if any(a.name in dep for a in n.all_input_nodes):
                dep.add(n.name)
        return dep

    def module_stack(self, n: torch.fx.Node) -> List[Tuple[str, str]]:
        """``[(path, type qualname), ...]`` from the outermost module to the innermost (root excluded)."""
        st = n.meta.get("nn_module_stack") or {}
        out = []
        for v in st.values():
            path, typ = v[0], v[1]
            if not isinstance(typ, str):
                typ = f"{typ.__module__}.{typ.__qualname__}"
            path = _strip_prefix(path)
            if path in ("", "inner"):
                continue
            out.append((path, typ))
        return out

    def module_calls(self, n: torch.fx.Node) -> List[Tuple[str, str, str]]:
        """``[(call key, path, type qualname), ...]`` outermost first, as :meth:`module_stack` plus the key of each
        call (``nn_module_stack`` has one per call: a module called twice has two)."""
        stack = self.module_stack(n)
        keys = list((n.meta.get("nn_module_stack") or {}).keys())
        return [(k, p, t) for k, (p, t) in zip(keys[len(keys) - len(stack):], stack)]

    def module_path(self, n: torch.fx.Node) -> str:
        st = self.module_stack(n)
        return st[-1][0] if st else ""

    def get_module(self, path: str) -> Optional[nn.Module]:
        try:
            return self.root.get_submodule(path) if path else self.root
        except AttributeError:
            return None

    def param_name(self, n: Any) -> Optional[str]:
        return self.params.get(n.name) if isinstance(n, torch.fx.Node) else None

    def dtype_of(self, n: Any, index: int = 0) -> Optional[str]:
        """:func:`held_dtype` of ``n`` in this graph."""
        return held_dtype(self, n, index)


def held_dtype(g: CapturedGraph, n: Any, index: int = 0) -> Optional[str]:
    """The dtype a node's value is held in, under the policy ``g`` was captured under (``g.precision``).

    Read from the node's concrete value in the captured run (docs/theory.md section 7: the graph tells, not a list of
    ops): under ``amp-fp16`` a ``linear`` node is ``"fp16"``, the residual add of an fp32 stream and an fp16 branch
    ``"fp32"``, an autocast cast ``aten._to_copy`` of an fp32 value ``"fp16"``.

    Args:
        g: the captured graph.
        n: a node of it (or its name).
        index: for a node with several outputs (``split``, ``native_layer_norm``), which one.

    Returns:
        The canonical dtype name (``"fp16"``, ``"bf16"``, ``"fp32"``, ...; a complex value: its parts'), or ``None``
        for a value that is not a floating tensor (integers, booleans, ``None``) or one certblocks has no range for.
    """
    name = n.name if isinstance(n, torch.fx.Node) else n
    v = g.env.get(name)
    if isinstance(v, (tuple, list)):
        v = v[index] if 0 <= index < len(v) else None
    if not isinstance(v, torch.Tensor) or not (v.is_floating_point() or v.is_complex()):
        return None
    try:
        return dtype_name(v.dtype.to_real() if v.is_complex() else v.dtype)
    except ValueError:  # a floating dtype certblocks has no range for
        return None


def _strip_prefix(path: str) -> str:
    return path[len(_PREFIX):] if path.startswith(_PREFIX) else path


def _flat_nodes(x: Any) -> List[torch.fx.Node]:
    if isinstance(x, torch.fx.Node):
        return [x]
    if isinstance(x, (list, tuple)):
        out: List[torch.fx.Node] = []
        for v in x:
            out.extend(_flat_nodes(v))
        return out
    if isinstance(x, dict):
        out = []
        for v in x.values():
            out.extend(_flat_nodes(v))
        return out
    return []


def _flat_tensors(x: Any) -> List[Any]:
    if isinstance(x, (list, tuple)):
        out: List[Any] = []
        for v in x:
            out.extend(_flat_tensors(v))
        return out
    if isinstance(x, dict):
        out = []
        for v in x.values():
            out.extend(_flat_tensors(v))
        return out
    return [x]


def _has_mutation(ep: Any) -> bool:
    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable and "assert" not in schema.name:
            return True
    return False


def _has_autocast(ep: Any) -> bool:
    """The graph holds an autocast region (``torch.autocast`` inside the forward, even a disabled one: timm's
    ``LiteMLA`` turns autocast off around its linear attention)."""
    return any(n.op == "call_function" and "autocast" in str(n.target) for n in ep.graph.nodes)


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Silence torch while exporting: a failed attempt prints and logs whole graphs; the CaptureError says why."""
    names = [n for n in logging.root.manager.loggerDict if n == "torch" or n.startswith("torch.")]
    saved = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)


def _export_key(module: nn.Module, leaves: Sequence[Any], spec: Any) -> Tuple[Any, ...]:
    """What an exported program depends on besides the values of its tensors: the inputs' shapes, dtypes and
    devices and the other arguments' values, the modules (types, training flags, hooks), the identity of every
    parameter and buffer (the program reads them by reference: values updated in place are seen), autocast and
    grad mode."""
    sig = tuple((tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else ("value", repr(x))
                for x in leaves)
    mods = tuple((n, type(m), m.training, len(m._forward_hooks), len(m._forward_pre_hooks))
                 for n, m in module.named_modules())
    tensors = tuple(id(t) for t in module.parameters()) + tuple(id(t) for t in module.buffers())
    amp: List[Tuple[str, Optional[bool], Optional[torch.dtype]]] = []
    for dev in ("cpu", "cuda"):
        try:
            amp.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))
        except (RuntimeError, TypeError, AttributeError):  # pragma: no cover - older torch
            amp.append((dev, None, None))
    return id(module), str(spec), sig, mods, tensors, tuple(amp), torch.is_grad_enabled()


def capture(module: nn.Module, args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]] = None, *,
            cache: Optional[Dict[Any, Any]] = None, precision: Any = None) -> CapturedGraph:
    """Export ``module`` on ``args``/``kwargs`` and run the graph once.

    HF models get ``use_cache=False`` when their forward accepts it.  Raises
    :class:`CaptureError` naming both export attempts' errors when neither works.

    Args:
        cache: a dict that keeps exported programs across calls (a monitor's checks): a call whose inputs have the
            same shapes, dtypes and other arguments, on the same modules, parameters (by identity: values
            updated in place are read again), autocast, grad mode and policy, runs the program already exported
            instead of exporting again.  It keeps the last 4 programs.
        precision: a precision policy (anything :func:`certblocks.precision.as_precision` accepts) to capture the
            module under (module docstring): parameters whose dtype differs from the policy's are cast on a copy of
            the module (the module itself is not changed), floating inputs are cast to the stream's dtype, and
            under autocast the casts are nodes of the graph.  ``None``: the module as it is.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    prec = None if precision is None else as_precision(precision)
    kwargs = dict(kwargs or {})
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "use_cache" in params and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    leaves, spec = torch.utils._pytree.tree_flatten((tuple(args), kwargs))
    device = _device_type(module, leaves)
    if prec is not None:
        module = _with_params(module, prec)
        leaves = [_cast_input(x, prec) for x in leaves]
        args, kwargs = torch.utils._pytree.tree_unflatten(leaves, spec)
    key = _export_key(module, leaves, spec) + (None if prec is None else (prec, device),) if cache is not None else None
    if cache is not None and key in cache:
        ep, strict = cache[key]
        return CapturedGraph(ep, module, _user_leaves(ep, leaves), strict, prec)
    wrapper = _Wrapper(module)
    errors = []
    with _autocast(prec, device):
        for strict in (False, True):
            try:
                with _quiet_torch_logs():
                    ep = torch.export.export(wrapper, tuple(args), kwargs=kwargs, strict=strict)
                break
            except Exception as exc:  # report both attempts
                errors.append(f"strict={strict}: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}")
        else:
            raise CaptureError(f"torch.export could not capture {type(module).__name__}; " + " | ".join(errors))
        autocast = prec is not None and prec.autocast_dtype is not None
        if autocast or _has_mutation(ep) or _has_autocast(ep):
            # in-place ops (x += y, relu_) break dataflow reasoning, and an autocast region inside the forward is a
            # higher-order op around a sub-graph: functionalize and inline (no decomposition); under a policy's
            # autocast the lowering runs inside it; autocast's casts become explicit _to_copy nodes
            try:
                with _quiet_torch_logs():
                    ep = ep.run_decompositions({})
            except Exception as exc:
                what = "be lowered under autocast" if autocast else \
                    "be functionalized (it has in-place ops or an autocast region)"
                raise CaptureError(f"the graph of {type(module).__name__} could not {what}: "
                                   f"{type(exc).__name__}: {exc}") from exc
    if cache is not None:
        while len(cache) >= 4:
            cache.pop(next(iter(cache)))
        cache[key] = (ep, strict)
    return CapturedGraph(ep, module, _user_leaves(ep, leaves), strict, prec)


_TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical name (``"fp16"`` -> ``torch.float16``; fp8 formats too)."""
    name = dtype_name(name)
    if name in _TORCH_DTYPES:
        return _TORCH_DTYPES[name]
    attr = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "fp8_e4m3fnuz": "float8_e4m3fnuz",
            "fp8_e5m2fnuz": "float8_e5m2fnuz"}[name]
    return getattr(torch, attr)


def _device_type(module: nn.Module, leaves: Sequence[Any]) -> str:
    """The device type the module runs on (its first parameter's or buffer's, else its first tensor input's)."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device.type
    for x in leaves:
        if isinstance(x, torch.Tensor):
            return x.device.type
    return "cpu"


def _with_params(module: nn.Module, prec: Precision) -> nn.Module:
    """``module``, or a copy of it whose floating parameters are cast to the policy's parameter dtype (FSDP's
    ``param_dtype``; buffers are kept, as FSDP keeps them)."""
    dt = torch_dtype(prec.param_dtype)
    if all(p.dtype == dt for p in module.parameters() if p.is_floating_point()):
        return module
    copy_ = copy.deepcopy(module)
    with torch.no_grad():
        for p in copy_.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dt)
    return copy_


def _cast_input(x: Any, prec: Precision) -> Any:
    """A floating tensor input in the policy's stream dtype (FSDP's ``cast_forward_inputs``); anything else as is."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(torch_dtype(prec.stream_dtype))
    return x


@contextlib.contextmanager
def _no_autocast() -> Iterator[None]:
    """Autocast off on the CPU and, where there is one, on CUDA."""
    with contextlib.ExitStack() as stack:
        for dev in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
            stack.enter_context(torch.autocast(dev, enabled=False))
        yield


@contextlib.contextmanager
def _autocast(prec: Optional[Precision], device: str) -> Iterator[None]:
    """``torch.autocast(device, dtype)`` of the policy (nothing without one)."""
    if prec is None or prec.autocast_dtype is None:
        yield
        return
    with torch.autocast(device, dtype=torch_dtype(prec.autocast_dtype)):
        yield


def _user_leaves(ep: Any, leaves: List[Any]) -> List[Any]:
    """The user inputs in the exported order (pytree flattening of args then kwargs)."""
    n_user = sum(1 for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT")
    if len(leaves) != n_user:
        leaves = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    return leaves
