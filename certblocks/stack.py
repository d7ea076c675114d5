"""``build_stack``: a residual stack that refuses to exist past its dtype's budget.

A stack is ``X_{k+1} = X_k + dt * v_k(X_k)`` over the given velocities, one
residual update each.  Building it computes the :class:`StackCertificate` from
the blocks' current weights and raises :class:`CertificationError` when the
stack is not certified at its depth for the chosen dtype.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Iterable, List, Sequence, Tuple, Union

import torch
from torch import nn

from .budget import dtype_name
from .certificate import BlockCertificate, StackCertificate, certify_stack

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


def block_certificate(module: nn.Module, **kwargs: Any) -> BlockCertificate:
    """Call ``module.certificate(...)`` with the keyword arguments it accepts.

    Args:
        module: a block with a ``certificate()`` method returning a BlockCertificate.
        **kwargs: offered to the method (e.g. ``seq_len``); those it does not take are dropped.
    """
    method = getattr(module, "certificate", None)
    if not callable(method):
        raise TypeError(f"{type(module).__name__} has no certificate() method; pass (module, BlockCertificate) "
                        "or use certblocks.certify to derive one from its graph")
    try:
        params = inspect.signature(method).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        offered = {k: v for k, v in kwargs.items() if v is not None and (takes_any or k in params)}
    except (TypeError, ValueError):  # builtins without a signature
        offered = {}
    cert = method(**offered)
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
            module, cert = spec, block_certificate(spec, seq_len=seq_len)
            explicit.append(None)
        else:
            raise TypeError(f"blocks[{k}] must be an nn.Module with certificate() or a (module, BlockCertificate) "
                            f"pair, got {type(spec).__name__}")
        if id(module) in seen:
            raise ValueError(f"blocks[{k}] is the same module instance as blocks[{seen[id(module)]}]; each residual "
                             "update needs its own module (weights shared across depth are not supported)")
        seen[id(module)] = k
        if not cert.name:
            cert = dataclasses.replace(cert, name=f"{k}:{type(module).__name__}")
        modules.append(module)
        certs.append(cert)
    if not modules:
        raise ValueError("blocks must contain at least one block")
    return modules, certs, explicit


def _error_message(cert: StackCertificate) -> str:
    f = cert.first_failure
    assert f is not None
    return (f"stack of {cert.depth} updates is not certified in {cert.dtype}: certified depth {cert.certified_depth} "
            f"of {cert.depth}; {f.reason}. Fix: {f.fix}.")


class CertifiedStack(nn.Module):
    """A residual stack ``X_{k+1} = X_k + dt * v_k(X_k)`` with its certificate.

    Build it with :func:`build_stack`.  ``certificate`` is computed when the
    stack is built; :meth:`recertify` recomputes it from the current weights.

    Attributes:
        blocks: the velocities, in depth order.
        dt: the residual step size.
        dtype: the dtype the stack was certified for (canonical name).
        certificate: the :class:`StackCertificate`.
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
        self.certificate = certificate
        self._explicit = list(explicit) if explicit is not None else [None] * len(blocks)

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
            cert = fixed if fixed is not None else block_certificate(block, seq_len=self.seq_len)
            if not cert.name:
                cert = dataclasses.replace(cert, name=f"{k}:{type(block).__name__}")
            certs.append(cert)
        self.certificate = certify_stack(certs, self.dtype, dt=self.dt, r0=self.r0, lip_g=self.lip_g)
        if strict and not self.certificate.ok:
            raise CertificationError(_error_message(self.certificate), self.certificate)
        return self.certificate

    def extra_repr(self) -> str:
        c = self.certificate
        return f"dt={self.dt:g}, dtype={self.dtype}, certified={c.certified_depth}/{c.depth}"


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
            names the first failing update, its exponents, the certified depth
            and the fix.
    """
    modules, certs, explicit = _split(blocks, seq_len)
    cert = certify_stack(certs, dtype_name(dtype), dt=dt, r0=r0, lip_g=lip_g)
    if certify and not cert.ok:
        raise CertificationError(_error_message(cert), cert)
    return CertifiedStack(modules, cert, dt=dt, r0=r0, lip_g=lip_g, seq_len=seq_len, explicit=explicit)

