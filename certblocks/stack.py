"""``build_stack``: a residual stack that refuses to exist past its dtype's budget.

A stack is ``X_{k+1} = X_k + dt * v_k(X_k)`` over the given velocities, one
residual update each.  Building it computes the :class:`StackCertificate` from
the blocks' current weights and raises :class:`CertificationError` when the
stack is not certified at its depth for the chosen dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, List, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn.utils import parametrize

from ._validation import check_finite
from .bounds import one_thread
from .budget import dtype_name
from .certificate import BlockCertificate, StackCertificate, certify_stack
from .fixes import Fix, compute_fixes, format_fixes

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


class CertifiedStack(nn.Module):
    """A residual stack ``X_{k+1} = X_k + dt * v_k(X_k)`` with its certificate.

    Build it with :func:`build_stack`.  ``certificate`` is never stale: reading it recomputes the
    certificate when any parameter or buffer changed since the last computation (their identities and
    version counters, which every in-place update, optimizer step and ``load_state_dict`` bumps);
    :meth:`recertify` forces the computation and can raise when the stack is no longer certified.  A write
    that hides from the version counter (``torch.autograd._unsafe_preserve_version_counter``, as FSDP2 uses
    for its gathered copies) is not seen: call :meth:`recertify` after one.

    Attributes:
        blocks: the velocities, in depth order.
        dt: the residual step size.
        dtype: the dtype the stack was certified for (canonical name).
        certificate: the :class:`StackCertificate` of the current weights (a property).
    """

    def __init__(self, blocks: Sequence[nn.Module], certificate: StackCertificate, *, dt: float,
                 r0: float, lip_g: float, seq_len: int | None = None,
                 explicit: Sequence[BlockCertificate | None] | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.dt = float(dt)
        self.dtype = certificate.dtype
        self.r0 = float(r0)
        self.lip_g = float(lip_g)
        self.seq_len = seq_len
        self._explicit = list(explicit) if explicit is not None else [None] * len(blocks)
        self._certificate = certificate
        self._certified_state = self._state_key()

    def _state_key(self) -> tuple:
        return (tuple((id(p), p._version) for p in self.parameters()),
                tuple((id(b), b._version) for b in self.buffers()))

    @property
    def certificate(self) -> StackCertificate:
        """The :class:`StackCertificate` of the current weights (recomputed when they changed)."""
        if self._state_key() != self._certified_state:
            self.recertify()
        return self._certificate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + self.dt * block(x)
        return x

    def recertify(self, *, strict: bool = False) -> StackCertificate:
        """Recompute the certificate from the current weights.

        Blocks given as ``(module, BlockCertificate)`` pairs keep their given certificate.

        Args:
            strict: raise :class:`CertificationError` if the stack is no longer certified.
        """
        certs = []
        for k, (block, fixed) in enumerate(zip(self.blocks, self._explicit)):
            cert = fixed if fixed is not None else block_certificate(block, seq_len=self.seq_len,
                                                                     prefix=f"blocks.{k}.")
            if not cert.name:
                cert = dataclasses.replace(cert, name=f"{k}:{block_class_name(block)}")
            certs.append(cert)
        self._certificate = certify_stack(certs, self.dtype, dt=self.dt, r0=self.r0, lip_g=self.lip_g)
        self._certified_state = self._state_key()
        if strict and not self._certificate.ok:
            raise CertificationError(_error_message(self._certificate, self.fixes()), self._certificate)
        return self._certificate

    def fixes(self) -> List[Fix]:
        """For a stack not certified, the value of each lever that certifies it, each certified again
        (:mod:`certblocks.fixes`): the blocks' ``init_values`` / ``qk_norm_eps``, ``dt``, the depth,
        :func:`certblocks.enforce`'s cap factor and a wider dtype when it certifies more.  Empty when certified."""
        return _fixes(self, self.certificate)

    def extra_repr(self) -> str:
        c = self.certificate
        return f"dt={self.dt:g}, dtype={self.dtype}, certified={c.certified_depth}/{c.depth}"


def block_class_name(module: nn.Module) -> str:
    """The block's class name; under :func:`certblocks.enforce` (``torch.nn.utils.parametrize``, which swaps the
    class for a ``Parametrized<Name>`` subclass) the original one."""
    return parametrize.type_before_parametrizations(module).__name__


def build_stack(blocks: Iterable[BlockSpec], dtype: Union[str, torch.dtype], *, dt: float = 1.0, r0: float = 1.0,
                lip_g: float = 1.0, seq_len: int | None = None, certify: bool = True) -> CertifiedStack:
    """Build a certified residual stack, or refuse with :class:`CertificationError`.

    Args:
        blocks: the velocities in depth order, one residual update each: modules
            with a ``certificate()`` method, or ``(module, BlockCertificate)`` pairs.
        dtype: the dtype the stack will run in (``torch.float16``, ``"bf16"``, ...).
        dt: residual step size.
        r0: bound on the input's per-token norm.
        lip_g: Lipschitz constant of the loss head in the state.
        seq_len: sequence length, offered to blocks whose certificate depends on it.
        certify: when ``False`` the stack is built even if not certified (its
            ``certificate`` still tells).

    Raises:
        CertificationError: the stack is not certified at its depth; the message
            names the first failing update, its exponents, the certified depth,
            the culprit's fix and the computed value of each lever that certifies
            the stack (:meth:`CertifiedStack.fixes`).
    """
    modules, certs, explicit = _split(blocks, seq_len)
    cert = certify_stack(certs, dtype_name(dtype), dt=dt, r0=r0, lip_g=lip_g)
    stack = CertifiedStack(modules, cert, dt=dt, r0=r0, lip_g=lip_g, seq_len=seq_len, explicit=explicit)
    if certify and not cert.ok:
        raise CertificationError(_error_message(cert, _fixes(stack, cert)), cert)
    return stack

