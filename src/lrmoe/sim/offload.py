"""Optimizer offload traffic of one MoE layer's step: bytes per rank -> MODELLED seconds.

Legend: G ranks, E experts, S slots per rank, P = 3HF parameters per expert. The stages
(``opt_d2h``, ``opt_host_update``, ``opt_h2d``; SYMI's sharded ``weight_scatter`` and
``grad_reduce``), their bytes, the datasheet peaks assumed and the measured overlap:
docs/design.md §9, "Optimizer offload".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lrmoe.errors import require
from lrmoe.sim.links import Link, exchange_time, rank_bytes

PCIE5_X16 = Link("pcie5-x16", 64e9, 5e-6,
                 source="PCI-SIG PCIe 5.0 x16: 32 GT/s per lane, 64 GB/s per direction "
                        "(datasheet peak, before encoding and protocol overheads)")
HOST_MEM_BPS = 8 * 38.4e9 * 2 / 8
HOST_MEM_SOURCE = ("2 sockets x 8 channels DDR5-4800 (38.4 GB/s each, JEDEC peak) shared by "
                   "8 GPUs: 76.8 GB/s per rank; the host AdamW taken as memory-bound")
HOST_UPDATE_FP32_BYTES = 24  # master, exp_avg, exp_avg_sq: read and written, 4 bytes each


@dataclass(frozen=True)
class MeasuredOverlap:
    """The measured share of the host optimizer's back-to-back stage time the trainer leaves
    exposed, and the ``benchmarks/offload_step.py`` run it comes from."""

    exposed_fraction: float
    source: str

    def __post_init__(self) -> None:
        require(0 < self.exposed_fraction <= 1.5,
                f"measured exposed fraction {self.exposed_fraction}: want (0, 1.5]")


# None until measured on the H200 (benchmarks/offload_step.py prints the candidate):
# the offload stages are charged back to back, in full.
MEASURED_OVERLAP: MeasuredOverlap | None = None


@dataclass(frozen=True)
class OffloadModel:
    """Per-rank offload bytes and modelled seconds of one MoE layer's step; ``overlap``
    ``None`` charges the stages back to back, in full."""

    E: int
    G: int
    P_params: int
    bytes_w: int
    layout: str  # "owner" or "sharded" (:func:`offload_for`)
    overlap: MeasuredOverlap | None = field(default_factory=lambda: MEASURED_OVERLAP)

    @property
    def host_params(self) -> int:
        """Parameters whose optimizer state one rank's host holds, per layer."""
        return self.E // self.G * self.P_params

    def rank_bytes(self) -> dict[str, list[int]]:
        """Per offload stage, each rank's bytes for one layer (the same whatever its slots)."""
        pcie = [self.host_params * self.bytes_w] * self.G
        return {"opt_d2h": pcie, "opt_h2d": list(pcie),
                "opt_host_update": [self.host_params * (HOST_UPDATE_FP32_BYTES
                                                        + 2 * self.bytes_w)] * self.G}

    def rank_seconds(self, inst_expert_GS, link: Link) -> dict[str, list[float]]:
        """MODELLED seconds per rank of the offload stages and, sharded, of ``weight_scatter`` and
        ``grad_reduce`` on the EP ``link``."""
        b = self.rank_bytes()
        f = 1.0 if self.overlap is None else self.overlap.exposed_fraction
        out = {k: [f * (x / PCIE5_X16.effective_Bps + PCIE5_X16.latency_s) for x in b[k]]
               for k in ("opt_d2h", "opt_h2d")}
        out["opt_host_update"] = [f * x / HOST_MEM_BPS for x in b["opt_host_update"]]
        for ex, m in self._sharded_GG(inst_expert_GS).items():
            out[ex] = exchange_time(m, link) if self.G > 1 else [0.0] * self.G
        return out

    def _sharded_GG(self, inst_expert_GS) -> dict:
        """The sharded layout's ``weight_scatter`` and ``grad_reduce`` bytes ``[src, dst]``."""
        if self.layout != "sharded":
            return {}
        # [src, dst]: each slot on dst gathers its expert's shard from every other rank
        occ = torch.as_tensor((inst_expert_GS >= 0).sum(1)).double()
        scatter = occ[None, :].expand(self.G, self.G) * self.P_params * self.bytes_w / self.G
        return {"weight_scatter": scatter, "grad_reduce": scatter.t()}

    def link_terms(self, inst_expert_GS) -> dict:
        """The sharded exchanges of :meth:`rank_seconds` as link-free terms
        (:func:`lrmoe.sim.cost.rank_link_terms`)."""
        return {ex: (int(self.G > 1), rank_bytes(m), [0.0] * self.G)
                for ex, m in self._sharded_GG(inst_expert_GS).items()}


def assumptions() -> str:
    """One line: the host link and memory bandwidth assumed, and how much is charged."""
    overlap, host_link = MEASURED_OVERLAP, PCIE5_X16
    charged = ("stages charged back to back, in full (the trainer's overlap is not measured "
               "yet)" if overlap is None else
               f"stages charged at {overlap.exposed_fraction:.3f} of their back-to-back time, "
               f"the exposed share measured in the trainer ({overlap.source})")
    return (f"host link {host_link.name} {host_link.bandwidth_Bps / 1e9:g} GB/s per direction "
            f"({host_link.source}); host memory {HOST_MEM_BPS / 1e9:g} GB/s per rank "
            f"({HOST_MEM_SOURCE}); {charged}; symi shards every expert 1/G over all ranks' "
            "hosts, static and lrmoe keep each expert's state with its owner")


def offload_for(ledger, policy: str) -> OffloadModel | None:
    """The offload model of ``policy`` under ``ledger`` (``None`` without host offload)."""
    if ledger is None or ledger.optimizer_offload != "host":
        return None
    # SYMI shards every expert's state over all ranks; static and lrmoe keep it with its owner
    return OffloadModel(ledger.E, ledger.G, ledger.P_params, ledger.bytes_w,
                        "sharded" if policy == "symi" else "owner")
