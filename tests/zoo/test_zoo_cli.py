"""``certblocks zoo``, ``certblocks convert`` and ``certblocks certify`` on zoo models (certblocks.cli)."""

from __future__ import annotations

import io

import pytest

from certblocks import cli
from certblocks.cli.zoo import run_certify_zoo


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_zoo_command(capsys):
    code, out, _ = run(capsys, "zoo", "patchtst_*_test", "--test")
    assert code == 0
    assert "patchtst_noln_test" in out and "(1, 2) (1, 0)" in out and "bf16" in out
    code, out, _ = run(capsys, "zoo", "--names-only")
    assert code == 0 and "gpt2_qknorm_124m" in out
    code, out, err = run(capsys, "zoo", "nothing_matches_*")
    assert code == 2 and out == ""
    assert err.strip() == ("certblocks zoo: error: no model matches 'nothing_matches_*' (add --test for the test "
                           "sizes); 'certblocks zoo --names-only' lists them")


def test_run_certify_zoo_markdown():
    buf = io.StringIO()
    names = ["gpt2_qknorm_test", "mamba_forecaster_free_test"]
    assert run_certify_zoo(["fp16", "bf16", "fp32"], names=names, markdown=True, stream=buf) == 0
    text = buf.getvalue()
    assert "### gpt2_qknorm_test" in text and "| transformer.h.0.attn | (1, 1) |" in text
    assert "| mamba_forecaster_free_test | mamba_forecaster | 4 | (5, 5) (1, 0) | NO 0/4 | NO 2/4 | NO 2/4 |" in text
    assert "### Summary" in text


def test_convert_command(capsys):
    pytest.importorskip("timm")
    code, out, _ = run(capsys, "convert", "timm:vit_tiny_patch16_224", "--img-size", "32", "--layers", "1",
                       "--remove-norms", "--dtype", "bf16")
    assert code == 0
    assert "blocks.0.attn: Attention (q=1, sigma=2) -> QKNormAttention (q=1, sigma=1)" in out
    assert "before" in out and "after" in out


@pytest.mark.parametrize("name", ["patchtst_noln_test", "mamba_forecaster_lg_test", "toto_style_test",
                                  "gpt2_qknorm_test"])
def test_certify_cli_traces_zoo_models(name, capsys):
    code, out, err = run(capsys, "certify", name, "--dtype", "fp32")
    assert code in (0, 1), out + err  # 0 certified, 1 not certified; 2 would be an error
    assert "updates" in out and "(q, sigma)" in out


def test_certify_exit_1_when_a_zoo_model_is_not_certified(capsys):
    # mamba_forecaster_free_test is certified for 0 of its 4 updates in fp16 (the summary row above)
    code, out, err = run(capsys, "certify", "mamba_forecaster_free_test", "--dtype", "fp16")
    assert code == 1 and err == ""
    assert "NOT certified" in out


def test_the_cli_knows_every_zoo_name_without_importing_the_zoo():
    from certblocks.zoo import list_models, model_entry

    from certblocks.cli.models import ZOO_NAMES, check_spec

    shipped = [n for n in list_models(include_test=True) if model_entry(n).fn.__module__.startswith("certblocks.zoo")]
    assert sorted(ZOO_NAMES) == shipped  # (other tests register models of their own)
    for name in ZOO_NAMES:
        check_spec(name)  # accepted before torch is imported
