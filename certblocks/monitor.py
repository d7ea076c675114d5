"""``CertificateMonitor``: watch a model's certificate while it trains, and warn before it breaks.

A certificate is computed from the current weights, and training moves them (docs/theory.md section 5):
in a no-LN GPT-2 that diverged, the query-key coefficient ``kappa`` of one block grew ~40x before
the blow-up.  The monitor follows, every ``every`` training steps:

* per residual update ``k`` (names from :func:`residual_updates`): the certificate's coefficients
  ``c, b, l1, l0``, the radius ``R_k``, the backward factor ``log(1 + dt L_k(R_k))`` and two margins
  to the dtype's budget (below);
* on the current batch: the saturation ratio ``||v(X_k)|| / (c ||X_k||^q + b)`` (largest over the
  batch's samples, per-token norm) and the cosine between ``v(X_k)`` and ``-p_{k+1}``;
* per attention update: ``kappa = max_h ||W_Q^{hT} W_K^h||`` and the largest attention logit on the batch;
* per ``nn.Linear`` inside an update: its operator norm (``<update>/<layer>.opnorm``).

**Margins** (``M`` the dtype's largest finite value, ``B = log(M / Lip G)`` the backward log budget,
``D`` the number of updates, ``f_k = log(1 + dt L_k(R_k))``):

* ``margin_grad`` of update ``k`` = ``1 - f_k / (B / D)``: the unused fraction of the update's even share
  of the backward budget (negative: the update uses more than its share; the stack can still be
  certified if others use less -- see ``stack/margin_grad``);
* ``margin_fwd`` of update ``k`` = ``1 - log(max(R_{k+1}, 1)) / log(M)``: how far the forward radius after
  the update is from overflow, in log scale;
* ``stack/margin_grad`` = ``1 - sum_k f_k / B`` and ``stack/ok``, ``stack/certified_depth``.

**On data** (``on_data=True``, the default; :mod:`certblocks.ondata`): at each check, the paper's trajectory
bound (T) on the checked batch -- the velocities called again on the states ``X_k`` captured in the training
forward, the spectral norm of each one's Jacobian by warm-started Lanczos (``data_steps``; an estimate from
below), the largest intermediates, and ``||p_D||`` measured from the user's own backward (the costate at the
last state; without a backward, ``lip_g``).  The records get ``data/headroom`` (nats, ``min`` of the forward and
backward margins to ``log M``), ``data/log_grad_bound``, their certified versions (the blocks' Jacobian bounds
at the batch's radius) and per update ``jacobian_norm``, ``jacobian_bound``, ``peak``, ``data_log_factor``.
A model without certified blocks is watched on data only: its call is kept by a forward pre-hook and
:func:`certblocks.trajectory` runs on it at the check (its graph: one more forward, an export).

**Alerts.**  Each issues a :class:`CertificateWarning` naming the update and the quantity, and calls
``callback(alert)``:

* ``headroom`` (on data): the batch's headroom is below ``headroom_threshold`` nats (default 1); the alert names
  the update that consumes the most headroom and its ``cause`` (``"Jacobian"``, ``"state norm"``,
  ``"logits"``, ``"intermediate"``, ``"head"`` or ``"gradient growth"``), with kappa and the largest logit for
  attention.  The headroom is read on ``headroom_basis``: by default ``"measured"``, the forward peaks and the
  costates ``p_k`` this batch's backward really has (from the training backward's ``p_D``, by vector-Jacobian
  products); ``"estimate"`` reads the (T) bound, a product of Jacobian norms that can sit far above the real
  gradient (about 15 nats on a 12-update GPT: alerts on runs that train); all three stay in the records;
* ``headroom trend`` (on data, ``horizon`` steps): the least-squares line through the last ``trend_window``
  headrooms reaches 0 within ``horizon`` steps;
* with ``worst_case_alerts=True`` (off by default: the worst-case certificate holds for every input of the
  ball and refuses models that train well on data; its margins stay in the records):
  ``stack/margin_grad`` below ``threshold`` (or not a number: exponents not derived), naming the update with the
  largest factor ``f_k``; ``margin_fwd`` below ``threshold`` (the first update after which the forward radius
  bound is that close to ``M``, log scale); with ``share_alerts=True``, every update whose ``margin_grad``
  (even share) is below ``threshold``;
* ``kappa`` of an attention update without QK-norm at least ``kappa_growth`` times its value at the
  first check (default 10x; docs/theory.md section 5: ~40x preceded the divergence of a no-LN GPT-2);
* ``non-finite weights``: a weight holds NaN or inf; the record has ``stack/ok = False`` and ``nonfinite``
  (the message naming the tensors), and the check returns instead of raising: the training loop decides.

**How the figures are obtained.**

* Coefficients and margins come from the blocks' own ``certificate()`` (sound upper bounds with
  float64 norms, on one thread, computed at each check: no cache) through :func:`certblocks.certify_stack`,
  at the certificate's ``r0`` and ``seq_len`` (the monitor's, else the model's): the margins are never
  optimistic for inputs inside them.  A forward outside them is the model's envelope's to report
  (:class:`certblocks.model.Envelope`: its ``certificate()`` is then computed at the envelope used).
  Measured cost: ~1.2 s per check for a 6-layer, width-384 GPT-2 on a busy 2-core CPU.
* ``kappa`` and the ``opnorm`` figures are *estimates* from warm-started power iteration: the previous
  top singular vector of each matrix is kept and ``power_iters`` iterations (``power_iters_init`` the
  first time) refine it.  A power-iteration value is ``||A v|| / ||v||`` for some ``v``, so it never
  exceeds the exact norm, and it converges to it from below; ``tests/monitor`` compares it with
  ``torch.linalg.matrix_norm(ord=2)``.  These are diagnostics, not bounds; nothing sound depends on them.
* Batch quantities use **forward hooks** on each velocity module (installed at construction, active
  only on checked steps): the hook reads the update's input ``X_k`` and output ``v(X_k)``.  ``p_{k+1}``
  comes from a tensor hook registered on ``v(X_k)`` during that forward: the user's own
  ``loss.backward()`` delivers ``dL/dv = dt * p_{k+1}`` (``X_{k+1} = X_k + dt v``, ``dt > 0``), which
  has the direction of ``p_{k+1}``.  No extra forward or backward pass is run.  With gradient
  accumulation, the first forward after the previous check is the one measured.
* **The measured basis in the training step** (``measure_in_step=True``, the default): on a step whose check
  reads only measured figures (``headroom_basis="measured"``, no Lanczos estimate due), the training step itself
  measures them: from each update's entry call to its exit's return a recorder
  (:class:`~certblocks.ondata.watch.StepRecorder`) sees every torch function and keeps the largest ``|entry|`` per
  dtype of each floating output autograd reaches ``X_k`` from (the tensors and figure of the separate recorded pass,
  read in the tensor's own dtype; a fused QK-norm runs as its plain composition on that step so that its normalized
  queries and keys are seen, as there), a tensor hook on ``X_k`` keeps ``p_k = dL/dX_k`` from the user's backward,
  and the attention's input gives its largest logit.  The check then adds no pass: its cost is the certificates
  and a little arithmetic (``benchmarks/results/trajectory_cost.md``).  The figures equal the separate passes' up
  to rounding (``tests/monitor/test_monitor_cost.py``) with two differences: they are the step's own (training-mode
  dropout active), and ``p_k`` is the whole ``dL/dX_k`` (a use of ``X_k`` outside the chain of updates included).
  Where the step cannot measure (a state that does not require grad, e.g. a stack fed a raw tensor: no costate at
  ``X_0``; a forward without grad; no backward before the check; a model read from its graph; a check with the
  estimates), the check runs the separate passes as before.
* The saturation ratio is ``<= 1`` whenever the certificate is sound and dropout is inactive (``eval()``
  or ``p = 0``): training-mode dropout rescales ``v`` by ``1 / (1 - p)``, outside the certificate.
* The attention logit is ``s q_i . k_j`` over the causal pairs (all pairs for bidirectional
  attention; user masks are ignored, so the figure is the largest over a superset), on the first
  ``logit_samples`` samples of the batch.

Use::

    monitor = CertificateMonitor(model, "bf16", every=50)
    for batch in data:
        loss = model(batch).loss
        loss.backward()
        monitor.step()          # after backward, before optimizer.step(): figures match the batch
        optimizer.step(); optimizer.zero_grad()
    monitor.to_csv("certificate.csv")
"""

