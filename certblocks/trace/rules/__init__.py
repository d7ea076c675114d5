"""The tracer's per-op rules (docs/theory.md section 2), one module per family, registered by op name.

Importing this package registers every rule with :func:`register_rule`, each with what it reads of its
ops' schemas; the interpreter finds them with :func:`rule_for` and checks each call with :func:`check_call`
before the rule runs (:mod:`.registry` describes the declarations; :func:`rule_spec` returns them).

* :mod:`.structural` -- copies, casts, views, permutes, selections, cat, pad;
* :mod:`.pointwise` -- activations, clamps, ``exp``, powers, entrywise ops outside the class;
* :mod:`.arithmetic` -- add/sub, mul, where, addcmul, lerp;
* :mod:`.division` -- div and addcdiv, by constants or by denominators with a proven positive minimum, and
  reciprocal, rsqrt and sqrt of such a denominator;
* :mod:`.lower_bounds` -- the proven minimum of a tensor (a denominator, a root's argument): top-k masses of
  probabilities, max-shifted exponentials, columns of nonnegative products, sums, casts (no rules of its own);
* :mod:`.linear_attention` -- the recognizer of a normalized linear attention ``(W V) / (W 1 + eps)`` (used by div);
* :mod:`.indexing` -- gather, index_select, index, and writes into a slice (slice_scatter, select_scatter);
* :mod:`.selection` -- topk, sort, cummax/cummin, entrywise maximum/minimum and clamps between tensors;
* :mod:`.linalg` -- linear, matmul, addmm, einsum, convolutions, FFTs;
* :mod:`.reductions` -- sum/mean, max/min/logsumexp, norms, cumsum, pooling;
* :mod:`.normalizations` -- layer/RMS/group/batch norm and the recognizer of normalizations written out;
* :mod:`.attention` -- softmax, log_softmax, fused attention and the recognizer of a written-out softmax;
* :mod:`.scan` -- the selective scan (``certblocks::selective_scan``).
"""

from .registry import (  # noqa: I001  (the registry first)
    INERT_ARGUMENTS, Rule, RuleSpec, check_call, register_rule, registered_rules, rule_for, rule_spec)
from . import structural, pointwise, normalizations, attention, arithmetic, linalg, reductions, scan  # noqa: F401
from . import division, indexing, selection  # noqa: F401

__all__ = ["INERT_ARGUMENTS", "Rule", "RuleSpec", "check_call", "register_rule", "registered_rules", "rule_for",
           "rule_spec"]
