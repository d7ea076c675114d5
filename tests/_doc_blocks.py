"""The code blocks of the project's Markdown files, extracted and run by the tests.

One mechanism for every Markdown file whose examples the tests execute (``README.md`` and ``docs/*.md``, in
``tests/test_docs.py``).  A fenced block whose info string is
``python`` is an example: it runs on its own, in a fresh namespace, so it must hold its own imports.

Directives, in an HTML comment on the line(s) before a block (blank lines may sit in between; several
directives are separated by ``;``)::

    <!-- doctest: skip REASON -->        never run (the reason is required and printed)
    <!-- doctest: requires PKG [PKG] --> run only when these packages are importable (optional extras)
    <!-- doctest: subprocess -->         run in a fresh interpreter (the block changes process-wide state:
                                          environment variables read at import, global registries)
    <!-- doctest: slow -->               a long run: the test gets the ``slow`` marker

A fence with the info string ``output`` right after a block (blank lines only in between) is the block's
expected standard output, compared line by line (trailing spaces and trailing blank lines ignored).

Blocks run in-process by default (no interpreter start-up): ``exec`` of the block's code with the code
placed at its line in the Markdown file, so a traceback names the file and the line of the failing
statement.  torch's global state that an example may touch (default dtype, random generator, number of
threads) and the warning filters are restored afterwards.

A block must use the current API: a ``DeprecationWarning`` attributed to the block's own lines (a deprecated name or
call it uses: certblocks' shims point at their caller) or raised inside certblocks is an error, in-process and in a
subprocess alike.  Third-party deprecations inside third-party code are left to the caller's filters.

This module is plain Python; it imports torch only to save and restore that state, and pytest only in
:func:`pytest_params`.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import io
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

__all__ = ["DocBlock", "DocBlockError", "python_blocks", "run_block", "pytest_params"]

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)[^`]*$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*doctest:(?P<body>.*?)-->\s*$")
_SUBPROCESS_TIMEOUT_S = 600
#: The modules whose DeprecationWarnings fail a block: the block itself (in-process ``__doc_block__``, in a subprocess
#: ``__main__``) and certblocks.
_DEPRECATION_MODULES = r"(__doc_block__|__main__|certblocks)(\.|$)"
#: The first line of a subprocess block (the code starts at line 2 or later: the fence is above it).
_SUBPROCESS_PRELUDE = ("import warnings as _w; _w.filterwarnings('error', category=DeprecationWarning, "
                       f"module={_DEPRECATION_MODULES!r}); del _w")


class DocBlockError(ValueError):
    """A Markdown file whose blocks or directives cannot be read (the message names the file and line)."""


@dataclass(frozen=True)
class DocBlock:
    """One ``python`` block of a Markdown file.

    Attributes:
        path: the Markdown file.
        line: 1-based line number of the block's first code line in that file.
        code: the block's code (dedented by its fence's indentation).
        expected: the expected standard output (the ``output`` fence after the block), or ``None``.
        skip: why the block is never run, or ``None``.
        requires: packages the block needs; it is skipped when one is not importable.
        subprocess: run it in a fresh interpreter.
        slow: a long run (the test is marked ``slow``).
    """

    path: Path
    line: int
    code: str
    expected: Optional[str] = None
    skip: Optional[str] = None
    requires: Tuple[str, ...] = ()
    subprocess: bool = False
    slow: bool = False

    @property
    def id(self) -> str:
        """``file.md:line``, the test id."""
        return f"{self.path.name}:{self.line}"

    def missing(self) -> List[str]:
        """The required packages that are not importable."""
        return [p for p in self.requires if importlib.util.find_spec(p) is None]


def _directives(body: str, where: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for part in (p.strip() for p in body.split(";")):
        if not part:
            continue
        word, _, rest = part.partition(" ")
        rest = rest.strip()
        if word == "skip":
            if not rest:
                raise DocBlockError(f"{where}: 'doctest: skip' needs a reason")
            out["skip"] = rest
        elif word == "requires":
            names = tuple(n for n in re.split(r"[\s,]+", rest) if n)
            if not names:
                raise DocBlockError(f"{where}: 'doctest: requires' needs at least one package name")
            out["requires"] = out.get("requires", ()) + names
        elif word in ("subprocess", "slow"):
            if rest:
                raise DocBlockError(f"{where}: 'doctest: {word}' takes no argument, got {rest!r}")
            out[word] = True
        else:
            raise DocBlockError(f"{where}: unknown doctest directive {word!r}; allowed: skip REASON, "
                                f"requires PKG, subprocess, slow")
    return out


def _fences(lines: Sequence[str], where: str) -> Iterator[Tuple[int, int, str, int, str]]:
    """Fenced blocks as (open line index, close line index, info, indent, fence), outermost only."""
    k = 0
    while k < len(lines):
        m = _FENCE.match(lines[k])
        if not m:
            k += 1
            continue
        fence, indent = m.group("fence"), len(m.group("indent"))
        close = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(k + 1, len(lines)) if close.match(lines[j])), None)
        if end is None:
            raise DocBlockError(f"{where}:{k + 1}: the fence {fence!r} opened here is never closed")
        yield k, end, m.group("info").lower(), indent, fence
        k = end + 1


def _body(lines: Sequence[str], start: int, end: int, indent: int) -> str:
    body = [ln[indent:] if ln[:indent].strip() == "" else ln.lstrip() for ln in lines[start + 1:end]]
    return "\n".join(body) + ("\n" if body else "")


def python_blocks(path: Path) -> List[DocBlock]:
    """The ``python`` blocks of a Markdown file, with their directives and expected outputs.

    Args:
        path: the Markdown file.

    Raises:
        DocBlockError: an unclosed fence, an unknown or malformed directive, a directive that is not followed
            by a ``python`` block, or an ``output`` fence that does not follow one.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    where = str(path)
    fences = list(_fences(lines, where))
    pending: Dict[str, Any] = {}
    pending_line = 0
    blocks: List[DocBlock] = []
    fence_at = {start: (end, info, indent) for start, end, info, indent, _ in fences}
    last_python_end: Optional[int] = None  # the python block an output fence may follow
    k = 0
    while k < len(lines):
        if k in fence_at:
            end, info, indent = fence_at[k]
            if info == "output":
                if last_python_end is None or any(lines[j].strip() for j in range(last_python_end + 1, k)):
                    raise DocBlockError(f"{where}:{k + 1}: an 'output' fence must follow a python block")
                if blocks[-1].expected is not None:
                    raise DocBlockError(f"{where}:{k + 1}: a python block has one 'output' fence at most")
                prev = blocks[-1]
                blocks[-1] = DocBlock(prev.path, prev.line, prev.code, _body(lines, k, end, indent), prev.skip,
                                      prev.requires, prev.subprocess, prev.slow)
                last_python_end = None
            elif info == "python":
                blocks.append(DocBlock(path, k + 2, _body(lines, k, end, indent), None, pending.get("skip"),
                                       tuple(pending.get("requires", ())), bool(pending.get("subprocess")),
                                       bool(pending.get("slow"))))
                pending, last_python_end = {}, end
            else:
                if pending:
                    raise DocBlockError(f"{where}:{pending_line}: a doctest directive must precede a python "
                                        f"block, not a {info or 'plain'!r} fence")
                last_python_end = None
            k = end + 1
            continue
        m = _DIRECTIVE.match(lines[k])
        if m:
            for key, value in _directives(m.group("body"), f"{where}:{k + 1}").items():
                pending[key] = pending.get(key, ()) + value if key == "requires" else value
            pending_line = k + 1
        elif lines[k].strip():
            if pending:
                raise DocBlockError(f"{where}:{pending_line}: a doctest directive must be followed by a python "
                                    f"block (blank lines only in between)")
            last_python_end = None
        k += 1
    if pending:
        raise DocBlockError(f"{where}:{pending_line}: a doctest directive at the end of the file has no block")
    return blocks


