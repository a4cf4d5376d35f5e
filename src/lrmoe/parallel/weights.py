"""Instance weights: each local slot's expert weights, from their owners, in the compute dtype.

Expert e's master weights live on its owner rank ``e // (E/G)`` (the native rank).
Every step the runtime gathers, for each local slot, a copy of its expert's weights
(``GatherInstances``); autograd's backward of that gather sums every instance's weight
gradient into its expert's gradient on the owner (inside a rank by ``index_add``,
across ranks by the reverse all-to-all): the replica-gradient reduce of docs/design.md §2.
Inside an optimizer step of several micro-batches a placement they share moves once
(:mod:`lrmoe.parallel.held`, through :func:`gather_slots` and :func:`reduce_slots`).

The owned weights are cast to the compute dtype once per optimizer step
(:func:`compute_copy`): the micro-batches of one step reuse the cast, and their
gradients still accumulate in the master dtype.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from lrmoe.parallel.comm import EPComm
from lrmoe.parallel.layout import to_device
from lrmoe.policy.plan import Plan


class InstanceRoute:
    """Which owned rows go where, and where arriving rows land, for one placement.

    Only occupied slots get weights: the rows arrive grouped by owner rank (slot order
    within an owner); ``recv_order`` takes them back to this rank's occupied slots in
    slot order, so an empty slot allocates nothing. Built with numpy from the placement
    alone and cached per (placement, rank) (:func:`instance_route`).
    """

    def __init__(self, inst_expert_GS: np.ndarray, me: int, E: int):
        G = inst_expert_GS.shape[0]
        per = E // G
        owner = np.where(inst_expert_GS >= 0, inst_expert_GS // per, -1)
        mine = owner == me
        # send: rank-major over (r, s), rows of my owned experts
        self.send_rows = inst_expert_GS[mine] - me * per
        self.send_splits = mine.sum(1).tolist()
        # receive: my occupied slots, grouped by owner (stable in slot order)
        my_owner = owner[me][owner[me] >= 0]
        self.arrival_slot = np.argsort(my_owner, kind="stable")  # arrival -> occupied slot
        self.recv_order = np.argsort(self.arrival_slot)  # occupied slot -> arrival
        self.recv_splits = np.bincount(my_owner, minlength=G).tolist()
        self.S = int(my_owner.size)
        self._index: dict = {}

    def index(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """``(send_rows, recv_order, arrival_slot)`` as index tensors on ``device``:
        copied once per route, in one pinned copy (indexing with a host tensor would make
        a pageable copy, which waits for the device)."""
        if device not in self._index:
            tab = np.concatenate((self.send_rows, self.recv_order, self.arrival_slot))
            n, m = self.send_rows.size, self.recv_order.size
            both = to_device(torch.from_numpy(tab), device)
            self._index[device] = (both[:n], both[n:n + m], both[n + m:])
        return self._index[device]


@functools.lru_cache(maxsize=256)
def _route(key: bytes, shape: tuple[int, int], me: int, E: int) -> InstanceRoute:
    return InstanceRoute(np.frombuffer(key, dtype=np.int64).reshape(shape), me, E)


def instance_route(plan: Plan, me: int, E: int) -> InstanceRoute:
    """The route of ``plan``'s placement for rank ``me`` (cached: placements repeat
    across micro-batches, layers and steps)."""
    ie = plan.inst_expert_GS.numpy().astype(np.int64, copy=False)
    return _route(ie.tobytes(), ie.shape, me, E)


class GatherInstances(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w_own: Tensor, route: InstanceRoute, comm: EPComm) -> Tensor:
        ctx.route, ctx.comm, ctx.n_own = route, comm, w_own.shape[0]
        return gather_slots(w_own, route, comm)

    @staticmethod
    def backward(ctx, g_S: Tensor):
        return reduce_slots(g_S, ctx.route, ctx.comm, ctx.n_own), None, None


def gather_slots(w_own: Tensor, route: InstanceRoute, comm: EPComm) -> Tensor:
    """This rank's occupied slots' weights ``[S_occupied, ...]`` (slot order) from the
    owned rows ``w_own [E/G, ...]`` of every rank: one all-to-all (the weight scatter)."""
    send_rows, recv_order, _ = route.index(w_own.device)
    recv = comm.all_to_all(w_own[send_rows], route.send_splits, route.recv_splits)
    return recv[recv_order]


def reduce_slots(g_S: Tensor, route: InstanceRoute, comm: EPComm, n_own: int) -> Tensor:
    """The reverse of :func:`gather_slots`: every instance's gradient summed into its
    expert's row of ``[n_own, ...]`` on the owner (one all-to-all, then ``index_add``
    in arrival order: the replica-gradient reduce)."""
    send_rows, _, arrival_slot = route.index(g_S.device)
    back = comm.all_to_all(g_S[arrival_slot], route.recv_splits, route.send_splits)
    g_own = g_S.new_zeros((n_own,) + tuple(g_S.shape[1:]))
    g_own.index_add_(0, send_rows, back)
    return g_own


def instance_weight_list(ws_own: list[Tensor], plan: Plan, comm: EPComm, E: int) -> list[Tensor]:
    """Weights ``[S_occupied, ...]`` for this rank's occupied slots (slot order) from each
    owned tensor ``[E/G, ...]`` of ``ws_own`` (one route for all); empty slots get no
    weights (the exchange runs its grouped GEMMs over the occupied slots,
    :func:`lrmoe.parallel.stages.occupied_counts`). When every rank's occupied slots are
    exactly its owned experts in order (the static plan), the owned tensors are returned
    as they are: no copy, no communication."""
    if natives_only(plan.inst_expert_GS.numpy(), E):
        return list(ws_own)
    route = instance_route(plan, comm.rank, E)
    return [GatherInstances.apply(w, route, comm) for w in ws_own]


def natives_only(ie: np.ndarray, E: int) -> bool:
    """Every rank's occupied slots are exactly its natives, in order: no rank needs a
    weight from another (every rank takes the same branch, so all skip the all-to-all)."""
    occ = ie[ie >= 0]
    per_rank = (ie >= 0).sum(1)
    return occ.size == E and bool((per_rank == per_rank[0]).all()) and bool(
        (occ == np.arange(E)).all())


class _CastOnce(torch.autograd.Function):
    """``w`` in the compute dtype from a copy cast once: the forward hands out a view of
    ``cast`` (no kernel); the backward is the cast's (the gradient in ``w``'s dtype).
    A missing gradient stays missing, not zeros: a micro-batch whose slots keep their
    gradient for the step (:mod:`lrmoe.parallel.held`) adds nothing to ``w.grad``."""

    @staticmethod
    def forward(ctx, w: Tensor, cast: Tensor) -> Tensor:
        ctx.dtype = w.dtype
        ctx.set_materialize_grads(False)
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, g: Tensor | None):
        return (None if g is None else g.to(ctx.dtype)), None


def compute_copy(w: Tensor, dtype: torch.dtype, cache: dict) -> Tensor:
    """``w.to(dtype)`` with the cast made once per ``cache`` (which the caller holds
    while ``w`` does not change: the micro-batches of one optimizer step); the same
    values and the same gradients as ``w.to(dtype)``."""
    if w.dtype == dtype:
        return w
    cast = cache.get((id(w), dtype))
    if cast is None:
        cast = cache[(id(w), dtype)] = w.detach().to(dtype)
    return _CastOnce.apply(w, cast) if w.requires_grad and torch.is_grad_enabled() else cast
