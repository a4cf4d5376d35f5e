"""Emulated step time from the virtual EP emulator's per-rank stats: each stage costs its
slowest virtual rank, stages run one after another (what each charges: docs/design.md
§9). Everything here is **emulated** cluster time, never measured."""

from __future__ import annotations

from dataclasses import dataclass

from lrmoe.errors import require
from lrmoe.parallel.instances import placement_key
from lrmoe.sim.links import Link, exchange_time, rank_bytes
from lrmoe.sim.vstats import EXCHANGES, MEASURED_STAGES, RECOMPUTE_EXCHANGES, VirtualStats

STAGES = ("plan", "count_exchange", "local", "fwd_dispatch", "fwd_experts", "fwd_combine",
          "select", "gather", "bwd_dispatch", "bwd_experts",
          "bwd_recompute", "bwd_combine", "weight_scatter", "grad_reduce",
          "opt_d2h", "opt_host_update", "opt_h2d")  # opt_*: --optimizer-offload host


@dataclass
class StepTimes:
    """Emulated seconds per stage (the slowest virtual rank each), summed over layers;
    ``non_moe`` is the caller's measured rest of the step."""

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

    def stages(self) -> dict[str, float]:
        return {s: getattr(self, s) for s in STAGES}

    @property
    def moe(self) -> float:
        return sum(self.stages().values())

    @property
    def total(self) -> float:
        return self.moe + self.non_moe


def live(stats: VirtualStats, ex: str) -> bool:
    """Exchange ``ex`` sends bytes over a link (not one rank, not a layer without it)."""
    return ex in stats.bytes_GG and max(rank_bytes(stats.bytes_GG[ex])) > 0


def _seconds(ms_by_key: dict, key: str | None, G: int) -> list[float]:
    return [ms / 1e3 for ms in ms_by_key.get(key, [0.0] * G)]


def rank_stage_seconds(stats: VirtualStats, link: Link) -> dict[str, list[float]]:
    """Per stage, each virtual rank's emulated seconds for one layer's step."""
    G = stats.plan.G

    def exchange(ex: str) -> list[float]:
        return exchange_time(stats.bytes_GG[ex], link) if live(stats, ex) else [0.0] * G
    out = {k: [f + sum(v) for f, *v in zip(fixed, *map(exchange, names))]
           for k, (names, fixed) in _groups(stats).items()}
    for k in MEASURED_STAGES:
        out[k] = _seconds(stats.stage_ms, k, G)
    out["fwd_experts"] = _seconds(stats.expert_ms, "fwd", G)
    out["bwd_experts"] = _seconds(stats.expert_ms, "bwd", G)
    return out


def _recompute(stats: VirtualStats) -> tuple[tuple[str, ...], str | None]:
    """What ``bwd_recompute`` re-runs: the exchanges it sends again and the expert kernels
    (``expert_ms`` key) it runs again. A whole-layer checkpoint's re-run is measured; one the
    plan needs but did not run is the forward again, modelled; rows recomputed inside the
    expert backward are measured there (nothing here)."""
    if "recompute" in stats.expert_ms:
        return RECOMPUTE_EXCHANGES, "recompute"
    if stats.recompute_mode in ("layer", "over"):
        return ("fwd_dispatch", "fwd_combine"), "fwd"
    return (), None


# Stages priced on the EP link: their seconds follow from the terms below and the link
LINK_STAGES = ("count_exchange", "fwd_dispatch", "fwd_combine", "bwd_dispatch",
               "bwd_recompute", "bwd_combine", "weight_scatter", "grad_reduce")


def _groups(stats: VirtualStats) -> dict[str, tuple[tuple[str, ...], list[float]]]:
    """Per :data:`LINK_STAGES` stage of one layer's step, the exchanges it sends and each
    rank's seconds besides them (a re-run's expert kernels)."""
    G = stats.plan.G
    out = {ex: ((ex,), [0.0] * G) for ex in LINK_STAGES if ex in EXCHANGES}
    out["count_exchange"] = (("count_allgather", "bwd_count_exchange"), [0.0] * G)
    names, kernels = _recompute(stats)
    out["bwd_recompute"] = (names, _seconds(stats.expert_ms, kernels, G))
    return out


def rank_link_terms(stats: VirtualStats) -> dict[str, tuple[int, list[float], list[float]]]:
    """Per :data:`LINK_STAGES` stage, :func:`rank_stage_seconds` as link-free terms
    ``(messages, bytes per rank, fixed seconds per rank)`` that :func:`price_terms` prices."""
    out = {}
    for k, (names, fixed) in _groups(stats).items():
        sent = [ex for ex in names if live(stats, ex)]
        per = [rank_bytes(stats.bytes_GG[ex]) for ex in sent]
        out[k] = len(sent), [sum(v) for v in zip(*per)] if per else [0.0] * stats.plan.G, fixed
    return out


