"""The tracer: certify any ``nn.Module`` from its graph (docs/theory.md sections 2 and 4).

``certify(module, example_input)`` captures the module with ``torch.export`` (aten level), applies
one rule per op and the atom recognizers, finds the residual updates ``X + f(X)`` and returns
their certificates (exponents, sound coefficients, the culprit and a fix).

Layout: :mod:`.capture` (the graph), :mod:`.values` (abstract values), :mod:`.nodes` (reading aten
nodes), :mod:`.rules` (one rule per op, by family, in a registry), :mod:`.atoms` (collapsed
sub-graphs), :mod:`.interp` (the walk and the dispatch), :mod:`.residual` (finding the velocities),
:mod:`.collapse` (coefficients and peak), :mod:`.diagnosis` (culprit and fix), :mod:`.report`
(the certificates), :mod:`.api` (``certify``).
"""

from ..bounds.poly import Poly
from .api import certify, certify_velocity
from .atoms import Atom, register_atom, registered_atoms, unregister_atom
from .capture import CapturedGraph, CaptureError, capture
from .report import NOT_DERIVED, ModelCertificate, NodeRow, TraceCertificate
from .residual import find_residual_updates

__all__ = [
    "certify",
    "certify_velocity",
    "find_residual_updates",
    "register_atom",
    "unregister_atom",
    "registered_atoms",
    "Atom",
    "capture",
    "CapturedGraph",
    "CaptureError",
    "Poly",
    "TraceCertificate",
    "ModelCertificate",
    "NodeRow",
    "NOT_DERIVED",
]
