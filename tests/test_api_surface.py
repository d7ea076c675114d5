"""The public API: a small top level, the rest in subpackages, old top-level imports kept for one release.

Also the one argument validator (``certblocks._validation``) and the one table renderer (``certblocks._format``).
"""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
import warnings

import pytest

import certblocks

#: what a user needs on the first day (certblocks/__init__.py says why each is there)
TOP = {"certify", "as_certified", "build_stack", "convert", "enforce", "trajectory", "CertificateMonitor",
       "CertificateWarning", "CertificationError", "BlockCertificate", "StackCertificate", "LinearGrowthMamba",
       "QKNormAttention", "RotaryQKNormAttention", "GatedMLP", "MLP", "DyT"}

#: the names that moved off the top level, and where they live now
MOVED = {"float_max": "certblocks.budget", "jacobian_budget": "certblocks.budget", "Depths": "certblocks.certificate",
         "Failure": "certblocks.certificate", "Peak": "certblocks.certificate",
         "certify_stack": "certblocks.certificate", "Exponents": "certblocks.exponents",
         "ConversionReport": "certblocks.conversion", "ConversionError": "certblocks.conversion",
         "ConversionWarning": "certblocks.conversion", "EnforceReport": "certblocks.enforcement",
         "unenforce": "certblocks.enforcement", "CertifiedStack": "certblocks.stack",
         "register_atom": "certblocks.trace", "Attention": "certblocks.blocks", "LayerScale": "certblocks.blocks",
         "PatchTSTBlock": "certblocks.blocks", "Mamba": "certblocks.blocks", "TrajectoryReport": "certblocks.ondata"}


def test_the_top_level_is_small_and_every_name_loads_without_warning():
    assert set(certblocks.__all__) == TOP and len(certblocks.__all__) == len(TOP) == 17
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in TOP:
            assert getattr(certblocks, name) is not None
    assert TOP <= set(dir(certblocks)) and not set(MOVED) & set(dir(certblocks))


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_still_imports_with_a_warning_naming_its_new_place(name):
    where = MOVED[name]
    new = getattr(importlib.import_module(where), name)
    assert name in importlib.import_module(where).__all__
    for _ in range(2):  # every use warns: the old name is not cached in the package
        with pytest.warns(DeprecationWarning, match=rf"certblocks\.{name} moved to {where}: use 'from {where} "
                                                     rf"import {name}'") as rec:
            old = getattr(certblocks, name)
        assert old is new
        assert rec[0].filename == __file__  # attributed to the caller's line
    with pytest.warns(DeprecationWarning, match=f"from {where} import {name}"):
        exec(f"from certblocks import {name}", {})


def test_unknown_names_are_attribute_errors_and_submodules_load_on_use():
    with pytest.raises(AttributeError, match="module 'certblocks' has no attribute 'nope'"):
        certblocks.nope  # noqa: B018
    for sub in ("budget", "certificate", "conversion", "model", "fixes", "ondata"):
        assert getattr(certblocks, sub).__name__ == f"certblocks.{sub}"


