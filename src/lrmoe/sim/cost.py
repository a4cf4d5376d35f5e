"""Emulated step time from the virtual EP emulator's per-rank stats (docs/design.md §9).

Each stage's time is its critical path: the slowest virtual rank. Expert stages use the
measured kernel time of each virtual rank; exchanges use :func:`lrmoe.sim.links.
exchange_time` on the exact ``[src, dst]`` bytes. Rows recomputed to fit a budget
(``Plan.recompute_G``) are run by the emulator as by the runtime, inside the expert
backward: their gate_up GEMM is measured in ``bwd_experts``. ``bwd_recompute`` is a
whole-layer checkpoint: one the emulator ran (``Plan.layer_checkpoint``) costs what its backward
measured: the forward's expert kernels again (``expert_ms["recompute"]``) and the
re-sent dispatch and combine (:data:`lrmoe.sim.vstats.RECOMPUTE_EXCHANGES`, from their
bytes; the re-run's local work is in ``local`` and ``gather``, measured); one it did not
run (``recompute_mode`` ``layer`` or ``over`` of modelled stats) costs each rank its
forward dispatch, experts and combine again. The control plane and the local work are charged
too: ``plan`` (the measured planning time, charged to every rank: each computes the
plan), ``count_exchange`` (modelled from bytes: the count all-gather, E int64 per peer,
and the sampled estimator's count exchange, S int64 per peer), and the measured
``select`` (metric, selection sorts, compaction), ``gather`` (saved rows gathered in
forward and backward) and ``local`` (counting, layouts, permutes, combine kernels)
(:data:`lrmoe.sim.virtual.MEASURED_STAGES`). Stages run one after another (no overlap
is modelled). Everything here is **emulated** cluster time, never measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lrmoe.errors import require
from lrmoe.parallel.held import placement_key
from lrmoe.sim.links import Link, exchange_time
from lrmoe.sim.vstats import EXCHANGES, MEASURED_STAGES, RECOMPUTE_EXCHANGES, VirtualStats

STAGES = ("plan", "count_exchange", "local", "fwd_dispatch", "fwd_experts", "fwd_combine",
          "select", "gather", "bwd_dispatch", "bwd_experts",
          "bwd_recompute", "bwd_combine", "weight_scatter", "grad_reduce",
          "opt_d2h", "opt_host_update", "opt_h2d")  # opt_*: --optimizer-offload host


@dataclass
class StepTimes:
    """Emulated seconds per stage (the slowest virtual rank each), summed over layers.

    ``non_moe`` is a measured time for the rest of the step (attention, dense layers,
    optimizer), passed in by the caller. ``per_rank`` keeps each stage's per-rank
    seconds (summed over layers) for inspection.
    """

    plan: float = 0.0
    count_exchange: float = 0.0
    local: float = 0.0
    select: float = 0.0
    gather: float = 0.0
    fwd_dispatch: float = 0.0
    fwd_experts: float = 0.0
    fwd_combine: float = 0.0
    bwd_dispatch: float = 0.0
    bwd_experts: float = 0.0
    bwd_recompute: float = 0.0
    bwd_combine: float = 0.0
    weight_scatter: float = 0.0
    grad_reduce: float = 0.0
    opt_d2h: float = 0.0
    opt_host_update: float = 0.0
    opt_h2d: float = 0.0
    non_moe: float = 0.0
    link: str = ""
    label: str = "emulated"
    per_rank: dict[str, list[float]] = field(default_factory=dict)

    def stages(self) -> dict[str, float]:
        return {s: getattr(self, s) for s in STAGES}

    @property
    def moe(self) -> float:
        return sum(self.stages().values())

    @property
    def total(self) -> float:
        return self.moe + self.non_moe


def rank_stage_seconds(stats: VirtualStats, link: Link) -> dict[str, list[float]]:
    """Per stage, each virtual rank's emulated seconds for one layer's step."""
    G = stats.plan.G
    out: dict[str, list[float]] = {}
    for ex in EXCHANGES:
        if ex not in stats.bytes_GG:
            out[ex] = [0.0] * G
            continue
        if sum(stats.bytes_sent(ex)) == 0:  # nothing crosses a link (one rank, or no replicas)
            out[ex] = [0.0] * G
        else:
            out[ex] = exchange_time(stats.bytes_GG[ex], link)
    counts = [[0.0] * G] + [out.pop(ex) for ex in ("count_allgather", "bwd_count_exchange")
                            if ex in out]
    out["count_exchange"] = [sum(v) for v in zip(*counts)]
    for k in MEASURED_STAGES:
        out[k] = [ms / 1e3 for ms in stats.stage_ms.get(k, [0.0] * G)]
    out["fwd_experts"] = [ms / 1e3 for ms in stats.expert_ms.get("fwd", [0.0] * G)]
    out["bwd_experts"] = [ms / 1e3 for ms in stats.expert_ms.get("bwd", [0.0] * G)]
    if "recompute" in stats.expert_ms:  # a whole-layer checkpoint, run: measured
        redo = [exchange_time(stats.bytes_GG[ex], link) if sum(stats.bytes_sent(ex)) else
                [0.0] * G for ex in RECOMPUTE_EXCHANGES]
        out["bwd_recompute"] = [ms / 1e3 + sum(v) for ms, *v in
                                zip(stats.expert_ms["recompute"], *redo)]
    elif stats.recompute_mode in ("layer", "over"):
        out["bwd_recompute"] = [a + b + c for a, b, c in
                                zip(out["fwd_dispatch"], out["fwd_experts"], out["fwd_combine"])]
    else:  # nothing, or rows recomputed inside the expert backward (measured there)
        out["bwd_recompute"] = [0.0] * G
    return out


# Stages priced on the EP link: their seconds follow from the terms below and the link
LINK_STAGES = ("count_exchange", "fwd_dispatch", "fwd_combine", "bwd_dispatch",
               "bwd_recompute", "bwd_combine", "weight_scatter", "grad_reduce")


def rank_bytes(bytes_GG) -> list[float]:
    """Each rank's ``max(sent, received)`` bytes of one exchange ``[src, dst]``, its copy
    to itself left out: what :func:`lrmoe.sim.links.alltoall_time` prices."""
    b = torch.as_tensor(bytes_GG, dtype=torch.float64)
    b = b - torch.diag(torch.diagonal(b))
    return [max(x, y) for x, y in zip(b.sum(1).tolist(), b.sum(0).tolist())]


def rank_link_terms(stats: VirtualStats) -> dict[str, tuple[int, list[float], list[float]]]:
    """Per :data:`LINK_STAGES` stage, the link-free terms of :func:`rank_stage_seconds`:
    ``(messages, bytes per rank, fixed seconds per rank)``, so that on a flat link each
    rank's seconds are ``fixed + bytes / bandwidth + messages · latency · (G - 1)``
    (:func:`price_terms`): ``messages`` counts the stage's exchanges with traffic,
    ``bytes`` sums their :func:`rank_bytes`, ``fixed`` is the measured or modelled
    compute of ``bwd_recompute`` (0 elsewhere)."""
    G = stats.plan.G

    def ex_terms(names, fixed=None):
        live = [ex for ex in names if ex in stats.bytes_GG and sum(stats.bytes_sent(ex))]
        per = [rank_bytes(stats.bytes_GG[ex]) for ex in live]
        return len(live), [sum(v) for v in zip(*per)] if per else [0.0] * G, \
            fixed or [0.0] * G

    out = {ex: ex_terms([ex]) for ex in LINK_STAGES if ex in EXCHANGES}
    out["count_exchange"] = ex_terms(["count_allgather", "bwd_count_exchange"])
    fwd = [ms / 1e3 for ms in stats.expert_ms.get("fwd", [0.0] * G)]
    if "recompute" in stats.expert_ms:
        out["bwd_recompute"] = ex_terms(RECOMPUTE_EXCHANGES,
                                        [ms / 1e3 for ms in stats.expert_ms["recompute"]])
    elif stats.recompute_mode in ("layer", "over"):
        out["bwd_recompute"] = ex_terms(["fwd_dispatch", "fwd_combine"], fwd)
    else:  # rows recomputed inside the expert backward are measured there
        out["bwd_recompute"] = ex_terms([])
    return out


def price_terms(charge: list, link: Link, G: int) -> float:
    """Emulated seconds of one recorded charge (``[messages, critical bytes]`` or
    ``[messages, bytes per rank, fixed per rank]``, see :func:`accumulated_times`) on
    ``link``: its slowest rank. A two-level link prices it only when the G ranks fit in
    one node (then it is its intra-node link); else the charge lacks the split."""
    require(not link.node_size or G <= link.node_size,
            f"--link {link.name}: {G} ranks span nodes of {link.node_size}, and the "
            "recorded bytes are not split into intra- and inter-node")
    lat = charge[0] * link.latency_s * max(G - 1, 0)
    if len(charge) == 2:
        return charge[1] / link.effective_Bps + lat
    return max(f + b / link.effective_Bps + lat for b, f in zip(charge[1], charge[2]))


def _record(terms: dict | None, t: dict) -> None:
    """Append one layer's link terms (:func:`rank_link_terms`) to ``terms``, compactly."""
    if terms is None:
        return
    for k, (m, b, f) in ((k, v) for k, v in t.items() if v is not None):
        if any(f):
            terms.setdefault(k, []).append([m, b, f])
        elif m:
            terms.setdefault(k, []).append([m, max(b)])


