"""Where the samples come from: PyTorch's OpInfo database (:func:`opinfo_samples`) and the hand-written samples of
:mod:`certblocks.testing.conformance_samples` (:func:`hand_samples`), with the seeding that makes every draw the same
on every run."""

from __future__ import annotations

import contextlib
import functools
import random
import sys
import types
import unittest
import warnings
import zlib
from typing import Any, Iterable, Iterator, List, Optional, Set, Tuple

import torch
from torch import Tensor

from ..trace.rules import registered_rules
from ._conformance_types import Sample


def _seed_all(seed: int) -> None:
    """Seed torch's, Python's and NumPy's global generators (OpInfo sample functions draw from all three)."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is a torch dependency in practice
        pass


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run with the global generators seeded, and give the caller back their states."""
    state = random.getstate()
    try:
        import numpy as np

        np_state: Any = np.random.get_state()
    except ImportError:  # pragma: no cover
        np, np_state = None, None
    with torch.random.fork_rng(devices=[]):
        _seed_all(seed)
        try:
            yield
        finally:
            random.setstate(state)
            if np is not None:
                np.random.set_state(np_state)


# ---------------------------------------------------------------------------------------------- OpInfo
@contextlib.contextmanager
def _opinfo_import() -> Iterator[None]:
    """Import PyTorch's OpInfo database.  It imports the test helper ``expecttest`` for a base class only: when that
    package is missing a stand-in module with ``TestCase`` and ``ACCEPT`` is registered.  The database freezes
    torch's global backend flags on import; they are unfrozen again when they were not frozen before."""
    frozen = torch.backends.flags_frozen()
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401
        except ModuleNotFoundError:
            stand_in = types.ModuleType("expecttest")
            stand_in.TestCase = unittest.TestCase  # type: ignore[attr-defined]
            stand_in.ACCEPT = False  # type: ignore[attr-defined]
            sys.modules["expecttest"] = stand_in
    try:
        yield
    finally:
        if not frozen and torch.backends.flags_frozen():
            torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True


@functools.lru_cache(maxsize=1)
def _op_db() -> Tuple[Any, ...]:
    with _opinfo_import(), warnings.catch_warnings(), _seeded(0):  # the import draws from the global generators
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return tuple(op_db)


def _opinfo_targets(info: Any, keys: Set[str]) -> List[str]:
    """The registered ops an OpInfo names: its aten name, its name's last part, its aliases, its function's name."""
    names = [info.aten_name, info.name.split(".")[-1], info.name.replace(".", "_"),
             getattr(info.op, "__name__", "")] + [a.name.split(".")[-1] for a in getattr(info, "aliases", ())]
    out: List[str] = []
    for nm in names:
        key = f"aten.{nm}"
        if nm and key in keys and key not in out:
            out.append(key)
    return out


def _signature(s: Any) -> str:
    leaves, spec = torch.utils._pytree.tree_flatten(((s.input,) + tuple(s.args), dict(s.kwargs)))
    return str(spec) + "|" + "|".join(str(tuple(v.shape)) if isinstance(v, Tensor) else repr(v) for v in leaves)


def opinfo_samples(ops: Optional[Iterable[str]] = None, *, per_opinfo: Optional[int] = None, spread: bool = True,
                   float32: bool = True, seed: int = 0) -> List[Tuple[Sample, List[str], str]]:
    """The float CPU samples of every OpInfo that names a registered rule (PyTorch's ``op_db``).

    Each OpInfo's float64 samples, then (``float32``) its float32 samples whose shapes and arguments differ from
    every float64 one (all are checked in float64), drawn by its ``sample_inputs_func`` after ``torch.manual_seed``
    set from the OpInfo's name and dtype: the same samples on every run.

    Args:
        ops: keep the OpInfos naming one of these registry keys (default: every registered rule).
        per_opinfo: at most this many samples per OpInfo (default: all).
        spread: take them evenly spread over the OpInfo's list (else its first ones: only those are generated).
        float32: add the float32 samples that differ from the float64 ones.
        seed: added to each OpInfo's seed.

    Returns:
        ``(sample, intended ops, "opinfo")`` triples for :func:`check_samples`.
    """
    keys = set(registered_rules())
    wanted = keys if ops is None else {o.replace("::", ".") for o in ops}
    out: List[Tuple[Sample, List[str], str]] = []
    limit = None if spread else per_opinfo
    with warnings.catch_warnings(), _seeded(seed):
        warnings.simplefilter("ignore")
        for info in _op_db():
            targets = [t for t in _opinfo_targets(info, keys) if t in wanted]
            if not targets:
                continue
            dtypes = info.supported_dtypes("cpu")
            name = info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")
            found: List[Tuple[Any, str]] = []
            seen: Set[str] = set()
            for dt in (torch.float64, torch.float32) if float32 else (torch.float64,):
                if dt not in dtypes or (limit is not None and len(found) >= limit):
                    continue
                try:
                    _seed_all(seed + zlib.crc32(f"{name}|{dt}".encode()))
                    # the OpInfo's own sample function (its sample_inputs wraps it in a test-tracking iterator that
                    # inspects the call stack at every call: seconds over the database)
                    for s in info.sample_inputs_func(info, "cpu", dt, False):
                        sig = _signature(s)
                        if sig not in seen:
                            seen.add(sig)
                            found.append((s, "" if dt == torch.float64 else " f32"))
                        if limit is not None and len(found) >= limit:
                            break
                except Exception:  # a sample generator that needs what this machine lacks
                    continue
            for i in _spread(len(found), per_opinfo):
                s, tag = found[i]
                out.append((Sample((s.input,) + tuple(s.args), dict(s.kwargs), fn=info.op,
                                   label=f"{name}#{i}{tag}"), targets, "opinfo"))
    return out


def _spread(n: int, k: Optional[int]) -> List[int]:
    """``k`` indices evenly spread over ``range(n)`` (all of them when ``k`` is ``None`` or ``>= n``)."""
    if k is None or k >= n:
        return list(range(n))
    if k <= 0:
        return []
    if k == 1:
        return [0]
    return sorted({round(j * (n - 1) / (k - 1)) for j in range(k)})


def hand_samples(ops: Optional[Iterable[str]] = None,
                 per_op: Optional[int] = None) -> List[Tuple[Sample, List[str], str]]:
    """The hand-written samples of :mod:`certblocks.testing.conformance_samples` (``per_op``: at most this many
    per op, evenly spread)."""
    from .conformance_samples import conformance_samples

    wanted = None if ops is None else {o.replace("::", ".") for o in ops}
    out: List[Tuple[Sample, List[str], str]] = []
    for op, samples in conformance_samples.items():
        if wanted is None or op in wanted:
            out += [(samples[i], [op], "hand") for i in _spread(len(samples), per_op)]
    return out
