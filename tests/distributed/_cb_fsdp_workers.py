"""Worker of tests/distributed/test_fsdp.py (run in spawned gloo processes; imported by name).

Each scenario shards a seeded model with FSDP2 (``fully_shard`` on every block, then the root), counts the FSDP units
unsharded at once (a wrapper of ``FSDPModule.unshard`` that, after each call, counts the units whose parameters are
not ``DTensor`` shards), and returns plain data the parent compares with one process on the unsharded model.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Dict, Iterator, List

import torch
from torch import nn

WORLD = 2
DTYPES = ("fp16", "bf16", "fp32")
STEPS = 3


def hf_model(kind: str, layers: int) -> nn.Module:
    """A tiny seeded Hugging Face causal LM (identical in every process), in eval mode."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    else:
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=layers, n_head=4, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def example_ids() -> torch.Tensor:
    return torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))


def blocks(model: nn.Module) -> List[nn.Module]:
    """The transformer blocks of a Hugging Face model or a zoo model."""
    inner = getattr(model, "model", None) or getattr(model, "transformer")  # noqa: B009
    return list(getattr(inner, "layers", None) or getattr(inner, "h"))  # noqa: B009


def unsharded_units(model: nn.Module) -> int:
    """How many FSDP units of ``model`` hold their parameters unsharded now (not ``DTensor`` shards)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    def own(m: nn.Module) -> Iterator[torch.Tensor]:  # a unit's parameters: not those of the units inside it
        yield from m.parameters(recurse=False)
        for c in m.children():
            if not isinstance(c, FSDPModule):
                yield from own(c)

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return sum(1 for u in units if any(not isinstance(p, DTensor) for p in own(u)))


@contextlib.contextmanager
def counting(model: nn.Module, seen: Dict[str, int]) -> Iterator[None]:
    """Count ``FSDPModule.unshard`` calls and the most units unsharded at once right after one (``seen``)."""
    from torch.distributed.fsdp import FSDPModule

    orig = FSDPModule.unshard

    def unshard(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        seen["calls"] += 1
        seen["peak"] = max(seen["peak"], unsharded_units(model))
        return out

    FSDPModule.unshard = unshard  # type: ignore[method-assign]
    try:
        yield
    finally:
        FSDPModule.unshard = orig  # type: ignore[method-assign]


def shard(model: nn.Module, units: List[nn.Module]) -> None:
    from torch.distributed.fsdp import fully_shard

    for blk in units:
        fully_shard(blk)
    fully_shard(model)


def certify(rank: int, kind: str, layers: int) -> Dict[str, Any]:
    """The FSDP2 model certified with :func:`certblocks.checkpoint.certify_ranks`, its stacks, what was unsharded."""
    from torch.distributed.tensor import DTensor

    from certblocks.checkpoint import certify_ranks

    model = hf_model(kind, layers)
    shard(model, blocks(model))
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    seen = {"calls": 0, "peak": 0}
    with counting(model, seen):
        rep = certify_ranks(model, example_ids())
        after = unsharded_units(model)
        stacks = {d: rep.stack(d) for d in DTYPES}  # fp16 reads every layer again, a unit at a time
    return {"report": rep.to_dict(), "stacks": stacks, "segments": [(s.name, s.certificate)
                                                                    for s in rep.all_segments()],
            "sharded": sharded, "seen": seen, "after": after, "after_stacks": unsharded_units(model),
            "units": len(blocks(model)) + 1}


def monitor(rank: int, kind: str) -> Dict[str, Any]:
    """The monitor on an FSDP2 model (the zoo model: each block and the root sharded; the stack: its root), SGD
    steps on the global batch, ``monitor.step()`` called as on one process: no ``unshard()`` / ``reshard()``."""
    from torch.distributed.tensor import DTensor

    from certblocks.monitor import CertificateMonitor

    workers = importlib.import_module("_cb_dist_workers")
    model = workers.build(kind)
    shard(model, list(model.transformer.h) if kind == "zoo" else [])
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    mon = CertificateMonitor(model, "fp32", every=1, threshold=-1e9, kappa_growth=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen, losses, after = {"calls": 0, "peak": 0}, [], []
    for s in range(STEPS):
        x, y = workers.batch(kind, s)
        opt.zero_grad()
        loss = workers.loss_of(kind, model, x, y)
        loss.backward()
        with counting(model, seen):
            mon.step()
        after.append(unsharded_units(model))
        opt.step()
        losses.append(float(loss.detach()))
    return {"records": mon.records, "weights": workers.weights(model), "losses": losses, "sharded": sharded,
            "seen": seen, "after": after, "units": 1 + (len(model.transformer.h) if kind == "zoo" else 0)}


def entry(scenario: str, rank: int, port: int, out_dir: str, kwargs: Dict[str, Any]) -> None:
    """Process entry: a scenario of this module run by tests/distributed's common entry point (it joins the gloo
    group of :data:`WORLD` ranks, writes ``<out_dir>/<rank>.pt``, or ``<rank>.err`` with a traceback)."""
    workers = importlib.import_module("_cb_dist_workers")
    workers.SCENARIOS.update({"fsdp_certify": certify, "fsdp_monitor_unassisted": monitor})
    workers.entry(scenario, rank, port, out_dir, kwargs)
