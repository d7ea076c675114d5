"""``build_stack``: a residual stack that refuses to exist past its dtype's budget.

A stack is ``X_{k+1} = X_k + dt * v_k(X_k)`` over the given velocities, one
residual update each.  Building it computes the :class:`StackCertificate` from
the blocks' current weights and raises :class:`CertificationError` when the
stack is not certified at its depth for the chosen dtype.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterable, List, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn.utils import parametrize

from ._validation import check_bool, check_finite, check_int, check_real
from .bounds import one_thread
from .certificate import BlockCertificate, StackCertificate, certify_stack
from .fixes import Fix, compute_fixes, format_fixes
from .precision import as_precision

__all__ = ["CertificationError", "CertifiedStack", "build_stack", "block_certificate"]

BlockSpec = Union[nn.Module, Tuple[nn.Module, BlockCertificate]]


class CertificationError(ValueError):
    """A stack is not certified at its depth for the chosen dtype.

    Attributes:
        certificate: the :class:`StackCertificate` that failed (``explain()`` prints it).
    """

    def __init__(self, message: str, certificate: StackCertificate | None = None) -> None:
        super().__init__(message)
        self.certificate = certificate


def block_certificate(module: nn.Module, *, seq_len: int | None = None, prefix: str = "") -> BlockCertificate:
    """``module.certificate(seq_len=seq_len)``, after checking that its weights are finite.

    Args:
        module: a certified block (:class:`~certblocks.protocol.CertifiedBlock`).
        seq_len: the sequence length, for blocks whose bound depends on it.
        prefix: the module's path in its model (``"blocks.3."``), so that an error names the tensor in the model.

    Raises:
        TypeError: the module has no ``certificate()`` method, or it returned something else.
        NonFiniteWeightError: a parameter or buffer of the module holds NaN or inf (the message names it).
    """
    method = getattr(module, "certificate", None)
    if not callable(method):
        raise TypeError(f"{type(module).__name__} has no certificate() method; pass (module, BlockCertificate) "
                        "or use certblocks.certify to derive one from its graph")
    check_finite(module, prefix)
    try:
        with one_thread():
            cert = method(seq_len=seq_len)
    except TypeError as exc:
        if "unexpected keyword argument 'seq_len'" not in str(exc):
            raise
        raise TypeError(f"{type(module).__name__}.certificate() does not take seq_len: a certified block keeps the "
                        "protocol certificate(*, seq_len=None, r0=None) (certblocks.protocol.CertifiedBlock)") from exc
    if not isinstance(cert, BlockCertificate):
        raise TypeError(f"{type(module).__name__}.certificate() returned {type(cert).__name__}, "
                        "expected a BlockCertificate")
    return cert


def _split(blocks: Iterable[BlockSpec], seq_len: int | None
           ) -> Tuple[List[nn.Module], List[BlockCertificate], List[BlockCertificate | None]]:
    modules: List[nn.Module] = []
    certs: List[BlockCertificate] = []
    explicit: List[BlockCertificate | None] = []
    seen: dict = {}
    for k, spec in enumerate(blocks):
        if isinstance(spec, tuple):
            if len(spec) != 2 or not isinstance(spec[0], nn.Module) or not isinstance(spec[1], BlockCertificate):
                raise TypeError(f"blocks[{k}] must be an nn.Module with certificate() or a (module, BlockCertificate) "
                                f"pair, got a tuple of {tuple(type(s).__name__ for s in spec)}")
            module, cert = spec
            explicit.append(cert)
        elif isinstance(spec, nn.Module):
            module, cert = spec, block_certificate(spec, seq_len=seq_len, prefix=f"blocks.{k}.")
            explicit.append(None)
        else:
            raise TypeError(f"blocks[{k}] must be an nn.Module with certificate() or a (module, BlockCertificate) "
                            f"pair, got {type(spec).__name__}")
        if id(module) in seen:
            raise ValueError(f"blocks[{k}] is the same module instance as blocks[{seen[id(module)]}]; each residual "
                             "update needs its own module (weights shared across depth are not supported)")
        seen[id(module)] = k
        if not cert.name:
            cert = dataclasses.replace(cert, name=f"{k}:{block_class_name(module)}")
        modules.append(module)
        certs.append(cert)
    if not modules:
        raise ValueError("blocks must contain at least one block")
    return modules, certs, explicit


def _error_message(cert: StackCertificate, fixes: Sequence[Fix] = ()) -> str:
    f = cert.first_failure
    assert f is not None
    text = format_fixes(fixes)
    return (f"stack of {cert.depth} updates is not certified in {cert.dtype}: certified depth {cert.certified_depth} "
            f"of {cert.depth}; {f.reason}. Culprit's fix: {f.fix}."
            + (f" {text[0].upper()}{text[1:]}." if text else ""))


def _fixes(stack: CertifiedStack, cert: StackCertificate) -> List[Fix]:
    """The computed fixes of a refused stack: its blocks' levers, ``dt``, depth, enforce's cap factor, dtype."""
    if cert.ok:
        return []
    levers = {k: list(getattr(m, "levers", lambda: [])()) for k, (m, fixed) in
              enumerate(zip(stack.blocks, stack._explicit)) if fixed is None}
    extra: List[Fix] = []
    if all(fixed is None for fixed in stack._explicit):
        from .enforcement import cap_factor

        try:
            alpha, worst = cap_factor(stack, cert.dtype)
            extra.append(Fix("enforce", alpha, worst.certified_depth, worst.depth, worst.ok,
                             f"certblocks.enforce(stack, {cert.dtype!r}) with cap factor {alpha:.3g} "
                             f"({'keeps' if alpha >= 1 else 'shrinks'} the current weights)"))
        except (TypeError, ValueError):  # a block without caps, or no caps certify it
            pass
    return compute_fixes(cert, levers={k: v for k, v in levers.items() if v}, extra=extra)


class _CertificateAccess:
    """What ``stack.certificate`` is while the property is deprecated: call it (``stack.certificate()``, the
    method); reading an attribute of the certificate through it (``stack.certificate.ok``) still works for one
    release, with a ``DeprecationWarning``."""

    __slots__ = ("_stack",)

    def __init__(self, stack: CertifiedStack) -> None:
        object.__setattr__(self, "_stack", stack)

    def __call__(self, dtype: Union[str, torch.dtype, None] = None, *, seq_len: int | None = None,
                 r0: float | None = None) -> StackCertificate:
        return self._stack._certificate_now(dtype, seq_len=seq_len, r0=r0)

    def _deprecated(self) -> StackCertificate:
        warnings.warn("CertifiedStack.certificate is a method: call stack.certificate() (reading the certificate's "
                      "attributes through the property is deprecated and will be removed in the next release)",
                      DeprecationWarning, stacklevel=3)
        return self._stack._certificate_now()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._deprecated(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("CertifiedStack.certificate is a method; a StackCertificate is immutable")

    def __eq__(self, other: object) -> bool:
        return self._deprecated() == (other._deprecated() if isinstance(other, _CertificateAccess) else other)

    __hash__ = None  # type: ignore[assignment]

    def __str__(self) -> str:
        return str(self._deprecated())

    def __repr__(self) -> str:
        return f"<bound method CertifiedStack.certificate of {type(self._stack).__name__} with " \
               f"{len(self._stack.blocks)} blocks>"

    def __dir__(self) -> List[str]:
        return sorted(set(dir(StackCertificate)) | {"__call__"})


class _CertificateMethod:
    """The ``certificate`` descriptor: ``stack.certificate(...)`` is the method; ``stack.certificate.<attr>`` the
    deprecated property's reading (:class:`_CertificateAccess`)."""

    def __get__(self, obj: Any, owner: type[CertifiedStack]) -> Any:
        if obj is None:
            return owner._certificate_now
        return _CertificateAccess(obj)


