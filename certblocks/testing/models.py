"""The counterexample search against a whole model's certificate (docs/theory.md section 6).

A :class:`~certblocks.certificate.StackCertificate` of a model (``certify(model, x).stack(dtype, r0=...)``)
promises, for every input of per-token norm at most ``r0`` (any token ids for an integer input):

* ``output``: the output's per-token norm is at most ``output_bound`` (the last state's ``R_n`` without a head);
* ``intermediate``: every entry the forward computes is at most the largest bound the certificate states
  (the radii, each segment's peak at its input radius, the output bound, the head's peak);
* ``peak``: every entry a segment computes is at most that segment's peak at its input radius
  (``updates[k].peak_bound(radii[k])``; the head's at ``radii[-1]``);
* ``gradient``: with a loss, the gradient of the loss in the model input has dual norm (the sum over rows of
  the Euclidean norm along the last dimension) at most ``lip_g * exp(sum(log_factors))``;
* ``state``: the state at each segment boundary ``k`` has per-token norm at most ``radii[k]``;
* ``costate``: with a loss, the gradient of the loss in that state has dual norm at most
  ``lip_g * exp(sum(log_factors[k:]))``.

:func:`search_model` tries to break each promise: random inputs on the sphere of the radius (the direction
families of :func:`~certblocks.testing.random_inputs`, and the example rescaled) or random token ids, then
Adam ascents on the log of the ratio value / bound with the input projected on the sphere (for token ids: a
hill climb that changes one id at a time).  ``output``, ``intermediate`` and ``gradient`` run the model
itself (the intermediates recorded by :func:`~certblocks.testing.largest_intermediate`); ``peak``, ``state``
and ``costate`` run the graph ``torch.export`` captures (the graph the certificate was derived from,
captured again in the search's dtype) and read the nodes the
:class:`~certblocks.trace.report.ModelCertificate` names: each segment's nodes and the boundaries between
segments.  That run also records every node the input reaches for ``intermediate`` (the only record for
token ids, which autograd does not reach).  Each input has the example's shape (the graph is specialized to
it): its per-token norm is taken over all its rows, batch included, as the certificate's is.
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._validation import check_choice
from ..certificate import StackCertificate
from ._constants import DEFAULT_RTOL, FAMILIES
from .counterexamples import _ascend
from .inputs import _check_count, _check_radius, _on_sphere, random_inputs, vector_norms
from .record import _Recorder
from .results import CheckResult, ModelSoundnessReport

#: The promises of a model certificate, in the order they are searched.
MODEL_CHECKS: Tuple[str, ...] = ("output", "intermediate", "peak", "gradient", "state", "costate")
LOSSES: Tuple[Optional[str], ...] = (None, "cross_entropy", "mse")

# (ratio, value, bound, where): ratio a float64 scalar tensor, differentiable when the evaluation is
Score = Tuple[Tensor, float, float, str]


def _row_norm(t: Tensor) -> Tensor:
    """The per-token norm of one whole tensor: the largest Euclidean norm along the last dimension."""
    t = t.to(torch.float64)
    return vector_norms(t.reshape(-1, t.shape[-1]), dim=-1).amax() if t.dim() else t.abs()


def _dual_norm(t: Tensor) -> Tensor:
    """The dual of the per-token norm: the sum over rows of the Euclidean norm along the last dimension."""
    t = t.to(torch.float64)
    return vector_norms(t.reshape(-1, t.shape[-1]), dim=-1).sum() if t.dim() else t.abs()


def _largest(t: Tensor) -> Tensor:
    """The largest ``|entry|``, masked attention logits (at or below ``finfo.min / 4``) left out."""
    return t.masked_fill(t <= torch.finfo(t.dtype).min / 4, 0.0).abs().amax().to(torch.float64)


def _first_tensor(out: Any) -> Tensor:
    from ..trace.capture import _flatten_output

    tensors = _flatten_output(out)
    if not tensors:
        raise ValueError(f"the model returned no tensor (got {type(out).__name__})")
    return tensors[0]


def _ratio(value: Tensor, bound: float) -> Tensor:
    """``value / bound``; ``inf`` for a non-finite value or a positive value over a zero bound."""
    if bound <= 0:
        return torch.where(value > 0, math.inf, 0.0).to(torch.float64) + 0.0 * value
    r = value / bound if math.isfinite(bound) else value * 0.0
    return torch.where(torch.isfinite(value), r, torch.full_like(r, math.inf))


def _math_attention() -> Any:
    """Fused attention through its math form: the ascents on gradients differentiate it twice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _exp_bound(log_bound: float) -> float:
    return math.exp(log_bound) if log_bound < 709.0 else math.inf


