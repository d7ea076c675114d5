"""The test matrix: every advertised path on every model a user brings (issue 32 item 2).

Rows (tiny configurations, random weights, seed 0): the zoo's GPT-2, ViT and forecaster (test sizes); HF GPT-2,
Llama (with and without ``remove_norms``), Mistral, Qwen2 and HF Mamba converted by :func:`certblocks.convert`; a
timm ViT converted; mamba-ssm's ``MambaLMHeadModel`` converted (on CPU through
:func:`certblocks.testing.mamba_ssm_on_cpu`); HF Mamba as it is (no certified block: read from its graph).

Columns: ``certify`` (``as_certified(m, example_input=batch).certificate(dtype)``), ``monitor`` (two optimizer steps
in a plain loop with ``CertificateMonitor(m, dtype, every=1)``), ``trainer`` (``CertificateCallback`` in a
``transformers.Trainer``, two steps on CPU; a model that is not HF-style gets its loss from the Trainer's
``compute_loss_func``: no wrapper), ``trajectory``, ``enforce`` then an optimizer step (the certificate stays ok),
``save_load`` (HF ``save_pretrained`` / :func:`~certblocks.conversion.load_converted`, zoo ``save_pretrained`` /
``from_pretrained``, timm ``state_dict`` + ``load_converted``; outputs and certificate identical after).

Each cell passes or raises the one error :data:`EXPECTED` lists for it; ``docs/matrix.md`` holds the same table
(:func:`test_docs_matrix_agrees_with_the_test`).  The models are built once per module and deep-copied per cell.
"""

from __future__ import annotations

import copy
import math
import os
import re
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn

import certblocks
from certblocks.certificate import StackCertificate
from certblocks.model import as_certified
from certblocks.testing import mamba_ssm_on_cpu

tr = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")

DTYPE = "bf16"
VOCAB = 64
D = 32  # the width of the HF and mamba-ssm rows
DOC = Path(__file__).resolve().parents[1] / "docs" / "matrix.md"

PATHS = ("certify", "monitor", "trainer", "trajectory", "enforce", "save_load")
PATH_LABELS = {"certify": "certify", "monitor": "monitor (plain loop)", "trainer": "Trainer callback",
               "trajectory": "trajectory", "enforce": "enforce + step", "save_load": "save / load"}


# ---------------------------------------------------------------------------------------------- the rows
def _quiet_convert(model: nn.Module, remove_norms: bool = False) -> nn.Module:
    from certblocks.conversion import convert

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the HF models' own notices; a ConversionWarning is the report's business
        return convert(model, remove_norms=remove_norms).model


def _gpt2() -> nn.Module:
    return tr.GPT2LMHeadModel(tr.GPT2Config(n_layer=2, n_embd=D, n_head=2, n_positions=16, vocab_size=VOCAB,
                                            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                            attn_pdrop=0.0))


_LLAMA = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _hf(family: str) -> nn.Module:
    cfg, cls = {"llama": (tr.LlamaConfig, tr.LlamaForCausalLM), "mistral": (tr.MistralConfig, tr.MistralForCausalLM),
                "qwen2": (tr.Qwen2Config, tr.Qwen2ForCausalLM)}[family]
    return cls(cfg(**_LLAMA))


def _hf_mamba() -> nn.Module:
    return tr.MambaForCausalLM(tr.MambaConfig(vocab_size=VOCAB, hidden_size=D, state_size=8, num_hidden_layers=2,
                                              use_mambapy=False, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _timm_vit() -> nn.Module:
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2, num_classes=10)


def _mamba_ssm() -> nn.Module:
    pytest.importorskip("mamba_ssm")
    with mamba_ssm_on_cpu() as config:
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

        return MambaLMHeadModel(config(d_model=D, n_layer=2, vocab_size=VOCAB, pad_vocab_size_multiple=8))


def _zoo(name: str) -> nn.Module:
    from certblocks.zoo import create_model

    return create_model(name)


def _ids(batch: int = 2, n: int = 8) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(0))


def _like(example: torch.Tensor, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, *example.shape[1:], generator=torch.Generator().manual_seed(0))