def price_terms(charge: list, link: Link, G: int) -> float:
    """Emulated seconds of one recorded charge on a flat ``link`` (a two-level one only when
    the G ranks fit in one node): its slowest rank."""
    require(not link.node_size or G <= link.node_size,
            f"--link {link.name}: {G} ranks span nodes of {link.node_size}, and the "
            "recorded bytes are not split into intra- and inter-node")
    lat = charge[0] * link.latency_s * max(G - 1, 0)
    if len(charge) == 2:
        return charge[1] / link.effective_Bps + lat
    return max(f + b / link.effective_Bps + lat for b, f in zip(charge[1], charge[2]))


def _record(terms: dict, t: dict) -> None:
    """Append one layer's link terms (:func:`rank_link_terms`) to ``terms``, compactly."""
    for k, (m, b, f) in t.items():
        if any(f):
            terms.setdefault(k, []).append([m, b, f])
        elif m:
            terms.setdefault(k, []).append([m, max(b)])


def step_times(stats: VirtualStats, link: Link, non_moe_s: float = 0.0, offload=None
               ) -> StepTimes:
    """One layer's emulator stats as a :class:`StepTimes`; ``offload`` adds the modelled
    ``opt_*`` stages and SYMI's sharded exchanges."""
    st = StepTimes(non_moe=non_moe_s, link=link.name)
    per = rank_stage_seconds(stats, link)
    if offload is not None:
        per.update(offload.rank_seconds(stats.plan.inst_expert_GS, link))
    _charge(st, per, stats.plan.G)
    return st


def _charge(st: StepTimes, per: dict[str, list[float]], G: int) -> None:
    """Add one layer's per-rank stage seconds to ``st`` (each stage: its slowest rank)."""
    for k in STAGES:  # stages a layer does not have cost nothing
        per.setdefault(k, [0.0] * G)
    for k, v in per.items():
        setattr(st, k, getattr(st, k) + max(v))


# a layer's replica stages, once per optimizer step while its placement stays the same
_PLACEMENT_STAGES = ("weight_scatter", "grad_reduce")


def _once_per_run(per: dict, t: dict, keys: list[bytes], m: int, G: int) -> None:
    """Micro-batch ``m``'s weight scatter only where it starts a run of micro-batches
    sharing a placement, its gradient reduce only where it ends one (the runtime's
    moves, :mod:`lrmoe.parallel.instances`): the others zeroed in ``per`` and left out of
    ``t``."""
    for k, same in (("weight_scatter", m > 0 and keys[m] == keys[m - 1]),
                    ("grad_reduce", m < len(keys) - 1 and keys[m] == keys[m + 1])):
        if same:
            per[k] = [0.0] * G
            t.pop(k, None)


def accumulated_times(micro: list[list[VirtualStats]], link: Link,
                      non_moe_micro_s: list[float] | None = None, non_moe_step_s: float = 0.0,
                      offload=None, *, terms: dict) -> tuple[list[StepTimes], StepTimes]:
    """One optimizer step of N micro-batches (``micro[m]``: micro-batch m's stats per MoE
    layer): ``(StepTimes per micro-batch, StepTimes of what is charged once per optimizer
    step)`` (docs/design.md §9, "Gradient accumulation in the emulator"); ``terms`` is
    filled with each charge's link-free terms for re-pricing on another link."""
    N = len(micro)
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
            t = rank_link_terms(s)
            if sharded and not fixed:  # its own slots' sharded exchanges
                off = offload.rank_seconds(s.plan.inst_expert_GS, link)
                per.update({k: off[k] for k in _PLACEMENT_STAGES if k in off})
                t.update(offload.link_terms(s.plan.inst_expert_GS))
            else:
                _once_per_run(per, t, keys, m, G)
            if fixed:  # the first micro-batch's weights arrive, the last's gradients leave
                for k, at in (("weight_scatter", 0), ("grad_reduce", N - 1)):
                    if m == at:
                        once[k], once_t[k] = per[k], t[k]
                    per[k] = [0.0] * G
                    t.pop(k, None)
            _charge(outs[m], per, G)
            _record(terms, t)
        if offload is not None:
            off = offload.rank_seconds(stats[-1].plan.inst_expert_GS, link)
            if not fixed:  # charged with each micro-batch above
                off = {k: v for k, v in off.items() if k not in _PLACEMENT_STAGES}
            once.update(off)
            if fixed:
                once_t.update(offload.link_terms(stats[-1].plan.inst_expert_GS))
        _charge(step, once, G)
        _record(terms, once_t)
    return outs, step
