"""What a placement costs on the run's link: the emulator's cost model (:mod:`lrmoe.sim.cost`)
as the planner sees it (docs/design.md §4, "lrmoe and the link").

Legend: G ranks, S slots per rank, E experts, H hidden, F expert intermediate size, K
prefixes of the replica placement's moves; ``_GG`` is ``[src rank, dst rank]``; numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lrmoe.errors import require
from lrmoe.traffic import BWD_ROW_EXTRA_BYTES, replica_rows_GG

FWD_FLOPS_PER_HF = 6  # three H·F GEMMs, two flops per multiply-add
BWD_FLOPS_PER_HF = 12  # input and weight gradients of each
RECOMPUTE_FLOPS_PER_HF = 4  # gate_up again: 2 of the 3 GEMMs


@dataclass(frozen=True)
class LinkCost:
    """The run's link (bytes per second per rank and direction, latency per peer; two
    levels unless ``node_size`` is 0) and expert GEMM rate (flop/s) as plain numbers;
    ``share``: the micro-batches one held placement's scatter and reduce serve."""

    bandwidth_Bps: float
    latency_s: float
    gemm_flops: float
    hidden: int
    intermediate: int
    bytes_act: int = 2
    bytes_w: int = 2
    node_size: int = 0
    inter_bandwidth_Bps: float = 0.0
    inter_latency_s: float = 0.0
    share: int = 1

    def __post_init__(self) -> None:
        require(self.bandwidth_Bps > 0 and self.gemm_flops > 0,
                f"link cost: bandwidth {self.bandwidth_Bps} B/s and GEMM rate "
                f"{self.gemm_flops} flop/s must be > 0")
        require(self.node_size == 0 or self.inter_bandwidth_Bps > 0,
                "link cost: a two-level link needs its inter-node bandwidth")
        require(isinstance(self.share, int) and self.share >= 1,
                f"link cost: share {self.share!r} must be an integer >= 1")

    def spans_nodes(self, G: int) -> bool:
        """Whether ``G`` ranks span more than one node of a two-level link."""
        return bool(self.node_size) and G > self.node_size

    @property
    def hf(self) -> float:
        return float(self.hidden) * self.intermediate

    @property
    def instance_bytes(self) -> int:
        """One instance's weights (SwiGLU: three H×F matrices); its gradient the same."""
        return 3 * self.hidden * self.intermediate * self.bytes_w

    def rows_seconds(self, rows_GG: np.ndarray):
        """``bytes_per_row -> seconds`` of an exchange of ``rows_GG`` rows, its row sums taken once."""
        G = rows_GG.shape[0]
        if self.spans_nodes(G):
            return lambda nbytes: float(exchange_seconds_G(
                rows_GG * nbytes, self.bandwidth_Bps, self.latency_s, self.node_size,
                self.inter_bandwidth_Bps, self.inter_latency_s).max())
        d = np.diagonal(rows_GG)
        top = max(int((rows_GG.sum(1) - d).max()), int((rows_GG.sum(0) - d).max()))
        lat = self.latency_s * (G - 1)
        return lambda nbytes: top * nbytes / self.bandwidth_Bps + lat if top else 0.0


def exchange_seconds_G(bytes_GG, bw: float, lat: float, node_size: int = 0,
                       inter_bw: float = 0.0, inter_lat: float = 0.0) -> np.ndarray:
    """Each rank's seconds in one all-to-all of ``bytes_GG`` ``[src, dst]`` (the diagonal,
    a rank's copy to itself, crosses no link): its ``max(sent, received)`` bytes /
    bandwidth + latency · (peers - 1); on a two-level link (``node_size`` ranks a node) the
    in-node and between-node bytes each at their link, the rank taking the longer. All
    zeros when no byte crosses a link."""
    b = np.array(bytes_GG, dtype=np.float64)
    np.fill_diagonal(b, 0.0)
    G = b.shape[0]
    if not b.any():
        return np.zeros(G)
    if not node_size or G <= node_size:
        return _alltoall_G(b, bw, lat, G)
    node = np.arange(G) // node_size
    same = node[:, None] == node[None, :]
    return np.maximum(_alltoall_G(b * same, bw, lat, node_size),
                      _alltoall_G(b * ~same, inter_bw, inter_lat, G - node_size + 1))