@dataclass(frozen=True)
class Row:
    """A model of the matrix.

    Attributes:
        label: the row's name in docs/matrix.md.
        build: the model (seeded by the caller).
        call: how it is called and trained: ``"hf"`` (``model(input_ids=, labels=).loss``), ``"zoo_gpt2"`` (the
            same, a :class:`~certblocks.zoo.ZooOutput`), ``"mamba_ssm"`` (``model(ids).logits``, cross-entropy),
            ``"regress"`` (``model(x)``, the mean square of the output as the loss).
        depth: the residual updates its certificate counts.
        save: how it is saved and loaded (``"zoo"``, ``"hf"``, ``"timm"``, ``"mamba_ssm"``, ``"hf_as_is"``).
        spine: what the model needs beyond the defaults (``seq_len`` of a converted Mamba: its certificate sums
            over the sequence).
        enforce: the arguments of :func:`certblocks.enforce` (``r0``: the first update's input radius of a model
            that does not know its own).
        fresh_process: the row runs in a fresh interpreter: the test process holds the stand-in
            ``selective_scan_cuda`` (tests/conftest.py), with which transformers routes an unconverted HF Mamba's
            forward (outside ``torch.export``) to mamba-ssm's CUDA kernels.
    """

    label: str
    build: Callable[[], nn.Module]
    call: str
    depth: int
    save: str
    spine: Dict[str, Any] = field(default_factory=dict)
    enforce: Dict[str, Any] = field(default_factory=dict)
    fresh_process: bool = False


_NORMED = {"r0": 2.0 * math.sqrt(D)}  # the first update's input of a kept-norm model: a normalized token
ROWS: Dict[str, Row] = {
    "zoo_gpt2": Row("zoo GPT-2 (`gpt2_qknorm_test`)", lambda: _zoo("gpt2_qknorm_test"), "zoo_gpt2", 4, "zoo"),
    "zoo_vit": Row("zoo ViT (`certblocks_vit_test`)", lambda: _zoo("certblocks_vit_test"), "regress", 4, "zoo"),
    "zoo_forecaster": Row("zoo forecaster (`mamba_forecaster_lg_test`)", lambda: _zoo("mamba_forecaster_lg_test"),
                          "regress", 4, "zoo"),
    "hf_gpt2": Row("converted HF GPT-2", lambda: _quiet_convert(_gpt2()), "hf", 4, "hf", enforce=_NORMED),
    "llama": Row("converted Llama", lambda: _quiet_convert(_hf("llama")), "hf", 4, "hf", enforce=_NORMED),
    "llama_no_norms": Row("converted Llama, `remove_norms=True`", lambda: _quiet_convert(_hf("llama"), True), "hf",
                          4, "hf", enforce=_NORMED),
    "mistral": Row("converted Mistral", lambda: _quiet_convert(_hf("mistral")), "hf", 4, "hf", enforce=_NORMED),
    "qwen2": Row("converted Qwen2", lambda: _quiet_convert(_hf("qwen2")), "hf", 4, "hf", enforce=_NORMED),
    "timm_vit": Row("converted timm ViT (`vit_tiny_patch16_224`, depth 2, 32 px)",
                    lambda: _quiet_convert(_timm_vit()), "regress", 4, "timm", enforce={"r0": 2.0 * math.sqrt(192)}),
    "mamba_ssm": Row("converted mamba-ssm `MambaLMHeadModel`", lambda: _quiet_convert(_mamba_ssm()), "mamba_ssm", 2,
                     "mamba_ssm", spine={"seq_len": 8}, enforce={**_NORMED, "seq_len": 8}),
    "hf_mamba_converted": Row("converted HF Mamba (`MambaForCausalLM`)", lambda: _quiet_convert(_hf_mamba()), "hf",
                              2, "hf", spine={"seq_len": 8}, enforce={**_NORMED, "seq_len": 8}),
    "hf_mamba": Row("HF Mamba as is (`MambaForCausalLM`, not converted)", _hf_mamba, "hf", 2, "hf_as_is",
                    fresh_process=True),
}

#: (model, path) -> (exception, message regex, the short text of docs/matrix.md); every other cell passes.  A known
#: bug of a file this test does not own is listed as such (its short text says "bug"), so that the table says it
#: and the test fails once it is fixed (then the cell becomes "yes" here and in docs/matrix.md).
EXPECTED: Dict[Tuple[str, str], Tuple[type, str, str]] = {
    ("hf_mamba", "enforce"): (TypeError, r"MambaForCausalLM has no certified block .* for enforce to cap; convert it "
                                         r"with certblocks\.convert first",
                              "TypeError: no certified block to cap; convert it first"),
}


# ---------------------------------------------------------------------------------------------- calling a row
def _batch(row: Row, model: nn.Module) -> Any:
    if row.call == "hf":
        return {"input_ids": _ids()}
    if row.call in ("zoo_gpt2", "mamba_ssm"):
        return _ids()
    ex = model.example_input(8) if callable(getattr(model, "example_input", None)) else torch.zeros(1, 3, 32, 32)
    return _like(ex)


