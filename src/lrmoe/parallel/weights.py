"""Instance weights: materialise each local slot's expert weights from their owners.

Expert e's master weights live on its owner rank ``e // (E/G)`` (the native rank).
Every step the runtime gathers, for each local slot, a copy of its expert's weights
(``GatherInstances``); autograd's backward of that gather sums every instance's weight
gradient into its expert's gradient on the owner (inside a rank by ``index_add``,
across ranks by the reverse all-to-all): the replica-gradient reduce of docs/design.md §2.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lrmoe.parallel.comm import EPComm
from lrmoe.parallel.layout import to_device
from lrmoe.policy.plan import Plan


class InstanceRoute:
    """Which owned rows go where, and where arriving rows land, for one plan.

    Only occupied slots get weights: arriving rows land at ``recv_slots``, positions
    among this rank's occupied slots (slot order), so an empty slot allocates nothing.
    """

    def __init__(self, plan: Plan, me: int, E: int):
        G, S = plan.G, plan.S
        per = E // G
        ie = plan.inst_expert_GS
        owner = torch.where(ie >= 0, ie // per, torch.full_like(ie, -1))
        # Send: rank-major over (r, s), rows of my owned experts.
        mine = owner == me
        self.send_rows = (ie[mine] - me * per).tolist()
        self.send_splits = mine.sum(1).tolist()
        # Receive: my slots sorted by owner rank (stable in slot order).
        my_owner = owner[me]
        occupied = [s for s in range(S) if my_owner[s] >= 0]
        pos = {s: i for i, s in enumerate(occupied)}
        slots = sorted(occupied, key=lambda s: (int(my_owner[s]), s))
        self.recv_slots = [pos[s] for s in slots]
        self.recv_splits = [int((my_owner == g).sum()) for g in range(G)]
        self.S = len(occupied)
        self._index: dict = {}

    def index(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(send_rows, recv_slots)`` as index tensors on ``device``: copied once per
        route through pinned memory (indexing with a host list would make a pageable
        copy, which waits for the device)."""
        if device not in self._index:
            both = torch.tensor(self.send_rows + self.recv_slots, dtype=torch.long)
            both = to_device(both, device)
            n = len(self.send_rows)
            self._index[device] = (both[:n], both[n:])
        return self._index[device]


class GatherInstances(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w_own: Tensor, route: InstanceRoute, comm: EPComm) -> Tensor:
        send_rows, recv_slots = route.index(w_own.device)
        send = w_own[send_rows]
        recv = comm.all_to_all(send, route.send_splits, route.recv_splits)
        out = w_own.new_zeros((route.S,) + tuple(w_own.shape[1:]))
        out[recv_slots] = recv
        ctx.route, ctx.comm, ctx.n_own = route, comm, w_own.shape[0]
        return out

    @staticmethod
    def backward(ctx, g_S: Tensor):
        route, comm = ctx.route, ctx.comm
        send_rows, recv_slots = route.index(g_S.device)
        back = comm.all_to_all(g_S[recv_slots].contiguous(), route.recv_splits,
                               route.send_splits)
        g_own = g_S.new_zeros((ctx.n_own,) + tuple(g_S.shape[1:]))
        g_own.index_add_(0, send_rows, back)
        return g_own, None, None


def instance_weights(w_own: Tensor, plan: Plan, comm: EPComm, E: int) -> Tensor:
    """Weights ``[S_occupied, ...]`` for this rank's occupied slots (slot order) from the
    owned experts ``[E/G, ...]``; empty slots get no weights (the exchange runs its
    grouped GEMMs over the occupied slots, :func:`lrmoe.parallel.exchange.occupied_counts`).

    When the occupied slots are exactly the owned experts in order (the static plan, or
    any plan that places no replica on this rank) and no other rank holds a replica of
    them, the owned tensor is returned as is: no copy, no communication.
    """
    return instance_weight_list([w_own], plan, comm, E)[0]


def instance_weight_list(ws_own: list[Tensor], plan: Plan, comm: EPComm, E: int) -> list[Tensor]:
    """:func:`instance_weights` of several owned tensors for one plan (one route)."""
    me, per = comm.rank, E // plan.G
    row = plan.inst_expert_GS[me]
    if (torch.equal(row[row >= 0], torch.arange(me * per, (me + 1) * per))
            and _no_replicas(plan)):
        return list(ws_own)
    route = InstanceRoute(plan, me, E)
    return [GatherInstances.apply(w, route, comm) for w in ws_own]


def _no_replicas(plan: Plan) -> bool:
    """Every rank's occupied slots are exactly its natives, in order: no rank needs a
    weight from another (every rank takes the same branch, so all skip the all-to-all)."""
    ie = plan.inst_expert_GS
    occ = (ie >= 0).sum(1)
    return (bool((occ == occ[0]).all())
            and torch.equal(ie[ie >= 0], torch.arange(int(occ.sum()))))
