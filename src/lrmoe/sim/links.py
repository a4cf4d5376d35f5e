"""Link presets and the all-to-all time model of the virtual EP emulator (emulated):
datasheet peaks at published all-to-all efficiencies, each preset citing its figures
(docs/design.md §9, "Links as published")."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lrmoe.errors import require
from lrmoe.policy.link_cost import LinkCost, exchange_seconds_G


@dataclass(frozen=True)
class Link:
    """One GPU's link to its EP peers: a datasheet peak per direction, the fraction of it an
    all-to-all achieves (published, with its source), a latency per peer message, and for
    a two-level link the GPUs per node and the link between nodes."""

    name: str
    bandwidth_Bps: float
    latency_s: float
    efficiency: float = 1.0
    source: str = ""
    efficiency_source: str = ""
    node_size: int = 0
    inter: "Link | None" = None

    @property
    def effective_Bps(self) -> float:
        return self.bandwidth_Bps * self.efficiency


# ~3 us: the usual small-message NVLink/NVSwitch latency (vendor figure order, not measured)
NVLINK = Link(
    "nvlink", 450e9, 3e-6, efficiency=370 / 450,
    source="NVIDIA H100/H200 SXM datasheet: NVLink 4, 900 GB/s bidirectional",
    efficiency_source="published, not measured by us: 370 GB/s, the bus bandwidth NCCL "
                      "reaches on 8 H100 GPUs over NVLink 4 for collectives other than "
                      "all-reduce, alltoall_perf included (450 GB/s line rate less ~20% "
                      "protocol overhead), NCCL maintainer's answer in NVIDIA/nccl-tests "
                      "issue 212 (2024-05-06); H200 has the same NVLink 4")
# one 400 Gb/s port per GPU in a DGX/HGX H100 node = 50 GB/s per direction; ~5 us end to end
IB = Link(
    "ib", 50e9, 5e-6, efficiency=48 / 50,
    source="NVIDIA ConnectX-7 datasheet: NDR InfiniBand 400 Gb/s per port",
    efficiency_source="published, not measured by us: 48 GB/s, the low end of the 48-49 "
                      "GB/s per NIC that NVIDIA states ConnectX-7 NICs at NDR rate reach "
                      "in alltoall_perf (an all-to-all does not aggregate several NICs), "
                      "NVIDIA/nccl-tests issue 267 (2025-01-23)")
# GPUs without NVLink exchange through PCIe switches and the CPUs' root complexes; ~5 us
PCIE = Link(
    "pcie", 64e9, 5e-6, efficiency=28 / 64,
    source="PCI-SIG PCIe 5.0 x16: 32 GT/s per lane, 64 GB/s per direction",
    efficiency_source="published, not measured by us: 28 GB/s, the all_reduce_perf bus "
                      "bandwidth of 8 PCIe 5.0 GPUs without NVLink (RTX 5090) in "
                      "NVIDIA/nccl issue 1639 (2025-03-14), which the NCCL maintainer "
                      "answering there calls the expected CPU- and memory-bound rate of "
                      "8 flows both ways; an all-reduce figure (no published PCIe "
                      "alltoall_perf figure found), taken as the all-to-all rate")

LINKS: dict[str, Link] = {
    "nvlink": NVLINK,
    "ib": IB,
    "pcie": PCIE,
    # EP over several 8-GPU nodes (EP 16-32): NVLink inside a node, IB between nodes
    "nvlink+ib": replace(NVLINK, name="nvlink+ib", node_size=8, inter=IB),
}


def get_link(name: str) -> Link:
    require(name in LINKS, f"--link {name!r} is not known; use one of {', '.join(LINKS)}")
    return LINKS[name]


def rank_bytes(bytes_GG) -> list[float]:
    """Each rank's ``max(sent, received)`` bytes of one exchange ``[src, dst]``, self-copy aside."""
    b = torch.as_tensor(bytes_GG, dtype=torch.float64)
    b = b - torch.diag(torch.diagonal(b))
    return [max(x, y) for x, y in zip(b.sum(1).tolist(), b.sum(0).tolist())]


def exchange_time(bytes_GG, link: Link) -> list[float]:
    """Emulated seconds each rank spends in one exchange of ``bytes_GG`` ``[src, dst]`` on
    ``link`` (the model: :func:`lrmoe.policy.link_cost.exchange_seconds_G`)."""
    b, inter = torch.as_tensor(bytes_GG, dtype=torch.float64).numpy(), link.inter
    return exchange_seconds_G(b, link.effective_Bps, link.latency_s, link.node_size,
                              0.0 if inter is None else inter.effective_Bps,
                              0.0 if inter is None else inter.latency_s).tolist()


def link_cost(link: Link, gemm_flops: float, hidden: int, intermediate: int,
              bytes_act: int, bytes_w: int, share: int = 1):
    """``link`` and an expert GEMM rate as the plain numbers the lrmoe planner prices
    replicas with (:class:`lrmoe.policy.link_cost.LinkCost`); ``share``: micro-batches a
    held placement serves."""
    inter = link.inter
    return LinkCost(link.effective_Bps, link.latency_s, gemm_flops, hidden, intermediate,
                    bytes_act, bytes_w, link.node_size,
                    0.0 if inter is None else inter.effective_Bps,
                    0.0 if inter is None else inter.latency_s, share)
