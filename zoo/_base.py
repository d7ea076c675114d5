"""``ZooModel``: the certificate and the refusal at construction shared by every zoo model.

A zoo model is a residual network ``X_{k+1} = X_k + v_k(X_k)`` (step ``dt = 1``) between an
input embedding and a head.  It lists its residual velocities in depth order
(:meth:`ZooModel.residual_updates`, names = module paths), and

* :meth:`ZooModel.certificate` gives the :class:`~certblocks.StackCertificate` of that stack
  from the blocks' own certificates (current weights, dropout inactive);
* the constructor ends with :meth:`ZooModel._certify_or_refuse`: unless ``certify=False``, a
  configuration that is not certified at its depth for ``cert_dtype`` raises
  :class:`~certblocks.CertificationError`.

Defaults used for certification (each family documents its own ``r0`` and ``seq_len``):

* ``cert_dtype = "bf16"``: the dtype these models are trained in with mixed precision (its
  range equals fp32's to 0.4%; fp16 is much stricter and is reported by the CLI).  A precision
  policy is accepted too (``cert_dtype="amp-fp16"``: :func:`certblocks.precision.as_precision`).
* ``r0``: a sound bound on the per-token norm of the state entering the first update, computed
  from the embedding weights (:meth:`ZooModel.input_radius`).
* ``seq_len``: the model's maximal sequence length of residual-stream tokens.
* ``dt = 1``; ``Lip(G)`` from the model's head (:meth:`ZooModel.head_certificate`: the language
  model's ``ln_f`` + ``lm_head``, the ViT's norm, pooling and classifier) times the loss gradient
  (cross-entropy: ``sqrt(2)``); a forecaster's head undoes the input's instance normalization with
  the input's own statistics, so it is not a map of the last state: ``lip_g`` (default 1) stands in.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from certblocks._validation import check_bool, check_int
from certblocks.blocks.gain import ScaledBranch, scaled_certificate
from certblocks.bounds import concurrent_calls, one_thread, op_norm, row_norm_max, vec_norm
from certblocks.bounds.normalization import module_norm_bounds
from certblocks.certificate import BlockCertificate, Peak, StackCertificate, certify_stack
from certblocks.fixes import Fix, Lever, compute_fixes, format_fixes
from certblocks.precision import as_precision
from certblocks.stack import CertificationError, block_certificate

from ._hub import HubMixin

__all__ = ["ZooModel", "DEFAULT_CERT_DTYPE", "normed_linear_head", "renamed"]

#: Certification dtype used at construction when none is given.
DEFAULT_CERT_DTYPE = "bf16"


def renamed(cert: BlockCertificate, name: str) -> BlockCertificate:
    """``cert`` with ``name`` as its label."""
    return dataclasses.replace(cert, name=name)


class ZooModel(nn.Module, HubMixin, metaclass=abc.ABCMeta):
    """Base class of the zoo's models (see the module docstring).

    Subclasses set ``self.cert_dtype`` and call :meth:`_certify_or_refuse` at the end of
    ``__init__``, and implement :meth:`residual_updates`, :meth:`input_radius` and
    :meth:`certificate_seq_len`.
    """

    cert_dtype: str = DEFAULT_CERT_DTYPE
    #: Bound on the training loss's gradient in the head's output (1: no loss named).
    loss_gradient: float = 1.0
    #: The constructor takes ``init_values`` (branch gains): a refusal computes the gain that certifies.
    branch_gains: bool = False

    # -- to implement --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def residual_updates(self) -> List[Tuple[str, nn.Module]]:
        """``(module path, velocity)`` of each residual update, in depth order."""

    @abc.abstractmethod
    def input_radius(self) -> float:
        """A sound bound ``r0`` on the per-token norm of the state entering the first update."""

    @abc.abstractmethod
    def certificate_seq_len(self) -> int:
        """The number of residual-stream tokens the certificate is for (the longest input)."""

    def head_certificate(self) -> Optional[BlockCertificate]:
        """The head ``G`` (last state to output) as a map certificate, or ``None`` when the model's head is not
        a map of the last state alone (then ``lip_g`` stands in for ``Lip(G)``)."""
        return None

    # -- certificate ---------------------------------------------------------------------------------------
    def update_certificates(self, *, seq_len: Optional[int] = None) -> List[BlockCertificate]:
        """One :class:`BlockCertificate` per residual update, named by module path, in depth order."""
        n = self.certificate_seq_len() if seq_len is None else check_int("seq_len", seq_len)
        key = (n, self._weights_key())
        cached = self.__dict__.get("_cert_cache")
        if cached is not None and cached[0] == key:
            return list(cached[1])
        return list(self._fill_caches(n, key[1], "updates"))  # the updates certified concurrently

    def _weights_key(self) -> tuple:
        """The parameters' and buffers' identities and versions (an optimizer step bumps the versions)."""
        return (tuple((id(p), p._version, p.dtype, p.device) for p in self.parameters()),
                tuple((id(b), b._version) for b in self.buffers()))

    def _cached(self, slot: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, cached like the update certificates (recomputed when a weight changed)."""
        key = self._weights_key()
        cached = self.__dict__.get(slot)
        if cached is None or cached[0] != key:
            with one_thread():
                cached = (key, compute())
            self.__dict__[slot] = cached
        return cached[1]

    def _radius(self) -> float:
        """:meth:`input_radius`, cached; a stale cache is refilled with what :meth:`certificate` reads next."""
        wkey = self._weights_key()
        cached = self.__dict__.get("_radius_cache")
        if cached is not None and cached[0] == wkey:
            return cached[1]
        return self._fill_caches(self.certificate_seq_len(), wkey, "radius")

    def _fill_caches(self, n: int, wkey: tuple, want: str) -> Any:
        """Compute ``want`` -- ``"updates"`` (the update certificates at ``seq_len = n``) or ``"radius"`` -- on
        the threads torch may use (:func:`certblocks.bounds.concurrent_calls`: bit-identical values), cache it
        and return it.

        With ``want="radius"`` (the first thing :meth:`certificate` reads), what it reads next is computed on the
        same threads when its cache is stale: the head certificate and the update certificates at ``n`` (the
        default ``seq_len``), so that the head's large norms overlap the updates'.  Each part is computed exactly
        as alone (same values, bit for bit) from the same weights (``wkey``).  A speculative part that raises is
        not cached (the call that asks for it computes it again and raises); an exception of ``want`` is raised
        (an update's: the first in depth order, as when they were certified one after another).
        """
        def stale(slot: str, key: tuple) -> bool:
            cached = self.__dict__.get(slot)
            return cached is None or cached[0] != key

        parts: Dict[str, List[Callable[[], Any]]] = {}  # the longest first: the head's lm_head norm
        if want == "radius" and stale("_head_cache", wkey):
            parts["head"] = [self.head_certificate]
        if want == "radius":
            parts["radius"] = [lambda: float(self.input_radius())]
        if want == "updates" or stale("_cert_cache", (n, wkey)):
            parts["updates"] = [functools.partial(_update_certificate, m, n, name)
                                for name, m in self.residual_updates()]
        results = iter(concurrent_calls([task for tasks in parts.values() for task in tasks],
                                        return_exceptions=True))
        out: Dict[str, Any] = {}
        for part, tasks in parts.items():
            values = [next(results) for _ in tasks]
            failure = next((value for value in values if isinstance(value, Exception)), None)
            if failure is not None:
                if part == want:
                    raise failure
                continue
            if part == "updates":
                out[part] = tuple(values)
                self.__dict__["_cert_cache"] = ((n, wkey), out[part])
            else:
                out[part] = values[0]
                self.__dict__[f"_{part}_cache"] = (wkey, out[part])
        return out[want]

    def certificate(self, dtype: Union[str, torch.dtype, None] = None, *, r0: Optional[float] = None,
                    seq_len: Optional[int] = None, dt: float = 1.0, lip_g: Optional[float] = None) -> StackCertificate:
        """The certificate of the model's chain (embedding bound, residual updates, head) from its current weights.

        Args:
            dtype: the dtype or precision policy (:func:`certblocks.precision.as_precision`: ``"amp-fp16"`` bounds the
                blocks' intermediates against fp16 and the residual stream against fp32; docs/theory.md section 7;
                default: the model's ``cert_dtype``, or the narrower compute dtype a forward ran in:
                :attr:`envelope`).
            r0: bound on the per-token norm of the first update's input (default:
                :meth:`input_radius`, computed from the embedding weights).
            seq_len: sequence length of the residual stream (default: :meth:`certificate_seq_len`).
            dt: residual step (the zoo's models add ``v`` with step 1).
            lip_g: ``Lip(G)`` in place of the head's (default: the head's Jacobian bound times
                :attr:`loss_gradient` when :meth:`head_certificate` gives one, else 1).
        """
        r = self._radius() if r0 is None else float(r0)
        certs = self.update_certificates(seq_len=seq_len)
        head = self._cached("_head_cache", self.head_certificate) if lip_g is None else None
        if dtype is None:
            env = self.__dict__.get("envelope")
            dtype = env.used()[0] if env is not None else self.cert_dtype
        if head is not None:
            return certify_stack(certs, dtype, dt=dt, r0=r, head=head, loss_grad=self.loss_gradient)
        return certify_stack(certs, dtype, dt=dt, r0=r, lip_g=1.0 if lip_g is None else lip_g)

    def levers(self, seq_len: Optional[int] = None) -> Dict[int, List[Lever]]:
        """The block levers of each residual update (``qk_norm_eps``, ``init_values``), by update index.

        With :attr:`branch_gains`, an update without a gain gets the ``init_values`` lever too (a gain ``v``
        scales its certificate by ``v``).
        """
        out: Dict[int, List[Lever]] = {}
        for k, (_, m) in enumerate(self.residual_updates()):
            ls = list(getattr(m, "levers", lambda: [])())
            if self.branch_gains and not any(lv.name == "init_values" for lv in ls):
                ls.append(Lever("init_values", 1.0, False, scaled_certificate))
            if ls:
                out[k] = ls
        return out

    def fixes(self, dtype: Union[str, torch.dtype, None] = None, *, enforce: bool = True) -> List[Fix]:
        """For a model refused in ``dtype`` (default ``cert_dtype``), the value of each lever that certifies it,
        each certified again (:mod:`certblocks.fixes`): ``init_values`` (branch gains), ``qk_norm_eps``, the
        number of updates, :func:`certblocks.enforce`'s cap factor (``enforce=True``; the head keeps its current
        ``Lip(G)``) and a wider dtype when it certifies more.  Empty when the model is certified."""
        cert = self.certificate(dtype)
        if cert.ok:
            return []
        extra: List[Fix] = []
        if enforce:
            extra += self._enforce_fix(cert)
        return compute_fixes(cert, levers=self.levers(), extra=extra, dt=False)

    def _enforce_fix(self, cert: StackCertificate) -> List[Fix]:
        from certblocks.enforcement import cap_factor

        try:
            alpha, worst = cap_factor(self, cert.dtype, lip_g=cert.lip_g)
        except (TypeError, ValueError):  # a block without caps, or no caps certify it
            return []
        return [Fix("enforce", alpha, worst.certified_depth, worst.depth, worst.ok,
                    f"certblocks.enforce(model, {cert.dtype!r}) with cap factor {alpha:.3g} "
                    f"({'keeps' if alpha >= 1 else 'shrinks'} the current weights)")]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The forward, after the envelope's check of its compute dtype (:attr:`envelope`; skipped while
        ``torch.compile`` / ``torch.export`` trace the model).  TorchScript compiles ``forward`` alone."""
        env = self.__dict__.get("envelope")
        if env is not None:
            x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if x is not None:
                param = None if x.is_floating_point() else next(self.parameters(), None)  # token ids: the weights'
                env.check(x, dtype=None if param is None else param.dtype, state=False, stacklevel=4)
        return super().__call__(*args, **kwargs)

    def _certify_or_refuse(self, certify: bool, cert_dtype: Union[str, torch.dtype, Any, None]) -> None:
        """Set ``cert_dtype`` and the :attr:`envelope`; when ``certify``, raise :class:`CertificationError` if the
        model is not certified.

        The envelope (:class:`certblocks.model.Envelope`) checks the compute dtype of each forward (the autocast
        dtype, else the input's or the parameters' dtype): one narrower than ``cert_dtype`` warns once with
        :class:`~certblocks.model.EnvelopeWarning` (raises with ``model.envelope.strict = True``) and
        :meth:`certificate` is then computed in it.  The sequence length is not checked: the zoo's models refuse
        longer inputs themselves (``block_size``, a fixed context or image size), and ``r0`` is derived from the
        embedding, valid for every input."""
        from certblocks.envelope import Envelope

        check_bool("certify", certify)
        self.cert_dtype = as_precision(cert_dtype if cert_dtype is not None else DEFAULT_CERT_DTYPE).name
        self.envelope = Envelope(type(self).__name__, self.cert_dtype, quiet=not certify)  # certify=False: no claim
        if not certify:
            return
        cert = self.certificate()
        if not cert.ok:
            f = cert.first_failure
            assert f is not None
            fixes = format_fixes(self.fixes(enforce=False))  # enforce's cap factor: .fixes() (every norm again)
            raise CertificationError(
                f"{type(self).__name__} with {cert.depth} residual updates is not certified in {cert.dtype} "
                f"(r0 = {cert.r0:.4g}, seq_len = {self.certificate_seq_len()}): certified depth "
                f"{cert.certified_depth} of {cert.depth}; {f.reason}. Culprit's fix: {f.fix}. "
                + (f"{fixes[0].upper()}{fixes[1:]}. " if fixes else "")
                + "Build it with certify=False to get it anyway (its .certificate() still tells; .fixes() also "
                "computes certblocks.enforce's cap factor).", cert)


def _update_certificate(module: nn.Module, seq_len: int, name: str) -> BlockCertificate:
    """One residual update's certificate, named by its module path."""
    # a gained update's view names its children as in their block (attn, ls1): the block's path is the prefix
    prefix = f"{name.rpartition('.')[0]}." if isinstance(module, ScaledBranch) and "." in name else f"{name}."
    return renamed(block_certificate(module, seq_len=seq_len, prefix=prefix), name)


