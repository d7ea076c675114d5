"""What every subcommand shares: exit codes, one-line usage errors and argument types.

Nothing here imports torch: the parser of every subcommand is built from this module.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import math
import sys
from typing import Any, Callable, Iterator, List, NoReturn, Optional, TextIO

__all__ = [
    "EXIT_OK",
    "EXIT_NOT_CERTIFIED",
    "EXIT_USAGE",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "UsageError",
    "Parser",
    "Progress",
    "add_quiet",
    "progress_of",
    "command",
    "dtype_list",
    "pure_dtype_list",
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
                _clear_progress()
                print(f"certblocks {name}: error: {exc}", file=sys.stderr)
                return EXIT_USAGE
            finally:
                _clear_progress()

        return checked

    return wrap


class Progress:
    """What a long command is doing, on one line of stderr rewritten in place: which model, which step.

    Shown only when stderr is a terminal and the command was not given ``--quiet``; the line is erased before the
    command prints its result (:meth:`clear`) and when it ends.  Inside :meth:`logging_steps` the library's own
    steps (``certblocks`` loggers, level ``INFO``: :func:`certblocks.convert` logs capture, certify and fixes) are
    shown too.

    Args:
        command: the subcommand (shown first).
        quiet: never show anything.
        stream: where to write (default ``sys.stderr``).
    """

    def __init__(self, command: str, *, quiet: bool = False, stream: Optional[TextIO] = None) -> None:
        self.command = command
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = not quiet and callable(isatty) and bool(isatty())
        self.subject = ""
        self._shown = False

    def __call__(self, step: str, subject: Optional[str] = None) -> None:
        """Show ``step`` (for ``subject``, e.g. the model, which is remembered for the next steps)."""
        if subject is not None:
            self.subject = subject
        if not self.enabled:
            return
        what = f"{self.subject}: {step}" if self.subject else step
        self.stream.write(f"\r\033[Kcertblocks {self.command}: {what} ...")
        self.stream.flush()
        self._shown = True
        _SHOWN.append(self)

    def clear(self) -> None:
        """Erase the progress line (before printing a result)."""
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False

    @contextlib.contextmanager
    def logging_steps(self) -> Iterator[Progress]:
        """Show the ``certblocks`` loggers' ``INFO`` records as steps while inside; the line is erased at the end."""
        handler: Optional[logging.Handler] = None
        logger = logging.getLogger("certblocks")
        old_level = logger.level
        if self.enabled:
            handler = _ProgressHandler(self)
            logger.addHandler(handler)
            if logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)
        try:
            yield self
        finally:
            if handler is not None:
                logger.removeHandler(handler)
                logger.setLevel(old_level)
            self.clear()


_SHOWN: List[Progress] = []  # the progress lines shown: erased when a command ends, before its error line


def _clear_progress() -> None:
    while _SHOWN:
        _SHOWN.pop().clear()


class _ProgressHandler(logging.Handler):
    def __init__(self, progress: Progress) -> None:
        super().__init__(logging.INFO)
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        self.progress(record.getMessage())


def add_quiet(p: argparse.ArgumentParser) -> None:
    """The ``--quiet`` flag of a command that shows its progress on stderr."""
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress on stderr (it is shown only when stderr is a terminal)")


def progress_of(args: Any, command: str) -> Progress:
    """The :class:`Progress` of a parsed command line (its ``--quiet``)."""
    return Progress(command, quiet=bool(getattr(args, "quiet", False)))


# ---------------------------------------------------------------------------------------------- argument types
# argparse turns an ArgumentTypeError into "argument --x: <message>" and exit status 2; it also applies
# these to string defaults, so a default such as "fp16,bf16,fp32" arrives parsed.

def dtype_list(text: str) -> List[str]:
    """``"fp16,amp-fp16,bf16"`` -> ``["fp16", "amp-fp16", "bf16"]``: dtypes (canonical names) and precision policies
    (:func:`certblocks.precision.as_precision`); an argparse ``type``."""
    from certblocks.precision import as_precision

    names = [t for t in (s.strip() for s in text.split(",")) if t]
    if not names:
        raise argparse.ArgumentTypeError(f"needs at least one dtype, e.g. fp16,bf16,fp32; got {text!r}")
    try:
        return [as_precision(n).name for n in names]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def pure_dtype_list(text: str) -> List[str]:
    """:func:`dtype_list` of dtypes only (a homogeneous stack's depths are for one dtype)."""
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
