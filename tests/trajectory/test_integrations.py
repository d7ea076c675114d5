"""``certblocks.integrations.CertificateCallback`` inside ``transformers.Trainer`` (a tiny random GPT-2, CPU)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from certblocks.integrations import CertificateCallback  # noqa: E402
from certblocks.monitor import CertificateWarning  # noqa: E402


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(tmp_path, callback, steps: int = 4):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=32, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2,
                                          logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                                          learning_rate=1e-3, disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=_Tokens(8, 12, 32), callbacks=[callback])


def test_callback_runs_the_monitor_inside_trainer(tmp_path, caplog) -> None:
    cb = CertificateCallback(every=2, estimate_every=1)  # the Lanczos figures too (by default: measured only)
    trainer = _trainer(tmp_path, cb)
    with caplog.at_level(logging.INFO, logger="transformers.trainer"):
        trainer.train()
    mon = cb.monitor
    assert mon.dtype == "fp32" and mon.updates is None  # the Trainer's dtype; no certified block: on data only
    assert [r["step"] for r in mon.records] == [0, 2]  # every 2 optimizer steps, the first included
    rec = mon.records[-1]
    assert rec["data/head_source"] == "loss" and math.isfinite(rec["data/headroom"]) and rec["data/headroom"] > 1.0
    assert rec["transformer.h.1.attn/jacobian_norm"] > 0 and rec["transformer.h.0.attn/data_max_logit"] >= 0
    assert cb.alerts == [] and trainer.state.global_step == 4  # no alert: the run is not stopped
    assert any("on-data headroom" in r.getMessage() for r in caplog.records)  # one line per check, Trainer's logger
    logged = [h for h in trainer.state.log_history if "certblocks/headroom" in h]
    assert logged and logged[-1]["certblocks/headroom"] == pytest.approx(rec["data/headroom"])


def test_alert_is_a_warning_and_can_stop_training(tmp_path, caplog) -> None:
    cb = CertificateCallback("fp16", every=1, stop_on_alert=True, headroom_threshold=50.0)  # past any headroom
    trainer = _trainer(tmp_path, cb, steps=6)
    with caplog.at_level(logging.WARNING, logger="transformers.trainer"), \
            pytest.warns(CertificateWarning, match="on-data headroom"):
        trainer.train()
    assert trainer.state.global_step == 1  # stopped at the end of the first step
    assert len(cb.alerts) == 1 and cb.alerts[0]["quantity"] == "headroom"
    rec = cb.monitor.records[0]  # by default a check on the measured basis runs no Lanczos estimate
    assert rec["data/alert_basis"] == "measured" and rec["data/headroom"] is None
    assert rec["transformer.h.0.attn/jacobian_norm"] is None and rec["transformer.h.0.attn/data_costate_norm"] > 0
    assert any("certblocks: step 0: on-data headroom" in r.getMessage() for r in caplog.records)
