"""The largest singular value of a map's Jacobian at a batch of states, one per sample.

:func:`jacobian_spectral_norm` estimates ``||Dv(x_s)||_2`` -- the spectral norm of the Jacobian of ``v`` at
sample ``s``, as a map of the sample's whole state (all tokens and features flattened) -- for every sample of a
batch at once, with Jacobian-vector products (``torch.func.jvp``, else the transpose of a double backward,
else central differences) and vector-Jacobian products (autograd, one graph reused).  The samples must not
interact through ``v`` (eval mode: no batch statistics).

Method: Lanczos on ``J^T J`` with full reorthogonalization (the power iteration, accelerated).  The value
reported for a sample is the Ritz value ``sqrt(lambda_max(T_k)) = ||J v*||`` for the unit Ritz vector ``v*`` (with
central differences, ``||J^T u*||`` for ``u* = J v* / ||J v*||``, one exact product more): it is attained, so it
never exceeds the norm (up to the rounding of the products): **an estimate from below**, reported with its number
of steps and the relative change of its last step.

:func:`dense_jacobian_norm` is the certified counterpart for small maps: the whole Jacobian of each sample
in float64, and :func:`certblocks.bounds.op_norm`'s rigorous bound of its spectral norm.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
from torch import Tensor

from ..bounds import op_norms

__all__ = ["LinearizedMap", "SpectralEstimate", "jacobian_spectral_norm", "dense_jacobian_norm"]

Map = Callable[[Tensor], Tensor]


def _math_attention() -> Any:
    """``scaled_dot_product_attention`` on its math kernel (plain ops: forward-mode rules exist for each)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - older torch
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.MATH])


def _flat(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0], -1)


def _norms(t: Tensor) -> Tensor:
    """Per-sample Euclidean norms in float64, ``(B,)``."""
    return torch.linalg.vector_norm(_flat(t).to(torch.float64), dim=1)


class LinearizedMap:
    """``v`` linearized at ``x``: ``J w`` and ``J^T u`` for the batch ``x`` (one autograd graph, reused).

    Args:
        f: the map ``(B, ...) -> (B, ...)``.
        x: the states.
        jvp: ``"forward"`` (``torch.func.jvp``, re-running ``f``), ``"double"`` (the transpose of the
            vector-Jacobian product: a double backward through the saved graph), ``"central"`` (central
            differences: only for choosing directions, never a value) or ``"auto"``: the first that works,
            in the order forward, double, central.
        graph: ``f(x)`` already computed with ``x`` requiring grad (its autograd graph is reused, so that one
            forward serves the recorder, the costates and the products).
    """

    def __init__(self, f: Map, x: Tensor, jvp: str = "auto", *, graph: Optional[Tensor] = None) -> None:
        if jvp not in ("auto", "forward", "double", "central"):
            raise ValueError(f"jvp must be 'auto', 'forward', 'double' or 'central', got {jvp!r}")
        self.f = f
        if graph is not None:  # f(x) already run with x requiring grad: its graph is reused, f is not run again
            if not x.requires_grad:
                raise ValueError("graph= needs the x it was computed from, requiring grad")
            self.x, self._out = x, graph
        else:
            self.x = x.detach().requires_grad_(True)
            with torch.enable_grad():
                self._out = f(self.x)  # one graph; vector-Jacobian products reuse it (plain autograd: any module)
        self.out = self._out.detach()
        self._mode = jvp
        self._dummy: Optional[Tensor] = None
        self._grad_of_dummy: Optional[Tensor] = None

    @property
    def exact_jvp(self) -> bool:
        """Whether ``J w`` is computed exactly (up to rounding): not by central differences."""
        return self._mode in ("forward", "double")

    @property
    def mode(self) -> str:
        return self._mode

    def vjp(self, u: Tensor) -> Tensor:
        """``J^T u``."""
        (g,) = torch.autograd.grad(self._out, self.x, u.to(self.out.dtype), retain_graph=True, allow_unused=True)
        return torch.zeros_like(self.x) if g is None else g

    def jvp(self, w: Tensor) -> Tensor:
        """``J w`` (the first call settles ``"auto"``)."""
        w = w.to(self.x.dtype)
        if self._mode != "auto":
            return self._jvp(self._mode, w)
        for mode in ("forward", "double", "central"):
            try:
                out = self._jvp(mode, w)
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            if mode != "central" and not self._adjoint_agrees(w, out):
                continue  # an op without a forward-mode rule can return zeros silently (a custom kernel)
            self._mode = mode
            return out
        raise RuntimeError("no Jacobian-vector product works for this map")  # central differences always run

    def _adjoint_agrees(self, w: Tensor, jw: Tensor) -> bool:
        """``<u, J w> = <J^T u, w>`` for a random ``u``, up to the rounding of the map's dtype: a mode whose
        products disagree with the vector-Jacobian product (which autograd always has) is not used."""
        g = torch.Generator(device="cpu").manual_seed(0)
        u = torch.randn(jw.shape, generator=g, dtype=torch.float64).to(jw.device)
        jtu = self.vjp(u.to(self.out.dtype)).double()
        lhs = float((u * jw.double()).sum())
        rhs = float((jtu * w.double()).sum())
        if not (math.isfinite(lhs) and math.isfinite(rhs)):
            return True  # an overflowing Jacobian is reported as such, not second-guessed here
        scale = float(jtu.norm() * w.double().norm()) + float(u.norm() * jw.double().norm())
        tol = 0.05 if self.x.dtype in (torch.float16, torch.bfloat16) else 1e-3
        return abs(lhs - rhs) <= tol * scale + 1e-30

    def _jvp(self, mode: str, w: Tensor) -> Tensor:
        x = self.x.detach()
        if mode == "forward":  # fused attention kernels have no forward-mode rule: the math kernel has
            with torch.no_grad(), _math_attention():
                return torch.func.jvp(self.f, (x,), (w,))[1]
        if mode == "double":  # J w = d/du <J^T u, w>: the transpose of the vector-Jacobian product
            with torch.enable_grad():
                if self._dummy is None:
                    self._dummy = torch.zeros_like(self.out).requires_grad_(True)
                    (self._grad_of_dummy,) = torch.autograd.grad(self._out, self.x, self._dummy, retain_graph=True,
                                                                 create_graph=True)
                assert self._grad_of_dummy is not None  # set with _dummy
                (jw,) = torch.autograd.grad(self._grad_of_dummy, self._dummy, w, retain_graph=True)
            return jw
        with torch.no_grad():
            h = 1e-3 * (_norms(x) / _norms(w).clamp_min(1e-30)).clamp_min(1e-6)
            h = h.to(x.dtype).reshape(-1, *([1] * (x.ndim - 1)))
            return (self.f(x + h * w) - self.f(x - h * w)) / (2 * h)


