"""The hooks of :class:`certblocks.CertificateMonitor`: what they capture of the training step (each update's call, the
gradient at the last state, and on a check measured in the step the intermediates, the costates and the largest
logit: docs/training.md, "The cost of a check")."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ._calls import state_of, velocity_output, without_state
from .envelope import envelope_paused
from .model import attention_module
from .ondata.watch import StepFigures, StepRecorder, autocast_state, batch_of


def _sample_norms(t: torch.Tensor) -> torch.Tensor:
    """Per-sample norm ``max over tokens of ||token||_2`` (float64), shape ``(batch,)``."""
    t = t.detach().to(torch.float64)
    if t.ndim == 1:
        return t.norm().reshape(1)
    tok = t.norm(dim=-1)  # (batch, ...)
    return tok.reshape(tok.shape[0], -1).amax(dim=1)


class MonitorHooks:
    """The hook methods of :class:`~certblocks.CertificateMonitor` (its state: ``updates``, ``every``,
    ``step_count``, ``measure_in_step``, ``_watch``, ``_captures``, ``_step_figs``, ...)."""

    updates: Any
    every: int
    step_count: int
    measure_in_step: bool
    logit_samples: int
    _watch: Any
    _captures: Dict[int, Dict[str, Any]]
    _inputs: Dict[int, Any]
    _batch: Optional[Any]
    _step_figs: Dict[int, StepFigures]
    _recording: Dict[int, Tuple[StepRecorder, List[nn.Module], StepFigures]]

    def _arm(self) -> None:
        """Arm the hooks for the next step when it is checked (``_armed``), and the measurement in the training
        step when that check reads the measured basis only (``_in_step``)."""
        self._armed = self.step_count % self.every == 0
        self._in_step = (self._armed and self.measure_in_step and self._watch is not None
                         and self.updates is not None and self._watch.measured_next())

    def _step_hooks(self, k: int, entry: nn.Module, exit_: nn.Module) -> List[Any]:
        """The hooks that measure update ``k`` in the training step of a check on the measured basis: from the
        entry's call to the exit's return a :class:`StepRecorder` sees every torch function (the largest
        intermediate per dtype, as the separate recorded pass; a fused QK-norm runs as its plain composition, as
        there), a tensor hook on ``X_k`` keeps the costate ``p_k`` of the user's backward, and the attention's input
        gives its largest logit."""
        assert self.updates is not None
        update = self.updates.modules[k]
        attn = attention_module(update)

        def start(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._in_step or k in self._step_figs or k in self._recording or not torch.is_grad_enabled():
                return
            found = state_of(module, args, kwargs)
            if found is None or not found[0].requires_grad:  # no graph from X_k: the separate passes measure
                return
            x, fig = found[0], StepFigures()
            fig.attention = attn is not None

            def keep(g: torch.Tensor) -> None:  # dL/dX_k, every use of X_k summed: the costate p_k
                if fig.costate is None:
                    fig.costate = g.detach()
            x.register_hook(keep)
            fused = [m for m in update.modules() if getattr(m, "fused_qk_norm", None) is True]
            for m in fused:
                setattr(m, "fused_qk_norm", False)  # noqa: B010 - an attribute of some modules only
            rec = StepRecorder(x)
            rec.__enter__()
            self._recording[k] = (rec, fused, fig)

        def seen(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if k in self._recording and self._recording[k][2].logit_input is None:
                found = state_of(module, args, kwargs)
                self._recording[k][2].logit_input = None if found is None else found[0]

        def stop(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if k not in self._recording:
                return
            rec, fused, fig = self._stop(k)
            fig.peak, fig.peaks = rec.peaks()
            if attn is not None and fig.logit_input is not None:
                with envelope_paused():
                    stats = attn.attention_stats(fig.logit_input, samples=self.logit_samples,  # type: ignore[operator]  # an attention
                                                 kappa=False)
                fig.max_logit = stats.get("max_logit")
            self._step_figs[k] = fig

        handles = [entry.register_forward_pre_hook(start, with_kwargs=True)]
        if attn is not None:
            handles.append(attn.register_forward_pre_hook(seen, with_kwargs=True))
        handles.append(exit_.register_forward_hook(stop, with_kwargs=True))
        return handles

    def _stop(self, k: int) -> Tuple[StepRecorder, List[nn.Module], StepFigures]:
        """End update ``k``'s recording (its recorder leaves the mode stack, a fused QK-norm is fused again)."""
        rec, fused, fig = self._recording.pop(k)
        rec.__exit__(None, None, None)
        for m in fused:
            setattr(m, "fused_qk_norm", True)  # noqa: B010 - an attribute of some modules only
        return rec, fused, fig

    def _drop_recordings(self) -> None:
        """End the recordings a forward left running (it raised between an update's entry and exit)."""
        for k in sorted(self._recording, reverse=True):
            self._stop(k)

    @staticmethod
    def _call_of(module: nn.Module, args: tuple, kwargs: dict) -> Optional[Tuple[torch.Tensor, tuple, dict, Any]]:
        """``(X_k, other args, other kwargs, where X_k was passed)`` of a velocity's call (:func:`state_of`)."""
        found = state_of(module, args, kwargs)
        if found is None:
            return None
        x, where = found
        rest_args, rest_kwargs = without_state(args, kwargs, where)
        return x, rest_args, rest_kwargs, where

    def _make_input_hook(self, k: int) -> Callable:
        """Keep the input ``X_k`` of a gained update's branch for the gain's hook (which sees ``v(X_k)``)."""
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._armed and k not in self._captures:
                call = self._call_of(module, args, kwargs)
                if call is not None:
                    self._inputs[k] = call
        return hook

    def _make_hook(self, k: int, entry: Optional[nn.Module] = None) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not self._armed or k in self._captures:
                return
            call = self._inputs.pop(k, None) if entry is not None else self._call_of(module, args, kwargs)
            module = module if entry is None else entry
            y = velocity_output(output)
            if call is None or y is None or call[0].shape[0] != y.shape[0]:
                return
            x, rest_args, rest_kwargs, where = call
            cap: Dict[str, Any] = {"x_norm": _sample_norms(x), "v_norm": _sample_norms(y), "v": y.detach(),
                                   "grad": None, "x": x.detach(), "rest": (rest_args, rest_kwargs), "where": where,
                                   "autocast": autocast_state(x.device.type)}
            if y.requires_grad:
                def grad_hook(g: torch.Tensor) -> None:
                    if cap["grad"] is None:
                        cap["grad"] = g.detach()
                y.register_hook(grad_hook)
            fig = self._step_figs.get(k)
            if fig is not None and fig.logit_input is x:  # measured in the step already, on the same input
                cap["max_logit"] = fig.max_logit
            elif callable(getattr(module, "attention_stats", None)):  # the update is an attention: X_k is its input
                with envelope_paused():
                    stats = module.attention_stats(x, samples=self.logit_samples, kappa=False)  # type: ignore[operator]  # checked callable above
                cap["max_logit"] = stats.get("max_logit")
            self._captures[k] = cap
        return hook

    def _model_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Keep the checked step's model call (a model without certified blocks: the on-data check re-runs it)."""
        if self._armed and self._batch is None:
            x = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
            self._batch = (batch_of(args, kwargs), autocast_state(x.device.type if x is not None else "cpu"))
