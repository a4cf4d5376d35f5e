"""SYMI's ``s`` for ``lrmoe bench ttl``: the least modelled time with every cost charged,
its GEMM rate calibrated on the static run's measured forward expert kernels
(docs/design.md §9)."""

from __future__ import annotations

import statistics

import torch

from lrmoe.policy.symi import best_slots
from lrmoe.sim.analytic import symi_slot_choice


def calibrated_gemm_rate(rows: list[dict], counts_GE_steps: list[list[list[torch.Tensor]]],
                         H: int, F: int) -> float | None:
    """flop/s of the static run's forward expert kernels: per step (the first skipped:
    warm-up), the busiest native rank's ``6·H·F`` flops per pair summed over layers and
    micro-batches (``counts_GE_steps[step][micro_batch][layer]``), over the emulated
    ``fwd_experts`` stage (the slowest rank per layer and micro-batch, summed); the
    median over steps. ``None`` when nothing was timed."""
    rates = []
    for row, micro in list(zip(rows, counts_GE_steps))[1:]:
        t = row["stages_emulated_s"]["fwd_experts"]
        flops = 0
        for c in (c for layers in micro for c in layers):
            G, E = c.shape
            flops += int(c.long().sum(0).reshape(G, E // G).sum(1).max()) * 6 * H * F
        if t > 0 and flops > 0:
            rates.append(flops / t)
    return statistics.median(rates) if rates else None


def symi_slots(mcfg, ledger, counts: list[torch.Tensor], pops: list[torch.Tensor], link,
               rate: float | None) -> tuple[int, str]:
    """``(s, note)``: :func:`lrmoe.sim.analytic.symi_slot_choice` over the profiled
    count matrices at the calibrated ``rate``; :func:`lrmoe.policy.symi.best_slots`
    (least busiest-rank GEMM work) when no rate could be calibrated."""
    G, E = counts[0].shape
    if rate is None:
        s, n_fit = best_slots(ledger, counts, pops, max_slots=2 * E // G)
        return s, (f"s={s}: least busiest-rank work among the s that fit (with recompute) "
                   f"the most profiled static micro-batches ({n_fit}/{len(counts)} layer-micro-batches)")
    s, n_fit = symi_slot_choice(mcfg, ledger, counts, pops, link, rate)
    if n_fit is not None:  # no s fits every step: say which rule chose it
        return s, (f"s={s}: no s fits (with recompute) every profiled static micro-batch; the "
                   f"s that fits the most ({n_fit}/{len(counts)} layer-micro-batches), least "
                   "busiest-rank work among those")
    off = " and the optimizer offload traffic" if ledger.optimizer_offload == "host" else ""
    return s, (f"s={s}: least modelled MoE time (GEMMs at the static run's measured "
               f"{rate / 1e9:.3g} GFLOP/s, recompute, exchanges, weight scatter, gradient "
               f"reduce{off}) among the s that fit every profiled static micro-batch")