@dataclass
class SpectralEstimate:
    """Per-sample estimates of ``||J||_2`` (from below) and how they were reached.

    Attributes:
        values: ``(B,)`` float64; ``inf`` for a sample whose products are not finite (the Jacobian overflows).
            ``(1,)``, the whole batch's, for a map whose output batch differs from its input's.
        vector: the unit right singular vector reached (a warm start for the next call), shape of ``x``.
        steps: Lanczos steps run (each one Jacobian-vector and one vector-Jacobian product).
        change: the largest relative change of a sample's estimate over the last step (0 when converged exactly).
        converged: ``change <= tol`` (or an exact invariant subspace was found).
        jvp: the Jacobian-vector product used (``forward``, ``double`` or ``central``).
    """

    values: Tensor
    vector: Tensor
    steps: int
    change: float
    converged: bool
    jvp: str


def _orthogonalize(t: Tensor, basis: List[Tensor]) -> Tensor:
    """``t`` minus its projections on the orthonormal rows of ``basis`` (per sample, two passes)."""
    for _ in range(2):
        for b in basis:
            t = t - (t * b).sum(dim=1, keepdim=True) * b
    return t


def _normalize(t: Tensor, basis: List[Tensor], gen: torch.Generator) -> Tensor:
    """Rows of ``t`` (B, N) normalized; a row that is zero or not finite is replaced by a random unit row
    orthogonal to ``basis``."""
    n = torch.linalg.vector_norm(t.to(torch.float64), dim=1, keepdim=True)
    ok = (n > 1e-300) & torch.isfinite(n)
    out = t / torch.where(ok, n, torch.ones_like(n)).to(t.dtype)
    if not bool(ok.all()):
        r = torch.randn(t.shape, generator=gen, dtype=torch.float64).to(device=t.device, dtype=t.dtype)
        r = _orthogonalize(r, basis)
        r = r / torch.linalg.vector_norm(r, dim=1, keepdim=True).clamp_min(1e-300)
        out = torch.where(ok, out, r)
    return out