class _Graph:
    """The exported graph of the model, run with autograd, recording the boundary nodes and every node's peak."""

    def __init__(self, module: nn.Module, example: Tensor, kwargs: Dict[str, Any], names: Sequence[str],
                 leaf: str) -> None:
        from ..trace.capture import capture

        self.g = capture(module, (example,), kwargs)
        missing = [n for n in names if n and n not in self.g.index]
        if missing:
            raise ValueError(f"the graph captured for the search has no node {missing}: the model certificate was "
                             "not derived from this model and example")
        self.names, self.leaf = set(names), leaf
        self.dep = self.g.depends_on_input()
        ep, state = self.g.ep, self.g.ep.state_dict
        consts = getattr(ep, "constants", {}) or {}
        self.args: List[Any] = []
        self.slot = -1
        for k, spec in enumerate(ep.graph_signature.input_specs):  # the placeholders' order
            if spec.kind.name == "USER_INPUT":
                self.slot = k if self.slot < 0 else self.slot
                self.args.append(None)
            else:
                self.args.append(state[spec.target] if spec.target in state else consts.get(spec.target))

    def run(self, x: Tensor) -> Tuple[Tensor, Dict[str, Tensor], Dict[str, Tensor]]:
        """The output, the boundary values and the largest entry of each node the input reaches."""
        args = list(self.args)
        args[self.slot] = x
        seen: Dict[str, Tensor] = {}
        peaks: Dict[str, Tensor] = {}
        outer = self

        class _Run(torch.fx.Interpreter):
            def run_node(self, n: torch.fx.Node) -> Any:
                r = super().run_node(n)
                if n.name == outer.leaf and isinstance(r, Tensor):
                    r = r.detach().requires_grad_(True)
                if n.name in outer.names:
                    seen[n.name] = r
                if n.name in outer.dep and n.op != "placeholder":
                    found = [_largest(t) for t in torch.utils._pytree.tree_leaves(r)
                             if isinstance(t, Tensor) and t.is_floating_point() and t.numel()]
                    if found:
                        peaks[n.name] = torch.stack(found).amax()
                return r

        out = _Run(self.g.ep.graph_module).run(*args)
        return _first_tensor(out), seen, peaks


@dataclass
class _Worst:
    """The running worst case of one check."""

    check: str
    rtol: float
    radius: float
    ratio: float = -math.inf
    value: float = 0.0
    bound: float = math.nan
    where: str = ""
    input: Optional[Tensor] = None
    evaluations: int = 0

    def update(self, score: Score, x: Tensor) -> float:
        ratio = float(score[0].detach())
        ratio = math.inf if math.isnan(ratio) else ratio
        self.evaluations += 1
        if ratio > self.ratio:
            self.ratio, self.value, self.bound, self.where = ratio, score[1], score[2], score[3]
            self.input = x.detach().to("cpu").clone()
            if self.input.is_floating_point():
                self.input = self.input.to(torch.float64)
        return ratio

    def result(self) -> CheckResult:
        return CheckResult(self.check, max(self.ratio, 0.0), self.value, self.bound, self.radius,
                           None if self.input is None else self.input[None], None, self.evaluations, self.rtol,
                           self.where)


@dataclass
class _Boundary:
    """A segment boundary: its graph node, the state bound ``R_k`` and the costate bound there."""

    node: str
    label: str
    state: float
    costate_log: float


