"""What a plan moves between ranks, in rows and bytes: the one price list of the runtime's
counters, the emulator, the analytic projection and the planner's link cost.

A row of an all-to-all is a hidden row, ``H·b`` bytes (``b`` bytes an element); a
backward dispatch row brings its pair index (int64) and scale (fp32), ``+ 12``; a
backward combine row its router gradient (fp32, ``+ 4``) where the experts compute it
(``BackwardOptions(router_grad="experts")`` on an exact plan). The weight scatter moves
one instance's weights per replica off its owner, the gradient reduce the same back.
Legend: G ranks, S slots per rank, E experts; ``_GG`` is ``[src rank, dst rank]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

BWD_ROW_EXTRA_BYTES = 12  # a backward dispatch row's pair index (int64) and scale (fp32)
ROW_DOT_BYTES = 4  # a backward combine row's router gradient (fp32)


@dataclass(frozen=True)
class RowBytes:
    """Bytes per row of each stage (module doc). ``row``: ``H·b``; ``instance``: one
    instance's weights; ``dot``: backward combine rows carry their router gradient."""

    row: int
    instance: int = 0
    dot: bool = False

    @property
    def bwd_dispatch(self) -> int:
        return self.row + BWD_ROW_EXTRA_BYTES

    @property
    def bwd_combine(self) -> int:
        return self.row + ROW_DOT_BYTES * self.dot

    def of(self, stage: str) -> int:
        return {"fwd_dispatch": self.row, "fwd_combine": self.row,
                "bwd_dispatch": self.bwd_dispatch, "bwd_combine": self.bwd_combine,
                "weight_scatter": self.instance, "grad_reduce": self.instance}[stage]


def replica_rows_GG(inst_GS: np.ndarray, E: int) -> np.ndarray:
    """``[owner, dst]`` instances each owner rank's experts have on each rank (the
    weight scatter's rows; the gradient reduce's transposed)."""
    G = inst_GS.shape[0]
    occ = inst_GS >= 0
    owner = inst_GS[occ] // (E // G)
    dst = np.broadcast_to(np.arange(G)[:, None], inst_GS.shape)[occ]
    return np.bincount(owner * G + dst, minlength=G * G).reshape(G, G)


def plan_rows_GG(plan, E: int) -> dict[str, Tensor]:
    """``[src, dst]`` rows of each stage under ``plan`` (a
    :class:`lrmoe.policy.plan.Plan`): its pairs, selected pairs and replicas."""
    fwd_GG = plan.assign_GGS.sum(2)
    bwd_GG = plan.select_GGS.sum(2)
    rep_GG = torch.from_numpy(replica_rows_GG(plan.inst_expert_GS.numpy(), E)).long()
    return {"fwd_dispatch": fwd_GG, "fwd_combine": fwd_GG.t().contiguous(),
            "bwd_dispatch": bwd_GG, "bwd_combine": bwd_GG.t().contiguous(),
            "weight_scatter": rep_GG, "grad_reduce": rep_GG.t().contiguous()}


def weight_scatter_bytes(plan, E: int, me: int, instance_bytes: int) -> int:
    """Bytes of instance weights rank ``me`` receives from other ranks' experts."""
    rep = replica_rows_GG(plan.inst_expert_GS.numpy(), E)[:, me]
    return int(rep.sum() - rep[me]) * instance_bytes
