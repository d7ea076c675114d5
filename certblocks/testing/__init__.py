"""Counterexample search against a certificate: the soundness harness of certblocks.

A :class:`~certblocks.certificate.BlockCertificate` makes three promises about a velocity ``v``, for
every state ``x`` (docs/theory.md sections 1 and 6):

* **growth**: ``||v(x)|| <= c ||x||^q + b``;
* **Jacobian**: ``||dv(x)|| <= l1 max(R, 1)^sigma + l0`` whenever ``||x|| <= R``;
* **peak**: every entry of every tensor ``v`` computes from ``x`` (its output included) is at most
  ``peak_bound(||x||)`` in absolute value.

``||.||`` is the per-token norm (the largest Euclidean norm of a token's feature vector; the last
dimension holds the features, every other dimension but the batch indexes tokens) and ``||dv(x)||``
the operator norm it induces.  This module tries hard to break a promise, in float64 by default:
random states at several radii, drawn from direction families that reach the bounds of the shipped
blocks (:data:`FAMILIES`: one dominant token, all tokens equal so that every attention logit row
ties, near-constant features, ...), then gradient ascent (Adam) on the ratio of the value to its
bound with the state projected on the sphere of the radius.  The Jacobian's norm is estimated from
below by an alternating (power-iteration) maximization with Jacobian-vector and vector-Jacobian
products (:func:`jacobian_norm_lower`); intermediates are recorded by a ``TorchFunctionMode``
(:func:`largest_intermediate`).  A search is deterministic for a given ``seed``::

    import certblocks.testing

    certblocks.testing.assert_sound(block, block.certificate(seq_len=8), (8, 64))

:func:`assert_sound` raises ``AssertionError`` naming the check, the ratio and the radius of a
counterexample; :func:`search` returns the :class:`SoundnessReport` without raising;
:func:`search_growth`, :func:`search_jacobian` and :func:`search_peak` run one check with its own
settings.  :func:`search_model` and :func:`assert_model_sound` search a whole model against its
stack certificate (output, every intermediate, the gradient, the state and costate at each segment
boundary; :mod:`certblocks.testing.models`).  :func:`mamba_ssm_on_cpu` runs mamba-ssm's models on a machine
without CUDA (:mod:`certblocks.testing.mamba_cpu`).  Finding nothing is evidence, not proof; the harness's own
tests plant wrong certificates and check that it finds them.  ``v`` must map a batch ``(B, *shape)`` to
``(B, ..., features)`` sample by sample (a module in eval mode): this is checked.  ``import certblocks`` does not import
this module.
"""

from ._constants import CHECKS, DEFAULT_RADII, DEFAULT_RTOL, FAMILIES
from .counterexamples import assert_sound, search, search_growth, search_jacobian, search_peak
from .inputs import random_inputs, token_norm
from .jacobian import _resolve_jvp, jacobian_norm_lower  # noqa: F401  (_resolve_jvp: read by the tests)
from .mamba_cpu import install_selective_scan_stub, mamba_cpu_config, mamba_ssm_on_cpu
from .models import LOSSES, MODEL_CHECKS, assert_model_sound, search_model
from .record import as_atom, largest_intermediate
from .results import CheckResult, ModelSoundnessReport, SoundnessReport

__all__ = ["CHECKS", "DEFAULT_RADII", "DEFAULT_RTOL", "FAMILIES", "LOSSES", "MODEL_CHECKS", "CheckResult",
           "ModelSoundnessReport", "SoundnessReport", "as_atom", "assert_model_sound", "assert_sound",
           "install_selective_scan_stub", "jacobian_norm_lower", "largest_intermediate", "mamba_cpu_config",
           "mamba_ssm_on_cpu", "random_inputs", "search", "search_growth", "search_jacobian",
           "search_model", "search_peak", "token_norm"]

# OpInfo conformance of the tracer's rules: certblocks.testing.conformance, imported on first use (it imports the
# tracer, and `python -m certblocks.testing.conformance` must not find it imported by the package)
_CONFORMANCE = ("ConformanceReport", "Sample", "check_rule", "run_conformance")
__all__ += list(_CONFORMANCE)


def __getattr__(name: str) -> object:
    if name in _CONFORMANCE:
        from . import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
