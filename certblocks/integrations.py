"""Training-framework integrations: :class:`CertificateCallback` runs a :class:`~certblocks.CertificateMonitor` inside a
Hugging Face ``transformers.Trainer``.

``transformers`` is imported with this module (``import certblocks`` never imports it)::

    from certblocks.integrations import CertificateCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[CertificateCallback(every=50, stop_on_alert=False)])
    trainer.train()

Each checked step (every ``every`` optimizer steps, the first included) the monitor computes the on-data
certificate of the step's batch before the optimizer step (``on_pre_optimizer_step``: the gradient of the batch is
there, the weights are those that produced it).  The model is read by :func:`certblocks.model.as_certified` (a zoo
model, a converted HF model -- its attentions called with HF's keywords, returning HF's tuples --, any wrapper of
one).  A model without certified blocks (an unconverted HF GPT-2) is watched on data only, from its graph
(:func:`certblocks.trajectory`; with ``labels`` in the batch the model's own loss gives the exact costate ``p_D``).

* the figures: one ``info`` line on the Trainer's logger (``transformers.trainer``) per check, and the
  ``certblocks/headroom`` (nats), ``certblocks/forward_headroom`` and ``certblocks/backward_headroom`` of the last check
  added to the Trainer's logs (``on_log``: its ``state.log_history`` entry, and the ``logs`` the reporting
  integrations after this callback receive);
* an alert: a :class:`~certblocks.CertificateWarning` (``warnings``) and a ``warning`` line on the Trainer's logger;
  with ``stop_on_alert=True`` training stops at the end of that step (``control.should_training_stop``).

Note: under ``fp16`` the Trainer scales the loss; the costate measured by a monitor of certified blocks is the scaled
one (what overflows), the graph route computes the unscaled loss's gradient.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

import torch

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - transformers is an optional dependency
    raise ImportError("certblocks.integrations needs transformers (pip install transformers)") from exc

__all__ = ["CertificateCallback"]


def _trainer_dtype(args: Any) -> str:
    """The dtype the Trainer computes in: ``fp16`` / ``bf16`` mixed precision, else ``fp32``."""
    if getattr(args, "fp16", False):
        return "fp16"
    if getattr(args, "bf16", False):
        return "bf16"
    return "fp32"


class CertificateCallback(TrainerCallback):
    """Run a :class:`~certblocks.CertificateMonitor` inside ``transformers.Trainer`` (module docstring).

    Args:
        dtype: the dtype whose limit the headroom refers to (default: the Trainer's: ``fp16``/``bf16`` when
            ``TrainingArguments.fp16``/``bf16``, else ``fp32``).
        every: check every ``every`` optimizer steps.
        stop_on_alert: stop training at the end of a step that raised an alert.
        **monitor_kwargs: passed to :class:`~certblocks.CertificateMonitor` (``headroom_threshold``, ``horizon``,
            ``worst_case_alerts``, ``r0``, ``seq_len``...).

    Attributes:
        monitor: the monitor (created at ``on_train_begin``), with its ``records`` and ``alerts``.
    """

    def __init__(self, dtype: Union[str, torch.dtype, None] = None, *, every: int = 50, stop_on_alert: bool = False,
                 **monitor_kwargs: Any) -> None:
        from ._validation import check_bool, check_int

        check_bool("stop_on_alert", stop_on_alert)
        if "callback" in monitor_kwargs:
            raise TypeError("monitor_kwargs must not contain 'callback': the Trainer callback handles the alerts")
        self.dtype = dtype
        self.every = check_int("every", every)
        self.stop_on_alert = stop_on_alert
        self.monitor_kwargs = monitor_kwargs
        self.monitor: Any = None
        self._alerted = False
        self._logs: Dict[str, float] = {}

    @staticmethod
    def _logger() -> Any:
        from transformers.utils import logging

        return logging.get_logger("transformers.trainer")

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> Any:
        from .monitor import CertificateMonitor

        if model is None:
            raise ValueError("CertificateCallback needs the Trainer's model (on_train_begin received none)")
        if self.monitor is not None:
            self.monitor.remove()
        dtype = self.dtype if self.dtype is not None else _trainer_dtype(args)
        self.monitor = CertificateMonitor(model, dtype, every=self.every, callback=self._on_alert,
                                          **self.monitor_kwargs)
        return control

    def _on_alert(self, alert: Dict[str, Any]) -> None:
        self._alerted = True
        self._logger().warning(f"certblocks: {alert['message']}")

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.monitor is None:
            return control
        # accelerate's optimizer wrapper holds the GradScaler of an fp16 run: the costates are read unscaled
        scaler = getattr(kwargs.get("optimizer"), "scaler", None)
        rec = self.monitor.step(loss_scale=scaler)
        if rec is not None and rec.get("data/alert_headroom") is not None:
            self._logs = {f"certblocks/{k}": float(rec[f"data/{k}"])
                          for k in ("alert_headroom", "headroom", "forward_headroom", "backward_headroom",
                                    "backward_headroom_measured") if rec.get(f"data/{k}") is not None}
            self._logger().info(f"certblocks: step {state.global_step}: on-data headroom "
                                f"{rec['data/alert_headroom']:.4g} nats ({self.monitor.dtype}, "
                                f"{rec['data/alert_basis']}), most consumed by {rec['data/worst_update']!r} "
                                f"({rec['data/worst_quantity']})")
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self._alerted and self.stop_on_alert:
            control.should_training_stop = True
        self._alerted = False
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict[str, Any]] = None, **kwargs: Any) -> Any:
        if logs is not None and self._logs:
            logs.update(self._logs)  # seen by the reporting callbacks after this one
            history = getattr(state, "log_history", None)
            if history and history[-1].get("step") == state.global_step:  # the entry Trainer.log just kept
                history[-1].update(self._logs)
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.monitor is not None:
            self.monitor.remove()
        return control

    @property
    def alerts(self) -> List[Dict[str, Any]]:
        return [] if self.monitor is None else self.monitor.alerts
