"""The command line starts light: run in fresh interpreters, since the test session has torch loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import List

from certblocks import cli

HEAVY = ("torch", "timm", "transformers")

# Runs certblocks.cli.main on each argv of a JSON list (argument 2), then prints the exit codes and which of the
# modules named in argument 1 are loaded.
_PROBE = """\
import contextlib, io, json, sys
from certblocks.cli import main
codes = []
for argv in json.loads(sys.argv[2]):
    with contextlib.redirect_stdout(io.StringIO()):
        codes.append(main(argv))
print(json.dumps({"codes": codes, "loaded": [m for m in json.loads(sys.argv[1]) if m in sys.modules]}))
"""


def probe(*argvs: List[str]) -> dict:
    res = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(HEAVY), json.dumps(argvs)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_import_certblocks_does_not_import_torch():
    code = "import sys, certblocks; print([m for m in sys.argv[1:] if m in sys.modules])"
    res = subprocess.run([sys.executable, "-c", code, *HEAVY], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


def test_budget_and_table_never_import_torch():
    got = probe(["budget", "--q", "1", "--sigma", "2", "--c", "1", "--l1", "1", "--dtype", "fp16,bf16,fp32"],
                ["budget", "--q", "1", "--peak", "2", "0.5", "0", "--json"],
                ["table"], ["table", "--markdown"])
    assert got == {"codes": [0, 0, 0, 0], "loaded": []}


def test_help_never_imports_torch_timm_or_transformers():
    argvs = [["--help"]] + [[name, "--help"] for name in cli.COMMANDS]
    got = probe(*argvs)
    assert got == {"codes": [0] * len(argvs), "loaded": []}


def test_python_m_certblocks():
    res = subprocess.run([sys.executable, "-m", "certblocks", "budget", "--q", "1", "--dtype", "fp64"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.splitlines()[-1].split()[:3] == ["fp64", "1.8e+308", "1,023"], res.stderr
    res = subprocess.run([sys.executable, "-m", "certblocks", "zoo", "--dtype", "fp12"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("certblocks zoo: error: argument --dtype: dtype 'fp12' is not supported")
    assert len(res.stderr.splitlines()) == 1


def test_unknown_models_are_answered_without_importing_torch():
    got = probe(["certify", "gpt2_qknorm_tini"], ["convert", "resnet50"], ["certify", "hf:gtp2"],
                ["trajectory", "timm-vit_tiny"])
    assert got == {"codes": [2, 2, 2, 2], "loaded": []}


def test_a_closed_pipe_is_not_a_bug():
    """``certblocks zoo --names-only | head -1``: the reader closes the pipe; the command stops quietly, status 0."""
    proc = subprocess.Popen([sys.executable, "-m", "certblocks", "zoo", "--names-only"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    assert b"internal error" not in err and b"Traceback" not in err, err.decode()