def normed_linear_head(norms: List[nn.Module], linear: Optional[nn.Linear], name: str) -> BlockCertificate:
    """The map certificate of ``linear(norm_k(... norm_1(x)))`` (normalizations, then a classifier): growth
    ``||W|| A + ||b||`` whatever ``x`` (q = 0), Jacobian ``||W|| prod G`` (sigma = 0), every entry below the
    last normalization's ``A`` and the logits' bound (``A`` and ``G`` from :mod:`certblocks.bounds.normalization`;
    token pooling between them -- the class token, or the mean over tokens -- has norm 1 in the per-token norm).
    """
    if not norms:
        raise ValueError("a normed head needs at least one normalization (its output bound)")
    a, g = 0.0, 1.0
    for norm in norms:
        a, gk = module_norm_bounds(norm)
        g *= gk
    if linear is None:
        return BlockCertificate(0.0, 0.0, c=0.0, b=a, l1=0.0, l0=g, name=name, kind="map", peak=Peak(0.0, 0.0, a))
    w = op_norm(linear.weight)
    bias = vec_norm(linear.bias)
    logits = row_norm_max(linear.weight) * a + (float(linear.bias.detach().abs().max()) if linear.bias is not None
                                                else 0.0)
    out = (w * a + bias) * (1.0 + 2.0**-50)
    return BlockCertificate(0.0, 0.0, c=0.0, b=out, l1=0.0, l0=w * g * (1.0 + 2.0**-50), name=name, kind="map",
                            peak=Peak(0.0, 0.0, max(a, logits) * (1.0 + 2.0**-50), "logits"))
