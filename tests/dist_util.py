"""Shared test helpers: gloo process groups on loopback, a fixed router, test plans."""

from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lrmoe.model.router import Routing
from lrmoe.policy.plan import Plan
from lrmoe.policy.plan_numpy import full_plan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, errfile: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        with open(f"{errfile}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(world: int, fn, *args, tmp_path) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; re-raise a rank's error."""
    errfile = str(tmp_path / "rank_error")
    try:
        mp.spawn(_entry, args=(world, free_port(), fn, args, errfile), nprocs=world, join=True)
    except Exception as e:
        msgs = []
        for r in range(world):
            p = f"{errfile}.{r}"
            if os.path.exists(p):
                msgs.append(f"--- rank {r} ---\n" + open(p).read())
        raise AssertionError("\n".join(msgs) or str(e)) from None


class FixedRouter(nn.Module):
    """Routes by a given table; gates stay differentiable (softmax of x @ w)."""

    def __init__(self, idx_TK: torch.Tensor, E: int, H: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, H) * 0.5)
        self.idx = idx_TK

    def forward(self, x):
        probs = torch.softmax(x @ self.weight.t(), dim=-1)
        return Routing(self.idx, probs.gather(1, self.idx), None)


def hot_replica_plan(counts_GE: torch.Tensor, avoid_owner: bool) -> Plan:
    """Natives plus one replica of each of the two hottest experts, on ranks G-1 and G-2
    (with ``avoid_owner``, the next rank when that one already owns the expert)."""
    G, E = counts_GE.shape
    per = E // G
    ie = torch.full((G, per + 2), -1, dtype=torch.long)
    ie[:, :per] = torch.arange(E).reshape(G, per)
    hot = torch.argsort(counts_GE.sum(0), descending=True)[:2]
    for k, e in enumerate(hot.tolist()):
        r = (G - 1 - k) % G
        if avoid_owner and e // per == r:
            r = (r + 1) % G
        ie[r, per + k] = e
    return full_plan(counts_GE, ie)


def trimmed(plan: Plan) -> Plan:
    """``plan`` with 80% of each block retained and 60% of those selected."""
    r = (plan.assign_GGS * 4) // 5
    return Plan(plan.inst_expert_GS, plan.assign_GGS, r, (r * 3) // 5)


def load_benchmark(name: str, folder: str = "benchmarks"):
    """``<folder>/<name>.py`` imported as a module (the scripts are not a package);
    ``folder`` is relative to the repository root (``tests/gpu`` for the GPU checks)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
