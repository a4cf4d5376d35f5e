"""Process groups for expert parallelism (EP) x data parallelism (DP), expert ownership
and gradient reduction (docs/design.md §6). Groups are created once by
:func:`init_parallel` and passed around explicitly."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lrmoe.errors import LrmoeError, require
from lrmoe.parallel.comm import EPComm


@dataclass
class ParallelContext:
    """Who this process is and the groups it belongs to (all ``None`` on one process)."""

    world: int = 1
    rank: int = 0
    ep_size: int = 1
    ep_group: dist.ProcessGroup | None = None
    expert_dp_group: dist.ProcessGroup | None = None
    device: torch.device = torch.device("cpu")

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def comm(self) -> EPComm:
        return EPComm(self.ep_group)


def init_parallel(ep: int, device: str, backend: str | None = None,
                  timeout_s: float = 300.0,
                  check: Callable[[int, int, LrmoeError | None], None] | None = None
                  ) -> ParallelContext:
    """Join the job started by torchrun (or stay single-process) and build the groups.

    ``timeout_s`` bounds every collective: if a peer dies or hangs, the survivors fail
    with an error instead of waiting forever. ``check(rank, world, refused)`` runs once
    the ranks have joined, before the groups are built (which needs every rank's ``ep``
    alike): a collective that raises on every rank when the ranks' settings differ or a
    rank refused its device (``refused``, that rank's error). A rank whose device is
    refused still joins (gloo, on the CPU): had it left before joining, torchrun would
    stop its peers, rank 0 included, and rank 0 could be stopped before it says why. Its
    peers join on the CPU too, told over the rendezvous store before any backend starts
    (:func:`_any_refused`): NCCL ranks beside a gloo rank would wait for it to time out.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if ep < 1:
        raise LrmoeError(f"--ep {ep} must be >= 1")
    if world == 1:
        if ep != 1:
            raise LrmoeError(f"--ep {ep} needs {ep} processes; launch with "
                             f"torchrun --nproc-per-node {ep} -m lrmoe train ...")
        return ParallelContext(device=_device(device, 0))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        dev, refused = _device(device, local), None
    except LrmoeError as e:  # said once every rank has joined (see above)
        dev, refused, backend = torch.device("cpu"), e, "gloo"
    to, others = datetime.timedelta(seconds=timeout_s), False
    if not dist.is_initialized():
        store, rank, _ = next(dist.rendezvous("env://", timeout=to))
        store.set_timeout(to)
        others = _any_refused(store, rank, world, refused is not None) and refused is None
        if others:  # the check says which rank, on every rank
            dev, backend = torch.device("cpu"), "gloo"
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        kw = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store),
                                rank=rank, world_size=world, timeout=to, **kw)  # as env:// does
    rank = dist.get_rank()
    if check is not None:  # first: a rank's other --ep is named as a flag that differs
        check(rank, world, refused)
    if refused is not None:  # a check that does not gather it: every rank says it
        raise refused
    if others:
        raise LrmoeError("another rank refused its device (see its error)")
    if world % ep != 0:  # alike on every rank once the flags agree
        raise LrmoeError(f"world size {world} is not divisible by --ep {ep}")
    # every rank creates every group, in the same order, each with the timeout (not just
    # the default group); each call returns the one holding this rank
    ep_group, _ = dist.new_subgroups_by_enumeration(
        [list(range(k * ep, (k + 1) * ep)) for k in range(world // ep)], timeout=to)
    dp_group, _ = dist.new_subgroups_by_enumeration(
        [list(range(j, world, ep)) for j in range(ep)], timeout=to)
    return ParallelContext(world, rank, ep, ep_group, dp_group, dev)


def _any_refused(store: dist.Store, rank: int, world: int, refused: bool) -> bool:
    """Whether any rank refused its device: each rank's word on the rendezvous store (under
    the job's restart count, so an earlier attempt's words are not read)."""
    votes = dist.PrefixStore(f"lrmoe/device/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}",
                             store)
    votes.set(str(rank), "1" if refused else "0")
    keys = [str(r) for r in range(world)]
    votes.wait(keys)
    return any(votes.get(k) == b"1" for k in keys)


def _device(device: str, local_rank: int) -> torch.device:
    if device == "cuda":
        if not torch.cuda.is_available():
            raise LrmoeError("--device cuda was asked for but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if device != "cpu":
        raise LrmoeError(f"--device {device!r} is not valid; use cpu or cuda")
    return torch.device("cpu")


def is_expert_param(name: str) -> bool:
    return ".experts.gate_up_proj" in name or ".experts.down_proj" in name


def owned_experts(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """Global ids of the experts EP rank ``ep_rank`` of ``ep_size`` owns."""
    if num_experts % ep_size:
        raise LrmoeError(f"num_experts={num_experts} is not divisible by --ep {ep_size}")
    per = num_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def expert_ids(model: nn.Module) -> dict[str, range]:
    """``{state-dict name of an expert parameter: global ids of its rows}``.

    Row ``i`` of ``...experts.gate_up_proj`` on this rank is global expert
    ``ids[i]``; these ids, not the rank, name expert state in checkpoints.
    """
    out = {}
    for name, _ in model.named_parameters():
        if is_expert_param(name):
            ex = model.get_submodule(name.rsplit(".", 1)[0])
            out[name] = range(ex.first, ex.first + ex.count)
    return out


def shard_experts(model: nn.Module, ctx: ParallelContext) -> None:
    """Keep only this rank's owned experts (:func:`owned_experts`) of the full model every
    rank built from the same seed. Expert modules are found by their attributes, so that
    ``parallel/`` imports nothing from ``model/``."""
    G, r = ctx.ep_size, ctx.ep_rank
    for ex in model.modules():
        if isinstance(getattr(ex, "gate_up_proj", None), nn.Parameter) and hasattr(ex, "num_experts"):
            own = owned_experts(ex.num_experts, G, r)
            ex.gate_up_proj = nn.Parameter(ex.gate_up_proj.data[own.start:own.stop].clone())
            ex.down_proj = nn.Parameter(ex.down_proj.data[own.start:own.stop].clone())
            ex.first, ex.count = own.start, len(own)


def sync_grads(model: nn.Module, ctx: ParallelContext, finished: Collection[int] = ()) -> None:
    """Average non-expert gradients over the world; sum expert gradients over the
    expert-DP group, then divide them by the world too. ``finished``: ``id``s of expert
    parameters whose gradient :func:`expert_grad_finish` already synced as it became
    final (left alone here)."""
    if not ctx.distributed:
        return
    dense, expert, done = [], [], []
    for name, p in model.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if not is_expert_param(name):
            dense.append(p.grad)
        else:
            (done if id(p) in finished else expert).append(p.grad)
    require(not done or ctx.world == ctx.ep_size,
            "sync_grads: expert gradients synced early under DP x EP")
    _allreduce_flat(dense, None)
    if ctx.world > ctx.ep_size:
        _allreduce_flat(expert, ctx.expert_dp_group)
    for g in dense + expert:
        g.div_(ctx.world)


def expert_grad_finish(ctx: ParallelContext) -> Callable[[torch.Tensor], None] | None:
    """What :func:`sync_grads` does to one expert gradient, as a function to apply as
    soon as that gradient is final (the host offload sends it to the host then): nothing
    on one process; under expert parallelism alone the division by the world size (the
    same in-place division, so the same values). ``None`` under DP x EP: there the
    expert gradients are all-reduced together in one flat buffer after backward, and
    all-reduced one by one they could be summed in another order."""
    if not ctx.distributed:
        return lambda g: None
    if ctx.world > ctx.ep_size:
        return None
    world = ctx.world
    return lambda g: g.div_(world)


def _allreduce_flat(grads: list[torch.Tensor], group) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a tensor over a group (identity without torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, group=group)
    return t


def clip_grad_norm(model: nn.Module, max_norm: float, ctx: ParallelContext,
                   scale_grads: Callable[[list[torch.Tensor], float], None] | None = None,
                   ) -> float:
    """Clip by the global gradient norm (expert shards counted once across the EP group).

    Call after :func:`sync_grads`. Returns the norm before clipping. ``scale_grads(params,
    coef)`` applies the clip coefficient instead of an in-place multiply (the host
    offload's :meth:`~lrmoe.train.offload.HostOffloadAdamW.scale_grads`: it scales bf16
    gradients in fp32 on the host, where an in-place multiply would round each product).
    """
    dense_sq = torch.zeros((), dtype=torch.float64, device=ctx.device)
    expert_sq = torch.zeros((), dtype=torch.float64, device=ctx.device)
    params = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        params.append(p)
        sq = p.grad.detach().double().pow(2).sum()
        if is_expert_param(name):
            expert_sq += sq
        else:
            dense_sq += sq
    if ctx.distributed and ctx.ep_size > 1:
        dist.all_reduce(expert_sq, group=ctx.ep_group)
    norm = float((dense_sq + expert_sq).sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        if scale_grads is not None:
            scale_grads(params, scale)
        else:
            for p in params:
                p.grad.mul_(scale)
    return norm


def count_reducer(ctx: ParallelContext):
    """A function summing a count tensor over the expert-DP group on the device (no host
    wait: the aux loss reads it there), or ``None`` when there is no data parallelism
    across EP groups."""
    if not ctx.distributed or ctx.world == ctx.ep_size:
        return None

    def reduce(t: torch.Tensor) -> torch.Tensor:
        d = t.to(ctx.device)
        dist.all_reduce(d, group=ctx.expert_dp_group)
        return d
    return reduce