@contextlib.contextmanager
def _restored_state() -> Iterator[None]:
    """Restore torch's default dtype, random generator and thread count, and the warning filters; inside, a
    DeprecationWarning of the block or of certblocks is an error."""
    torch = sys.modules.get("torch")
    saved = None if torch is None else (torch.get_default_dtype(), torch.random.get_rng_state(),
                                         torch.get_num_threads())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=DeprecationWarning, module=_DEPRECATION_MODULES)
        try:
            yield
        finally:
            torch = sys.modules.get("torch")
            if torch is not None and saved is not None:
                dtype, rng, threads = saved
                torch.set_default_dtype(dtype)
                torch.random.set_rng_state(rng)
                if torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)


def _placed(block: DocBlock, prelude: str = "") -> str:
    """The code with blank lines in front, so that its line numbers are the Markdown file's (``prelude`` on the first
    line, above the block's first line)."""
    return prelude + "\n" * (block.line - 1) + block.code


def _compare(block: DocBlock, out: str) -> None:
    if block.expected is None:
        return

    def norm(text: str) -> List[str]:
        rows = [r.rstrip() for r in text.splitlines()]
        while rows and not rows[-1]:
            rows.pop()
        return rows

    want, got = norm(block.expected), norm(out)
    if want != got:
        diff = "\n".join(difflib.unified_diff(want, got, "expected (output fence)", "printed", lineterm=""))
        raise AssertionError(f"{block.id}: the printed output differs from the block's output fence:\n{diff}")


def run_block(block: DocBlock, *, cwd: Optional[Path] = None) -> str:
    """Run one block on its own and check its output.

    Args:
        block: the block (its ``skip`` and ``requires`` are the caller's to honour).
        cwd: working directory of a subprocess block (default: the repository root).

    Returns:
        What the block printed.

    Raises:
        AssertionError: the block raised (the original exception is chained; in a subprocess, its stderr is
            in the message), including a DeprecationWarning of its own or of certblocks, or printed something else
            than its ``output`` fence.
    """
    if block.subprocess:
        proc = subprocess.run([sys.executable, "-"], input=_placed(block, _SUBPROCESS_PRELUDE), text=True,
                              capture_output=True, cwd=str(cwd or ROOT), env=dict(os.environ),
                              timeout=_SUBPROCESS_TIMEOUT_S)
        if proc.returncode != 0:
            raise AssertionError(f"{block.id} (subprocess) exited with {proc.returncode} (line numbers are the "
                                 f"Markdown file's, '<stdin>' is {block.path}):\n{proc.stderr[-6000:]}")
        out = proc.stdout
    else:
        buf = io.StringIO()
        namespace: Dict[str, Any] = {"__name__": "__doc_block__"}
        with _restored_state(), contextlib.redirect_stdout(buf):
            try:
                exec(compile(_placed(block), str(block.path), "exec"), namespace)  # the project's own docs
            except Exception as exc:
                raise AssertionError(f"{block.id} raised {type(exc).__name__}: {exc}") from exc
        out = buf.getvalue()
    _compare(block, out)
    return out


def pytest_params(paths: Sequence[Path]) -> List[Any]:
    """``pytest.param`` per block of ``paths`` (id ``file.md:line``; slow blocks marked ``slow``)."""
    import pytest

    params = []
    for path in paths:
        for block in python_blocks(path):
            marks = [pytest.mark.slow] if block.slow else []
            params.append(pytest.param(block, id=block.id, marks=marks))
    return params
