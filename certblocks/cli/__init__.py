"""The ``certblocks`` command line (also ``python -m certblocks``).

Commands:

* ``certblocks budget --q 1 --sigma 2 --c 1 --l1 1 --dtype fp16,bf16,fp32``: the certified depths of a
  homogeneous stack of one block, per dtype (:mod:`certblocks.cli.budget`).
* ``certblocks table``: forward overflow depths for q in {0, 1/2, 1, 2, 5} (``--markdown`` for the README,
  ``--update-readme PATH`` to rewrite its table; :mod:`certblocks.cli.table`).
* ``certblocks demo``: the certificate tables ``make demo`` prints (:mod:`certblocks.cli.demo`).
* ``certblocks certify [MODEL]``: certify a model's residual updates from its graph (``timm:<name>``,
  ``hf:gpt2``, ``hf:mamba``, ``module:pkg.mod:factory``, a zoo name); without MODEL, every zoo model
  (:mod:`certblocks.cli.certify`).
* ``certblocks zoo [PATTERN]``: the zoo's models and their certificates (:mod:`certblocks.cli.zoo`).
* ``certblocks convert MODEL``: a backbone's certificate before and after :func:`certblocks.convert`
  (:mod:`certblocks.cli.convert`).
* ``certblocks trajectory MODEL [--batch FILE]``: the on-data certificate of one batch (the trajectory bound and
  the headroom per update; ``--plot PNG``; :mod:`certblocks.cli.trajectory`).

Exit status:

* 0 -- success (for ``certify MODEL``: the model is certified in the dtype);
* 1 -- ``certify MODEL`` ran and the model is NOT certified (``certify`` without MODEL reports every zoo
  model and exits 0: a model that is not certified is a result there); ``trajectory MODEL``: the batch
  overflows the dtype (headroom <= 0); ``convert MODEL``: refused (``--strict``), or the model could not be
  captured and certified before or after the conversion (one line on stderr);
* 2 -- a bad argument: usage, a value out of range, a MODEL that cannot be built or captured, a file
  that cannot be read; one line ``certblocks <command>: error: ...`` on stderr, no traceback;
* 3 -- an internal error (a bug): the traceback, then one line saying so, on stderr;
* 130 -- interrupted (Ctrl-C).

Start-up stays light: the parser imports a subcommand's module only when that subcommand is asked for,
and no subcommand module imports torch, timm or transformers at import time. ``certblocks budget`` and
``certblocks table`` never import torch; no ``--help`` imports timm or transformers; a MODEL of an unknown form or
name is answered before torch is imported, with the close names ("did you mean").

Progress: ``certify``, ``convert``, ``trajectory`` and ``zoo`` show on stderr which model and which step they are at
(build, capture, certify, fixes), on one line erased before the result, when stderr is a terminal and without
``--quiet``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from typing import Any, Dict, Optional, Sequence, Tuple

from ._common import EXIT_INTERNAL, EXIT_INTERRUPTED, Parser

__all__ = ["COMMANDS", "add_command", "build_parser", "main"]

#: name -> (module with ``add_arguments(parser)``, one-line help).
COMMANDS: Dict[str, Tuple[str, str]] = {
    "budget": ("certblocks.cli.budget", "certified depths of a homogeneous stack of one block, per dtype"),
    "table": ("certblocks.cli.table", "forward overflow depths for q in {0, 1/2, 1, 2, 5}"),
    "demo": ("certblocks.cli.demo", "print the certificate tables (what `make demo` shows)"),
    "certify": ("certblocks.cli.certify", "certify a model's residual updates from its graph (torch.export)"),
    "zoo": ("certblocks.cli.zoo", "the zoo's models and their certificates"),
    "convert": ("certblocks.cli.convert", "a backbone's certificate before and after certblocks.convert"),
    "trajectory": ("certblocks.cli.trajectory", "the on-data certificate of one batch: trajectory bound, headroom"),
}


def add_command(subparsers: Any, name: str) -> argparse.ArgumentParser:
    """Register subcommand ``name`` with its arguments on an ``argparse`` sub-parsers object.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
        name: a key of :data:`COMMANDS`.

    Returns:
        The subcommand's parser (its ``func`` default runs it and returns the exit status).
    """
    if name not in COMMANDS:
        raise ValueError(f"name must be one of {sorted(COMMANDS)}, got {name!r}")
    module, help_text = COMMANDS[name]
    p = subparsers.add_parser(name, help=help_text, description=help_text)
    importlib.import_module(module).add_arguments(p)
    return p


def _requested(argv: Sequence[str]) -> Optional[str]:
    """The subcommand in ``argv``: its first word that is not an option (the top level has no valued option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: Optional[Sequence[str]] = None) -> argparse.ArgumentParser:
    """The argument parser.

    Args:
        argv: the arguments about to be parsed: only the subcommand they name gets its arguments (and has
            its module imported); the others appear in ``--help`` with their one-line help. None: every
            subcommand gets its arguments.
    """
    from certblocks import __version__

    parser = Parser(prog="certblocks", description="Stability certificates for residual blocks.")
    parser.add_argument("--version", action="version", version=f"certblocks {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = _requested(argv) if argv is not None else None
    for name, (_, help_text) in COMMANDS.items():
        if argv is None or name == wanted:
            add_command(sub, name)
        else:
            sub.add_parser(name, help=help_text, description=help_text)
    return parser


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``certblocks`` console script.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status (see the module docstring); ``--help`` and usage errors return too, they do not
        raise ``SystemExit``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors: argparse has printed what to say
        return _exit_status(exc.code)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"certblocks {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader closed the pipe (`certblocks zoo | head`): not an error of ours
        try:  # stdout is gone: point it at devnull so that the interpreter's final flush does not fail again
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except Exception:  # a bug: keep the traceback for the report, and say so in the last line
        traceback.print_exc()
        print(f"certblocks {args.command}: internal error (a bug; please report it with the traceback above)",
              file=sys.stderr)
        return EXIT_INTERNAL
