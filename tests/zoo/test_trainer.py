"""A zoo GPT-2 called the Hugging Face way, and trained by transformers.Trainer (checkpoints included)."""

from __future__ import annotations

import pytest
import torch
from certblocks.zoo import ZooOutput, create_model


def _model():
    torch.manual_seed(0)
    return create_model("gpt2_qknorm_test")


def test_hf_call_returns_loss_and_logits_as_a_dict_with_hf_label_shift():
    m = _model().eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    out = m(input_ids=ids, labels=ids)
    assert isinstance(out, dict) and isinstance(out, ZooOutput) and list(out) == ["loss", "logits"]
    assert out[0] is out.loss is out["loss"] and out.logits is out["logits"]
    # HF's labels are the inputs, shifted inside; nanoGPT's targets are already shifted (-1 ignored)
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -1)], dim=1)
    logits, loss = m(ids, targets)  # nanoGPT's call is unchanged
    torch.testing.assert_close(out.loss, loss, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, logits, rtol=0, atol=0)
    no_labels = m(input_ids=ids)
    assert list(no_labels) == ["logits"] and no_labels.loss is None and no_labels[0] is no_labels.logits


def test_hf_call_padding_and_argument_errors():
    m = _model().eval()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[1, 4:] = -100
    right = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    out = m(input_ids=ids, labels=labels, attention_mask=right)
    assert torch.isfinite(out.loss)
    with pytest.raises(ValueError, match="right padding only"):
        m(input_ids=ids, attention_mask=torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]]))
    with pytest.raises(TypeError, match="not both"):
        m(ids, input_ids=ids)
    with pytest.raises(TypeError, match="labels= needs input_ids="):
        m(labels=ids)
    with pytest.raises(ValueError, match="attention_mask must have input_ids' shape"):
        m(input_ids=ids, attention_mask=torch.ones(2, 5))


def test_trainer_trains_a_zoo_gpt2_and_saves_a_checkpoint(tmp_path):
    tr = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    m = _model()
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, 64, (16,), generator=g) for _ in range(12))]
    before = {k: v.clone() for k, v in m.state_dict().items()}
    args = tr.TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to=[], max_steps=3,
                                per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
                                save_strategy="no", disable_tqdm=True)
    trainer = tr.Trainer(model=m, args=args, train_dataset=data)
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert torch.isfinite(torch.tensor(result.training_loss))
    changed = [k for k, v in m.state_dict().items() if not torch.equal(before[k], v)]
    assert len(changed) == len(before)  # every tensor moved (QK-norm scales, gains and the tied embedding too)
    # the Trainer's own checkpoint of a model that is not a PreTrainedModel (safetensors of its state_dict)
    trainer.save_model(str(tmp_path / "final"))
    other = _model()
    other.load_state_dict(load_file(str(tmp_path / "final" / "model.safetensors")), strict=True)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in other.state_dict().items())
    assert other.lm_head.weight is other.transformer.wte.weight


def test_certificate_callback_watches_a_zoo_gpt2_in_a_trainer(tmp_path):
    tr = pytest.importorskip("transformers")
    from certblocks.integrations import CertificateCallback

    m = _model()
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, 64, (16,), generator=g) for _ in range(8))]
    args = tr.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2,
                                per_device_train_batch_size=4, logging_steps=1, save_strategy="no", disable_tqdm=True)
    trainer = tr.Trainer(model=m, args=args, train_dataset=data, callbacks=[CertificateCallback(every=1)])
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2
    for h in logged:  # the batch's figures from the model's own loss (its labels): finite headroom in fp16
        assert h["certblocks/forward_headroom"] > 0 and h["certblocks/backward_headroom_measured"] > 0
