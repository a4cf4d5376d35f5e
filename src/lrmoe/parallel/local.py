"""The one-process exact path: the exchange's stage sequence with no plan, no
collective and no host wait.

On one process with the static policy's plan within the budget (:func:`runs_locally`:
instance = expert, every pair retained and selected, nothing recomputed) the plan, its
layouts and the collectives are identities, yet the exchange builds all of them on the
host from the counts. This path runs the same :class:`~lrmoe.parallel.exchange.ExpertExchange`
from device tensors alone (:func:`run_local`): the rank's pairs are one block of ``P``
rows (:class:`OneBlock`: host numbers known from the shapes), sorted by expert on the
device (the stable sort ``home_layout`` does), cut per expert by int32 offsets from the
device counts (``ExchangeState.offs``), over a transport with no collectives
(:class:`LocalTransport`). Same kernels in the same order, so its results are bitwise
the exchange's. On CUDA with grouped GEMMs nothing in its forward or backward waits for
the host (``tests/test_local_path.py`` runs it on the meta device, where any host read
fails).

Legend: T tokens, K top-k, P = T*K pairs, E experts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from lrmoe.ops.rowops import invert_permutation
from lrmoe.parallel.exchange import BackwardOptions, ExchangeState, ExpertExchange, GroupTransport
from lrmoe.parallel.layout import HomeLayout, RecvLayout
from lrmoe.parallel.stages import Retention


def expert_counts(idx_P: Tensor, E: int) -> Tensor:
    """Pairs per expert ``[E]`` (int64), without the host sync of CUDA's ``bincount``
    (which reads the largest index to size its output)."""
    return torch.zeros(E, dtype=torch.long, device=idx_P.device).scatter_add_(
        0, idx_P, torch.ones_like(idx_P))


def runs_locally(rt, E: int, P: int) -> bool:
    """The rule of the one-process path (an :class:`lrmoe.model.moe.MoERuntime` ``rt``,
    ``E`` experts, ``P`` pairs): one rank, at least one pair, a policy that plans every
    expert's pairs on its own instance exactly (``plans_natives_exactly()``: plain
    static), the selection knobs at their defaults (inert on an exact plan;
    ``router_grad`` is honoured), and no budget or one the ledger says that plan fits.
    Then the plan is the identity, whatever the counts: the same experts, every pair
    retained and selected, nothing recomputed. Over the budget the exchange runs, where
    the policy recomputes or raises, as on any rank count."""
    if not rt.fast_local or rt.comm.size != 1 or P == 0 or not rt.policy.plans_natives_exactly():
        return False
    if dataclasses.replace(rt.backward, router_grad="home") != BackwardOptions():
        return False
    budget = None if rt.ledger is None else rt.ledger.budget_bytes
    return budget is None or one_rank_total(rt.ledger, E, P) <= budget


def one_rank_total(ledger, E: int, P: int) -> int:
    """The ledger's total for the identity plan on one rank: ``E`` instances, ``P``
    pairs received, home and retained, nothing recomputed."""
    return ledger.terms(E, P, P, P, exact=True)["total"]


def local_stats(ledger, E: int, counts_E: Tensor, P: int) -> dict:
    """The plan's stats of the identity plan (as the exchange's ``_plan_stats`` has
    them); ``counts_E`` stays the device tensor (no host sync): readers resolve it
    (:func:`lrmoe.model.moe.host_stats`)."""
    stats = {"plan_replicas": 0, "count_exchange_ms": 0.0, "plan_ms": 0.0,
             "weight_scatter_bytes": 0, "rank_load": [P], "rank_backward_load": [P],
             "recomputed_rows": 0, "layer_checkpoint": False, "counts_E": counts_E}
    if ledger is not None:
        stats["ledger_total_bytes"] = one_rank_total(ledger, E, P)
    return stats


@dataclasses.dataclass(frozen=True)
class OneBlock:
    """The plan as the one-process path's stage sequence reads it: one rank, one slot
    (the ``E`` experts' grouped weights, cut per expert on the device by
    ``ExchangeState.offs``) receiving all ``P`` pairs from itself, every one retained and
    selected: the :class:`~lrmoe.policy.plan.Plan` attributes an exact one-rank exchange
    reads, in numpy rather than torch, so no op touches them."""

    P: int
    exact = all_retained = all_selected = True
    recompute_G = None

    @property
    def assign_GGS(self) -> np.ndarray:
        return np.full((1, 1, 1), self.P)

    retain_GGS = select_GGS = assign_GGS


class LocalTransport(GroupTransport):
    """One process, no collectives: every buffer stays where it is. Counters into
    ``stats``; only the expert kernels are timed."""

    def __init__(self, stats: dict, device: torch.device):
        self.stats, self.device, self.timing = stats, device, False
        self.ranks, self.exchange_counts = [0], None

    def all_to_all(self, send_G, send_splits_G, recv_splits_G) -> list[Tensor]:
        return send_G


def run_local(x_TH: Tensor, gate_TK: Tensor, w13_E: Tensor, w2_E: Tensor, idx_TK: Tensor,
              counts_E: Tensor, opts: BackwardOptions, stats: dict) -> Tensor:
    """``out_TH``: :class:`~lrmoe.parallel.exchange.ExpertExchange` on one process for
    the identity plan, its layouts built on the device. Kept for backward: the exchange's
    rows, per pair two int64 indices (its row, the pair of each row; no row-in-block:
    only selection reads it) and the ``E`` int32 offsets."""
    T, K = gate_TK.shape
    P = T * K
    # dispatch order: the pairs sorted by expert, stably (home_layout's order on one rank)
    pair_R = torch.argsort(idx_TK.reshape(-1), stable=True)
    one = np.array([P])
    home = HomeLayout(invert_permutation(pair_R, P), False, pair_R, None, one, one, one, [P])
    # the rows per expert stay on the device: the grouped GEMMs read them there; the
    # per-expert loop fallback reads them from the offsets where it runs
    st = ExchangeState(LocalTransport(stats, x_TH.device), OneBlock(P), [home], K, opts, [None],
                       [None], offs=counts_E.cumsum(0).to(torch.int32))
    return ExpertExchange.apply(x_TH, gate_TK, w13_E, w2_E, st, RecvLayout([P], [P], None),
                                Retention(one))
