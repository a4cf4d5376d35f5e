"""Link presets and the all-to-all time model of the virtual EP emulator (emulated).

Numbers are vendor datasheet figures (peak, per GPU, per direction), not measurements;
achieved all-to-all bandwidth is lower (NCCL typically reaches 70-90% of them on large
messages), which ``efficiency`` lets a caller model. Latencies are order-of-magnitude
per-message figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from lrmoe.errors import LrmoeError


@dataclass(frozen=True)
class Link:
    """One GPU's link to its EP peers.

    Attributes:
        name: preset name.
        bandwidth_Bps: bytes per second per direction per GPU.
        latency_s: seconds per peer message.
        efficiency: fraction of ``bandwidth_Bps`` an all-to-all achieves (1 = peak).
        source: where the numbers come from.
    """

    name: str
    bandwidth_Bps: float
    latency_s: float
    efficiency: float = 1.0
    source: str = ""

    @property
    def effective_Bps(self) -> float:
        return self.bandwidth_Bps * self.efficiency


LINKS: dict[str, Link] = {
    # NVIDIA H100 / H200 SXM datasheets: "NVLink: 900 GB/s" (4th-generation NVLink,
    # bidirectional total per GPU), i.e. 450 GB/s per direction; ~3 us is the usual
    # small-message NVLink/NVSwitch latency (vendor figure order, not measured here).
    "nvlink": Link("nvlink", 450e9, 3e-6,
                   source="NVIDIA H100/H200 SXM datasheet: NVLink 4, 900 GB/s bidirectional"),
    # NVIDIA ConnectX-7 / Quantum-2 datasheets: NDR InfiniBand, 400 Gb/s per port, one
    # port per GPU in a DGX/HGX H100 node = 50 GB/s per direction; ~5 us end to end.
    "ib": Link("ib", 50e9, 5e-6,
               source="NVIDIA ConnectX-7 datasheet: NDR InfiniBand 400 Gb/s per port"),
    # PCI-SIG PCIe 5.0: 32 GT/s per lane, x16 = ~63 GB/s raw per direction, ~55 GB/s
    # after encoding and protocol overhead (commonly quoted usable figure); ~5 us.
    "pcie": Link("pcie", 55e9, 5e-6,
                 source="PCI-SIG PCIe 5.0 x16: 32 GT/s/lane (~63 GB/s raw, ~55 GB/s usable)"),
}


def get_link(name: str) -> Link:
    if name not in LINKS:
        raise LrmoeError(f"--link {name!r} is not known; use one of {', '.join(LINKS)}")
    return LINKS[name]


def alltoall_time(bytes_sent_G: list[float], bytes_recv_G: list[float], link: Link,
                  G: int | None = None) -> list[float]:
    """Emulated seconds each rank spends in one all-to-all.

    ``max(sent, received) / bandwidth + latency * (G - 1)``: a rank's send and receive
    directions run concurrently, and it exchanges one message with each of its G - 1
    peers. Bytes should exclude a rank's copy to itself (no link carries it).
    """
    G = len(bytes_sent_G) if G is None else G
    bw = link.effective_Bps
    lat = link.latency_s * max(G - 1, 0)
    return [max(s, r) / bw + lat for s, r in zip(bytes_sent_G, bytes_recv_G)]
