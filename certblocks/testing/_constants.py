"""The harness's defaults (the checks, radii, rounding allowance, direction families) and its type aliases."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

#: The promises of a certificate, in the order they are searched.
CHECKS: Tuple[str, ...] = ("growth", "jacobian", "peak")
#: Radii searched by default: tiny, below 1, about 1, large and very large.
DEFAULT_RADII: Tuple[float, ...] = (1e-3, 0.1, 1.0, 10.0, 1e3)
#: Rounding allowance: a ratio above ``1 + rtol`` is a counterexample (float64 arithmetic).
DEFAULT_RTOL: float = 1e-7
#: Direction families of the random draws (draw ``i`` comes from family ``i mod len(families)``).
FAMILIES: Tuple[str, ...] = ("gaussian", "dominant_token", "equal_tokens", "constant_features", "sparse_tokens",
                             "quiet_last", "axis")
_DEFAULT_COUNT: Dict[str, int] = {"growth": 64, "jacobian": 16, "peak": 32}

Velocity = Callable[[Tensor], Tensor]
Example = Union[Tensor, Sequence[int]]
Device = Optional[Union[str, torch.device]]