@pytest.mark.subprocess
def test_import_is_light_and_the_pure_python_parts_never_import_torch():
    code = ("import sys, certblocks, certblocks.budget, certblocks.certificate, certblocks.exponents, "
            "certblocks._validation, certblocks._format; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_conversion_package_exposes_its_public_names_under_the_package():
    import certblocks.conversion as conv

    for name in conv.__all__:
        obj = getattr(conv, name)
        if callable(obj):
            assert obj.__module__ == "certblocks.conversion", name
    assert {c.name for c in conv.registered_converters()} >= {"hf_gpt2_attention", "timm_attention", "gated_mlp"}


# ---------------------------------------------------------------------------------------------- one validator
def test_validator_messages_name_the_argument_the_value_and_what_is_allowed():
    from certblocks._validation import check_bool, check_callable, check_choice, check_int, check_prob, check_real

    cases = [
        (lambda: check_real("dt", 0, gt=0), ValueError, r"^dt must be a finite number > 0, got 0$"),
        (lambda: check_real("r0", -1.0, ge=0, optional=True), ValueError,
         r"^r0 must be a finite number >= 0 or None, got -1.0$"),
        (lambda: check_real("r0", math.nan, ge=0), ValueError, r"^r0 must be a finite number >= 0, got nan$"),
        (lambda: check_real("p", 1.5, gt=0, le=1), ValueError, r"^p must be a finite number in \(0, 1\], got 1.5$"),
        (lambda: check_real("threshold", "x", lt=1, note="a margin"), TypeError,
         r"^threshold must be a real number < 1 \(a margin\), got 'x' \(str\)$"),
        (lambda: check_real("c", True), TypeError, r"^c must be a real number, got True \(bool\)$"),
        (lambda: check_int("every", 0), ValueError, r"^every must be an int >= 1, got 0$"),
        (lambda: check_int("n", 2.0, optional=True), TypeError, r"^n must be an int >= 1 or None, got 2.0 \(float\)$"),
        (lambda: check_prob("dropout", 1.0), ValueError, r"^dropout must be a finite number in \[0, 1\) "),
        (lambda: check_bool("strict", 1), TypeError, r"^strict must be a bool, got 1 \(int\)$"),
        (lambda: check_choice("kind", "x", ("a", "b")), ValueError, r"^kind must be one of \('a', 'b'\), got 'x'$"),
        (lambda: check_choice("kind", 1, (True,)), ValueError, r"kind must be one of"),  # 1 is not True
        (lambda: check_callable("fn", 3, "callable(x)"), TypeError, r"^fn must be callable\(x\), got int$"),
    ]
    for call, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call()
    assert check_real("r0", None, optional=True) is None and check_int("n", None, optional=True) is None
    assert check_real("x", 3) == 3.0 and isinstance(check_real("x", 3), float) and check_int("k", 0, 0) == 0


def test_the_call_sites_use_the_one_validator():
    # a sample of the former hand-written copies, each now the shared message
    from certblocks import GatedMLP, as_certified
    from certblocks.exponents import Exponents

    with pytest.raises(ValueError, match=r"^q must be a finite number >= 0 or None \(None: not derived\), got -1"):
        Exponents(-1, 0)
    with pytest.raises(TypeError, match=r"^bias must be a bool, got 1 \(int\)$"):
        GatedMLP(8, 16, bias=1)
    with pytest.raises(ValueError, match=r"^dt must be a finite number > 0 or None, got -1"):
        as_certified([("a", GatedMLP(8, 16))], dt=-1)


# ---------------------------------------------------------------------------------------------- one renderer
def test_one_table_renderer_for_text_and_markdown():
    from certblocks._format import render_table
    from certblocks.cli.formatting import render_table as cli_render

    assert cli_render is render_table
    text = render_table(["name", "n"], [["a", "1"], ["bbb", "22"]])
    assert text.splitlines() == ["name   n", "----  --", "a      1", "bbb   22"]
    assert render_table(["a", "b"], [["x", "y"]], markdown=True) == "| a | b |\n|---|---|\n| x | y |"
    assert render_table(["a", "b"], [["x", "y"]], align="rl", rule=False, indent="  ") == "  a  b\n  x  y"
    with pytest.raises(ValueError, match=r"rows\[0\] has 1 cells, the header 2"):
        render_table(["a", "b"], [["x"]])
    with pytest.raises(ValueError, match="align must be one letter"):
        render_table(["a"], [["x"]], align="c")


# ---------------------------------------------------------------------------------------------- the CLI and the spine
def _cli(capsys, *argv):
    from certblocks import cli

    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_certify_reads_a_zoo_model_through_the_spine_and_prints_its_fixes(capsys):
    import json

    import torch
    from certblocks.zoo import create_model

    from certblocks.model import as_certified

    code, out, err = _cli(capsys, "certify", "mamba_forecaster_free_test", "--dtype", "fp16", "--json")
    assert code == 1 and err == ""
    doc = json.loads(out)
    torch.manual_seed(0)
    cm = as_certified(create_model("mamba_forecaster_free_test", certify=False))
    cert = cm.certificate("fp16")
    assert doc["read_from"] == "zoo" and doc["stack"]["certified_depth"] == cert.certified_depth == 0
    assert [u["name"] for u in doc["certificates"]["updates"]] == [u.name for u in cert.updates]
    assert [f["text"] for f in doc["stack"]["fixes"]] == [f.text for f in cm.fixes("fp16")] != []
    code, text, _ = _cli(capsys, "certify", "mamba_forecaster_free_test", "--dtype", "fp16")
    assert code == 1 and "NOT certified" in text and "fixes (each certified again): certblocks.enforce(" in text


def test_certify_residual_patterns_read_any_model_from_its_graph(capsys):
    import json

    code, out, err = _cli(capsys, "certify", "gpt2_qknorm_test", "--dtype", "fp32", "--json", "--residual",
                          "transformer.h.*.attn")
    assert code in (0, 1), err
    doc = json.loads(out)
    assert doc["read_from"] == "graph"
    assert [u["name"] for u in doc["certificates"]["updates"]] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    code, _, err = _cli(capsys, "certify", "gpt2_qknorm_test", "--dt", "0.5")
    assert code == 2 and "dt=0.5 differs from the step 1" in err and len(err.splitlines()) == 1