def _output(row: Row, model: nn.Module, batch: Any) -> torch.Tensor:
    out = model(**batch) if isinstance(batch, dict) else model(batch)
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, dict):
        return out["logits"]
    return out[0] if isinstance(out, tuple) else out


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def _loss(row: Row, model: nn.Module, batch: Any) -> torch.Tensor:
    if row.call == "hf":
        return model(**batch, labels=batch["input_ids"]).loss
    if row.call == "zoo_gpt2":
        return model(input_ids=batch, labels=batch)["loss"]
    if row.call == "mamba_ssm":
        return _lm_loss(model(batch).logits, batch)
    return _output(row, model, batch).float().pow(2).mean()


# ---------------------------------------------------------------------------------------------- the paths
def _certify(row: Row, model: nn.Module) -> None:
    batch = _batch(row, model)
    was = model.training
    cm = as_certified(model, example_input=batch, **row.spine)
    cert = cm.certificate(DTYPE)
    assert isinstance(cert, StackCertificate) and cert.dtype == DTYPE and cert.depth == row.depth, cert
    assert model.training == was  # certified in eval mode, the caller's mode restored
    fixes = cm.fixes(DTYPE)  # on a refusal, the levers that certify it (each certified again), possibly none
    assert (fixes == [] if cert.ok else all(f.certified_depth <= f.depth for f in fixes))


def _monitor(row: Row, model: nn.Module) -> None:
    batch = _batch(row, model)
    mon = certblocks.CertificateMonitor(model, DTYPE, every=1, headroom_threshold=None, **row.spine)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        for _ in range(2):
            opt.zero_grad()
            _loss(row, model, batch).backward()
            rec = mon.step()
            opt.step()
    finally:
        mon.remove()
    assert [r["step"] for r in mon.records] == [0, 1]
    assert math.isfinite(rec["data/alert_headroom"]) and rec["data/alert_headroom"] > 0