class CertifiedStack(nn.Module):
    """A residual stack ``X_{k+1} = X_k + dt * v_k(X_k)`` with its certificate.

    Build it with :func:`build_stack`.  :meth:`certificate` is never stale: it recomputes the certificate when any
    parameter or buffer changed since the last computation (their identities and version counters, which every
    in-place update, optimizer step and ``load_state_dict`` bumps) and nothing else computes it (``repr`` shows
    the last one computed); :meth:`recertify` forces the computation and can raise when the stack is no longer
    certified.  A write that hides from the version counter (``torch.autograd._unsafe_preserve_version_counter``,
    as FSDP2 uses for its gathered copies) is not seen: call :meth:`recertify` after one.

    **Envelope.**  The certificate is for ``dtype``, ``seq_len`` and inputs of per-token norm at most ``r0``
    (:class:`certblocks.model.Envelope`): a forward on a longer sequence, a larger input or in a narrower compute
    dtype warns once with :class:`~certblocks.model.EnvelopeWarning` (raises :class:`CertificationError` when
    ``envelope.strict``), and :meth:`certificate` is then computed at the envelope used.  The check costs a shape
    and a dtype comparison and one per-token norm of the input per forward; it is skipped under ``torch.compile``
    and ``torch.export``.  A stack refused at construction (``build_stack(..., certify=False)``) records the
    envelope without warning (``quiet``): it has no certified envelope to leave.

    Attributes:
        blocks: the velocities, in depth order.
        dt: the residual step size.
        dtype: the dtype the stack was certified for (canonical name).
        r0, seq_len, lip_g: what it was certified with.
        envelope: the :class:`~certblocks.model.Envelope` of the runs.
    """

    certificate = _CertificateMethod()

    def __init__(self, blocks: Sequence[nn.Module], certificate: StackCertificate, *, dt: float,
                 r0: float, lip_g: float, seq_len: int | None = None,
                 explicit: Sequence[BlockCertificate | None] | None = None, strict: bool = False,
                 quiet: bool = False) -> None:
        from .envelope import Envelope

        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.dt = float(dt)
        self.dtype = certificate.dtype
        self.r0 = float(r0)
        self.lip_g = float(lip_g)
        self.seq_len = seq_len
        self._explicit = list(explicit) if explicit is not None else [None] * len(blocks)
        self.envelope = Envelope("CertifiedStack", self.dtype, seq_len, self.r0, strict=strict, quiet=quiet)
        self._certificate = certificate
        self._certified_key = self._key(self.dtype, seq_len, self.r0)

    def _state_key(self) -> tuple:
        return (tuple((id(p), p._version) for p in self.parameters()),
                tuple((id(b), b._version) for b in self.buffers()))

    def _key(self, dtype: str, seq_len: int | None, r0: float) -> tuple:
        return self._state_key(), dtype, seq_len, r0

    def _settings(self, dtype: Union[str, torch.dtype, None], seq_len: int | None, r0: float | None
                  ) -> Tuple[str, int | None, float]:
        """The certificate's dtype, ``seq_len`` and ``r0``: the given ones, else the envelope used."""
        used_dtype, used_len, used_r0 = self.envelope.used()
        dtype = used_dtype if dtype is None else as_precision(dtype).name
        seq_len = used_len if seq_len is None else check_int("seq_len", seq_len)
        if r0 is None:
            r0 = self.r0 if used_r0 is None else used_r0
        else:
            r0 = check_real("r0", r0, ge=0.0, optional=True)
        return dtype, seq_len, float(r0)

    def _certificate_now(self, dtype: Union[str, torch.dtype, None] = None, *, seq_len: int | None = None,
                         r0: float | None = None) -> StackCertificate:
        """The :class:`StackCertificate` of the current weights (recomputed when they changed).

        Args:
            dtype: the dtype or precision policy (:func:`certblocks.precision.as_precision`; default: the stack's, or
                the narrowest compute dtype a forward ran in).
            seq_len: the sequence length offered to the blocks (default: the stack's, or the longest sequence a
                forward ran on).
            r0: bound on the input's per-token norm (default: the stack's, or the largest input a forward saw).
        """
        settings = self._settings(dtype, seq_len, r0)
        if self._key(*settings) != self._certified_key:
            self._compute(*settings)
        return self._certificate

    _certificate_now.__name__ = "certificate"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.jit.is_scripting():
            self.envelope.check(x)
        for block in self.blocks:
            x = x + self.dt * block(x)
        return x

    def _compute(self, dtype: str, seq_len: int | None, r0: float) -> StackCertificate:
        certs = []
        for k, (block, fixed) in enumerate(zip(self.blocks, self._explicit)):
            cert = fixed if fixed is not None else block_certificate(block, seq_len=seq_len, prefix=f"blocks.{k}.")
            if not cert.name:
                cert = dataclasses.replace(cert, name=f"{k}:{block_class_name(block)}")
            certs.append(cert)
        self._certificate = certify_stack(certs, dtype, dt=self.dt, r0=r0, lip_g=self.lip_g)
        self._certified_key = self._key(dtype, seq_len, r0)
        return self._certificate

    def recertify(self, *, strict: bool = False) -> StackCertificate:
        """Recompute the certificate from the current weights, at the envelope used (:meth:`certificate`).

        Blocks given as ``(module, BlockCertificate)`` pairs keep their given certificate.

        Args:
            strict: raise :class:`CertificationError` if the stack is no longer certified.
        """
        cert = self._compute(*self._settings(None, None, None))
        if strict and not cert.ok:
            raise CertificationError(_error_message(cert, self.fixes()), cert)
        return cert

    def fixes(self) -> List[Fix]:
        """For a stack not certified, the value of each lever that certifies it, each certified again
        (:mod:`certblocks.fixes`): the blocks' ``init_values`` / ``qk_norm_eps``, ``dt``, the depth,
        :func:`certblocks.enforce`'s cap factor and a wider dtype when it certifies more.  Empty when certified."""
        return _fixes(self, self._certificate_now())

    def extra_repr(self) -> str:
        """The last certificate computed (no computation here: call :meth:`certificate` for the current one)."""
        c = self._certificate
        stale = self._certified_key[0] != self._state_key() or self._certified_key[1:] != self._settings(
            None, None, None)
        return (f"dt={self.dt:g}, dtype={self.dtype}, certified={c.certified_depth}/{c.depth}"
                + (" (as last computed: weights or envelope changed since)" if stale else ""))


