"""The soundness harness of certblocks, a package: :mod:`.counterexamples` (split into modules next)."""

from .counterexamples import *  # noqa: F403
from .counterexamples import __all__, __doc__, _resolve_jvp  # noqa: F401
