"""Certificates produced by the tracer: one velocity (:class:`TraceCertificate`) or a whole model
(:class:`ModelCertificate`), with the culprit, a suggested fix and a per-node table."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

from ..certificate import BlockCertificate, StackCertificate, certify_stack, json_number
from ..exponents import Exponents
from .values import AValue

__all__ = ["NodeRow", "TraceCertificate", "ModelCertificate", "NOT_DERIVED", "jsonable"]

#: Coefficient reported when no finite bound was derived (the certificate stays sound: it is huge).
NOT_DERIVED = sys.float_info.max


def _fmt(x: Optional[float]) -> str:
    return "?" if x is None else f"{x:g}"


@dataclass(frozen=True)
class NodeRow:
    """One row of the per-node table."""

    node: str
    op: str
    module: str
    q: Optional[float]
    sigma: Optional[float]
    rule: str
    growth: str
    jacobian: str
    note: str = ""

    def to_dict(self) -> Dict[str, Any]:
        return {"node": self.node, "op": self.op, "module": self.module, "q": self.q, "sigma": self.sigma,
                "rule": self.rule, "growth": self.growth, "jacobian": self.jacobian, "note": self.note}


@dataclass
class TraceCertificate:
    """The certificate of one velocity derived from its graph.

    Attributes:
        name: module path of the velocity (e.g. ``"blocks.3.attn"``) or the module's class name.
        certificate: the :class:`~certblocks.certificate.BlockCertificate` (coefficients are sound
            upper bounds in the per-token norm; :data:`NOT_DERIVED` when no finite bound was derived).
        culprit: the node (and module) responsible for the exponents, with the reason.
        culprit_node: that node's name in the exported graph.
        suggestion: a fix in words (THEORY.md section 4).
        nodes: the per-node table, in topological order.
        coefficients_derived: whether c, b, l1, l0 are finite derived bounds.
        input_node, output_node: the graph nodes of the velocity's input and output.
    """

    name: str
    certificate: BlockCertificate
    culprit: str
    culprit_node: str
    suggestion: str
    nodes: List[NodeRow]
    coefficients_derived: bool
    input_node: str = ""
    output_node: str = ""
    input_shape: Sequence[int] = field(default_factory=tuple)

    @property
    def exponents(self) -> Exponents:
        return self.certificate.exponents

    @property
    def q(self) -> Optional[float]:
        return self.certificate.q

    @property
    def sigma(self) -> Optional[float]:
        return self.certificate.sigma

    def explain(self) -> str:
        """A readable per-node table, then the certificate, the culprit and the fix."""
        cols = ("node", "op", "module", "(q, sigma)", "rule", "N bound", "J bound")
        rows = [(r.node, r.op, r.module or "-", f"({_fmt(r.q)}, {_fmt(r.sigma)})", r.rule + (f" [{r.note}]"
                 if r.note else ""), r.growth, r.jacobian) for r in self.nodes]
        widths = [min(60, max(len(c), *(len(x[i]) for x in rows))) if rows else len(c) for i, c in enumerate(cols)]

        def line(r):
            return "  ".join(s[:w].ljust(w) for s, w in zip(r, widths)).rstrip()
        out = [f"velocity {self.name or '-'}: input {self.input_node} {tuple(self.input_shape)}, "
               f"output {self.output_node}", line(cols), line(tuple("-" * w for w in widths))]
        out += [line(r) for r in rows]
        out.append(str(self.certificate))
        if not self.coefficients_derived:
            out.append("coefficients: not derived (reported as the largest float)")
        if self.culprit:
            out.append(f"culprit: {self.culprit}")
        if self.suggestion:
            out.append(f"fix: {self.suggestion}")
        return "\n".join(out)

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "q": self.q, "sigma": self.sigma, "certificate": self.certificate.to_dict(),
                "coefficients_derived": self.coefficients_derived, "culprit": self.culprit,
                "culprit_node": self.culprit_node, "suggestion": self.suggestion,
                "input_node": self.input_node, "output_node": self.output_node,
                "nodes": [r.to_dict() for r in self.nodes]}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(jsonable(self.to_dict()), **kwargs)

    def __str__(self) -> str:
        s = str(self.certificate)
        if self.culprit:
            s += f"; culprit: {self.culprit}"
        return s


@dataclass
class ModelCertificate:
    """Certificates of the residual updates of a model, in depth order.

    Attributes:
        updates: one :class:`TraceCertificate` per residual update ``X + f(X)`` (the velocity ``f``).
        model: the model's class name.
        strict: which ``torch.export`` mode captured the graph.
    """

    updates: List[TraceCertificate]
    model: str = ""
    strict: bool = False

    def __len__(self) -> int:
        return len(self.updates)

    def __iter__(self) -> Iterator[TraceCertificate]:
        return iter(self.updates)

    def __getitem__(self, k: Any) -> TraceCertificate:
        if isinstance(k, str):
            for u in self.updates:
                if u.name == k:
                    return u
            raise KeyError(f"no update named {k!r}; names: {[u.name for u in self.updates]}")
        return self.updates[k]

    @property
    def names(self) -> List[str]:
        return [u.name for u in self.updates]

    @property
    def certificates(self) -> List[BlockCertificate]:
        return [u.certificate for u in self.updates]

    def stack(self, dtype: object, *, r0: float = 1.0, dt: float = 1.0, lip_g: float = 1.0) -> StackCertificate:
        """Certify the stack of these updates (:func:`certblocks.certificate.certify_stack`)."""
        return certify_stack(self.certificates, dtype, dt=dt, r0=r0, lip_g=lip_g)

    def explain(self) -> str:
        out = [f"{self.model}: {len(self.updates)} residual updates"]
        w = max([len(u.name) for u in self.updates] + [6])
        for k, u in enumerate(self.updates):
            c = u.certificate
            coef = (f"c={c.c:.4g} b={c.b:.4g} l1={c.l1:.4g} l0={c.l0:.4g}" if u.coefficients_derived
                    else "coefficients not derived")
            out.append(f"{k:3d}  {u.name.ljust(w)}  {str(u.exponents):22s}  {coef}"
                       + (f"  culprit: {u.culprit}" if u.culprit and (u.q is None or u.q > 1 or (u.sigma or 0) > 0)
                          else ""))
        return "\n".join(out)

    def to_dict(self) -> Dict[str, Any]:
        return {"model": self.model, "strict": self.strict, "depth": len(self.updates),
                "updates": [u.to_dict() for u in self.updates]}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(jsonable(self.to_dict()), **kwargs)

    def __str__(self) -> str:
        return self.explain()


def jsonable(x: Any) -> Any:
    """``x`` with every float made JSON-safe (inf -> ``"inf"``, NaN -> ``None``), through dicts, lists and tuples."""
    if isinstance(x, float):
        return json_number(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def node_row(node: Any, av: AValue, module: str, op: str) -> NodeRow:
    return NodeRow(node.name, op, module, av.exps.q, av.exps.sigma, av.rule,
                   repr(av.growth) if av.growth is not None else "?",
                   repr(av.jacobian) if av.jacobian is not None else "?", av.bad)
