"""Every advertised path on real converted models: HF GPT-2 and Llama (tiny configs, random weights), converted with
:func:`certblocks.convert`.

The monitor in a plain training loop, :func:`certblocks.trajectory`, :func:`certblocks.enforce` then optimizer steps,
and :class:`~certblocks.integrations.CertificateCallback` inside ``transformers.Trainer``.  The converted GPT-2
attention returns ``(output, None)`` and the converted Llama attention is called with keywords
(``hidden_states=``, ``position_embeddings=``, a KV cache): both crashed the on-data code before.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import certblocks
from certblocks import RotaryQKNormAttention
from certblocks.bounds import product_norm
from certblocks.conversion import convert
from certblocks.enforcement import cap_ratios
from certblocks.model import EnvelopeWarning, as_certified
from certblocks.monitor import CertificateMonitor

tr = pytest.importorskip("transformers")

VOCAB = 64


def _gpt2() -> torch.nn.Module:
    cfg = tr.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=VOCAB, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return tr.GPT2LMHeadModel(cfg)


def _llama() -> torch.nn.Module:
    cfg = tr.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    return tr.LlamaForCausalLM(cfg)


CASES = {"gpt2": (_gpt2, False), "llama": (_llama, False), "llama_no_norms": (_llama, True)}


def _converted(case: str) -> torch.nn.Module:
    tr.logging.set_verbosity_error()
    make, remove_norms = CASES[case]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the HF models' own notices
        return convert(make(), remove_norms=remove_norms).model.train()


def _ids(n: int = 12, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def _attention_names(model: torch.nn.Module) -> list:
    cm = as_certified(model)
    return [n for k, n in enumerate(cm.names) if cm.attention(k) is not None]


@pytest.mark.parametrize("case", sorted(CASES))
def test_monitor_in_a_plain_training_loop(case: str) -> None:
    model = _converted(case)
    cm = as_certified(model)
    assert cm.kind == "blocks" and cm.names
    attn = _attention_names(model)
    assert attn  # every converted attention is found by its capability
    mon = CertificateMonitor(model, "bf16", every=1, threshold=-1e9, headroom_threshold=None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = _ids()
    for _ in range(3):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        rec = mon.step()
        exact = {}  # the exact kappa of the weights checked (per head, key heads repeated per group)
        for k, name in enumerate(cm.names):
            if cm.attention(k) is not None:
                hw = cm.attention(k)._head_weights()
                exact[name] = max(product_norm(q.T, kk) for q, kk in zip(hw["wq"], hw["wk"]))
        opt.step()
    assert [r["step"] for r in mon.records] == [0, 1, 2]
    assert rec["data/head_source"] == "loss" and math.isfinite(rec["data/alert_headroom"])
    for name in cm.names:
        assert 0.0 <= rec[f"{name}/saturation"] <= 1.0  # the certificate bounds the velocity on the batch
        assert -1.0 <= rec[f"{name}/cosine"] <= 1.0
        assert rec[f"{name}/data_costate_norm"] > 0
    assert sorted(exact) == sorted(attn)
    for name, kappa in exact.items():  # warm-started power iteration: from below, close after three checks
        assert kappa * (1 - 2e-2) <= rec[f"{name}/kappa"] <= kappa * (1 + 1e-9)
        assert rec[f"{name}/max_logit"] > 0 and rec[f"{name}/data_max_logit"] == rec[f"{name}/max_logit"]
    mon.remove()


@pytest.mark.parametrize("case", ["gpt2", "llama"])
def test_trajectory(case: str) -> None:
    model = _converted(case).eval()
    ids = _ids()
    rep = certblocks.trajectory(model, {"input_ids": ids, "labels": ids}, "bf16")
    assert rep.head.source == "loss" and math.isfinite(rep.headroom) and rep.headroom > 0
    attn = [u for u in rep.updates if u.kappa is not None]
    assert len(attn) == len(_attention_names(model))  # kappa and the largest logit for every attention
    for u in attn:
        assert u.kappa > 0 and 0 < u.max_logit < 1e4  # masked pairs are left out of the largest logit
    if case == "llama":
        assert all(isinstance(m, RotaryQKNormAttention) for m in (model.model.layers[0].self_attn,))


@pytest.mark.parametrize("case", ["gpt2", "llama"])
def test_enforce_then_optimizer_steps(case: str) -> None:
    model = _converted(case)
    r0 = 2.0 * math.sqrt(32)  # the first update's input: a normalized state (LayerNorm / RMSNorm kept)
    rep = certblocks.enforce(model, "bf16", r0=r0)
    assert rep.worst_case.ok and rep.alpha > 0
    opt = torch.optim.SGD(model.parameters(), lr=10.0)  # large steps: the caps keep the certificate
    ids = _ids()
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    assert max(cap_ratios(model).values()) <= 1.0
    assert as_certified(model, r0=r0).certificate("bf16", record_envelope=False).ok
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
    assert certblocks.enforcement.unenforce(model) == len(rep.modules)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int) -> None:
        self.ids = torch.randint(3, VOCAB, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.mark.parametrize("case", ["gpt2", "llama"])
def test_callback_in_trainer(case: str, tmp_path) -> None:
    from certblocks.integrations import CertificateCallback

    model = _converted(case)
    cb = CertificateCallback(every=1, headroom_threshold=None)
    args = tr.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, report_to=[],
                                save_strategy="no", use_cpu=True, learning_rate=1e-3, logging_steps=1,
                                disable_tqdm=True)
    trainer = tr.Trainer(model=model, args=args, train_dataset=_Tokens(8, 12), callbacks=[cb])
    trainer.train()
    mon = cb.monitor
    assert trainer.state.global_step == 3 and mon.updates is not None and mon.updates.kind == "blocks"
    assert [r["step"] for r in mon.records] == [0, 1, 2]
    rec = mon.records[-1]
    assert rec["data/head_source"] == "loss" and math.isfinite(rec["data/alert_headroom"])
    logged = [h for h in trainer.state.log_history if "certblocks/alert_headroom" in h]
    assert logged and logged[-1]["certblocks/alert_headroom"] == pytest.approx(rec["data/alert_headroom"])


def test_converted_model_envelope_through_the_spine() -> None:
    model = _converted("llama").eval()
    cm = as_certified(model, r0=100.0, seq_len=12)
    assert cm.certificate("bf16").dtype == "bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("error", EnvelopeWarning)
        model(input_ids=_ids(12))  # inside: no warning
    with pytest.warns(EnvelopeWarning, match=r"sequence length 20 > the certified seq_len 12"):
        model(input_ids=_ids(20))
    assert cm.envelope.used()[1] == 20 and cm.certificate().dtype == "bf16"


def test_a_certificate_without_a_batch_says_what_it_does_not_cover() -> None:
    model = _converted("gpt2").eval()
    blocks = as_certified(model, r0=1.0, seq_len=12).certificate("fp32", record_envelope=False)
    assert "kept normalizations" in blocks.scope and "scope:" in blocks.explain()
    assert blocks.to_dict()["scope"] == blocks.scope
    whole = as_certified(model, example_input={"input_ids": _ids(12)}).certificate("fp32")
    assert whole.scope == ""  # read from its graph: the whole model's chain