@dataclass
class _Search:
    """One model's search (see :func:`search_model`)."""

    f: nn.Module
    st: StackCertificate
    example: Tensor
    kwargs: Dict[str, Any]
    integer: bool
    radius: float
    loss: Optional[str]
    targets: Optional[Tensor]
    target_radius: float
    vocab: int
    gen: torch.Generator
    rtol: float
    graph: Optional[_Graph] = None
    boundaries: List[_Boundary] = field(default_factory=list)
    peaks: List[Tuple[List[str], float, str]] = field(default_factory=list)  # each segment's nodes, peak, label
    bounds: Dict[str, float] = field(default_factory=dict)
    output_like: Tensor = field(default_factory=lambda: torch.zeros(()))  # the output on the example

    # evaluation ----------------------------------------------------------------------------------------------
    def loss_of(self, y: Tensor, t: Tensor) -> Tensor:
        y = y.to(torch.float64)
        if self.loss == "cross_entropy":
            return F.cross_entropy(y.reshape(-1, y.shape[-1]), t.reshape(-1))
        return F.mse_loss(y, t.to(y.dtype))

    def draw_targets(self, y: Tensor) -> Tensor:
        if self.targets is not None:
            return self.targets
        if self.loss == "cross_entropy":
            return torch.randint(0, y.shape[-1], tuple(y.shape[:-1]), generator=self.gen)
        if self.target_radius == 0.0 or y.dim() == 0:
            return torch.zeros(y.shape, dtype=torch.float64)
        shape = tuple(y.shape) if y.dim() > 1 else (1, *y.shape)
        return random_inputs(shape, self.target_radius, 1, generator=self.gen)[0].reshape(y.shape)

    def evaluate(self, checks: Sequence[str], x: Tensor, t: Tensor, create_graph: bool) -> Dict[str, Score]:
        """Score ``x`` (one input of the example's shape) on ``checks``; differentiable when ``create_graph``."""
        out: Dict[str, Score] = {}
        peak: Optional[Score] = None
        if not self.integer and not x.requires_grad:
            x = x.detach().requires_grad_(True)
        with torch.enable_grad(), _math_attention():
            if not self.integer and {"output", "intermediate", "gradient"} & set(checks):
                with _Recorder(x) as mode:
                    y = _first_tensor(self.f(x, **self.kwargs))
                    mode.record(y)
                if "output" in checks:
                    v = _row_norm(y)
                    out["output"] = (_ratio(v, self.bounds["output"]), float(v.detach()), self.bounds["output"], "")
                if mode.values:
                    v = torch.stack(mode.values).amax()
                    peak = (_ratio(v, self.bounds["intermediate"]), float(v.detach()), self.bounds["intermediate"],
                            "the model's torch calls")
                if "gradient" in checks:
                    (grad,) = torch.autograd.grad(self.loss_of(y, t), x, create_graph=create_graph)
                    v = _dual_norm(grad)
                    out["gradient"] = (_ratio(v, self.bounds["gradient"]), float(v.detach()), self.bounds["gradient"],
                                       "the model input")
            if self.graph is not None and ({"intermediate", "peak", "state", "costate"} & set(checks) or (
                    self.integer and "output" in checks)):
                y, seen, peaks = self.graph.run(x)
                if self.integer and "output" in checks:
                    v = _row_norm(y)
                    out["output"] = (_ratio(v, self.bounds["output"]), float(v.detach()), self.bounds["output"], "")
                if "intermediate" in checks and peaks:
                    node = max(peaks, key=lambda k: float(peaks[k].detach()))
                    here = (_ratio(peaks[node], self.bounds["intermediate"]), float(peaks[node].detach()),
                            self.bounds["intermediate"], f"graph node {node}")
                    peak = here if peak is None or float(here[0].detach()) > float(peak[0].detach()) else peak
                if "peak" in checks:
                    items = [(peaks[n], bound, f"graph node {n} of {label}") for names, bound, label in self.peaks
                             for n in names if n in peaks]
                    out["peak"] = self.worst_boundary(items)
                if "state" in checks:
                    out["state"] = self.worst_boundary(
                        [(_row_norm(seen[b.node]), b.state, b.label) for b in self.boundaries])
                if "costate" in checks and self.loss is not None:
                    vals = [seen[b.node] for b in self.boundaries]
                    grads = torch.autograd.grad(self.loss_of(y, t), vals, create_graph=create_graph,
                                                allow_unused=True)
                    out["costate"] = self.worst_boundary(
                        [(_dual_norm(g) if g is not None else torch.zeros((), dtype=torch.float64),
                          _exp_bound(b.costate_log), b.label) for g, b in zip(grads, self.boundaries)])
        if peak is not None and "intermediate" in checks:
            out["intermediate"] = peak
        return out

    @staticmethod
    def worst_boundary(items: Sequence[Tuple[Tensor, float, str]]) -> Score:
        """The item with the largest ratio value / bound (a zero score when there is none: a chain of one segment has
        no inner boundary)."""
        if not items:
            return torch.zeros((), dtype=torch.float64), 0.0, 0.0, "no boundary"
        ratios = [_ratio(v, b) for v, b, _ in items]
        k = max(range(len(items)), key=lambda i: float(ratios[i].detach()))
        return ratios[k], float(items[k][0].detach()), items[k][1], items[k][2]

    # inputs --------------------------------------------------------------------------------------------------
    def draws(self, n: int, offset: int) -> Tensor:
        shape = tuple(self.example.shape)
        if self.integer:
            out = torch.randint(0, self.vocab, (n, *shape), generator=self.gen)
            for i in range(n):  # uniform ids; one id everywhere; two alternating ids
                fam = (i + offset) % 3
                if fam == 1:
                    out[i] = out[i].reshape(-1)[0]
                elif fam == 2:
                    flat = out[i].view(-1)
                    a, b = int(flat[0]), int(flat[-1])
                    flat[0::2], flat[1::2] = a, b
            return out.to(self.example.device)
        x = random_inputs(shape, self.radius, n, generator=self.gen, families=FAMILIES, offset=offset)
        return x.to(self.example.device, self.example.dtype)

    def run(self, checks: Sequence[str], count: int, restarts: int, from_best: int, steps: int,
            lr: float) -> ModelSoundnessReport:
        worst = {c: _Worst(c, self.rtol, math.nan if self.integer else self.radius) for c in checks}
        xs = self.draws(count, 0)
        if self.integer:
            xs = torch.cat([xs, self.example[None]])
        else:
            xs = torch.cat([xs, _on_sphere(self.example[None], self.radius)])
        ts = [self.draw_targets(self.output_like) for _ in range(xs.shape[0])]
        ranks: Dict[str, List[float]] = {c: [] for c in checks}
        for x, t in zip(xs, ts):
            scores = self.evaluate(checks, x, t, False)
            for c in checks:
                ranks[c].append(worst[c].update(scores[c], x))
        for c in checks:
            order = sorted(range(len(ranks[c])), key=lambda i: -ranks[c][i] if math.isfinite(ranks[c][i]) else 0.0)
            if not all(math.isfinite(r) for r in ranks[c]):
                continue  # a non-finite value is a counterexample already
            fresh = self.draws(restarts, 1 + count)
            starts = torch.cat([fresh, xs[order[:from_best]]])
            targets = [self.draw_targets(self.output_like) for _ in range(restarts)] + [ts[i] for i in
                                                                                          order[:from_best]]
            for x0, t in zip(starts, targets):
                if self.integer:
                    self.climb(c, x0, t, steps, worst[c])
                else:
                    self.ascend(c, x0, t, steps, lr, worst[c])
        return ModelSoundnessReport(type(self.f).__name__, tuple(worst[c].result() for c in checks))

    def ascend(self, check: str, x0: Tensor, t: Tensor, steps: int, lr: float, worst: _Worst) -> None:
        """Adam on ``log(ratio)`` with the input projected on the sphere of the radius."""
        z = _on_sphere(x0[None], math.sqrt(x0.shape[-1])).detach().requires_grad_(True)

        def step() -> Tuple[Tensor, bool]:
            x = _on_sphere(z, self.radius)[0]
            score = self.evaluate([check], x, t, True)[check]
            ratio = worst.update(score, x)
            return score[0].clamp_min(1e-300).log().reshape(1), math.isfinite(ratio)

        _ascend([z], step, steps, lr)

    def climb(self, check: str, x0: Tensor, t: Tensor, steps: int, worst: _Worst) -> None:
        """Token ids: change one id at a time, keeping each change that raises the ratio."""
        x = x0.clone()
        best = worst.update(self.evaluate([check], x, t, False)[check], x)
        flat_n = x.numel()
        for _ in range(steps):
            y = x.clone()
            k = int(torch.randint(0, flat_n, (1,), generator=self.gen))
            y.view(-1)[k] = int(torch.randint(0, self.vocab, (1,), generator=self.gen))
            r = worst.update(self.evaluate([check], y, t, False)[check], y)
            if r > best:
                x, best = y, r
            if not math.isfinite(r):
                return



