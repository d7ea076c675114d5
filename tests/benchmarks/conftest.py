"""The benchmark scripts are not a package: put ``benchmarks/`` on ``sys.path`` for these tests."""

from __future__ import annotations

import os
import sys

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
if _BENCH not in sys.path:
    sys.path.insert(0, _BENCH)