def step_times(stats: VirtualStats | list[VirtualStats], link: Link,
               non_moe_s: float = 0.0, offload=None) -> StepTimes:
    """Turn one or several layers' emulator stats into a :class:`StepTimes`.

    Per layer, each stage costs its slowest rank; layers add up (they run in sequence).
    ``offload`` (a :class:`lrmoe.sim.offload.OffloadModel`, ``--optimizer-offload
    host``) adds the modelled ``opt_*`` stages and, for SYMI's sharded layout, replaces
    the weight scatter and gradient reduce by its sharded exchanges.
    """
    layers = stats if isinstance(stats, list) else [stats]
    st = StepTimes(non_moe=non_moe_s, link=link.name)
    for s in layers:
        per = rank_stage_seconds(s, link)
        if offload is not None:
            per.update(offload.rank_seconds(s.plan.inst_expert_GS, link))
        _charge(st, per, s.plan.G)
    return st


def _charge(st: StepTimes, per: dict[str, list[float]], G: int) -> None:
    """Add one layer's per-rank stage seconds to ``st`` (each stage: its slowest rank)."""
    for k in STAGES:  # stages a layer does not have cost nothing
        per.setdefault(k, [0.0] * G)
    for k, v in per.items():
        setattr(st, k, getattr(st, k) + max(v))
        acc = st.per_rank.setdefault(k, [0.0] * len(v))
        st.per_rank[k] = [a + b for a, b in zip(acc, v)]


