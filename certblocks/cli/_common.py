"""What every subcommand shares: exit codes, one-line usage errors and argument types.

Nothing here imports torch: the parser of every subcommand is built from this module.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from typing import Callable, List, NoReturn

__all__ = [
    "EXIT_OK",
    "EXIT_NOT_CERTIFIED",
    "EXIT_USAGE",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "UsageError",
    "Parser",
    "command",
    "dtype_list",
    "int_at_least",
    "nonnegative_float",
    "positive_float",
]

EXIT_OK = 0
EXIT_NOT_CERTIFIED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130


class UsageError(ValueError):
    """A bad argument: reported as one line ``certblocks <sub>: error: ...`` with exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``certblocks <sub>: error: ...`` (exit status 2).

    Sub-parsers created from it are of this class too (``add_subparsers`` uses the parent's class).
    """

    def error(self, message: str) -> NoReturn:
        """Print one line naming the command and the problem, then exit with status 2."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def command(name: str) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    """Decorate a subcommand's run function: a :class:`UsageError` becomes one line on stderr and exit status 2.

    Args:
        name: the subcommand, as typed after ``certblocks``.
    """

    def wrap(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        @functools.wraps(run)
        def checked(args: argparse.Namespace) -> int:
            try:
                return run(args)
            except UsageError as exc:
                print(f"certblocks {name}: error: {exc}", file=sys.stderr)
                return EXIT_USAGE

        return checked

    return wrap


# ---------------------------------------------------------------------------------------------- argument types
# argparse turns an ArgumentTypeError into "argument --x: <message>" and exit status 2; it also applies
# these to string defaults, so a default such as "fp16,bf16,fp32" arrives parsed.

def dtype_list(text: str) -> List[str]:
    """``"fp16,bf16"`` -> ``["fp16", "bf16"]`` (canonical names); an argparse ``type``."""
    from certblocks.budget import dtype_name

    names = [t for t in (s.strip() for s in text.split(",")) if t]
    if not names:
        raise argparse.ArgumentTypeError(f"needs at least one dtype, e.g. fp16,bf16,fp32; got {text!r}")
    try:
        return [dtype_name(n) for n in names]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def _real(text: str, *, strict: bool) -> float:
    allowed = "> 0" if strict else ">= 0"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number {allowed}, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (strict and value == 0):
        raise argparse.ArgumentTypeError(f"must be a finite number {allowed}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number ``> 0``."""
    return _real(text, strict=True)


def nonnegative_float(text: str) -> float:
    """An argparse ``type``: a finite number ``>= 0``."""
    return _real(text, strict=False)
