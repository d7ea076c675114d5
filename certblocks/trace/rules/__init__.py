"""The tracer's per-op rules (THEORY.md section 2), one module per family, registered by op name.

Importing this package registers every rule with :func:`register_rule`; the interpreter finds them
with :func:`rule_for`.

* :mod:`.structural` -- copies, casts, views, permutes, selections, cat, pad;
* :mod:`.pointwise` -- activations, clamps, ``exp``, powers, entrywise ops outside the class;
* :mod:`.arithmetic` -- add/sub, mul, where, addcmul, lerp;
* :mod:`.division` -- div and addcdiv, by constants or by denominators with a proven positive minimum;
* :mod:`.indexing` -- gather, index_select, index, and writes into a slice (slice_scatter, select_scatter);
* :mod:`.selection` -- topk, sort, cummax/cummin, entrywise maximum/minimum and clamps between tensors;
* :mod:`.linalg` -- linear, matmul, addmm, einsum, convolutions, FFTs;
* :mod:`.reductions` -- sum/mean, max/min/logsumexp, norms, cumsum, pooling;
* :mod:`.normalizations` -- layer/RMS/group/batch norm and the recognizer of normalizations written out;
* :mod:`.attention` -- softmax, log_softmax, fused attention and the recognizer of a written-out softmax;
* :mod:`.scan` -- the selective scan (``certblocks::selective_scan``).
"""

from .registry import Rule, register_rule, registered_rules, rule_for  # noqa: I001  (the registry first)
from . import structural, pointwise, normalizations, attention, arithmetic, linalg, reductions, scan  # noqa: F401
from . import division, indexing, selection  # noqa: F401

__all__ = ["Rule", "register_rule", "registered_rules", "rule_for"]
