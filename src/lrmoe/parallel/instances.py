"""Instance weights: each local slot's expert weights, from their owners, in the compute dtype.

Expert e's master weights live on its owner rank ``e // (E/G)`` (the native rank), cast
to the compute dtype once per optimizer step (:func:`compute_copy`). Every step the
runtime gathers, for each local slot, a copy of its expert's weights (``GatherInstances``,
whose backward is the replica-gradient reduce of docs/design.md §2: :func:`reduce_slots`);
over an optimizer step of several micro-batches it holds them (:class:`HeldInstances`).

Legend: S occupied slots, E experts, G ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from lrmoe.ops.rowops import to_device
from lrmoe.parallel.comm import EPComm
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
        self._index: dict = {}

    def index(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """``(send_rows, recv_order, arrival_slot)`` as index tensors on ``device``:
        copied once per route, in one pinned copy (indexing with a host tensor would make
        a pageable copy, which waits for the device)."""
        if device not in self._index:
            parts = (self.send_rows, self.recv_order, self.arrival_slot)
            tab = to_device(torch.from_numpy(np.concatenate(parts)), device)
            self._index[device] = tab.split([p.size for p in parts])
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
    :meth:`lrmoe.parallel.stages.Retention.weighted`). When every rank's occupied slots are
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
    gradient for the step (:class:`HeldInstances`) adds nothing to ``w.grad``."""

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


# ------------------------------------------------------- held over an optimizer step
def placement_key(ie_GS: np.ndarray) -> bytes:
    """What the instance weights depend on: every rank's occupied experts in slot order
    (empty slots, wherever they are, change nothing)."""
    ie = ie_GS.astype(np.int64, copy=False)
    return np.concatenate([(ie >= 0).sum(1), ie[ie >= 0]]).tobytes()


class HeldInstances:
    """One MoE layer's instance weights and their gradient accumulators over the
    ``micros`` micro-batches of an optimizer step (how, and why that is exact:
    docs/design.md §7).

    Args:
        params: the layer's owned expert parameters, in the order of the weight lists
            (``gate_up_proj``, ``down_proj``): where a flush adds its gradients.
        micros: the step's micro-batches; the last one's backward sends the sums home.
    """

    def __init__(self, params: Sequence[Tensor], micros: int):
        self.params, self.micros = list(params), micros
        self._clear()

    def _clear(self) -> None:
        self.key: bytes | None = None
        self.route: InstanceRoute | None = None
        self.comm: EPComm | None = None
        self.weights: list[Tensor | None] = []
        self.grads: list[Tensor | None] = []

    def weight_list(self, ws_own: list[Tensor], plan: Plan, comm: EPComm, E: int,
                    micro: int) -> list[Tensor]:
        """The weights of this rank's occupied slots for ``plan`` at micro-batch ``micro``
        of the step: :func:`instance_weight_list`'s values, gathered only where the
        placement differs from the previous micro-batch's."""
        ie = plan.inst_expert_GS.numpy()
        key = None if natives_only(ie, E) else placement_key(ie)
        if self.key is not None and self.key != key:
            self.flush()
        if key is None:
            return list(ws_own)
        if self.key is None:
            route = instance_route(plan, comm.rank, E)
            with torch.no_grad():
                self.weights = [gather_slots(w.detach(), route, comm) for w in ws_own]
            self.key, self.route, self.comm = key, route, comm
            self.grads = [None] * len(ws_own)
        final = micro == self.micros - 1
        return [_Held.apply(w, self, j, final) for j, w in enumerate(ws_own)]

    def flush(self) -> None:
        """Send home what the held slots accumulated, outside autograd (a placement that
        changes within the step, or what a last backward left): each owned parameter's
        ``.grad`` gets what autograd's accumulation would add (widened to its dtype)."""
        with torch.no_grad():
            for p, acc in zip(self.params, self.grads):
                if acc is None:
                    continue
                g = reduce_slots(acc, self.route, self.comm, p.shape[0]).to(p.dtype)
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad += g
        self._clear()


class _Held(torch.autograd.Function):
    """Slot weights ``held.weights[j]``, kept for the step: the forward hands out a view
    (no copy, no communication); the backward adds the slots' gradient to the step's
    sum and, at the step's last micro-batch, sends the sum home as the gradient of the
    owned ``w_own`` (the last micro-batch's is the only one autograd carries further)."""

    @staticmethod
    def forward(ctx, w_own: Tensor, held: HeldInstances, j: int, final: bool) -> Tensor:
        ctx.held, ctx.j, ctx.final, ctx.n_own = held, j, final, w_own.shape[0]
        w = held.weights[j]
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g_S: Tensor):
        held, j = ctx.held, ctx.j
        acc = held.grads[j]
        # out of place: ``g_S`` is autograd's, and the sum a fresh tensor of ours
        acc = g_S if acc is None else acc + g_S
        if not ctx.final:
            held.grads[j] = acc
            return None, None, None, None
        g_own = reduce_slots(acc, held.route, held.comm, ctx.n_own)
        held.weights[j] = held.grads[j] = None  # sent home
        if all(w is None for w in held.weights):
            held._clear()
        return g_own, None, None, None