class _Items(torch.utils.data.Dataset):
    def __init__(self, items: List[Dict[str, torch.Tensor]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return self.items[i]


def _trainer(row: Row, model: nn.Module) -> None:
    from certblocks.integrations import CertificateCallback

    batch = _batch(row, model)
    kw: Dict[str, Any] = {}
    if row.call in ("hf", "zoo_gpt2"):  # HF-style: model(input_ids=, labels=) returns its loss
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        items = [{"input_ids": ids[i], "labels": ids[i]} for i in range(len(ids))]
    else:  # the Trainer computes the loss from the output (compute_loss_func): no wrapper around the model
        key = "input_ids" if row.call == "mamba_ssm" else "x"
        items = [{key: batch[i], "labels": batch[i]} for i in range(len(batch))]

        def compute_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
            if row.call == "mamba_ssm":
                return _lm_loss(outputs.logits, labels)
            return (outputs[0] if isinstance(outputs, tuple) else outputs).float().pow(2).mean()

        kw["compute_loss_func"] = compute_loss
    if row.call == "mamba_ssm":  # mamba-ssm passes every extra keyword of its forward to its mixers
        model.accepts_loss_kwargs = False
    cb = CertificateCallback(DTYPE, every=1, headroom_threshold=None, **row.spine)
    with tempfile.TemporaryDirectory() as out:
        args = tr.TrainingArguments(output_dir=out, max_steps=2, per_device_train_batch_size=2, report_to=[],
                                    save_strategy="no", use_cpu=True, learning_rate=1e-3, logging_steps=1,
                                    disable_tqdm=True, remove_unused_columns=False)
        trainer = tr.Trainer(model=model, args=args, train_dataset=_Items(items * 2), callbacks=[cb], **kw)
        trainer.train()
    assert trainer.state.global_step == 2 and [r["step"] for r in cb.monitor.records] == [0, 1]
    logged = [h["certblocks/alert_headroom"] for h in trainer.state.log_history if "certblocks/alert_headroom" in h]
    assert logged and all(math.isfinite(h) for h in logged)


def _trajectory(row: Row, model: nn.Module) -> None:
    batch = _batch(row, model)
    if row.call == "hf":
        batch = {**batch, "labels": batch["input_ids"]}
    rep = certblocks.trajectory(model, batch, DTYPE, steps=4)
    assert len(rep.updates) == row.depth and math.isfinite(rep.headroom) and rep.headroom > 0, rep.explain()


def _enforce(row: Row, model: nn.Module) -> None:
    from certblocks.enforcement import cap_ratios

    rep = certblocks.enforce(model, DTYPE, **row.enforce)
    assert rep.worst_case.ok and rep.alpha > 0
    batch = _batch(row, model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # a large step: the caps keep the certificate
    opt.zero_grad()
    _loss(row, model, batch).backward()
    opt.step()
    assert max(cap_ratios(model).values()) <= 1.0
    assert as_certified(model, **row.enforce).certificate(DTYPE, record_envelope=False).ok
    with torch.no_grad():
        assert torch.isfinite(_output(row, model, batch)).all()


def _save_load(row: Row, model: nn.Module) -> None:
    from certblocks.conversion import load_converted

    model.eval()
    with tempfile.TemporaryDirectory() as d:
        if row.save == "zoo":
            model.save_pretrained(d)
            back = type(model).from_pretrained(d)
        elif row.save == "hf":
            model.save_pretrained(d)
            back = load_converted(d)
        elif row.save == "hf_as_is":  # not converted: HF's own round trip (load_converted refuses it, by name)
            model.save_pretrained(d)
            back = type(model).from_pretrained(d)
            with pytest.raises(ValueError, match="records no conversion .* not a checkpoint of a converted model"):
                load_converted(d)
        elif row.save == "timm":
            torch.manual_seed(1)  # another initialization: every tensor must come from the checkpoint
            back = load_converted(_timm_vit(), model.state_dict())
        else:
            model.save_pretrained(d)
            torch.manual_seed(1)
            back = load_converted(_mamba_ssm(), d)
    back.eval()
    batch = _batch(row, model)
    with torch.no_grad():
        assert torch.equal(_output(row, model, batch), _output(row, back, batch))
    mine = as_certified(model, example_input=batch, **row.spine).certificate(DTYPE)
    theirs = as_certified(back, example_input=batch, **row.spine).certificate(DTYPE)
    assert mine.to_dict() == theirs.to_dict()


CELLS: Dict[str, Callable[[Row, nn.Module], None]] = {
    "certify": _certify, "monitor": _monitor, "trainer": _trainer, "trajectory": _trajectory, "enforce": _enforce,
    "save_load": _save_load}


def run_cell(key: str, path: str, model: Optional[nn.Module] = None) -> None:
    """Run one cell on ``model`` (default: built now, seed 0), expecting its error if :data:`EXPECTED` lists one."""
    row = ROWS[key]
    if model is None:
        torch.manual_seed(0)
        model = row.build()
    if (key, path) in EXPECTED:
        exc, pattern, _ = EXPECTED[(key, path)]
        with pytest.raises(exc, match=pattern):
            CELLS[path](row, model)
    else:
        CELLS[path](row, model)


# ---------------------------------------------------------------------------------------------- the cells
@pytest.fixture(scope="module")
def built():
    """The rows' models, built once per module (seed 0); each cell gets its own deep copy."""
    cache: Dict[str, nn.Module] = {}

    def get(key: str) -> nn.Module:
        if key not in cache:
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # HF/timm construction notices
                cache[key] = ROWS[key].build()
        return copy.deepcopy(cache[key])

    tr.logging.set_verbosity_error()
    return get


#: the cells that take over ~10 s on a 2-core CPU (none today: every cell runs in under 2 s once its model is built);
#: the Trainer column and the rows run in a fresh interpreter are marked slow as well
_SLOW: set = set()


def _cells() -> List[Any]:
    out = []
    for key, row in ROWS.items():
        for path in PATHS:
            slow = path == "trainer" or (key, path) in _SLOW or row.fresh_process
            marks = ([pytest.mark.slow] if slow else []) + ([pytest.mark.subprocess] if row.fresh_process else [])
            out.append(pytest.param(key, path, id=f"{key}-{path}", marks=marks))
    return out


@pytest.fixture(scope="module")
def fresh():
    """The outcome of each cell of the rows run in a fresh interpreter (one interpreter per row, run once)."""
    cache: Dict[str, Dict[str, str]] = {}

    def get(key: str) -> Dict[str, str]:
        if key not in cache:
            cache[key] = _in_fresh_process(key)
        return cache[key]

    return get


@pytest.mark.parametrize("key, path", _cells())
def test_cell(key: str, path: str, built, fresh) -> None:
    if ROWS[key].fresh_process:
        outcome = fresh(key)[path]
        assert outcome == "ok", outcome
        return
    run_cell(key, path, built(key))


def run_row(key: str) -> Dict[str, str]:
    """Every cell of a row, each on a model built for it: ``"ok"`` or the failure (for a fresh interpreter)."""
    import traceback

    out = {}
    for path in PATHS:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run_cell(key, path)
            out[path] = "ok"
        except BaseException as exc:  # a failed assertion too: reported to the test process
            out[path] = "".join(traceback.format_exception(exc))[-3000:]
    return out


def _in_fresh_process(key: str) -> Dict[str, str]:
    """Run a row in a new interpreter, which has no stand-in ``selective_scan_cuda`` (:class:`Row`)."""
    import json

    code = ("import importlib.util, json, sys\n"
            f"spec = importlib.util.spec_from_file_location('matrix_cells', {str(Path(__file__))!r})\n"
            "mod = importlib.util.module_from_spec(spec); sys.modules['matrix_cells'] = mod\n"
            "spec.loader.exec_module(mod)\n"
            "assert 'selective_scan_cuda' not in sys.modules\n"
            "mod.tr.logging.set_verbosity_error()\n"
            f"print('RESULT ' + json.dumps(mod.run_row({key!r})))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


# ---------------------------------------------------------------------------------------------- the table in the docs
def _doc_cell(key: str, path: str) -> str:
    return EXPECTED[(key, path)][2] if (key, path) in EXPECTED else "yes"


def test_docs_matrix_agrees_with_the_test() -> None:
    lines = [ln.strip() for ln in DOC.read_text(encoding="utf-8").splitlines() if ln.strip().startswith("|")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    header, body = cells[0], [r for r in cells[2:]]
    assert header == ["model"] + [PATH_LABELS[p] for p in PATHS]
    by_label = {row.label: key for key, row in ROWS.items()}
    assert [r[0] for r in body] == [row.label for row in ROWS.values()]  # every row, in the test's order
    for r in body:
        key = by_label[r[0]]
        assert r[1:] == [_doc_cell(key, p) for p in PATHS], r[0]


def test_every_expected_error_is_a_cell_of_the_matrix() -> None:
    assert all(k in ROWS and p in PATHS for k, p in EXPECTED)
    for exc, pattern, short in EXPECTED.values():
        assert issubclass(exc, Exception) and re.compile(pattern) and short.startswith(exc.__name__)


# ---------------------------------------------------------------------------------------------- mamba-ssm on CPU
def test_stub_is_installed_only_where_the_extension_is_missing(monkeypatch) -> None:
    import importlib.util

    from certblocks.testing import mamba_cpu

    monkeypatch.delitem(sys.modules, "selective_scan_cuda", raising=False)
    real_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "selective_scan_cuda" else real_spec(name, *a))
    assert mamba_cpu.install_selective_scan_stub() is False and "selective_scan_cuda" not in sys.modules
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "selective_scan_cuda" else real_spec(name, *a))
    assert mamba_cpu.install_selective_scan_stub() is True
    assert mamba_cpu.is_selective_scan_stub(sys.modules["selective_scan_cuda"])
    assert mamba_cpu.install_selective_scan_stub() is True  # already there: kept
    sys.modules["selective_scan_cuda"] = type(sys)("selective_scan_cuda")  # a real extension, already imported
    assert mamba_cpu.install_selective_scan_stub() is False


def test_mamba_cpu_config_refuses_what_needs_cuda() -> None:
    pytest.importorskip("mamba_ssm")
    from certblocks.testing import mamba_cpu_config

    cfg = mamba_cpu_config(d_model=16, n_layer=1, vocab_size=32)
    assert (cfg.rms_norm, cfg.fused_add_norm, cfg.d_model) == (False, False, 16)
    for kw, needle in ((dict(rms_norm=True), "rms_norm must be False on CPU"),
                       (dict(fused_add_norm=True), "fused_add_norm must be False on CPU"),
                       (dict(ssm_cfg={"layer": "Mamba2"}), "ssm_cfg layer must be 'Mamba1' on CPU")):
        with pytest.raises(ValueError, match=needle):
            mamba_cpu_config(**kw)


def test_mamba_ssm_on_cpu_runs_the_slow_path_and_restores_it() -> None:
    pytest.importorskip("mamba_ssm")
    import mamba_ssm.modules.mamba_simple as ms
    from mamba_ssm.ops.selective_scan_interface import selective_scan_ref

    before = {n: getattr(ms, n) for n in ("selective_scan_fn", "causal_conv1d_fn", "selective_state_update")}
    with mamba_ssm_on_cpu() as config:
        assert ms.selective_scan_fn is selective_scan_ref
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

        torch.manual_seed(0)
        model = MambaLMHeadModel(config(d_model=16, n_layer=1, vocab_size=32, pad_vocab_size_multiple=8))
        logits = model(_ids(1, 6) % 32).logits
    assert logits.shape == (1, 6, 32) and torch.isfinite(logits).all()
    assert {n: getattr(ms, n) for n in before} == before