def _vocab(model: nn.Module) -> Optional[int]:
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if isinstance(emb, nn.Embedding):
        return emb.num_embeddings
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    return None


def _forward_kwargs(model: nn.Module) -> Dict[str, Any]:
    """``use_cache=False`` for a model that takes it (HF), as the capture does."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in params else {}


def _boundaries(model_certificate: Any, st: StackCertificate, integer: bool) -> List[_Boundary]:
    """The boundaries ``k = 1 .. n`` of the chain (``n``: the head's input, when there is a head)."""
    from ..trace.report import ModelCertificate

    if not isinstance(model_certificate, ModelCertificate):
        raise TypeError(f"model_certificate must be a ModelCertificate, got {type(model_certificate).__name__}")
    if not model_certificate.chained:
        raise ValueError("model_certificate is not chained (its segments do not cover the model): no boundaries")
    segs = ([model_certificate.stem] if model_certificate.stem is not None else []) + list(model_certificate.segments)
    if len(segs) != len(st.updates):
        raise ValueError(f"the stack certificate has {len(st.updates)} segments, the model certificate {len(segs)}: "
                         "pass the stack of this model certificate")
    logs = [float(v) for v in st.log_factors]
    lip = math.log(st.lip_g) if st.lip_g > 0 else -math.inf
    out = [_Boundary(segs[k].input_node, f"boundary {k} (input of {segs[k].name or segs[k].input_node})",
                     float(st.radii[k]), lip + sum(logs[k:])) for k in range(1, len(segs))]
    head = model_certificate.head
    if head is not None:
        n = len(segs)
        out.append(_Boundary(head.input_node, f"boundary {n} (input of the head {head.name})", float(st.radii[n]),
                             lip))
    return out


def _segment_peaks(model_certificate: Any, st: StackCertificate) -> List[Tuple[List[str], float, str]]:
    """Each segment's graph nodes (its per-node table, and those of the model outputs computed from its input, its
    input left out) and its peak at its input radius."""
    segs = ([model_certificate.stem] if model_certificate.stem is not None else []) + list(model_certificate.segments)
    pairs = [(segs[k], st.updates[k].peak_bound(float(st.radii[k])), f"segment {k} ({segs[k].name})")
             for k in range(len(segs))]
    if model_certificate.head is not None and st.head is not None:
        pairs.append((model_certificate.head, st.head.peak_bound(float(st.radii[-1])),
                      f"the head ({model_certificate.head.name})"))
    outputs = list(getattr(model_certificate, "outputs", ()))
    return [([r.node for t in [tc] + [o for o in outputs if o.input_node == tc.input_node] for r in t.nodes
              if r.node != tc.input_node], float(bound), label)
            for tc, bound, label in pairs if bound is not None]


def _stated_bounds(st: StackCertificate, integer: bool) -> Dict[str, float]:
    radii = [float(r) for r in st.radii][1 if integer else 0:]
    peaks = [st.updates[k].peak_bound(float(st.radii[k])) for k in range(len(st.updates))]
    values = radii + [p for p in peaks if p is not None]
    output = float(st.output_bound) if st.head is not None else float(st.radii[-1])
    if st.head is not None:
        values.append(output)
        hp = st.head.peak_bound(float(st.radii[-1]))
        if hp is not None:
            values.append(hp)
    lip = math.log(st.lip_g) if st.lip_g > 0 else -math.inf
    return {"output": output, "intermediate": max(values),
            "gradient": _exp_bound(lip + sum(float(v) for v in st.log_factors))}


def search_model(model: nn.Module, stack_certificate: StackCertificate, example: Tensor, *,
                 model_certificate: Any = None, radius: Optional[float] = None, checks: Optional[Sequence[str]] = None,
                 count: int = 8, restarts: int = 2, from_best: int = 1, steps: int = 10, lr: float = 0.1,
                 loss: Optional[str] = None, targets: Optional[Tensor] = None, target_radius: float = 0.0,
                 vocab: Optional[int] = None, seed: int = 0, dtype: torch.dtype = torch.float64,
                 rtol: float = DEFAULT_RTOL) -> ModelSoundnessReport:
    """Search for an input that breaks a whole model's certificate (the checks are the module's).

    Args:
        model: the model (in eval mode); searched as a copy cast to ``dtype``.
        stack_certificate: ``certify(model, example).stack(dtype, r0=..., loss=...)``.
        example: the example input the certificate was derived from (float, or token ids); every input the
            search tries has its shape.
        model_certificate: the :class:`~certblocks.trace.report.ModelCertificate` the stack comes from: with
            it, the ``peak``, ``state`` and ``costate`` checks run on the nodes it names.
        radius: the per-token norm of the float inputs (default: the stack's ``r0``).
        checks: the checks to run among :data:`MODEL_CHECKS` (default: every check the arguments allow).
        count: random inputs scored.
        restarts: ascents (hill climbs for token ids) per check from fresh inputs.
        from_best: ascents per check from the best-scored inputs.
        steps: Adam steps (changed ids) per ascent.
        lr: Adam's learning rate (the ascent moves a direction whose entries are of order 1).
        loss: ``None``, ``"cross_entropy"`` (logits ``(..., classes)``, random integer targets, mean
            reduction) or ``"mse"`` (mean reduction): the loss the stack was certified with.
        targets: the targets of every input (default: drawn at random per input).
        target_radius: the per-token norm of the random MSE targets (the stack's ``target_radius``).
        vocab: the number of token ids (default: the model's input embedding's).
        seed: seed of every random draw; the search is deterministic.
        dtype: the floating dtype of the model copy and the inputs.
        rtol: the rounding allowance: a ratio above ``1 + rtol`` is a counterexample.

    Returns:
        The :class:`ModelSoundnessReport`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(stack_certificate, StackCertificate):
        raise TypeError(f"stack_certificate must be a StackCertificate, got {type(stack_certificate).__name__}")
    if not isinstance(example, Tensor) or example.dim() < 1:
        raise TypeError(f"example must be the example input tensor, got {type(example).__name__}")
    check_choice("loss", loss, LOSSES)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    for name, n in (("count", count), ("restarts", restarts), ("from_best", from_best), ("steps", steps),
                    ("seed", seed)):
        _check_count(name, n)
    st = stack_certificate
    integer = not (example.is_floating_point() or example.is_complex())
    radius = _check_radius(float(st.r0) if radius is None else radius)
    chained = model_certificate is not None
    allowed = ["output", "intermediate"] + (["peak"] if chained else []) + (
        ["gradient"] if loss is not None and not integer else []) + (["state"] if chained else []) + (
        ["costate"] if chained and loss is not None else [])
    wanted = list(allowed if checks is None else checks)
    bad = [c for c in wanted if c not in allowed]
    if bad:
        raise ValueError(f"checks {bad} cannot run here (with these arguments the search runs {allowed}; "
                         "gradient needs a loss and a float input, peak, state and costate a model_certificate)")
    if integer:
        vocab = _vocab(model) if vocab is None else vocab
        if vocab is None:
            raise ValueError("vocab must be given for token ids when the model has no nn.Embedding")
    f = copy.deepcopy(model).to(dtype).requires_grad_(False).eval()
    ex = example.detach().to(dtype) if not integer else example.detach()
    kwargs = _forward_kwargs(f)
    s = _Search(f, st, ex, kwargs, integer, radius, loss, targets, float(target_radius), int(vocab or 0),
                torch.Generator().manual_seed(seed), float(rtol))
    s.bounds = _stated_bounds(st, integer)
    if model_certificate is not None:
        s.boundaries = _boundaries(model_certificate, st, integer)
        s.peaks = _segment_peaks(model_certificate, st)
    if model_certificate is not None or integer:
        names = [b.node for b in s.boundaries]
        leaf = s.boundaries[0].node if integer and s.boundaries else ""
        s.graph = _Graph(f, ex, {}, names, leaf)
    with torch.no_grad():
        s.output_like = (s.graph.run(ex)[0] if s.graph is not None else _first_tensor(f(ex, **kwargs))).detach()
    return s.run(wanted, count, restarts, from_best, steps, lr)


def assert_model_sound(model: nn.Module, stack_certificate: StackCertificate, example: Tensor,
                       **kwargs: Any) -> ModelSoundnessReport:
    """:func:`search_model` (same arguments), raising ``AssertionError`` when it finds a counterexample.

    Raises:
        AssertionError: naming each failing check with its ratio, radius, where, value and bound; the report
            is the exception's ``report`` attribute.
    """
    report = search_model(model, stack_certificate, example, **kwargs)
    if not report.ok:
        lines = [f"the certificate of the model {report.name} is not sound ({stack_certificate.dtype}, "
                 f"r0 = {stack_certificate.r0:g})"]
        for r in report.failures:
            at = f" at {r.where}" if r.where else ""
            radius = f"radius {r.radius:.4g}" if math.isfinite(r.radius) else "token ids"
            lines.append(f"  {r.check} bound exceeded by a factor {r.ratio:.6g} at {radius}{at} "
                         f"(value {r.value:.6g} > bound {r.bound:.6g})")
        err = AssertionError("\n".join(lines))
        err.report = report  # type: ignore[attr-defined]
        raise err
    return report


__all__ = ["LOSSES", "MODEL_CHECKS", "assert_model_sound", "search_model"]