def block_class_name(module: nn.Module) -> str:
    """The block's class name; under :func:`certblocks.enforce` (``torch.nn.utils.parametrize``, which swaps the
    class for a ``Parametrized<Name>`` subclass) the original one."""
    return parametrize.type_before_parametrizations(module).__name__


def build_stack(blocks: Iterable[BlockSpec], dtype: Union[str, torch.dtype], *, dt: float = 1.0, r0: float = 1.0,
                lip_g: float = 1.0, seq_len: int | None = None, certify: bool = True,
                strict: bool = False) -> CertifiedStack:
    """Build a certified residual stack, or refuse with :class:`CertificationError`.

    Args:
        blocks: the velocities in depth order, one residual update each: modules
            with a ``certificate()`` method, or ``(module, BlockCertificate)`` pairs.
        dtype: the dtype the stack will run in (``torch.float16``, ``"bf16"``, ...), or its precision policy
            (``"amp-fp16"``: autocast fp16 with an fp32 stream; :func:`certblocks.precision.as_precision`): the
            blocks' intermediates are then bounded against the policy's narrowest dtype, the stream against its
            own (docs/theory.md section 7).
        dt: residual step size.
        r0: bound on the input's per-token norm.
        lip_g: Lipschitz constant of the loss head in the state.
        seq_len: sequence length, offered to blocks whose certificate depends on it.
        certify: when ``False`` the stack is built even if not certified (its
            ``certificate()`` still tells).
        strict: a forward outside the certified envelope (a sequence longer than ``seq_len``, an input of
            per-token norm above ``r0``, a narrower compute dtype) raises :class:`CertificationError` instead of
            warning once (:attr:`CertifiedStack.envelope`).

    Raises:
        CertificationError: the stack is not certified at its depth; the message
            names the first failing update, its exponents, the certified depth,
            the culprit's fix and the computed value of each lever that certifies
            the stack (:meth:`CertifiedStack.fixes`).
    """
    check_bool("strict", strict)
    modules, certs, explicit = _split(blocks, seq_len)
    cert = certify_stack(certs, as_precision(dtype), dt=dt, r0=r0, lip_g=lip_g)
    stack = CertifiedStack(modules, cert, dt=dt, r0=r0, lip_g=lip_g, seq_len=seq_len, explicit=explicit,
                           strict=strict, quiet=not cert.ok)  # a refused stack has no envelope to leave
    if certify and not cert.ok:
        raise CertificationError(_error_message(cert, _fixes(stack, cert)), cert)
    return stack

