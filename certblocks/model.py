"""The model spine: :func:`as_certified`, the one place that knows what kind of object a user handed in.

Every part of certblocks that works on a whole model -- :class:`~certblocks.CertificateMonitor`,
:func:`certblocks.trajectory`, :func:`certblocks.enforce` / :func:`~certblocks.unenforce` /
:func:`~certblocks.enforcement.cap_factor` and :class:`~certblocks.integrations.CertificateCallback` -- reads it
through :func:`as_certified`, which returns a :class:`CertifiedModel`: the residual updates ``v_k`` in depth order
(``X_{k+1} = X_k + dt v_k(X_k)``, docs/theory.md section 3) with their names, the input radius ``r0``, the
sequence length, ``dt``, the head (``Lip(G)`` or a head certificate), the underlying module and how to call it on a
batch.  It recognizes

* a :class:`~certblocks.CertifiedStack` (its blocks, ``dt``, ``r0``, ``lip_g``, ``seq_len``, given certificates);
* a model that lists its own updates (:class:`ResidualModel`: every zoo model);
* a converted model or its :class:`~certblocks.ConversionReport`: every module with a ``certificate()`` and an
  ``exponents`` that is not inside another one, in module order (a layer with ``updates()`` and
  ``certificates()`` gives each of its updates);
* ``DistributedDataParallel`` / ``DataParallel`` / FSDP (``.module``) and ``torch.compile`` (``_orig_mod``)
  wrappers around any of these (the wrapper is what :meth:`CertifiedModel.__call__` calls);
* a sequence of ``(name, module)`` pairs;
* any other ``nn.Module``: no update is known before its graph is read (kind ``"graph"``: :func:`certblocks.certify`
  finds the updates in the graph captured on ``example_input``; the trajectory on the batch).

Blocks are never recognized by class: what a block can do is a capability it exposes -- ``certificate()``,
``levers()`` (the knobs a fix may name), ``cap_slots()`` (what :func:`~certblocks.enforce` caps),
``attention_stats(x)`` (an attention's query-key coefficient and largest logit) and ``velocity_io()`` (an update
whose branch and output are separate modules of the forward, a gained branch).

**The certified envelope** (:class:`Envelope`, :mod:`certblocks.envelope`): a forward outside what a certificate
assumed warns (:class:`EnvelopeWarning`) or raises, and ``certificate()`` is then computed at the envelope used.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    Union,
    runtime_checkable,
)

from torch import nn

from ._calls import as_args, state_of, unwrap, velocity_output, with_state
from ._validation import check_bool, check_int, check_real
from .bounds import one_thread
from .certificate import BlockCertificate, StackCertificate, certify_stack
from .envelope import CertificateWarning, Envelope, EnvelopeWarning, envelope_paused
from .precision import as_precision

if TYPE_CHECKING:  # pragma: no cover
    from .fixes import Fix, Lever

# certblocks.stack is imported where it is used (importing it here would load every block with the spine)

__all__ = ["CertifiedModel", "ResidualModel", "Envelope", "CertificateWarning", "EnvelopeWarning", "as_certified",
           "as_args", "unwrap", "state_of", "with_state", "velocity_output", "envelope_paused", "KINDS"]

#: What :func:`as_certified` can be handed, as :attr:`CertifiedModel.kind`.
KINDS = ("stack", "zoo", "blocks", "pairs", "graph")

class _EnvelopeHook:
    """The forward pre-hook that checks a converted model's first update (a callable object: ``copy.deepcopy`` and
    pickling carry the envelope with the model)."""

    def __init__(self, envelope: Envelope) -> None:
        self.envelope = envelope

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        found = state_of(module, args, kwargs)
        if found is not None:
            self.envelope.check(found[0], stacklevel=7)


# ------------------------------------------------------------------------------------------------ the protocol
@runtime_checkable
class ResidualModel(Protocol):
    """A model that lists its own residual updates (every zoo model; any user model may implement it).

    ``residual_updates()`` gives ``(module path, velocity)`` in depth order (step ``dt = 1``),
    ``input_radius()`` a sound bound on the per-token norm of the first update's input, and
    ``certificate_seq_len()`` the sequence length the certificates are for.  Optional: ``head_certificate()``,
    ``update_certificates(seq_len=...)``, ``certificate(dtype, ...)``, ``levers()``, ``loss_gradient``.
    """

    def residual_updates(self) -> List[Tuple[str, nn.Module]]: ...

    def input_radius(self) -> float: ...

    def certificate_seq_len(self) -> int: ...


def _lists_updates(model: Any) -> bool:
    return all(callable(getattr(model, a, None)) for a in ("residual_updates", "input_radius", "certificate_seq_len"))


def _real(name: str, value: Any, *, positive: bool = False) -> Optional[float]:
    return check_real(name, value, positive=positive, nonnegative=not positive, optional=True)


#: The scope of a converted model's certificate computed without a batch (:attr:`StackCertificate.scope`).
BLOCKS_ONLY = ("the chain of the model's certified blocks, each a velocity of its own input, from r0 with the stated "
               "Lip(G): the modules around them (kept normalizations, branches left unconverted, the stem and the "
               "head) are not covered; pass example_input= to as_certified for the model's certificate read from its "
               "graph")


@dataclass
class CertifiedModel:
    """A model as certblocks reads it (:func:`as_certified`): its residual updates in depth order and the run
    parameters of its certificate.

    Attributes:
        names: one label per update (module paths where known).
        modules: the velocity modules ``v_k`` (empty for kind ``"graph"``: the updates are in the graph).
        dt: the residual step.
        r0: bound on the per-token norm of the first update's input; a callable is re-read at each check (a zoo
            model's ``input_radius``, computed from the embedding weights).
        seq_len: the sequence length offered to the certificates (``None``: the blocks' default).
        lip_g: ``Lip(G)`` of the head where no head certificate stands for it.
        fixed: a given certificate per update, or ``None`` (computed from the module).
        kind: one of :data:`KINDS`.
        module: the underlying ``nn.Module`` (unwrapped; ``None`` for ``(name, module)`` pairs).
        wrapper: what :meth:`__call__` calls (the object handed in: a DDP or compiled wrapper calls through it).
        dtype: the model's own certification dtype (a stack's, a zoo model's ``cert_dtype``), else ``None``.
        example_input: the batch a ``"graph"`` model's certificate is captured on.
        residual: how a ``"graph"`` model's updates are found in its graph (:func:`certblocks.certify`'s
            ``residual``: ``"auto"``, ``None`` for the whole model as one velocity, or module path patterns).
        r0_given, seq_len_given, lip_g_given: ``r0`` / ``seq_len`` / ``lip_g`` were given to :func:`as_certified`
            (they override the model's own).
        strict: the envelope's ``strict`` to set when :meth:`certificate` records one (``None``: leave it).
    """

    names: List[str]
    modules: List[nn.Module] = field(repr=False)
    dt: float = 1.0
    r0: Union[float, Callable[[], float]] = 1.0
    seq_len: Optional[int] = None
    lip_g: float = 1.0
    fixed: List[Optional[BlockCertificate]] = field(default_factory=list, repr=False)
    kind: str = "pairs"
    module: Optional[nn.Module] = field(default=None, repr=False)
    wrapper: Any = field(default=None, repr=False)
    dtype: Optional[str] = None
    example_input: Any = field(default=None, repr=False)
    residual: Any = "auto"
    r0_given: bool = False
    seq_len_given: bool = False
    lip_g_given: bool = False
    strict: Optional[bool] = None
    _traced: Any = field(default=None, repr=False, compare=False)  # (key, ModelCertificate) of graph_report()

    # -- the updates -------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.modules)

    def __bool__(self) -> bool:  # a "graph" model has no update listed, and is still a model
        return True

    def __iter__(self) -> Iterator[Tuple[str, nn.Module]]:
        return iter(zip(self.names, self.modules))

    def radius(self) -> float:
        """``r0`` now (a callable is evaluated)."""
        return float(self.r0()) if callable(self.r0) else float(self.r0)

    @property
    def stack_forward(self) -> bool:
        """The module's forward is the chain ``X_{k+1} = X_k + dt v_k(X_k)`` of these updates (a stack, a zoo
        model): hooks on the updates give every state.  A converted model's blocks may sit behind kept
        normalizations: its states are read from its graph."""
        return self.kind in ("stack", "zoo")

    @property
    def reads_graph(self) -> bool:
        """The certificate is read from the graph captured on :attr:`example_input`: a model without certified blocks
        (kind ``"graph"``), or a model with certified blocks handed in with a batch (kind ``"blocks"``: a converted
        model certified as it runs -- its kept normalizations, its branches left unconverted and its head in the
        chain, each certified block by its own certificate where an update is exactly that block).  Without a batch
        a converted model's certificate is the chain of its blocks (what the monitor watches and
        :func:`certblocks.enforce` caps)."""
        return self.kind == "graph" or (self.kind == "blocks" and self.example_input is not None)

    @property
    def loss_gradient(self) -> float:
        """Bound on the loss gradient in the head's output (a zoo model's, else 1)."""
        return float(getattr(self.module, "loss_gradient", 1.0)) if self.kind == "zoo" else 1.0

    def io(self, k: int) -> Tuple[nn.Module, nn.Module]:
        """``(entry, exit)`` of update ``k``: the module whose input is ``X_k`` and the one whose output is
        ``v(X_k)`` -- the update itself, or where it is a view outside the forward (``velocity_io()``: a gained
        branch), its branch and its gain."""
        m = self.modules[k]
        io = getattr(m, "velocity_io", None)
        return io() if callable(io) else (m, m)

    def attention(self, k: int) -> Optional[nn.Module]:
        """The attention inside update ``k`` (the first submodule with ``attention_stats()``), or ``None``."""
        return attention_module(self.io(k)[0])

    def certificates(self, seq_len: Optional[int] = None, *, cached: bool = True) -> List[BlockCertificate]:
        """One certificate per update, named by :attr:`names` (float64 linear algebra on one thread: on a busy
        machine multi-threaded LAPACK on these small matrices was measured many times slower).

        ``cached=False`` computes each from its module now: a model's cache is keyed on the parameters' version
        counters, which a write that hides from them (FSDP2's gathered copies) does not bump."""
        n = self.seq_len if seq_len is None else seq_len
        if cached and self.kind == "zoo" and callable(getattr(self.module, "update_certificates", None)):
            certs = list(self.module.update_certificates(seq_len=n))  # type: ignore[operator, union-attr]
            return [dataclasses.replace(c, name=name) for c, name in zip(certs, self.names)]
        with one_thread():
            return self._certificates(n)

    def _certificates(self, seq_len: Optional[int]) -> List[BlockCertificate]:
        from .stack import block_certificate

        out = []
        fixed = self.fixed or [None] * len(self.modules)
        for name, m, f in zip(self.names, self.modules, fixed):
            try:
                cert = f if f is not None else block_certificate(m, seq_len=seq_len, prefix=f"{name}.")
            except ValueError as e:
                if seq_len is None and "needs seq_len" in str(e):
                    raise ValueError(f"update {name!r} ({type(m).__name__}) needs the sequence length for its "
                                     "certificate: pass seq_len=") from e
                raise
            out.append(dataclasses.replace(cert, name=name))
        return out

    def head_certificate(self) -> Optional[BlockCertificate]:
        """The head ``G`` as a map certificate (a zoo model's), or ``None`` (then :attr:`lip_g` stands in)."""
        head = getattr(self.module, "head_certificate", None) if self.kind == "zoo" else None
        return head() if callable(head) else None

    def levers(self) -> Dict[int, List[Lever]]:
        """The block levers of each update (``init_values``, ``qk_norm_eps``), by update index: the blocks'
        ``levers()`` (a zoo model's own ``levers()`` where it has one: its gains)."""
        own = getattr(self.module, "levers", None) if self.kind == "zoo" else None
        if callable(own):
            return dict(own())
        fixed = self.fixed or [None] * len(self.modules)
        out: Dict[int, List[Lever]] = {}
        for k, (m, f) in enumerate(zip(self.modules, fixed)):
            ls = list(getattr(m, "levers", lambda: [])()) if f is None else []
            if ls:
                out[k] = ls
        return out

    # -- the certificate ---------------------------------------------------------------------------------------
    @property
    def envelope(self) -> Optional[Envelope]:
        """The model's :class:`Envelope` (a stack's or zoo model's own; a converted model's once
        :meth:`certificate` recorded one), or ``None``."""
        return getattr(self.module, "envelope", None) if self.kind in ("stack", "zoo") else \
            getattr(self.module, "_certblocks_envelope", None)

    def certificate(self, dtype: Any = None, *, r0: Optional[float] = None, seq_len: Optional[int] = None,
                    record_envelope: bool = True) -> StackCertificate:
        """The :class:`~certblocks.StackCertificate` of the model's chain from its current weights.

        Args:
            dtype: the dtype (a torch dtype or a name) or a precision policy (:func:`certblocks.precision.as_precision`:
                ``"amp-fp16"``, ...: every value against the ``M`` of the dtype it is held in; a model read from its
                graph is captured under the policy, a model of certified blocks bounds their intermediates against
                the policy's narrowest dtype); default: the envelope used (the narrowest dtype a forward ran in, else
                the model's own certification dtype).  A converted model has no dtype of its own: its first
                certificate needs one.
            r0: bound on the first update's input (default: :func:`as_certified`'s, else the model's, widened by
                the envelope used).
            seq_len: the sequence length (default likewise).
            record_envelope: a converted model records the envelope of this certificate (:class:`Envelope`; a
                forward pre-hook on its first update checks each forward); ``False`` for a look that certifies no
                run (the monitor's checks).

        Raises:
            ValueError: no dtype for a model without one, a graph model without ``example_input``, or a block that
                needs ``seq_len``.
        """
        r0 = _real("r0", r0)
        if seq_len is not None:
            check_int("seq_len", seq_len)
        if r0 is None and self.r0_given:
            r0 = self.radius()
        if seq_len is None and self.seq_len_given:
            seq_len = self.seq_len
        if self.kind == "stack":
            return self.module.certificate(dtype, seq_len=seq_len, r0=r0)  # type: ignore[operator, union-attr]
        if self.kind == "zoo" and callable(getattr(self.module, "certificate", None)):
            kw = {"lip_g": self.lip_g} if self.lip_g_given else {}
            return self.module.certificate(dtype, r0=r0, seq_len=seq_len, **kw)  # type: ignore[operator, union-attr]
        env = self.envelope
        used = env.used() if env is not None else (None, None, None)
        if dtype is None:
            dtype = used[0] or self.dtype
            if dtype is None:
                raise ValueError(f"dtype: {type(self.module).__name__ if self.module is not None else 'the model'} has "
                                 "no certification dtype of its own; pass one (certificate('bf16'))")
        name = as_precision(dtype).name
        if self.reads_graph:
            return self._graph_certificate(name, r0)
        n = seq_len if seq_len is not None else _wider(self.seq_len, used[1])
        r = r0 if r0 is not None else _wider(self.radius(), used[2])
        head = None if self.lip_g_given else self.head_certificate()
        certs = self.certificates(n)
        if head is not None:
            cert = certify_stack(certs, name, dt=self.dt, r0=r, head=head, loss_grad=self.loss_gradient)
        else:
            cert = certify_stack(certs, name, dt=self.dt, r0=r, lip_g=self.lip_g)
        if self.kind == "blocks":  # nothing but the blocks is known without the graph: say what is not covered
            cert = dataclasses.replace(cert, scope=BLOCKS_ONLY)
        if record_envelope and self.module is not None and self.modules:
            self._record_envelope(name, n, r)
        return cert

    def graph_report(self, precision: Any = None) -> Any:
        """The :class:`~certblocks.trace.ModelCertificate` a ``"graph"`` model's certificate is read from (its updates
        found in the graph captured on ``example_input``, each with its per-node explanation), or ``None`` for a model
        whose updates are listed (its certified blocks: their certificates are their own).

        Captured in eval mode, once for the current weights, batch and policy (a change of any captures again): the
        certificate and the fixes of a graph model share one capture.  ``precision``: a mixed precision policy to
        capture it under (:func:`certblocks.certify`'s ``precision``); ``None`` or a pure dtype: as it is.

        Raises:
            ValueError: a graph model without ``example_input``.
            certblocks.trace.CaptureError: ``torch.export`` cannot capture the model on the batch.
        """
        if not self.reads_graph:
            return None
        if self.example_input is None:
            raise ValueError(f"{type(self.module).__name__} has no certified block: its updates are read from its "
                             "graph, which needs a batch (as_certified(model, example_input=...))")
        from .trace import ModelCertificate, certify

        assert self.module is not None
        weights = tuple((id(p), p._version) for p in self.module.parameters())
        prec = None if precision is None or as_precision(precision).pure else as_precision(precision)
        key = (id(self.example_input), repr(self.residual), weights, None if prec is None else prec.name)
        if self._traced is None or self._traced[0] != key:
            with _eval_mode(self.module):  # a certificate is for the model in eval mode (dropout is the identity)
                rep = certify(self.module, self.example_input, residual=self.residual, precision=prec)
            rep = rep if isinstance(rep, ModelCertificate) else ModelCertificate([rep], type(self.module).__name__)
            self._traced = (key, rep)
        return self._traced[1]

    def _graph_certificate(self, dtype: str, r0: Optional[float]) -> StackCertificate:
        rep = self.graph_report(dtype)
        if r0 is None:
            own = getattr(self.module, "input_radius", None)
            r0 = float(own()) if callable(own) else self.radius()
        return rep.stack(dtype, r0=r0, dt=self.dt)

    def _record_envelope(self, dtype: str, seq_len: Optional[int], r0: float) -> None:
        """A converted model's envelope: recorded on the module, checked by a pre-hook on the first update."""
        assert self.module is not None
        env = getattr(self.module, "_certblocks_envelope", None)
        if env is None:
            env = Envelope(type(self.module).__name__, dtype, seq_len, r0)
            self.module.__dict__["_certblocks_envelope"] = env
        else:
            env.record(dtype, seq_len, r0)
        if self.strict is not None:
            env.strict = self.strict
        entry = self.io(0)[0]
        if not any(isinstance(h, _EnvelopeHook) and h.envelope is env for h in entry._forward_pre_hooks.values()):
            entry.register_forward_pre_hook(_EnvelopeHook(env), with_kwargs=True)

    def fixes(self, dtype: Any = None, *, enforce: bool = True) -> List[Fix]:
        """For a model refused in ``dtype``, the value of each lever it has that certifies it, each certified
        again (:mod:`certblocks.fixes`): its blocks' ``levers()``, ``dt`` where the model has a step (a stack),
        the number of updates, :func:`certblocks.enforce`'s cap factor (``enforce``) and a wider dtype.  Empty when
        certified.  A certificate read from the graph (:attr:`reads_graph`) gets the levers of the updates that are
        exactly a block or a gained branch, no ``dt`` and no ``enforce`` (enforce certifies the chain of the blocks,
        another chain)."""
        from .fixes import Fix, compute_fixes

        if self.kind in ("stack", "zoo") and callable(getattr(self.module, "fixes", None)) and not (
                self.r0_given or self.seq_len_given):
            return list(self.module.fixes(dtype) if self.kind == "zoo" else self.module.fixes())  # type: ignore
        cert = self.certificate(dtype, record_envelope=False)
        if cert.ok:
            return []
        if self.reads_graph:  # the traced chain: the levers of the updates that are exactly a block, or gained
            from .conversion.api import traced_levers

            assert self.module is not None
            return compute_fixes(cert, levers=traced_levers(self.module, cert), dt=False)
        extra: List[Fix] = []
        if enforce and self.modules and not any(f is not None for f in self.fixed):
            from .enforcement import cap_factor

            try:
                alpha, worst = cap_factor(self, cert.dtype, r0=cert.r0, lip_g=cert.lip_g)
                extra.append(Fix("enforce", alpha, worst.certified_depth, worst.depth, worst.ok,
                                 f"certblocks.enforce(model, {cert.dtype!r}) with cap factor {alpha:.3g} "
                                 f"({'keeps' if alpha >= 1 else 'shrinks'} the current weights)"))
            except (TypeError, ValueError):  # a block without caps, or no caps certify it
                pass
        return compute_fixes(cert, levers=self.levers(), extra=extra, dt=self.kind == "stack")

    # -- running it --------------------------------------------------------------------------------------------
    def __call__(self, batch: Any) -> Any:
        """The model on ``batch`` (:func:`as_args`), through the wrapper it was handed in."""
        if self.wrapper is None:
            raise TypeError("(name, module) pairs are not a model: there is nothing to call")
        args, kwargs = as_args(batch)
        return self.wrapper(*args, **kwargs)


@contextlib.contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode inside, its own mode restored after."""
    was = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was)


def _wider(own: Optional[float], seen: Optional[float]) -> Any:
    if seen is None:
        return own
    return seen if own is None else max(own, seen)


def attention_module(m: nn.Module) -> Optional[nn.Module]:
    """The attention inside a velocity: the first of its modules (itself included) with ``attention_stats()``."""
    for sub in m.modules():
        if callable(getattr(sub, "attention_stats", None)):
            return sub
    return None


# ------------------------------------------------------------------------------------------------ the adapter
def _block_updates(model: nn.Module) -> Tuple[List[str], List[nn.Module]]:
    """Every certified block not inside another one, in module order (a layer of several updates: each)."""
    names: List[str] = []
    mods: List[nn.Module] = []
    taken: List[str] = []
    for path, m in model.named_modules():
        if any(path.startswith(t + ".") for t in taken):
            continue
        ups = getattr(m, "updates", None)
        if callable(ups) and callable(getattr(m, "certificates", None)):  # a layer of several updates
            for j, u in enumerate(ups()):
                names.append(f"{path}.updates[{j}]" if path else f"updates[{j}]")
                mods.append(u)
            taken.append(path)
        elif callable(getattr(m, "certificate", None)) and hasattr(m, "exponents") and m is not model:
            names.append(path)
            mods.append(m)
            taken.append(path)
    return names, mods


def _pairs(obj: Sequence[Any]) -> Tuple[List[str], List[nn.Module]]:
    names, mods = [], []
    for k, item in enumerate(obj):
        if (not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str)
                or not isinstance(item[1], nn.Module)):
            raise TypeError(f"model[{k}] must be a (name, nn.Module) pair, got {item!r}")
        names.append(item[0])
        mods.append(item[1])
    if not mods:
        raise ValueError("model must contain at least one (name, module) pair")
    return names, mods


def underlying(obj: Any) -> Any:
    """The ``nn.Module`` behind ``obj`` (wrappers and a ConversionReport removed), or ``obj`` itself."""
    from .conversion import ConversionReport

    if isinstance(obj, ConversionReport):
        obj = obj.model
    return unwrap(obj)


def as_certified(obj: Any, *, r0: Optional[float] = None, seq_len: Optional[int] = None, dt: Optional[float] = None,
                 example_input: Any = None, lip_g: Optional[float] = None, strict: Optional[bool] = None,
                 residual: Union[str, Sequence[str], None] = "auto") -> CertifiedModel:
    """Read any model as a :class:`CertifiedModel` (module docstring: what is recognized and how).

    Args:
        obj: a :class:`~certblocks.CertifiedStack`, a zoo model (:class:`ResidualModel`), a converted model or its
            :class:`~certblocks.ConversionReport`, any of these inside DDP / DataParallel / FSDP / ``torch.compile``,
            a sequence of ``(name, module)`` pairs, or any other ``nn.Module`` (kind ``"graph"``).
        r0: the input radius (overrides the model's; converted models and pairs default to 1).
        seq_len: the sequence length of the certificates (overrides the model's; Mamba blocks need one).
        dt: the residual step of a converted model's or pairs' updates (default 1); a stack or zoo model has its
            own and a different value raises.
        example_input: a batch (tensor, tuple, mapping), for a model whose updates are read from its graph.
        lip_g: ``Lip(G)`` of the head (default the stack's, else 1; a zoo model's head certificate when ``None``).
        strict: set the envelope's ``strict`` (:class:`Envelope`): raise at a forward outside it.
        residual: how a model read from its graph finds its updates (:func:`certblocks.certify`'s ``residual``);
            anything but ``"auto"`` reads any ``nn.Module`` from its graph (kind ``"graph"``), certified blocks or not.

    Raises:
        TypeError: ``obj`` is none of the above, or a pair is not ``(str, nn.Module)``.
        ValueError: an argument out of range, or empty pairs.
    """
    r0 = _real("r0", r0)
    dt_v = _real("dt", dt, positive=True)
    lip = _real("lip_g", lip_g, positive=True)
    if seq_len is not None:
        check_int("seq_len", seq_len)
    check_bool("strict", strict, optional=True)
    given = dict(r0_given=r0 is not None, seq_len_given=seq_len is not None, lip_g_given=lip is not None,
                 example_input=example_input, strict=strict, residual=residual)
    if isinstance(obj, CertifiedModel):
        return obj if not any((r0 is not None, seq_len is not None, dt is not None, lip_g is not None)) else \
            dataclasses.replace(obj, r0=obj.r0 if r0 is None else r0, seq_len=obj.seq_len if seq_len is None else
                                seq_len, dt=obj.dt if dt_v is None else dt_v, lip_g=obj.lip_g if lip is None else lip,
                                r0_given=obj.r0_given or r0 is not None,
                                seq_len_given=obj.seq_len_given or seq_len is not None,
                                lip_g_given=obj.lip_g_given or lip is not None)
    if isinstance(obj, (list, tuple)):
        names, mods = _pairs(obj)
        return CertifiedModel(names, mods, dt=dt_v or 1.0, r0=1.0 if r0 is None else r0, seq_len=seq_len,
                              lip_g=lip or 1.0, kind="pairs", **given)
    from .stack import CertifiedStack

    model = underlying(obj)
    wrapper = obj if isinstance(obj, nn.Module) else model
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a CertifiedStack, a zoo model, a ConversionReport, an nn.Module (with "
                        f"certified blocks, or read from its graph) or a sequence of (name, module) pairs, got "
                        f"{type(obj).__name__}")
    common = dict(module=model, wrapper=wrapper, **given)
    if not (isinstance(residual, str) and residual == "auto"):  # asked to read the updates from the graph
        out = CertifiedModel([], [], dt=dt_v or 1.0, r0=1.0 if r0 is None else r0, seq_len=seq_len, lip_g=lip or 1.0,
                             kind="graph", **common)
    elif isinstance(model, CertifiedStack):
        _same_dt(dt_v, model.dt, model)
        n = len(model.blocks)
        out = CertifiedModel([f"blocks.{k}" for k in range(n)], list(model.blocks), dt=model.dt,
                             r0=model.r0 if r0 is None else r0, seq_len=model.seq_len if seq_len is None else seq_len,
                             lip_g=model.lip_g if lip is None else lip, fixed=list(model._explicit), kind="stack",
                             dtype=model.dtype, **common)
    elif _lists_updates(model):
        _same_dt(dt_v, 1.0, model)
        pairs = list(model.residual_updates())  # type: ignore[operator]
        out = CertifiedModel([p for p, _ in pairs], [m for _, m in pairs], dt=1.0,
                             r0=model.input_radius if r0 is None else r0,  # type: ignore[arg-type]
                             seq_len=int(model.certificate_seq_len()) if seq_len is None else seq_len,  # type: ignore
                             lip_g=lip or 1.0, kind="zoo", dtype=getattr(model, "cert_dtype", None), **common)
    else:
        names, mods = _block_updates(model)
        out = CertifiedModel(names, mods, dt=dt_v or 1.0, r0=1.0 if r0 is None else r0, seq_len=seq_len,
                             lip_g=lip or 1.0, kind="blocks" if mods else "graph", **common)
    env = out.envelope
    if strict is not None and env is not None:
        env.strict = strict
    return out


def _same_dt(dt: Optional[float], own: float, model: nn.Module) -> None:
    if dt is not None and dt != own:
        raise ValueError(f"dt={dt!r} differs from the step {own:g} of {type(model).__name__}'s updates (the "
                         "certificate is for the model as it runs): leave dt=None")
