"""Worker functions of tests/distributed (run in spawned processes; importable by name, see the test module).

Each scenario builds the same seeded model as the single-process reference of the test module
(:func:`build`), runs a few training steps under DDP or FSDP2 and returns plain data (monitor records,
weights, flags) that the parent process compares across ranks and with the single-process run.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

WORLD = 2
STEPS = 3


# ---------------------------------------------------------------------------------------------- shared setup
def build(kind: str) -> nn.Module:
    """The model of a scenario, seeded (identical in every process)."""
    import certblocks
    from certblocks.blocks import MLP, GatedMLP, QKNormAttention

    torch.manual_seed(0)
    if kind == "stack":
        blocks = [QKNormAttention(16, 2), MLP(16, 32), QKNormAttention(16, 2), GatedMLP(16, 24, bias=True)]
        return certblocks.build_stack(blocks, "fp32", dt=0.5, certify=False)
    if kind == "zoo":
        from certblocks.zoo import create_model

        return create_model("gpt2_qknorm_test")
    raise ValueError(kind)


def batch(kind: str, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: ``(inputs, targets)``, 4 samples."""
    g = torch.Generator().manual_seed(100 + step)
    if kind == "stack":
        return torch.randn(4, 6, 16, generator=g) * 2.0, torch.randn(4, 6, 16, generator=g)
    idx = torch.randint(0, 64, (4, 17), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def loss_of(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "stack":
        return (model(x) - y).square().mean()
    return model(x, y)[1]


def local(x: torch.Tensor, rank: int, shard: bool) -> torch.Tensor:
    """This rank's part of the global batch (all of it when ``shard`` is false)."""
    if not shard:
        return x
    n = x.shape[0] // WORLD
    return x[rank * n:(rank + 1) * n]


def weights(model: nn.Module) -> Dict[str, torch.Tensor]:
    sd = model.module.state_dict() if hasattr(model, "module") else model.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in sd.items()}


# ---------------------------------------------------------------------------------------------- entry point
def entry(scenario: str, rank: int, port: int, out_dir: str, kwargs: Dict[str, Any]) -> None:
    """Process entry: join the gloo group, run ``scenario``, save its result as ``<out_dir>/<rank>.pt``."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
        result = SCENARIOS[scenario](rank, **kwargs)
        dist.barrier()
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()  # every rank has saved its result
    except BaseException:
        with open(os.path.join(out_dir, f"{rank}.err"), "w") as fh:
            fh.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Done: leave without the interpreter's teardown, where gloo's threads sometimes abort the process
    # ("terminate called without an active exception", exit -6) after a complete, saved run on a busy machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------- DDP
def ddp_monitor(rank: int, kind: str, shard: bool) -> Dict[str, Any]:
    """DDP, the monitor on the DDP wrapper, SGD steps; each rank sees the global batch or its half of it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from certblocks.monitor import CertificateMonitor

    model = DDP(build(kind))
    mon = CertificateMonitor(model, "fp32", every=1, threshold=-1e9, kappa_growth=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for s in range(STEPS):
        x, y = batch(kind, s)
        opt.zero_grad()
        loss = loss_of(kind, model, local(x, rank, shard), local(y, rank, shard))
        loss.backward()
        mon.step()
        opt.step()
        losses.append(float(loss.detach()))
    # the batch maxima over ranks: the global batch's figure
    sat = torch.tensor([[r[k] for k in r if k.endswith("/saturation")] for r in mon.records], dtype=torch.float64)
    dist.all_reduce(sat, op=dist.ReduceOp.MAX)
    return {"records": mon.records, "weights": weights(model), "losses": losses, "saturation_max": sat}


def ddp_enforce(rank: int, lr: float) -> Dict[str, Any]:
    """``enforce`` before the DDP wrapper, large-learning-rate steps, then the caps and the certificate."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from certblocks.enforcement import NormCap, ScaleClamp, enforce, unenforce
    from certblocks.monitor import CertificateMonitor

    out: Dict[str, Any] = {}
    for kind in ("stack", "zoo"):
        base = build(kind)
        r0 = 1.0 if kind == "stack" else float(base.input_radius())  # the zoo's embedding is not capped: freeze r0
        report = enforce(base, "fp32" if kind == "stack" else "bf16", r0=r0)
        model = DDP(base)
        mon = CertificateMonitor(model, "fp32" if kind == "stack" else "bf16", every=1, threshold=-1e9,
                                 kappa_growth=None, r0=r0)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        g = torch.Generator().manual_seed(7 + rank)  # different data per rank
        ok = []
        for s in range(STEPS):
            x, y = batch(kind, s)
            if kind == "stack":
                x = x * 3.0 + torch.randn(x.shape, generator=g)
            opt.zero_grad()
            loss_of(kind, model, x, y).backward()
            mon.step()
            opt.step()
            ok.append(bool(mon.records[-1]["stack/ok"]))
        # every capped tensor within its cap (exact norms, float64)
        excess = []
        for m in base.modules():
            if not hasattr(m, "parametrizations"):
                continue
            for name, plist in m.parametrizations.items():
                eff = getattr(m, name).detach().double()
                for p in plist:
                    if isinstance(p, NormCap):
                        for part, cap in zip(torch.split(eff, p.sizes, dim=0), p.caps.tolist()):
                            n = torch.linalg.matrix_norm(part, ord=2) if part.ndim == 2 else part.norm()
                            excess.append(float(n) / cap)
                    elif isinstance(p, ScaleClamp):
                        excess.append(float(eff.abs().max()) / p.cap)
        if kind == "stack":
            # at the r0 it was enforced for (the inputs above ran outside that envelope, on purpose: large steps)
            recert = bool(base.certificate(r0=r0).ok)
        else:
            from certblocks.certificate import certify_stack
            from certblocks.monitor import residual_updates

            ups = residual_updates(base, r0=r0)
            recert = bool(certify_stack(ups.certificates(), "bf16", dt=ups.dt, r0=ups.radius()).ok)
        eff = weights(model)
        restored = unenforce(base)
        plain = {k: v.detach().clone() for k, v in base.state_dict().items()}
        out[kind] = {"alpha": report.alpha, "ok": ok, "excess": excess, "recertified": recert, "effective": eff,
                     "restored": restored, "plain": plain, "ncaps": len(report.caps)}
    return out


# ---------------------------------------------------------------------------------------------- FSDP2
def _unsharded(model: nn.Module) -> List[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.unshard()
    return units


def fsdp_monitor(rank: int, kind: str) -> Dict[str, Any]:
    """FSDP2 (``fully_shard``), the monitor checked with the parameters unsharded; same batch on each rank."""
    from torch.distributed.fsdp import fully_shard

    from certblocks.monitor import CertificateMonitor

    model = build(kind)
    if kind == "zoo":
        for blk in model.transformer.h:  # units above the velocities: their forward hooks see full weights
            fully_shard(blk)
    fully_shard(model)
    sharded = type(model.parameters().__next__()).__name__
    mon = CertificateMonitor(model, "fp32", every=1, threshold=-1e9, kappa_growth=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for s in range(STEPS):
        x, y = batch(kind, s)
        opt.zero_grad()
        loss = loss_of(kind, model, x, y)
        loss.backward()
        units = _unsharded(model)
        mon.step()
        for m in units:
            m.reshard()
        opt.step()
        losses.append(float(loss.detach()))
    return {"records": mon.records, "weights": weights(model), "losses": losses, "param_type": sharded}


def fsdp_enforce(rank: int, lr: float) -> Dict[str, Any]:
    """``enforce`` then ``fully_shard`` (zoo model), large steps with different data per rank; with the
    parameters unsharded, the caps and the certificate hold and both ranks hold the same effective weights."""
    from torch.distributed.fsdp import fully_shard

    from certblocks.enforcement import NormCap, ScaleClamp, enforce
    from certblocks.monitor import CertificateMonitor

    model = build("zoo")
    r0 = float(model.input_radius())
    report = enforce(model, "bf16", r0=r0)
    for blk in model.transformer.h:
        fully_shard(blk)
    fully_shard(model)
    mon = CertificateMonitor(model, "bf16", every=1, threshold=-1e9, kappa_growth=None, r0=r0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(11 + rank)
    ok = []
    for _ in range(STEPS):
        x = torch.randint(0, 64, (2, 17), generator=g)
        opt.zero_grad()
        loss_of("zoo", model, x[:, :-1], x[:, 1:]).backward()
        units = _unsharded(model)
        mon.step()
        for m in units:
            m.reshard()
        opt.step()
        ok.append(bool(mon.records[-1]["stack/ok"]))
    units = _unsharded(model)
    excess = []
    for m in model.modules():
        if not hasattr(m, "parametrizations"):
            continue
        for name, plist in m.parametrizations.items():
            eff = getattr(m, name).detach().double()
            for p in plist:
                if isinstance(p, NormCap):
                    for part, cap in zip(torch.split(eff, p.sizes, dim=0), p.caps.tolist()):
                        n = torch.linalg.matrix_norm(part, ord=2) if part.ndim == 2 else part.norm()
                        excess.append(float(n) / cap)
                elif isinstance(p, ScaleClamp):
                    excess.append(float(eff.abs().max()) / p.cap)
    for m in units:
        m.reshard()
    return {"alpha": report.alpha, "ok": ok, "excess": excess, "weights": weights(model)}


SCENARIOS: Dict[str, Callable[..., Dict[str, Any]]] = {
    "ddp_monitor": ddp_monitor,
    "ddp_enforce": ddp_enforce,
    "fsdp_monitor": fsdp_monitor,
    "fsdp_enforce": fsdp_enforce,
}