from __future__ import annotations

import csv
import math
import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from ._fsdp import Units, is_fsdp
from ._monitor_hooks import MonitorHooks
from ._validation import NonFiniteWeightError, check_bool, check_callable, check_finite, check_int, check_real
from .blocks.stats import power_norm as _power_step
from .bounds import one_thread
from .certificate import BlockCertificate, StackCertificate, certify_stack
from .envelope import CertificateWarning, envelope_paused
from .model import CertifiedModel, as_certified
from .ondata.sources import Call
from .ondata.watch import OnDataWatch, StepFigures, StepRecorder
from .precision import as_precision
from .updates import ResidualUpdates, residual_updates

# CertificateWarning lives in certblocks.envelope (the envelope's warnings are ones too); importable from here as before
__all__ = ["CertificateMonitor", "CertificateWarning", "ResidualUpdates", "residual_updates"]


# ------------------------------------------------------------------------------------------------ monitor
class CertificateMonitor(MonitorHooks):
    """Recompute a model's certificate during training and warn when a margin runs low.

    See the module docstring for every figure and how it is obtained.

    Args:
        model: a :class:`~certblocks.CertifiedStack`, a zoo model, a converted model (or its
            :class:`~certblocks.ConversionReport`), a wrapper of one (DDP, FSDP, ``torch.compile``), ``(name,
            module)`` pairs, or any other module (watched on data only, from its graph): what
            :func:`certblocks.model.as_certified` reads.
        dtype: the dtype whose budget the margins refer to (``torch.bfloat16``, ``"fp16"``, ...), or a precision
            policy (:func:`certblocks.precision.as_precision`: ``"amp-fp16"``): the certificate checks each value
            against the dtype it is held in (``margin_fwd`` against the stream's, ``margin_grad`` against the
            gradient dtype's ``M``), and on data each recorded value counts against its own dtype's ``M`` where the
            batch ran in the policy's narrowest dtype (train under its autocast).
        every: check every ``every`` calls of :meth:`step` (the first check is at step 0).
        r0: the input radius of the certificate (default: the model's, see :func:`~certblocks.model.as_certified`).
        seq_len: the sequence length of the certificates (default: the model's).
        threshold: warn when a margin is below this value (a number < 1; default 0.1).
        callback: ``callback(alert)`` for each alert, ``alert`` a dict with ``step``, ``update``,
            ``quantity``, ``value``, ``threshold`` and ``message``.
        share_alerts: also alert on each update's ``margin_grad`` (its even share of the backward budget);
            off by default because a certified stack may spend its budget unevenly.
        kappa_growth: alert when an attention update without QK-norm has ``kappa`` at least this many
            times its value at the first check (``None``: never).
        power_iters: power iterations per check (warm-started) for ``kappa`` and the operator norms.
        power_iters_init: power iterations the first time a matrix is seen.
        logit_samples: samples of the batch used for the largest attention logit.
        batch_figures: install the forward hooks (saturation, cosine, logits, the on-data certificate);
            ``False`` keeps only the weight-based figures.
        on_data: compute the on-data certificate (:func:`certblocks.trajectory`'s figures) of the checked batch.
        headroom_threshold: on-data alert when the batch's headroom (nats) is below this (``None``: never).
        horizon: on-data alert when the headroom's trend (least squares over the last ``trend_window`` checks)
            reaches 0 within this many steps (``None``: never).
        trend_window: checks in the trend.
        headroom_basis: the headroom the on-data alerts read: ``"measured"`` (default; the estimate where no
            backward was seen), ``"estimate"`` or ``"certified"`` (:meth:`TrajectoryReport.headroom_on`).
        worst_case_alerts: also alert on the worst-case margins (``stack/margin_grad``, ``margin_fwd``, and with
            ``share_alerts`` each update's share); off by default: they stay in the records.
        data_steps: Lanczos steps per Jacobian at each check (warm-started from the previous check).
        estimate_every: run the Lanczos estimates (records ``data/headroom``, ``data/log_grad_bound``,
            ``<update>/jacobian_norm``) at every this many on-data checks.  ``None`` (default): only where the alerts
            need them (``headroom_basis`` ``"estimate"`` or ``"certified"``, or no backward seen before the
            check).
        measure_in_step: measure the figures of a check on the measured basis in its training step (module
            docstring; no pass of the check); ``False``: separate passes (a few forward+backward passes of the checked
            segments).
        certificate_every: compute the worst-case certificate (the coefficients, margins, ``stack/...``, the
            saturation and the on-data certified figures) at every this many checks (the first included); the other
            checks record the batch, kappa, operator-norm and on-data measured figures, check the weights finite,
            and leave the worst-case alerts out.  The certificate is most of a check measured in the step (its
            float64 norms: ``benchmarks/results/trajectory_cost.md``).

    Attributes:
        records: one plain dict per check (keys ``step``, ``stack/...`` and ``<update>/<quantity>``).
        alerts: every alert issued.
    """

    def __init__(self, model: Any, dtype: Union[str, torch.dtype, Any], *, every: int = 50, r0: Optional[float] = None,
                 seq_len: Optional[int] = None, threshold: float = 0.1,
                 callback: Optional[Callable[[Dict[str, Any]], Any]] = None,
                 share_alerts: bool = False, kappa_growth: Optional[float] = 10.0,
                 power_iters: int = 4, power_iters_init: int = 50, logit_samples: int = 8,
                 batch_figures: bool = True, on_data: bool = True, headroom_threshold: Optional[float] = 1.0,
                 horizon: Optional[int] = None, trend_window: int = 5, worst_case_alerts: bool = False,
                 data_steps: int = 4, headroom_basis: str = "measured", estimate_every: Optional[int] = None,
                 measure_in_step: bool = True, certificate_every: int = 1) -> None:
        self.precision = as_precision(dtype)
        self.dtype = self.precision.name
        self.every = check_int("every", every)
        self.threshold = check_real("threshold", threshold, lt=1.0, note="a margin")
        self.callback = check_callable("callback", callback, "callable(alert)", optional=True)
        self.share_alerts = check_bool("share_alerts", share_alerts)
        self.kappa_growth = check_real("kappa_growth", kappa_growth, gt=1.0, optional=True)
        self.power_iters = check_int("power_iters", power_iters, 0)
        self.power_iters_init = check_int("power_iters_init", power_iters_init, 1)
        self.logit_samples = check_int("logit_samples", logit_samples)
        for flag, val in (("batch_figures", batch_figures), ("on_data", on_data),
                          ("worst_case_alerts", worst_case_alerts)):
            check_bool(flag, val)
        self.worst_case_alerts = worst_case_alerts
        check_real("headroom_threshold", headroom_threshold, optional=True, note="nats")
        check_int("horizon", horizon, optional=True)
        # on data, each value is read against its own dtype's M where the batch ran in the policy's narrowest dtype
        self._watch = OnDataWatch(self.precision.narrowest, threshold=headroom_threshold, horizon=horizon,
                                  window=check_int("trend_window", trend_window, 3), steps=check_int("data_steps",
                                                                                                    data_steps),
                                  tol=1e-2, logit_samples=self.logit_samples,
                                  basis=headroom_basis, estimate_every=estimate_every
                                  ) if on_data and batch_figures else None
        cm = as_certified(model, r0=r0, seq_len=seq_len)
        if cm.kind == "graph" and self._watch is None:
            raise TypeError(f"{type(cm.module).__name__} has no certified block (no submodule with certificate() and "
                            "exponents): convert it with certblocks.convert first, pass (name, module) pairs, or "
                            "watch it on data only (on_data=True, batch_figures=True)")
        #: the model as the spine reads it; ``None`` for a model watched on data only (from its graph)
        self.updates: Optional[CertifiedModel] = None if cm.kind == "graph" else cm
        self._model = cm
        self.model = model
        # FSDP2 (fully_shard): a check unshards each update's unit in turn, then reshards it (certblocks._fsdp.Units)
        self._units = Units(cm.module) if cm.module is not None and is_fsdp(cm.module) else None
        self.records: List[Dict[str, Any]] = []
        self.alerts: List[Dict[str, Any]] = []
        self.step_count = 0
        self._vectors: Dict[Tuple[int, str], torch.Tensor] = {}
        self._captures: Dict[int, Dict[str, Any]] = {}
        self._handles: List[Any] = []
        self._armed = True
        self._stacklevel = 5  # warnings point at the caller of check() / step()
        self._kappa0: Dict[int, float] = {}
        self._gen = torch.Generator().manual_seed(0)
        self._inputs: Dict[int, Any] = {}
        self._batch: Optional[Any] = None
        self._qk_normed: Dict[int, bool] = {}
        self._warm: Dict[int, Dict[str, torch.Tensor]] = {}
        # measured in the training step (the measured basis): per update its figures, the recorders running now
        self._step_figs: Dict[int, StepFigures] = {}
        self._loss_scale = 1.0  # of the backward the next check reads (step(loss_scale=...))
        self._recording: Dict[int, Tuple[StepRecorder, List[nn.Module], StepFigures]] = {}
        self._in_step = False
        self.measure_in_step = check_bool("measure_in_step", measure_in_step)
        self.certificate_every = check_int("certificate_every", certificate_every)
        self._certified = 0  # checks of the updates so far (the worst-case certificate at every certificate_every-th)
        if self.updates is None:
            assert cm.module is not None
            self._handles.append(cm.module.register_forward_pre_hook(self._model_hook, with_kwargs=True))
        elif batch_figures:
            for k in range(len(cm.modules)):
                entry, exit_ = cm.io(k)
                if self._watch is not None and measure_in_step:  # before the hooks below: they run outside it
                    self._handles += self._step_hooks(k, entry, exit_)
                if entry is not exit_:  # a view outside the model's forward: its entry sees X_k, its exit v(X_k)
                    self._handles.append(entry.register_forward_hook(self._make_input_hook(k), with_kwargs=True))
                    self._handles.append(exit_.register_forward_hook(self._make_hook(k, entry), with_kwargs=True))
                else:
                    self._handles.append(entry.register_forward_hook(self._make_hook(k), with_kwargs=True))

        self._arm()

    # -- weight figures -------------------------------------------------------------------------------------
    @torch.no_grad()
    def _power(self, key: Tuple[int, str], mv: Callable, rmv: Callable, batch: int, n: int) -> torch.Tensor:
        v = self._vectors.get(key)
        iters = self.power_iters
        if v is None or tuple(v.shape) != (batch, n):
            v = torch.randn(batch, n, generator=self._gen, dtype=torch.float64)
            v = v / v.norm(dim=-1, keepdim=True)
            iters = self.power_iters_init
        sigma, v = _power_step(mv, rmv, v, iters)
        self._vectors[key] = v
        return sigma

    def _kappa(self, k: int, m: nn.Module) -> float:
        """``max_h ||W_Q^{hT} W_K^h||`` by warm-started power iteration (an estimate from below): the attention's
        ``attention_stats()``, its start vectors kept across checks."""
        warm = self._warm.setdefault(k, {})
        iters = self.power_iters if "kappa" in warm else self.power_iters_init
        stats = m.attention_stats(None, warm=warm, iters=iters, generator=self._gen)  # type: ignore[operator]  # an attention: has attention_stats
        self._qk_normed[k] = bool(stats.get("qk_norm"))
        return float(stats["kappa"])

    def _opnorm(self, k: int, sub: str, w: torch.Tensor) -> float:
        w = w.detach().to("cpu", torch.float64)
        if w.ndim != 2 or w.numel() == 0:
            return math.nan
        mv = lambda v: v @ w.T
        rmv = lambda u: u @ w
        return float(self._power((k, sub), mv, rmv, 1, w.shape[1])[0])

    # -- the check ------------------------------------------------------------------------------------------
    def step(self, loss_scale: Union[float, Any, None] = None) -> Optional[Dict[str, Any]]:
        """Count one training step; on a checked step compute, record and return the figures.

        Call it once per training step, after ``loss.backward()`` (the batch figures need the
        gradient) and before ``optimizer.step()`` (so the certificate is for the weights that produced
        the batch).  Returns the record on a checked step, else ``None``.

        Args:
            loss_scale: the scale the loss was multiplied by before this backward (a number, or the
                ``torch.amp.GradScaler`` itself: its current scale).  The measured costates are divided by it, so
                the backward headroom reads the unscaled gradients: a scaled gradient past ``M`` is a skipped step
                the scaler absorbs, an unscaled one is a scaler that has to fall below 1.  ``None``: the loss was
                not scaled.
        """
        self._loss_scale = self._scale_of(loss_scale)
        record = None
        self._drop_recordings()  # a forward that raised inside an update left its recorder running
        if self.step_count % self.every == 0:
            self._stacklevel = 6
            try:
                record = self.check()
            finally:
                self._stacklevel = 5
        self.step_count += 1
        self._captures, self._batch, self._step_figs, self._loss_scale = {}, None, {}, 1.0
        self._arm()
        return record

    @staticmethod
    def _scale_of(loss_scale: Any) -> float:
        if loss_scale is None:
            return 1.0
        get = getattr(loss_scale, "get_scale", None)
        value = get() if callable(get) else loss_scale
        return check_real("loss_scale", float(value) if isinstance(value, torch.Tensor) else value, gt=0.0,
                          note="the loss scale of this backward (a GradScaler's get_scale())")

    def check(self) -> Dict[str, Any]:
        """Compute the figures now (weights as they are, batch figures from the last captured forward)."""
        with one_thread():  # small float64 linear algebra: one thread is much faster here
            try:
                return self._check()
            finally:
                self._hold(())  # FSDP2: the units the check unsharded are sharded again

    def _hold(self, modules: Any, outside: bool = False) -> None:
        """FSDP2: unshard the units of ``modules`` (``outside``: the units holding none of the updates' weights, an
        embedding and a head), resharding the others (:class:`certblocks._fsdp.Units`); no FSDP2: nothing."""
        if self._units is not None:
            ups = self.updates.modules if self.updates is not None else []
            self._units.hold(self._units.outside(ups) if outside else self._units.of_modules(modules))

    def _check(self) -> Dict[str, Any]:
        ups = self.updates
        if ups is None:  # on data only
            rec: Dict[str, Any] = {"step": self.step_count}
            if self._batch is not None:
                assert self._watch is not None and self._model.module is not None
                with envelope_paused():
                    self._record_data(rec, self._watch.from_batch(self._model.module, *self._batch))
            self.records.append(rec)
            return rec
        worst_case = self._certified % self.certificate_every == 0
        self._certified += 1
        certs: Optional[List[BlockCertificate]] = None
        try:
            if worst_case:
                # the updates' stack at the certified r0 and seq_len (the model's envelope is its certificate()'s
                # business), each certificate computed now from the weights as they are (no cache: FSDP2 writes)
                certs = ups.certificates(cached=False) if self._units is None else self._units.certificates(ups)
            else:  # no certificate at this check: its weights are still checked finite, as certificates() does
                for name, m, fixed in zip(ups.names, ups.modules, ups.fixed or [None] * len(ups.modules)):
                    if fixed is None:
                        self._hold([m])
                        check_finite(m, f"{name}.")
        except NonFiniteWeightError as exc:  # record and alert; the training loop decides what to do
            rec = {"step": self.step_count, "stack/ok": False, "nonfinite": str(exc)}
            self.records.append(rec)
            self._emit({"step": self.step_count, "update": exc.names[0][0], "quantity": "non-finite weights",
                        "value": math.nan, "threshold": self.threshold,
                        "message": f"step {self.step_count}: {exc}; no certificate for these weights"})
            return rec
        self._hold((), outside=True)  # a zoo model's r0 reads its embedding
        stack = None if certs is None else certify_stack(certs, self.dtype, dt=ups.dt, r0=ups.radius(), lip_g=ups.lip_g)
        rec = {"step": self.step_count}
        if stack is not None:
            rec.update(self._stack_figures(stack))
        for k, (name, m) in enumerate(zip(ups.names, ups.modules)):
            cert = None if certs is None else certs[k]
            self._hold([m, *ups.io(k)])
            rec.update({f"{name}/{key}": val for key, val in self._update_figures(k, m, cert, stack).items()})
        self.records.append(rec)
        self._alert(rec, stack)
        if self._watch is not None and len(self._captures) == len(ups.modules):
            with envelope_paused():
                self._record_data(rec, self._watch_calls(rec, certs))
        return rec

    def _watch_calls(self, rec: Dict[str, Any], certs: Optional[List[BlockCertificate]]) -> Any:
        """The on-data certificate from the velocities' calls captured in the training forward."""
        ups = self.updates
        assert ups is not None and self._watch is not None
        caps = [self._captures[k] for k in range(len(ups.modules))]
        # a view update (its entry and exit apart) is called as itself, the state first
        calls = [Call(n, m, c["x"], c["rest"][0], c["rest"][1], c["v"], c["where"] if ups.io(k)[0] is m else 0)
                 for k, (n, m, c) in enumerate(zip(ups.names, ups.modules, caps))]
        grad = caps[-1]["grad"]
        scale = self._loss_scale
        rec["data/loss_scale"] = scale
        if scale != 1.0 and grad is not None:  # the costates of the unscaled loss (step(loss_scale=...))
            grad = grad / scale
        kappas = {k: rec[f"{n}/kappa"] for k, n in enumerate(ups.names) if rec.get(f"{n}/kappa") is not None}
        figs = [self._step_figs.get(k) for k in range(len(calls))]
        if scale != 1.0:
            for f in figs:
                if f is not None and f.costate is not None:
                    f.costate = f.costate / scale
        model = type(self._model.module).__name__
        rec["data/measured_in_step"] = in_step = (grad is not None and self._watch.measured_next()
                                                  and all(f is not None and f.complete for f in figs))
        if in_step:  # the training step measured everything the measured basis reads: no pass here
            return self._watch.from_measured(calls, figs, dt=ups.dt, certs=certs, p_d=grad / ups.dt,
                                             kappas=kappas, model=model)
        self._hold([c.module for c in calls])  # FSDP2: the check's passes run every update (all units unsharded)
        return self._watch.from_calls(calls, dt=ups.dt, certs=certs, p_d=None if grad is None else grad / ups.dt,
                                      lip_g=ups.lip_g, kappas=kappas, state=caps[0]["autocast"], model=model)

    def _record_data(self, rec: Dict[str, Any], report: Any) -> None:
        """The on-data figures into ``rec``, and their alerts."""
        assert self._watch is not None
        rec.update(self._watch.figures(report))
        for alert in self._watch.alerts(self.step_count, report):
            self._emit(alert)

    def _stack_figures(self, stack: StackCertificate) -> Dict[str, Any]:
        M = stack.max_value  # the backward budget's (a policy's gradient dtype)
        budget = math.log(M) - math.log(stack.lip_g)
        total = stack.log_gradient_bound
        return {"stack/ok": bool(stack.ok), "stack/certified_depth": stack.certified_depth,
                "stack/depth": stack.depth, "stack/log_grad_bound": total, "stack/log_budget": budget,
                "stack/radius_out": stack.radii[-1], "stack/margin_grad": 1.0 - total / budget}

    def _update_figures(self, k: int, m: nn.Module, cert: Optional[BlockCertificate],
                        stack: Optional[StackCertificate]) -> Dict[str, Any]:
        """Update ``k``'s figures; without a certificate at this check (``certificate_every``) the batch, kappa and
        operator-norm figures only."""
        out: Dict[str, Any] = {}
        if cert is not None and stack is not None:
            M = stack.max_value
            D = stack.depth
            budget = math.log(M) - math.log(stack.lip_g)
            f = stack.log_factors[k]
            r_out = stack.radii[k + 1]
            out.update({"q": cert.q, "sigma": cert.sigma, "c": cert.c, "b": cert.b, "l1": cert.l1, "l0": cert.l0,
                        "radius_in": stack.radii[k], "radius_out": r_out, "log_factor": f})
            out["margin_grad"] = 1.0 - f * D / budget if not math.isnan(f) else math.nan
            m_state = math.log(stack.state_max_value)  # the stream's dtype (a policy's; the dtype itself when pure)
            out["margin_fwd"] = (1.0 - math.log(max(r_out, 1.0)) / m_state) if not math.isnan(r_out) else math.nan
        cap = self._captures.get(k)
        if cap is not None and (cert is None or cert.q is not None):
            out["saturation"] = None
            if cert is not None:
                bound = cert.c * cap["x_norm"] ** cert.q + cert.b
                ratio = torch.where(bound > 0, cap["v_norm"] / bound.clamp_min(1e-300),
                                    torch.where(cap["v_norm"] > 0, torch.full_like(bound, math.inf),
                                                torch.zeros_like(bound)))
                out["saturation"] = float(ratio.max())
            out["state_norm"] = float(cap["x_norm"].max())
            out["velocity_norm"] = float(cap["v_norm"].max())
            g = cap["grad"]
            if g is not None and g.shape == cap["v"].shape:
                v64, g64 = cap["v"].double().flatten(), g.double().flatten()
                den = float(v64.norm()) * float(g64.norm())
                out["cosine"] = float(-(v64 @ g64)) / den if den > 0 else 0.0
            else:
                out["cosine"] = None
        else:
            out.update({"saturation": None, "state_norm": None, "velocity_norm": None, "cosine": None})
        gain = getattr(m, "gain_bound", None)
        if callable(gain):  # a gained update: the gain max |gamma|, and its branch's figures
            out["gain"] = float(gain())
        m = self.updates.io(k)[0] if self.updates is not None else m
        if callable(getattr(m, "attention_stats", None)):
            out["kappa"] = self._kappa(k, m)
            out["max_logit"] = cap.get("max_logit") if cap is not None else None
        for sub, lin in m.named_modules():
            if isinstance(lin, nn.Linear):
                out[f"{sub}.opnorm"] = self._opnorm(k, sub, lin.weight)
        return out

    def _alert(self, rec: Dict[str, Any], stack: Optional[StackCertificate]) -> None:
        step = rec["step"]
        assert self.updates is not None  # _check alerts on a stack certificate only with the updates listed
        names = self.updates.names
        where = (f"{self.dtype}, certified depth {stack.certified_depth}/{stack.depth}" if stack is not None
                 else f"{self.dtype}, no worst-case certificate at this check")
        wc = self.worst_case_alerts and stack is not None  # certificate_every: no worst-case margin at this check
        # 1. the whole backward budget: name the update with the largest factor
        val = rec.get("stack/margin_grad", math.nan)
        if wc and (val < self.threshold or math.isnan(val)):
            factors = [rec[f"{n}/log_factor"] for n in names]
            worst = max(range(len(names)), key=lambda i: math.inf if math.isnan(factors[i]) else factors[i])
            msg = (f"step {step}: update {names[worst]!r}: stack margin_grad = {val:.4g} below threshold "
                   f"{self.threshold:g} (backward budget nearly used; this update has the largest factor "
                   f"log(1 + dt L_k(R_k)) = {factors[worst]:.4g}, margin_grad of its even share "
                   f"{rec[f'{names[worst]}/margin_grad']:.4g}; {where})")
            self._emit({"step": step, "update": names[worst], "quantity": "stack/margin_grad", "value": val,
                        "threshold": self.threshold, "message": msg})
        # 2. per-update even shares (opt-in: a certified stack may spend its budget unevenly)
        if self.share_alerts and wc:
            for name in names:
                val = rec[f"{name}/margin_grad"]
                if val < self.threshold or math.isnan(val):
                    msg = (f"step {step}: update {name!r}: margin_grad = {val:.4g} below threshold "
                           f"{self.threshold:g} (its even share of the backward budget; {where})")
                    self._emit({"step": step, "update": name, "quantity": "margin_grad", "value": val,
                                "threshold": self.threshold, "message": msg})
        # 3. the forward radius: it grows with depth, name the first update below the threshold
        for name in names if wc else ():
            val = rec[f"{name}/margin_fwd"]
            if val < self.threshold or math.isnan(val):
                msg = (f"step {step}: update {name!r}: margin_fwd = {val:.4g} below threshold {self.threshold:g} "
                       f"(forward radius bound after the update {rec[f'{name}/radius_out']:.4g}, log scale of M; "
                       f"{where})")
                self._emit({"step": step, "update": name, "quantity": "margin_fwd", "value": val,
                            "threshold": self.threshold, "message": msg})
                break
        # 4. kappa growth of attention without QK-norm (the early-warning signal of docs/theory.md section 5)
        if self.kappa_growth is not None:
            for k, name in enumerate(names):
                kap = rec.get(f"{name}/kappa")
                if kap is None or self._qk_normed.get(k, False):  # QK-norm: kappa does not drive the Jacobian
                    continue
                first = self._kappa0.setdefault(k, kap)
                if first > 0 and kap >= self.kappa_growth * first:
                    msg = (f"step {step}: update {name!r}: kappa = {kap:.4g} grew {kap / first:.3g}x since the "
                           f"first check ({first:.4g}; threshold {self.kappa_growth:g}x): the query-key coefficient "
                           f"drives the attention Jacobian (sigma = 2); {where}")
                    self._emit({"step": step, "update": name, "quantity": "kappa", "value": kap,
                                "threshold": self.kappa_growth * first, "message": msg})

    def _emit(self, alert: Dict[str, Any]) -> None:
        self.alerts.append(alert)
        warnings.warn(alert["message"], CertificateWarning, stacklevel=self._stacklevel)
        if self.callback is not None:
            self.callback(alert)

    # -- output and lifetime --------------------------------------------------------------------------------
    def to_csv(self, path: Union[str, os.PathLike]) -> None:
        """Write :attr:`records` as CSV (one row per check, columns = union of keys; missing = empty)."""
        keys: List[str] = []
        seen = set()
        for r in self.records:
            for key in r:
                if key not in seen:
                    seen.add(key)
                    keys.append(key)
        with open(path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=keys)
            writer.writeheader()
            for r in self.records:
                writer.writerow({key: ("" if r.get(key) is None else r[key]) for key in keys})

    def remove(self) -> None:
        """Remove the forward hooks (the records stay)."""
        self._drop_recordings()
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> CertificateMonitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        n = "on-data only" if self.updates is None else f"{len(self.updates.modules)} updates"
        return (f"CertificateMonitor({n}, dtype={self.dtype}, every={self.every}, "
                f"threshold={self.threshold:g}, {len(self.records)} records)")