def _alltoall_G(b: np.ndarray, bw: float, lat: float, peers: int) -> np.ndarray:
    return np.maximum(b.sum(1), b.sum(0)) / bw + lat * max(peers - 1, 0)


def plan_seconds(cost: LinkCost, plan, E: int) -> float:
    """MODELLED seconds of the stages of one layer's step that ``plan``'s placement changes."""
    inst_GS = plan.inst_expert_GS.numpy()
    fwd_GG = plan.assign_GGS.numpy().sum(2)  # [home, rank]
    bwd_GG = plan.select_GGS.numpy().sum(2)
    row = cost.hidden * cost.bytes_act
    # recomputed rows run their gate_up inside the expert backward of their rank
    bwd_G = bwd_GG.sum(0) * BWD_FLOPS_PER_HF
    if plan.recompute_G is not None:
        bwd_G = bwd_G + plan.recompute_G.numpy() * RECOMPUTE_FLOPS_PER_HF
    t = (float(fwd_GG.sum(0).max()) * FWD_FLOPS_PER_HF
         + float(bwd_G.max())) * cost.hf / cost.gemm_flops
    f, b = cost.rows_seconds(fwd_GG), cost.rows_seconds(bwd_GG)
    t += 2 * f(row) + b(row + BWD_ROW_EXTRA_BYTES) + b(row)  # fwd dispatch and combine
    rep = cost.rows_seconds(replica_rows_GG(inst_GS, E))(cost.instance_bytes)
    return t + 2 * rep / cost.share


def prefix_seconds(cost: LinkCost, load_KG: np.ndarray, kept_KG: np.ndarray,
                   sent_KG: np.ndarray, recv_KG: np.ndarray, home_G: np.ndarray,
                   balance: float, min_keep: float, selection: bool) -> np.ndarray:
    """MODELLED seconds ``[K]`` of a layer's step after each prefix of the placement's moves,
    from per-rank loads alone (latencies every prefix pays alike left out)."""
    G = load_KG.shape[1]
    off = (G - 1) / G
    L = load_KG.astype(np.float64)
    k = kept_KG.astype(np.float64)
    if selection:
        M = k.sum(1, keepdims=True) / G
        trim = np.maximum(np.ceil(M + (1.0 - balance) * (k - M) - 1e-9),
                          np.minimum(k, np.ceil(min_keep * L)))
        sel = np.where(k > M, np.minimum(k, trim), k)
    else:
        sel = k
    row = cost.hidden * cost.bytes_act
    if not cost.spans_nodes(G):
        bw = rep_bw = cost.bandwidth_Bps
    else:  # rows spread evenly over G - 1 peers, in-node and between nodes: the slower
        inside = (cost.node_size - 1) / (G - 1)
        bw = 1.0 / max(inside / cost.bandwidth_Bps, (1 - inside) / cost.inter_bandwidth_Bps)
        rep_bw = cost.inter_bandwidth_Bps
    lmax, smax = L.max(1), sel.max(1)
    home = float(np.max(home_G)) * off
    kappa = sel.sum(1) / np.maximum(L.sum(1), 1.0)
    t = (lmax * FWD_FLOPS_PER_HF + smax * BWD_FLOPS_PER_HF) * cost.hf / cost.gemm_flops
    t += 2 * np.maximum(home, lmax * off) * row / bw
    t += np.maximum(home * kappa, smax * off) * (2 * row + BWD_ROW_EXTRA_BYTES) / bw
    reps = np.maximum(sent_KG, recv_KG).max(1).astype(np.float64)
    lat = cost.latency_s * (G - 1)
    return t + 2 * (reps * cost.instance_bytes / rep_bw + (reps > 0) * lat) / cost.share