# Stages of a layer's replicas that need happen only once per optimizer step when the
# placement stays the same over the step's micro-batches (module doc of accumulated_times).
_PLACEMENT_STAGES = ("weight_scatter", "grad_reduce")


def _once_per_run(per: dict, t: dict, keys: list[bytes], m: int, G: int) -> None:
    """Micro-batch ``m``'s weight scatter only where it starts a run of micro-batches
    sharing a placement, its gradient reduce only where it ends one (the runtime's
    moves, :mod:`lrmoe.parallel.held`): the others zeroed in ``per`` and left out of
    ``t``."""
    for k, same in (("weight_scatter", m > 0 and keys[m] == keys[m - 1]),
                    ("grad_reduce", m < len(keys) - 1 and keys[m] == keys[m + 1])):
        if same:
            per[k] = [0.0] * G
            t.pop(k, None)


def accumulated_times(micro: list[list[VirtualStats]], link: Link,
                      non_moe_micro_s: list[float] | None = None, non_moe_step_s: float = 0.0,
                      offload=None, terms: dict | None = None
                      ) -> tuple[list[StepTimes], StepTimes]:
    """One optimizer step of N micro-batches (gradient accumulation): ``(per micro-batch
    StepTimes, the per-optimizer-step StepTimes)``; the step costs their sum.

    ``micro[m]`` holds micro-batch m's stats, one per MoE layer. Every micro-batch is
    charged its own forward and backward stages. Charged once per optimizer step, in the
    second :class:`StepTimes`:

    * the optimizer's offload stages (``opt_*``, with ``offload``): the weights and the
      optimizer state change only at the optimizer step;
    * a layer's ``weight_scatter`` and ``grad_reduce`` when its placement (the occupied
      slots' experts, :func:`~lrmoe.parallel.held.placement_key`) is the same in every
      micro-batch of the step (SYMI's, from the previous step's popularity; lrmoe's held
      one; static's): the slots keep their weights and add up their gradients over the
      micro-batches, so the replicas' weights arrive once and their gradients go home
      once, as the runtime does (:mod:`lrmoe.parallel.held`). A placement that changes
      within the step is charged as the runtime moves it: each run of consecutive
      micro-batches sharing a placement scatters at its first micro-batch and reduces at
      its last (lrmoe placing from each micro-batch's counts pays both in every one;
      SYMI giving replicas up at one micro-batch, or lrmoe's held placement left at one
      by a rung of its ladder, pay them again after it). Under the sharded offload
      layout (SYMI) they are the offload model's sharded exchanges: once, or every
      micro-batch (for its own placement) where the placement changed.

    ``non_moe_micro_s`` (per micro-batch) and ``non_moe_step_s`` (the optimizer's
    measured part) are the caller's per-rank non-MoE seconds. With one micro-batch the
    sum equals :func:`step_times` of that micro-batch.

    ``terms`` (a dict, filled): per :data:`LINK_STAGES` stage, the charges the step adds
    up, each one layer's slowest rank as link-free terms (``[messages, critical bytes]``,
    or ``[messages, bytes per rank, fixed seconds per rank]`` where the stage has compute
    too); :func:`price_terms` prices one on any flat link, so a recorded step can be
    re-priced for another link (``benchmarks/reprice_links.py``).
    """
    N = len(micro)
    require(N >= 1 and all(len(m) == len(micro[0]) for m in micro),
            "accumulated_times: every micro-batch needs one stats entry per MoE layer")
    non_moe_micro_s = non_moe_micro_s or [0.0] * N
    outs = [StepTimes(non_moe=non_moe_micro_s[m], link=link.name) for m in range(N)]
    step = StepTimes(non_moe=non_moe_step_s, link=link.name)
    for layer in range(len(micro[0])):
        stats = [m[layer] for m in micro]
        G = stats[0].plan.G
        keys = [placement_key(s.plan.inst_expert_GS.numpy()) for s in stats]
        fixed = all(k == keys[0] for k in keys)
        sharded = offload is not None and offload.layout == "sharded"
        once: dict[str, list[float]] = {}
        once_t: dict = {}
        for m, s in enumerate(stats):
            per = rank_stage_seconds(s, link)
            t = rank_link_terms(s) if terms is not None else {}
            if sharded and not fixed:  # its own slots' sharded exchanges
                off = offload.rank_seconds(s.plan.inst_expert_GS, link)
                per.update({k: off[k] for k in _PLACEMENT_STAGES if k in off})
                if terms is not None:
                    t.update(offload.link_terms(s.plan.inst_expert_GS))
            else:
                _once_per_run(per, t, keys, m, G)
            if fixed:  # the first micro-batch's weights arrive, the last's gradients leave
                for k, at in (("weight_scatter", 0), ("grad_reduce", N - 1)):
                    if m == at:
                        once[k], once_t[k] = per.get(k, [0.0] * G), t.get(k)
                    per[k] = [0.0] * G
                    t.pop(k, None)
            _charge(outs[m], per, G)
            _record(terms, t)
        if offload is not None:
            off = offload.rank_seconds(stats[-1].plan.inst_expert_GS, link)
            if not fixed:  # charged with each micro-batch above
                off = {k: v for k, v in off.items() if k not in _PLACEMENT_STAGES}
            once.update(off)
            if terms is not None and fixed:
                once_t.update(offload.link_terms(stats[-1].plan.inst_expert_GS))
        _charge(step, once, G)
        _record(terms, once_t)
    return outs, step
