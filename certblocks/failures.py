"""Where a chain of segments stops being certified, and what to change: :class:`Failure`, :func:`suggest_fix`.

:func:`locate_failure` reads a finished scan (:func:`certblocks.budget.scan_stack`) and names the failing
segment (or the head), the kind of failure and a fix in words (docs/theory.md section 4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

from . import budget as _budget
from ._format import fmt_num as _fmt_num

if TYPE_CHECKING:
    from .certificate import BlockCertificate

__all__ = ["Failure", "suggest_fix", "locate_failure", "head_gradient_failure"]


def suggest_fix(cert: BlockCertificate, kind: str) -> str:
    """A fix in words for a failing update or map (docs/theory.md section 4).

    Args:
        cert: the failing segment's certificate.
        kind: ``"forward"``, ``"backward"``, ``"intermediate"`` (an intermediate
            reaches ``M`` before the state does) or ``"unknown"``.
    """
    if cert.kind != "update" and cert.q is not None and cert.q <= 1 and kind != "unknown":
        what = "Jacobian" if kind == "backward" else "gain"
        where = "map" if cert.kind == "map" else "residual block"
        return (f"this {where}'s {what} is too large for the dtype whatever the depth: reduce its operator norm "
                "(rescale or normalize its weights, or normalize its output) or bound the input radius (the computed "
                "fixes say whether a wider dtype certifies it)")
    if kind == "intermediate":
        what = cert.peak.what if cert.peak is not None and cert.peak.what else "the largest intermediate"
        order = f" (it grows like ||x||^{cert.peak.q:g})" if cert.peak is not None else ""
        hint = (" -- normalize queries and keys (QK-norm bounds the logits)" if "logit" in what else
                " -- normalize or bound the inputs of the product that makes it")
        return f"bound {what}{order}{hint}; or a smaller input radius or fewer updates"
    if cert.fix:
        return cert.fix
    if kind == "unknown":
        return ("the exponents of this update were not derived: replace the primitive outside the class "
                "(exp of an argument of unknown sign, division, ...) or register an atom for it")
    if cert.q is not None and cert.q > 1:
        return (f"q = {cert.q:g} > 1: normalize the input of the primitive with the largest exponent (q -> 0) or "
                "swap it for a Lipschitz or bounded substitute (q -> 1), e.g. a sigmoid gate instead of SiLU")
    if kind == "backward" and cert.sigma is not None and cert.sigma > 0:
        return (f"sigma = {cert.sigma:g} > 0: bound the culprit -- normalize the branch input (sigma -> 0), or for "
                "attention normalize queries and keys (QK-norm removes the R^2 term); or a smaller dt or fewer "
                "updates")
    return ("the coefficients are too large for this depth: reduce the operator norms (c, l0), the step dt or the "
            "depth")


@dataclass(frozen=True)
class Failure:
    """Where a chain stops being certified.

    Attributes:
        index: the failing segment (0-based, into :attr:`StackCertificate.updates`; ``len(updates)`` for
            the head).
        name: that segment's name.
        kind: ``"forward"``, ``"backward"`` or ``"unknown"`` (exponents not derived).
        reason: a sentence saying what fails.
        fix: what to change.
        segment: the failing segment's kind (``"update"``, ``"map"``, ``"block"`` or ``"head"``).
    """

    index: int
    name: str
    kind: str
    reason: str
    fix: str
    segment: str = "update"

    def to_dict(self) -> Dict[str, Any]:
        return {"index": self.index, "name": self.name, "kind": self.kind, "segment": self.segment,
                "reason": self.reason, "fix": self.fix}


def _describe(k: int, cert: BlockCertificate) -> str:
    culprit = f", culprit: {cert.culprit}" if cert.culprit else ""
    what = {"update": "update", "map": "map", "block": "residual block"}[cert.kind]
    return f"{what} {k} ({cert.name or 'unnamed'}) with {cert.exponents}{culprit}"


def locate_failure(certs: Sequence[BlockCertificate], dtype: str, k: int, scan: _budget.StackScan,
                   unknown: Optional[int], fwd_seg: int, bwd_seg: int, head: Optional[BlockCertificate]) -> Failure:
    """The failure at segment ``k`` (``len(certs)``: the head)."""
    M = _budget.float_max(dtype)
    n = len(certs)
    if k == n:  # every segment passes; the head's output or intermediates reach M
        assert head is not None  # segment n is the head: the scan gives k == n only with one
        R = _fmt_num(scan.radii[-1])
        if scan.forward_intermediate:
            what = head.peak.what if head.peak is not None and head.peak.what else "an intermediate value"
            reason = (f"{what} of the head '{head.name or 'head'}' can reach M = {M:.4g} at the last state's radius "
                      f"R_{n} = {R}: the head is not certified at any depth of this chain")
            return Failure(n, head.name, "forward", reason, suggest_fix(head, "intermediate"), "head")
        reason = (f"the output bound {_fmt_num(scan.output_bound)} of the head '{head.name or 'head'}' reaches "
                  f"M = {M:.4g} at the last state's radius R_{n} = {R}")
        return Failure(n, head.name, "forward", reason, suggest_fix(head, "forward"), "head")
    cert = certs[k]
    seg = cert.kind
    at = (f"at depth {sum(1 for c in certs[:k + 1] if c.is_update)}" if cert.is_update
          else "whatever the depth (a map is not a residual update: it is not certified at any depth)")
    if unknown is not None and k == unknown and k <= fwd_seg and k <= bwd_seg:
        missing = "q and sigma" if cert.q is None and cert.sigma is None else ("q" if cert.q is None else "sigma")
        reason = f"{_describe(k, cert)} has {missing} not derived"
        return Failure(k, cert.name, "unknown", reason, suggest_fix(cert, "unknown"), seg)
    if fwd_seg <= bwd_seg and scan.forward_intermediate and k + 1 == scan.forward_overflow:
        what = cert.peak.what if cert.peak is not None and cert.peak.what else "an intermediate value"
        state = " (the state itself stays below M there)" if scan.radii[k + 1] < M else ""
        reason = (f"{what} of {_describe(k, cert)} can reach M = {M:.4g} {at}: its bound "
                  f"{_fmt_num(cert.peak_bound(scan.radii[k]))} at the input radius R_{k} = {_fmt_num(scan.radii[k])}"
                  f"{state}")
        return Failure(k, cert.name, "forward", reason, suggest_fix(cert, "intermediate"), seg)
    if fwd_seg <= bwd_seg:
        reason = f"the forward bound reaches M = {M:.4g} {at}, after {_describe(k, cert)}"
        # A superlinear segment upstream is the culprit of a forward failure: name the first with the largest q.
        qs = [u.q if u.q is not None else -1.0 for u in certs[: k + 1]]
        worst = qs.index(max(qs))
        if qs[worst] > 1 and worst != k:
            reason += f"; the superlinear growth comes from {_describe(worst, certs[worst])}"
            return Failure(k, cert.name, "forward", reason, suggest_fix(certs[worst], "forward"), seg)
        return Failure(k, cert.name, "forward", reason, suggest_fix(cert, "forward"), seg)
    jac = _fmt_num(cert.jacobian_bound(scan.radii[k]))
    reason = (f"the backward (gradient) bound reaches M = {M:.4g} {at}, after {_describe(k, cert)} "
              f"whose Jacobian bound on the reachable ball is L(R_{k}) <= {jac}")
    if head is not None:
        reason += f" (with Lip(G) of the head '{head.name or 'head'}' in the budget)"
    # Name the segment with the largest factor as the culprit of a backward failure.
    factors = scan.log_factors[: k + 1]
    worst = max(range(len(factors)), key=lambda i: -math.inf if math.isnan(factors[i]) else factors[i])
    if worst != k:
        reason += f"; the largest factor comes from {_describe(worst, certs[worst])}"
    return Failure(k, cert.name, "backward", reason, suggest_fix(certs[worst], "backward"), seg)


def head_gradient_failure(head: BlockCertificate, n: int, lip_g: float, loss_grad: float, radius: float,
                          M: float) -> Failure:
    """The head's ``Lip(G)`` reaches ``M``: the gradient at the model output itself can overflow."""
    reason = (f"the head '{head.name or 'head'}' has Lip(G) >= {lip_g:.4g} on the reachable ball (its Jacobian "
              f"bound at R_{n} = {_fmt_num(radius)} times the loss gradient {loss_grad:g}): the gradient at the "
              f"model output can reach M = {M:.4g}, so the head is not certified at any depth")
    return Failure(n, head.name, "backward", reason, suggest_fix(head, "backward"), "head")
