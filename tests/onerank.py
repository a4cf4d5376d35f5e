"""One rank of a G-rank EP group, run alone: the real runtime with synthetic peers
(tests and ``benchmarks/``), and synthetic routing for it.

Legend: G ranks, E experts, S slots per rank.

:class:`OneRankComm` is an :class:`lrmoe.parallel.comm.EPComm` for rank ``me`` of a
G-rank group in which the other ranks are not running. The count all-gather returns a
given ``[G, E]`` count matrix with row ``me`` replaced by this rank's real counts, so
every planner sees what it would in a real G-rank step; every all-to-all returns a
**new** buffer of the rows a real exchange would deliver (zeros from the absent peers,
this rank's own rows copied back), so this rank allocates, keeps and frees exactly the
tensors a real rank does. The numbers it computes from peers' rows are meaningless:
this is for memory accounting (the ledger test, ``benchmarks/ledger_peak.py``) and
never for numerics. :class:`TableRouter` routes by a fixed table, drawn for instance by
:func:`zipf_routing`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lrmoe.errors import require
from lrmoe.parallel.comm import EPComm


class OneRankComm(EPComm):
    """Rank ``me`` of a G-rank EP group whose peers are synthetic (see module doc).

    Args:
        me: this rank's index in the group.
        peers_GE: the group's count matrix; row ``me`` is replaced by the real counts.
    """

    def __init__(self, me: int, peers_GE: Tensor):
        super().__init__(None)
        G = peers_GE.shape[0]
        require(0 <= me < G, f"rank {me} is not in an EP group of {G}")
        self.size, self.rank = G, me
        self.peers_GE = peers_GE.long().cpu()
        self.last_counts_GE: Tensor | None = None

    def all_gather_counts(self, counts_E: Tensor) -> Tensor:
        c = self.peers_GE.clone()
        c[self.rank] = counts_E.detach().long().cpu()
        self.last_counts_GE = c
        return c

    def all_to_all(self, x: Tensor, send: list[int], recv: list[int]) -> Tensor:
        """A new ``[sum(recv), ...]`` buffer: this rank's rows to itself where they land,
        zeros for the rows of absent peers."""
        require(len(send) == len(recv) == self.size,
                f"all_to_all splits have {len(send)}/{len(recv)} entries, want {self.size}")
        out = x.new_zeros((sum(recv),) + tuple(x.shape[1:]))
        me = self.rank
        n = min(send[me], recv[me])
        if n:
            src, dst = sum(send[:me]), sum(recv[:me])
            out[dst:dst + n] = x[src:src + n]
        return out

    def exchange_counts(self, counts_GS: Tensor) -> Tensor:
        """Each peer is taken to send this rank what this rank sends it."""
        return counts_GS.clone()


def one_rank_layer(layer, me: int, peers_GE: Tensor, policy, ledger=None, backward=None):
    """A copy of the full MoE ``layer`` as EP rank ``me`` of ``G = peers_GE.shape[0]``:
    only its owned experts (``me*E/G .. (me+1)*E/G - 1``), planning with ``policy``
    against ``ledger`` and exchanging through a :class:`OneRankComm`."""
    import copy

    from lrmoe.model.moe import MoERuntime
    from lrmoe.parallel.exchange import BackwardOptions
    from lrmoe.parallel.groups import ParallelContext, shard_experts

    G = peers_GE.shape[0]
    out = copy.deepcopy(layer)
    shard_experts(out, ParallelContext(world=G, rank=me, ep_size=G))
    out.runtime = MoERuntime(comm=OneRankComm(me, peers_GE), policy=policy,
                             backward=backward or BackwardOptions(), ledger=ledger)
    return out


class TableRouter(torch.nn.Module):
    """Routes by a fixed ``[N, K]`` table; gates are the softmax router's probabilities
    of those experts, renormalised (differentiable), so the backward has a router."""

    def __init__(self, weight: torch.Tensor, idx_NK: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone())
        self.idx = idx_NK

    def forward(self, x):
        from lrmoe.model.router import Routing

        probs = torch.softmax(torch.nn.functional.linear(x.float(), self.weight.float()), dim=-1)
        gate = probs.gather(1, self.idx)
        return Routing(self.idx, gate / gate.sum(-1, keepdim=True), None)


def zipf_routing(N: int, E: int, K: int, skew: float, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
    """``[N, K]`` distinct experts per token; expert popularity ``∝ 1/rank^skew`` over a
    random order of the experts (``skew`` 0: uniform)."""
    perm = torch.randperm(E, generator=generator)
    p = torch.empty(E)
    p[perm] = 1.0 / torch.arange(1, E + 1, dtype=torch.float64).pow(skew).float()
    return torch.multinomial(p.expand(N, E), K, replacement=False, generator=generator)
