"""The benchmark scripts are not a package: put ``benchmarks/``, ``benchmarks/experiments/`` and
``benchmarks/tools/`` on ``sys.path`` for these tests (this conftest covers tests/benchmarks/experiments too)."""

from __future__ import annotations

import os
import sys

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
for _sub in ("tools", "experiments", ""):
    _path = os.path.normpath(os.path.join(_BENCH, _sub))
    if _path not in sys.path:
        sys.path.insert(0, _path)
