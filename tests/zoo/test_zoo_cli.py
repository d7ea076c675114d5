"""The zoo's command-line pieces (wired into certblocks/cli.py by the lead)."""

from __future__ import annotations

import argparse
import io

import pytest
from certblocks.zoo.cli import add_zoo_commands, run_certify_zoo


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="certblocks")
    add_zoo_commands(p.add_subparsers(dest="command", required=True))
    return p


def test_zoo_command(capsys):
    args = _parser().parse_args(["zoo", "patchtst_*_test", "--test"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "patchtst_noln_test" in out and "(1, 2) (1, 0)" in out and "bf16" in out
    args = _parser().parse_args(["zoo", "--names-only"])
    assert args.func(args) == 0
    assert "gpt2_qknorm_124m" in capsys.readouterr().out
    args = _parser().parse_args(["zoo", "nothing_matches_*"])
    assert args.func(args) == 2


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
    args = _parser().parse_args(["convert", "timm:vit_tiny_patch16_224", "--img-size", "32", "--layers", "1",
                                 "--remove-norms", "--dtype", "bf16"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "blocks.0.attn: Attention (q=1, sigma=2) -> QKNormAttention (q=1, sigma=1)" in out
    assert "before" in out and "after" in out
    args = _parser().parse_args(["convert", "resnet50"])
    assert args.func(args) == 2


@pytest.mark.parametrize("name", ["patchtst_noln_test", "mamba_forecaster_lg_test", "toto_style_test",
                                  "gpt2_qknorm_test"])
def test_certify_cli_traces_zoo_models(name, capsys):
    from certblocks import cli

    code = cli.main(["certify", name, "--dtype", "fp32"])
    out = capsys.readouterr().out
    assert code in (0, 1), out  # 0 certified, 1 not certified; 2 would be an error
    assert "updates" in out and "(q, sigma)" in out