def jacobian_spectral_norm(lin: LinearizedMap, *, steps: int = 12, tol: float = 1e-2, v0: Optional[Tensor] = None,
                           seed: int = 0) -> SpectralEstimate:
    """Estimate ``||J(x_s)||_2`` for each sample ``s`` (from below; see the module docstring).

    Lanczos on ``J^T J`` (its largest eigenvalue is ``||J||^2``), full reorthogonalization: only vectors of the
    input's shape are kept (the output may be much larger, e.g. a language model's logits).

    Args:
        lin: the linearized map.
        steps: at most this many Lanczos steps (``>= 1``; each one ``J w`` and one ``J^T u``).
        tol: stop when every sample's estimate changed by at most ``tol`` (relative) over one step.
        v0: starting vector (shape of ``x``; e.g. the previous call's :attr:`SpectralEstimate.vector`);
            default: random.
        seed: seed of the random starting vectors.
    """
    x = lin.x
    # one block per sample when the map keeps the batch (sample s's output reads sample s only); a map whose output
    # batch differs (a forecaster's head gathering a series' channels folded into the batch) is one block
    B = x.shape[0] if lin.out.shape[:1] == x.shape[:1] else 1
    N = x.numel() // max(B, 1)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    gen = torch.Generator().manual_seed(seed)
    bad = torch.zeros(B, dtype=torch.bool, device=x.device)

    def checked(r: Tensor) -> Tensor:
        nonlocal bad
        r = r.reshape(B, -1).detach().to(work)
        finite = torch.isfinite(r).all(dim=1)
        bad = bad | ~finite
        return torch.where(finite[:, None], r, torch.zeros_like(r))

    J = lambda t: checked(lin.jvp(t.reshape(x.shape)))
    JT = lambda t: checked(lin.vjp(t.reshape(lin.out.shape)))

    def JTJ(t: Tensor) -> Tensor:
        """``J^T J t`` for unit rows ``t``, with ``J t`` normalized before ``J^T`` (in a half-precision map
        ``||J||^2`` may exceed the format where ``||J||`` does not)."""
        u = J(t)
        nu = torch.linalg.vector_norm(u.to(torch.float64), dim=1, keepdim=True)
        return JT(u / nu.clamp_min(1e-300).to(work)) * nu.to(work)
    start = torch.randn(B, N, generator=gen, dtype=torch.float64).to(x.device, work)
    if v0 is not None and tuple(v0.shape) == tuple(x.shape):
        start = v0.reshape(B, N).to(x.device, work)
    V: List[Tensor] = [_normalize(start, [], gen)]
    alphas: List[Tensor] = []
    betas: List[Tensor] = []
    est = torch.zeros(B, dtype=torch.float64, device=x.device)
    change, done, n = math.inf, False, 0
    w = JTJ(V[0])
    while True:
        n += 1
        a = (w.to(torch.float64) * V[-1].to(torch.float64)).sum(dim=1)
        alphas.append(a)
        w = _orthogonalize(w - a.to(work)[:, None] * V[-1], V)
        T = torch.diag_embed(torch.stack(alphas, 1))
        if betas:
            off = torch.stack(betas, 1)
            T = T + torch.diag_embed(off, offset=1) + torch.diag_embed(off, offset=-1)
        evals, evecs = torch.linalg.eigh(T.cpu())
        new = evals[:, -1].clamp_min(0.0).sqrt().to(x.device)
        if n > 1:
            ok = ~bad & (new > 0)
            rel = ((new - est).abs() / new.clamp_min(1e-300))[ok]
            change = float(rel.max()) if rel.numel() else 0.0
            done = change <= tol
        est = new
        if done or n >= steps or len(V) >= N:
            done = done or len(V) >= N
            break
        b = torch.linalg.vector_norm(w.to(torch.float64), dim=1)
        betas.append(b)
        V.append(_normalize(w, V, gen))
        w = _orthogonalize(JTJ(V[-1]) - b.to(work)[:, None] * V[-2], [])
    # the Ritz vector of the largest eigenvalue: with exact products, ||J v*||^2 = v*^T J^T J v* is the Ritz value
    # (attained); with central differences the value is re-measured by a vector-Jacobian product (exact)
    y = evecs[:, :, -1].to(x.device, work)
    v_star = _normalize(sum(y[:, i:i + 1] * V[i] for i in range(len(V))), [], gen)
    if lin.exact_jvp:
        values = est
    else:
        values = torch.linalg.vector_norm(JT(_normalize(J(v_star), [], gen)).to(torch.float64), dim=1)
    values = torch.where(bad, torch.full_like(values, math.inf), values)
    return SpectralEstimate(values, v_star.reshape(x.shape).detach(), n, change, bool(done), lin.mode)


def dense_jacobian_norm(f64: Map, x: Tensor) -> Tensor:
    """A rigorous upper bound of ``||J(x_s)||_2`` per sample: the whole float64 Jacobian, then ``op_norm``'s bound.

    Args:
        f64: the map computed in float64 (parameters and input in float64, no autocast).
        x: the states ``(B, ...)`` (cast to float64).

    Returns:
        ``(B,)`` float64 upper bounds (exact up to the float64 rounding of the Jacobian itself); ``(1,)``, the whole
        batch's, when the map's output batch differs from its input's.
    """
    x64 = x.detach().to(torch.float64).requires_grad_(True)
    with torch.enable_grad(), torch.autocast(x.device.type, enabled=False):
        y = f64(x64)
        # samples are independent when the map keeps the batch; otherwise (a head that gathers channels folded into
        # the batch) the whole batch is one block: (1, N_out, N_in)
        B = x64.shape[0] if y.shape[:1] == x64.shape[:1] else 1
        out = y.reshape(B, -1)
        rows = []
        for i in range(out.shape[1]):  # one backward gives row i of every block
            rows.append(torch.autograd.grad(out[:, i].sum(), x64, retain_graph=True)[0].reshape(B, -1))
    J = torch.stack(rows, dim=1)  # (B, N_out, N_in)
    return torch.tensor([op_norms(J[s:s + 1])[0] for s in range(J.shape[0])], dtype=torch.float64)
