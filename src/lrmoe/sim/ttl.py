"""Time to target loss on emulated G-rank expert parallelism (docs/design.md §9).

Every policy trains the same model (same seed) on the same batches; every MoE layer's
training forward runs through :class:`lrmoe.sim.virtual.VirtualEPLayer` over G virtual
ranks (global batch row ``g*B/G .. (g+1)*B/G - 1`` is home rank g's), so the numbers are
those of a real G-rank EP run with that policy. Validation uses the layer's own
single-process forward (the forward of every policy here is exact and dropless).

Per step this records:

* ``moe_emulated_s``: :func:`lrmoe.sim.cost.step_times` summed over the MoE layers
  (slowest virtual rank per stage; measured per-rank expert kernels, selection, gathers
  and local kernels, measured planning charged to every rank, modelled links and count
  exchanges);
* ``moe_wall_s`` (measured): the emulator's own wall time, per MoE layer the forward
  call (count, plan, G ranks' experts and exchanges) plus the backward from the grad
  hook on the layer's output to the end of the exchange's backward — the router and
  the shared experts are left out (they are per-token work, charged below); the
  emulator's own assembly of the G ranks' gradients is inside it;
* ``non_moe_measured_s``: step wall (batch fetch .. after ``end_step``) minus
  ``moe_wall_s``: embedding, attention, dense MLPs, norms, the routers and shared
  experts, head, loss, clipping, AdamW over all parameters, for all G ranks' tokens in
  this one process;
* ``non_moe_s = non_moe_measured_s / G``: the per-rank share (modelled: assumes that
  work splits evenly over the G ranks), and ``step_emulated_s = moe_emulated_s +
  non_moe_s``. All ``*_emulated_s`` are **emulated**, never measured cluster time.
* ``compiles``: what the step compiled (:func:`compiles_so_far`), a one-off cost inside
  its measured times;
* ``link_terms``: each link-priced stage's charges as link-free terms (bytes per rank,
  messages, compute seconds; :func:`lrmoe.sim.cost.accumulated_times`), so the step can be
  re-priced exactly for another link (``benchmarks/reprice_links.py``).

The target, the budget rules (out of memory, rungs), ``--router-grad``, ``--reuse`` and
``--deterministic``: docs/design.md §9.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from lrmoe.data import PackedBatches, build_streams, load_corpus, validation_batches
from lrmoe.errors import LrmoeError, OutOfMemory, require
from lrmoe.ledger import Ledger
from lrmoe.model import MoEForCausalLM
from lrmoe.model.compile import compile_model
from lrmoe.parallel.groups import ParallelContext
from lrmoe.policy.lrmoe import HELD
from lrmoe.policy.registry import PolicyConfig, make_policy
from lrmoe.sim import ttl_budget
from lrmoe.sim.cost import STAGES, accumulated_times, live
from lrmoe.sim.links import get_link, link_cost, rank_bytes
from lrmoe.sim.offload import assumptions as offload_assumptions
from lrmoe.sim.offload import offload_for
from lrmoe.sim.target import crossing, eval_noise, target_at
from lrmoe.sim.ttl_config import (
    TTLConfig,
    check_ttl_config,
    policy_variant,
    recorded_settings,
    with_knobs,
)
from lrmoe.sim.ttl_symi import calibrated_gemm_rate, symi_slots
from lrmoe.sim.virtual import now
from lrmoe.sim.vmodel import Emulator, release_graph, warm_up
from lrmoe.sim.vstats import EXCHANGES, pair_ratios
from lrmoe.tokenizer import check_vocab
from lrmoe.tokenizer_load import load_tokenizer
from lrmoe.train.accum import accumulate, update
from lrmoe.train.config import TrainConfig, resolve_model_config
from lrmoe.train.loop import evaluate, make_autocast, val_windows
from lrmoe.train.offload import last_backward_hook
from lrmoe.train.optim import build_optimizer, build_scheduler
from lrmoe.train.step_oom import allocator_words, verdict
from lrmoe.units import parse_bytes

OOM = "OOM"  # a ratio involving a policy that ran out of memory


def _profile(counts_GE_steps: list[list[list[torch.Tensor]]], n: int = 24
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every micro-batch's ``[G, E]`` counts (all layers) of up to ``n`` evenly spaced
    steps of a run (``counts_GE_steps[step][micro_batch][layer]``), each with its
    popularity: the previous step's global counts, summed over its micro-batches (what
    the runtime keeps, and SYMI uses)."""
    T = len(counts_GE_steps)
    picks = sorted({min(T - 1, 1 + round(i * (T - 2) / max(n - 1, 1))) for i in range(n)}) \
        if T > 1 else [0]
    counts, pops = [], []
    for t in picks:
        prev = counts_GE_steps[max(t - 1, 0)]
        for micro in counts_GE_steps[t]:
            for layer, c in enumerate(micro):
                counts.append(c)
                pops.append(sum(m[layer] for m in prev).sum(0))
    return counts, pops


PLACEMENT_NOTES = {"current": "", "previous": ", placement from the previous step's counts",
                   "step": ", placement held for the optimizer step (from its first "
                           "micro-batch's counts)",
                   "step-previous": ", placement held for the optimizer step (from the "
                                    "previous step's counts)"}


def _choose(name, cfg, mcfg, ledger, profile=None):
    """``(PolicyConfig, config note)`` of policy ``name`` under the budget rules
    (docs/design.md §9: the exact policies recompute to fit ``ledger``); symi's ``s`` is
    chosen on ``profile``, the static run's counts and GEMM rate."""
    G, E = cfg.train.ep, mcfg.num_experts
    lc = cfg.lrmoe.planner
    slots, note = cfg.slots_per_rank, ""
    rate = profile[2] if profile else None
    if name == "lrmoe" and cfg.lrmoe.link_cost and rate is not None:
        wb = 2 if cfg.train.device == "cuda" else 4  # budget_ledger's dtype
        share = cfg.train.grad_accum if lc.placement in HELD else 1
        lc = replace(lc, link=link_cost(get_link(cfg.link), rate, mcfg.hidden_size,
                                        mcfg.moe_intermediate_size, wb, wb, share))
    if name == "symi" and slots is None and ledger is not None:
        prof_c, prof_p, rate = profile  # static runs first: its profile is there
        try:
            slots, note = symi_slots(mcfg, ledger, prof_c, prof_p, get_link(cfg.link), rate)
        except LrmoeError:
            slots = E // G
            note = (f"s={slots} (E/G): no s fits the profiled steps even with a whole-layer "
                    "checkpoint")
    elif name == "symi":
        slots = slots if slots is not None else E // G + 2
        note = f"s={slots}"
    elif name == "lrmoe":
        slots = lc.max_slots_per_rank if lc.max_slots_per_rank is not None else slots
        note = (f"max slots {slots if slots is not None else E // G + 2}, min_keep "
                f"{lc.min_keep}, {cfg.lrmoe.backward.estimator}"
                + (", recompute" if lc.recompute else "")
                + PLACEMENT_NOTES[lc.placement]
                + (f", replicas weighed against their {cfg.link} link cost (GEMMs at the "
                   f"static run's {rate / 1e9:.3g} GFLOP/s)" if lc.link is not None else
                   ", replicas not weighed against their link cost"))
    elif name == "static":
        note = f"s={E // G} (natives)"
    if name != "lrmoe" and ledger is not None:
        note += ", recompute to fit"
    if name != "lrmoe" and cfg.train.router_grad == "experts":
        note += ", router gradient at the experts (no combined rows kept)"
    pc = PolicyConfig(name=name, slots_per_rank=slots, lrmoe=lc,
                      recompute=name in ("static", "symi") and ledger is not None)
    return pc, note


def _eval_steps(t: TrainConfig) -> list[int]:
    """The steps a run evaluates after: 0, every ``eval_every``-th and the last."""
    return [0] + [s for s in range(1, t.steps + 1)
                  if (t.eval_every and s % t.eval_every == 0) or s == t.steps]


def _val_eval(model, batches, dev, autocast) -> dict:
    """The validation loss over every trained target, as the trainer's (each batch weighted
    by its targets: prompt tokens train none), and the loss of each batch."""
    per = [evaluate(model, [b], ParallelContext(device=dev), autocast) for b in batches]
    loss = sum(x * n for x, n in per) / sum(n for _, n in per)
    return {"val_loss": loss, "val_batch_losses": [x for x, _ in per]}


def _step_row(step, loss, micro, opt_wall, link, G, ledger, cum, offload=None,
              host_s=0.0) -> dict:
    """One optimizer step's record (module doc). ``micro``: per micro-batch ``(its layers'
    stats, wall s, MoE wall s)``; ``opt_wall``: the measured seconds after the last one;
    with ``offload`` the measured host optimizer (``host_s``) is left out (modelled)."""
    stats = [s for m in micro for s in m[0]]  # every micro-batch's layers
    non_moe_micro = [max(w - mw, 0.0) for _, w, mw in micro]
    non_moe_opt = max(opt_wall - host_s, 0.0)
    terms: dict = {}
    outs, once = accumulated_times([m[0] for m in micro], link,
                                   [x / G for x in non_moe_micro], non_moe_opt / G, offload,
                                   terms=terms)
    total = sum(o.total for o in outs) + once.total
    moe = sum(o.moe for o in outs) + once.moe
    fwd = [s.plan.rank_load().double() for s in stats]
    bwd = [s.plan.rank_backward_load().double() for s in stats]
    ratios = pair_ratios([s.plan for s in stats], [s.recompute_rows for s in stats])
    moe_wall = sum(mw for _, _, mw in micro)
    row = {"step": step + 1, "train_loss": loss, "wall_s": sum(w for _, w, _ in micro) + opt_wall,
           "moe_wall_s": moe_wall, "non_moe_measured_s": sum(non_moe_micro) + non_moe_opt,
           "non_moe_s": total - moe,
           "moe_emulated_s": moe, "step_emulated_s": total, "cum_emulated_s": cum + total,
           "stages_emulated_s": {k: sum(getattr(o, k) for o in outs) + getattr(once, k)
                                 for k in STAGES},
           "micro_batches": len(micro),
           # per micro-batch and once per optimizer step (lrmoe.sim.cost.accumulated_times)
           "micro_batch_emulated_s": [
               {"moe_emulated_s": o.moe, "non_moe_s": o.non_moe, "step_emulated_s": o.total,
                "stages_emulated_s": o.stages()} for o in outs],
           "optimizer_step_emulated_s": {
               "moe_emulated_s": once.moe, "non_moe_s": once.non_moe,
               "step_emulated_s": once.total,
               "stages_emulated_s": {k: v for k, v in once.stages().items() if v}},
           "fwd_load_max_over_mean": _max_over_mean(fwd),
           "bwd_load_max_over_mean": _max_over_mean(bwd),
           "keep_ratio": ratios["keep_ratio"], "retain_ratio": ratios["retain_ratio"],
           "replicas": sum(s.plan.num_replicas() for s in micro[-1][0]),
           # every micro-batch's layers: replicas placed, and those a policy's own rule
           # chose but gave up, per reason (Plan.given_up_for): [layer-micro-batches,
           # replicas, most in one]
           "replicas_placed": sum(s.plan.num_replicas() for s in stats),
           "layer_micro_batches": len(stats),
           "replicas_given_up": _given_up(
               (s.plan.given_up_for, (1, s.plan.replicas_given_up, s.plan.replicas_given_up))
               for s in stats if s.plan.replicas_given_up),
           # the policies' placement from the previous step's counts (not charged)
           "prepare_ms": sum(s.prepare_ms for s in stats),
           "expert_load_max_over_mean": sum(_max_over_mean([s.counts_GE.sum(0).double()])
                                            for s in stats) / len(stats),
           # per exchange: the sum over layers of the critical rank's max(sent, received)
           # bytes and the layers with traffic, so the link model can be re-applied offline
           "exchange_critical_bytes": {
               ex: [sum(int(max(rank_bytes(s.bytes_GG[ex]))) for s in stats if ex in s.bytes_GG),
                    sum(1 for s in stats if live(s, ex))] for ex in EXCHANGES},
           # each link-priced stage's charges as link-free terms (lrmoe.sim.cost.price_terms):
           # what benchmarks/reprice_links.py re-prices exactly for another link
           "link_terms": {"G": G, "stages": terms}}
    if ledger is not None:  # each layer's emulator priced its plan (with recompute if any)
        peak = max(max(s.ledger_total_bytes) for s in stats)
        row.update({
            "recompute_modes": [s.recompute_mode for s in micro[-1][0]],
            "ledger_peak_bytes": peak,
            "recompute_ratio": ratios["recompute_ratio"],
            "fits": peak <= ledger.budget_bytes,  # else out of memory
            # how each layer met the budget, every micro-batch (lrmoe_ladder.RUNGS)
            "rungs": dict(sorted(Counter(s.rung for s in stats).items()))})
    return row


def budget_ledger(cfg: TTLConfig, mcfg, budget: int | None) -> Ledger:
    """The ledger a run prices its budget with: ``cfg.train.ep`` ranks, bf16 on CUDA (fp32 on
    the CPU), ``cfg.train.optimizer_offload``'s memory design, ``budget`` bytes per rank."""
    dtype = "bf16" if cfg.train.device == "cuda" else "fp32"
    return Ledger.for_dtype(mcfg, cfg.train.ep, budget, dtype, optimizer_offload=cfg.train.optimizer_offload)


def static_floor_ledger(cfg: TTLConfig, mcfg) -> Ledger:
    """The ledger static's whole-layer floor ``F`` is priced with (no budget)."""
    return policy_ledger(budget_ledger(cfg, mcfg, None), "static", cfg)


def policy_router_grad(name: str, cfg: TTLConfig) -> str:
    """Where policy ``name`` takes the router gradient (module doc: lrmoe always home)."""
    return "home" if name == "lrmoe" else cfg.train.router_grad


def policy_ledger(ledger: Ledger | None, name: str, cfg: TTLConfig) -> Ledger | None:
    """``ledger`` as policy ``name`` is priced (no combined rows kept where it takes the
    router gradient at the experts)."""
    if ledger is not None and policy_router_grad(name, cfg) == "experts":
        return replace(ledger, router_grad_at_experts=True)
    return ledger


@dataclass
class _PolicyRun:
    """One policy's training run, built as the trainer builds it, on the emulator."""

    name: str
    model: torch.nn.Module
    em: Emulator
    opt: torch.optim.Optimizer
    sched: object
    autocast: object
    ctx: object
    dev: torch.device
    ledger: Ledger | None
    offload: object  # lrmoe.sim.offload.OffloadModel with host offload, else None
    note: str


def run_policy(name, cfg, mcfg, batches, val_b, ledger, link, log=print, profile=None) -> dict:
    """Train with policy ``name`` for ``cfg.train.steps`` steps on ``cfg.train.ep``
    emulated ranks: its step rows, evaluations and verdict (module docstring)."""
    t = cfg.train
    run = _build_run(name, cfg, mcfg, ledger, profile)
    rows, trace_GE = [], []
    evals = [{"step": 0, **_val_eval(run.model, val_b, run.dev, run.autocast),
              "cum_emulated_s": 0.0}]
    run.model.train()
    failed = oom = None
    try:
        for step in range(t.steps):
            compiled = compiles_so_far()
            micro, opt_wall, loss = _train_step(run, step, batches, t)
            cum = rows[-1]["cum_emulated_s"] if rows else 0.0
            rows.append(_step_row(step, loss, micro, opt_wall, link, t.ep, run.ledger, cum,
                                  run.offload, getattr(run.opt, "host_s", 0.0)))
            rows[-1]["compiles"] = compiles_so_far() - compiled
            # every micro-batch's counts per home rank, its layers in order (what a plan
            # sees: symi's profile, the budget floor)
            trace_GE.append([[st.counts_GE for st in m[0]] for m in micro])
            done, cum = step + 1, rows[-1]["cum_emulated_s"]
            if done in _eval_steps(t):
                evals.append({"step": done, **_val_eval(run.model, val_b, run.dev, run.autocast),
                              "cum_emulated_s": cum})
                log(f"[{name}] step {done}/{t.steps} train {loss:.4f} val "
                    f"{evals[-1]['val_loss']:.4f} emulated {cum:.4f} s")
    except OutOfMemory as e:  # as a GPU would: the run stops at that step
        oom = {"step": len(rows) + 1, "needs_bytes": e.needs_bytes,
               "budget_bytes": e.budget_bytes, "detail": e.detail}
        failed = verdict(e, oom["step"])
        if name == "static":
            flag = ("--budget-floor-fraction" if cfg.budget_floor_fraction is not None
                    else "--mem-budget")  # the flag that set the budget
            raise LrmoeError(f"static (whose run sets the target) is {failed}: {e.detail}; "
                             f"raise {flag}") from None
        log(f"[{name}] {failed}")
    except LrmoeError as e:  # e.g. a non-finite loss
        if name == "static":
            raise
        failed = f"stopped at step {len(rows) + 1}: {e}"
        log(f"[{name}] {failed}")
    res = _policy_result(run, rows, evals, failed, oom)
    # the routing trace: each step's global counts per layer
    res["routing_trace"] = [[sum(c.sum(0) for c in layer).tolist() for layer in zip(*step)]
                            for step in trace_GE]
    res["_counts_GE"] = trace_GE
    del run
    _release(cfg)  # before the next run builds its model
    return res


def _build_run(name, cfg, mcfg, ledger, profile) -> _PolicyRun:
    """The planner (:func:`_choose`), the model, emulator, optimizer and schedule of
    policy ``name``'s run, as the trainer builds them (lrmoe.train.loop._build): with host
    offload the device keeps the experts in bf16 on CUDA, their fp32 masters on the
    "host" (here the emulating device: its cost is modelled per rank)."""
    t = cfg.train
    dev, G = torch.device(t.device), t.ep
    if dev.type == "cuda":  # this policy's own peak of the emulating process
        torch.cuda.reset_peak_memory_stats(dev)
    ledger = policy_ledger(ledger, name, cfg)
    pc, note = _choose(name, cfg, mcfg, ledger, profile)
    policy = make_policy(pc, mcfg, G)
    torch.manual_seed(t.seed)
    model = MoEForCausalLM(mcfg).to(dev)
    model.set_activation_checkpoint(t.activation_checkpoint)
    if t.compile:  # as lrmoe train --compile: all but the routed experts
        compile_model(model)
    opts = replace(cfg.lrmoe.backward, router_grad=policy_router_grad(name, cfg))
    # every policy plans against the budget (lrmoe's ladder, the exact policies' recompute);
    # a step where no fallback fits is out of memory: the run stops there (OutOfMemory)
    em = Emulator(model, G, policy, opts, ledger)
    opt = build_optimizer(model, t.lr, t.weight_decay, offload=t.optimizer_offload,
                          host=dev, router_lr_scale=t.router_lr_scale)
    sched = build_scheduler(opt, t.warmup, t.steps, t.min_lr_ratio)
    offload = offload_for(budget_ledger(cfg, mcfg, None), name)
    if offload is not None:
        note += f", optimizer offload to host ({offload.layout} layout)"
    return _PolicyRun(name, model, em, opt, sched, make_autocast(dev),
                      ParallelContext(device=dev), dev, ledger, offload, note)


def compiles_so_far() -> int:
    """Graphs Dynamo has compiled in this process and variants of lrmoe's own Triton
    kernels (one per specialization Triton met), so far."""
    from torch._dynamo.utils import counters

    n = counters["stats"]["unique_graphs"]
    for name in ("lrmoe.ops.rowops_triton", "lrmoe.ops.selection_triton"):
        module = sys.modules.get(name)  # not imported: none of its kernels ran
        for k in vars(module).values() if module is not None else ():
            n += sum(len(c[0]) for c in getattr(k, "device_caches", {}).values())
    return n


def _train_step(run: _PolicyRun, step: int, batches, t: TrainConfig
                ) -> tuple[list[tuple], float, float]:
    """One optimizer step as the trainer makes it: ``(micro, optimizer wall, loss)``,
    ``micro`` per micro-batch ``(its layers' stats, its wall from batch fetch to after
    its backward, its routed experts' wall)``, timed with the device synchronised."""
    run.em.set_step(step)
    run.opt.zero_grad(set_to_none=True)
    micro, clock, N = [], {}, t.grad_accum

    def on_micro(m: int, pair) -> None:
        at_s = now(run.dev)
        if pair is None:
            run.em.wall, clock["t0"] = 0.0, at_s
            return
        micro.append((run.em.stats(), at_s - clock["t0"], run.em.wall))
        release_graph(run.model)  # the aux losses hold the step's graph
    # a profiler range (free without a profiler), which benchmarks/non_moe_profile.py reads
    with torch.profiler.record_function("ttl:step"):
        # micro-batch m of step s: global batch s * N + m (the trainer's order)
        sums = accumulate(run.model, lambda m: batches.batch(step * N + m).to(run.dev), N,
                          run.autocast, on_micro, last_backward_hook(run.opt, run.ctx))
        t0 = time.perf_counter()
        update(run.model, run.opt, run.sched, t.clip, run.ctx)
        opt_wall = now(run.dev) - t0
    loss = float(sums[0]) / N
    require(math.isfinite(loss), f"{run.name}: training loss is {loss} at step {step + 1}; lower --lr")
    return micro, opt_wall, loss


def _policy_result(run: _PolicyRun, rows: list[dict], evals: list[dict], failed: str | None,
                   oom: dict | None) -> dict:
    """A policy's result: its rows and evaluations, their totals and its verdict."""
    res = {"policy": run.name, "config": run.note, "steps": rows, "evals": evals,
           "final_val_loss": evals[-1]["val_loss"], "budget_status": "no budget",
           "failed": failed, "out_of_memory": oom,
           # every virtual rank at once on one device: whether the emulation fits the
           # device, not a rank's memory (that is the ledger's)
           "emulator_device_peak_bytes": (torch.cuda.max_memory_allocated(run.dev)
                                          if run.dev.type == "cuda" else None)}
    if rows:
        # per reason: layer-micro-batches that gave replicas up, the replicas, most in one
        tot = _given_up(kv for r in rows for kv in r["replicas_given_up"].items())
        res["replicas_given_up"] = {why: {"layer_micro_batches": n, "replicas": k,
                                          "most_in_one": most}
                                    for why, (n, k, most) in tot.items()}
        res["layer_micro_batches"] = sum(r["layer_micro_batches"] for r in rows)
        res["replicas_placed"] = sum(r["replicas_placed"] for r in rows)
    if run.ledger is not None and rows:
        res["ledger_peak_bytes"] = max(r["ledger_peak_bytes"] for r in rows)
        res["rungs"] = dict(sorted(sum((Counter(r["rungs"]) for r in rows), Counter()).items()))
    if failed:
        res["budget_status"] = failed
    elif run.ledger is not None:
        res["budget_status"] = "fits"
        more = {k: v for k, v in res["rungs"].items() if k != "plan"}
        if more:  # " (recompute 3, layer 1 of 240 layer-steps)"
            res["budget_status"] += (" (" + ", ".join(f"{k} {v}" for k, v in more.items())
                                     + f" of {sum(res['rungs'].values())} layer-steps)")
    return res


def _given_up(parts) -> dict[str, list[int]]:
    """Per reason, ``[plans, replicas, most in one plan]`` summed over ``(reason, [plans,
    replicas, most])`` parts."""
    tot: dict[str, list[int]] = {}
    for why, (n, k, most) in parts:
        a = tot.setdefault(why, [0, 0, 0])
        a[0], a[1], a[2] = a[0] + n, a[1] + k, max(a[2], most)
    return dict(sorted(tot.items()))


def ratio_over(r: dict, symi: dict | None) -> float | str | None:
    """``r``'s time to target over symi's: :data:`OOM` when either ran out of memory,
    ``None`` when there is no symi or either never reached the target."""
    if symi is None:
        return None
    if r.get("out_of_memory") or symi.get("out_of_memory"):
        return OOM
    a, b = r["time_to_target_emulated_s"], symi["time_to_target_emulated_s"]
    return a / b if a is not None and b else None


def _max_over_mean(loads: list[torch.Tensor]) -> float:
    """Mean over layers of (busiest rank's pairs / mean rank's pairs)."""
    return sum(float(x.max() / x.mean().clamp(min=1e-9)) for x in loads) / len(loads)


@contextlib.contextmanager
def deterministic_mode(on: bool, fill: bool = True):
    """torch's deterministic algorithms (warn-only) inside the block when ``on``, with its
    fill of new uninitialized tensors only if ``fill``; the caller's settings are restored
    after. cuBLAS reads its workspace setting when it starts, so it is set here only if
    nothing set it and no CUDA context exists yet."""
    if not on:
        yield
        return
    import torch.utils.deterministic as tud
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ and not torch.cuda.is_initialized():
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    was, was_warn = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())
    was_fill = tud.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    tud.fill_uninitialized_memory = fill
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)
        tud.fill_uninitialized_memory = was_fill


def load_reused(cfg: TTLConfig, policies: list[str], val_loss0: float) -> dict:
    """The results of ``cfg.reuse`` for the ``policies`` it holds, checked against this
    run (docs/design.md §9): raises :class:`LrmoeError` naming the first difference."""
    path = Path(cfg.reuse)
    try:
        rep = json.loads(path.read_text())
        require(isinstance(rep.get("policies"), dict), "no policies")
    except (OSError, ValueError, AttributeError) as e:
        raise LrmoeError(f"--reuse {path}: not a readable ttl.json or ttl_partial.json "
                         f"({type(e).__name__}: {e})") from None
    got = rep["policies"]
    old = rep.get("config")
    if old is not None:
        # a setting the file lacks was added since: its default is the behaviour before it
        before = TTLConfig().flat()
        new = recorded_settings(cfg)
        for k in sorted(set(new) | set(old)):
            was = old.get(k, before.get(k))
            require(k in ("policies", "reuse") or was == new.get(k),
                    f"--reuse {path}: it ran with {k}={was!r}, this run has {k}={new.get(k)!r}")
    was_link, link = rep.get("link"), asdict(get_link(cfg.link))
    require(was_link is None or was_link == link,  # a preset re-priced since that run
            f"--reuse {path}: it priced --link {cfg.link} as {was_link}, this run as {link}; "
            "run every policy again")
    # symi's s is chosen on the static run's routing profile, which only a static run
    # that happens here provides (a file keeps no per-home counts)
    require("static" not in got or "symi" in got or "symi" not in policies,
            f"--reuse {path}: symi needs static's routing profile; reuse static and symi "
            "together or run both")
    want = _eval_steps(cfg.train)
    out = {}
    for p in policies:
        if p not in got:
            continue
        r = dict(got[p])
        steps = [e["step"] for e in r.get("evals", [])]
        require(len(r.get("steps", [])) == cfg.train.steps or r.get("failed"),
                f"--reuse {path}: {p} ran {len(r.get('steps', []))} steps, this run has "
                f"--steps {cfg.train.steps}")
        require(r.get("failed") or steps == want,
                f"--reuse {path}: {p} was evaluated at steps {steps[:4]}..., this run at "
                f"{want[:4]}...")
        # the probe evaluates through the plain model, the file's policy through its EP
        # layer: under bf16 autocast on CUDA their sums differ by ~1e-6 relative (seen:
        # 6e-6 at 5.79); another seed or model moves the initial loss far more
        v = r["evals"][0]["val_loss"]
        require(abs(v - val_loss0) <= 1e-5 * max(1.0, abs(val_loss0)),
                f"--reuse {path}: {p}'s initial validation loss {v!r} differs from this "
                f"run's {val_loss0!r} (another seed, model, data or validation set)")
        r["reused_from"] = str(path)
        out[p] = r
    return out


@dataclass
class _Data:
    """What every policy's run reads: the model config (vocabulary from the tokenizer),
    the corpus, its training and validation batches."""

    mcfg: object
    corpus: object
    batches: object
    val_b: list


@contextlib.contextmanager
def _emulator_memory(name: str, G: int):
    """The emulation itself out of the device's (or the host's) memory: its G ranks share
    one device, so this is no verdict on the policy; one line, and the run stops."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as e:
        found = allocator_words(e)
        if found is None:
            raise
        where, words = found
        raise LrmoeError(f"emulating {name}: out of {where} memory ({words}); the {G} virtual "
                         f"ranks share this one device: use a smaller --batch-size or "
                         f"--seq-len, fewer --ep ranks or a device with more memory") from None


def bench_ttl(cfg: TTLConfig, log=print, on_policy=None) -> dict:
    """Run every policy and return the report dict, calling ``on_policy(name, result)``
    after each (to save partial results); a policy that fails is reported with
    ``failed`` and the steps it made."""
    with deterministic_mode(cfg.deterministic, cfg.deterministic_fill):
        check_ttl_config(cfg)
        G = cfg.train.ep
        policies = list(dict.fromkeys(("static",) + tuple(cfg.policies)))  # static: the target
        variants = {p: policy_variant(p, cfg) for p in policies}  # bad specs fail before any run
        link = get_link(cfg.link)
        mcfg = resolve_model_config(cfg.train, vocab_size=None)
        require(mcfg.num_experts % G == 0, f"--ep {G} must divide the number of experts "
                                           f"{mcfg.num_experts}")
        ledger, rule = None, None
        if cfg.train.mem_budget is not None:
            home = cfg.train.batch_size // G * cfg.train.seq_len
            ledger = budget_ledger(cfg, mcfg, parse_bytes(cfg.train.mem_budget))
            ledger.raise_if_over(ledger.feasible_minimum(tokens_per_rank_home=home),
                                 "even the native experts with one retained pair per instance")
        data = _load_data(cfg)
        reused = _probe(cfg, data, variants)
        if cfg.budget_floor_fraction is not None:  # static's floor over this run's routing
            with _emulator_memory("static's calibration", G):
                rule = (ttl_budget.reused(cfg, reused["static"]) if "static" in reused else
                        ttl_budget.calibrate(cfg, data.mcfg, data.batches, data.val_b, link, log,
                                             run_policy, static_floor_ledger(cfg, data.mcfg)))
            ledger = budget_ledger(cfg, data.mcfg, rule.budget_bytes)
            log(f"budget {ledger.budget_bytes} bytes = {rule.fraction:g} x static's "
                f"whole-layer floor {rule.floor_bytes} bytes ({rule.source})")
        results, profile = {}, _reused_profile(cfg, reused, variants)
        for p in policies:
            if p in reused:
                log(f"[{p}] reused from {cfg.reuse}")
                results[p] = reused[p]
            else:
                base, vcfg = variants[p]
                with _emulator_memory(p, G):
                    results[p] = run_policy(base, vcfg, data.mcfg, data.batches, data.val_b,
                                            ledger, link, log, profile)
                results[p]["policy"] = p
                counts_GE = results[p].pop("_counts_GE")
                if rule is not None:  # with each result: --reuse takes it with the policy
                    results[p]["budget_rule"] = rule.record()
                if p == "static":  # symi's profile: static's routing and GEMM rate
                    rate = calibrated_gemm_rate(results[p]["steps"], counts_GE,
                                                data.mcfg.hidden_size,
                                                data.mcfg.moe_intermediate_size)
                    results[p]["gemm_rate_flops"] = rate  # lrmoe's link cost, also under --reuse
                    profile = (*_profile(counts_GE), rate)
            if on_policy is not None:
                on_policy(p, results[p])
        target = _reach_target(cfg, results)
        ratios = {p: ratio_over(r, results.get("symi")) for p, r in results.items()
                  if variants[p][0] == "lrmoe"}
        offload_model = offload_assumptions() if cfg.train.optimizer_offload == "host" else None
        return {"label": "emulated", "link": asdict(link), "config": recorded_settings(cfg),
                "model": data.mcfg.to_hf_dict(), "data": data.corpus.source,
                "budget_bytes": None if ledger is None else ledger.budget_bytes,
                "budget_rule": None if rule is None else rule.record(),
                "offload_model": offload_model, "target": target,
                "ratio_lrmoe_over_symi_time_to_target_emulated": ratios.get("lrmoe"),
                "ratios_over_symi_time_to_target_emulated": ratios,
                "measured_vs_modelled": __doc__, "policies": results}


def _reused_profile(cfg: TTLConfig, reused: dict, variants: dict) -> tuple | None:
    """A reused static run's profile: its GEMM rate alone (symi, which also needs its
    counts, is then reused with it), or None when static runs here."""
    if "static" not in reused:
        return None
    rate = reused["static"].get("gemm_rate_flops")
    require(rate is not None or not any(b == "lrmoe" and v.lrmoe.link_cost
                                        for b, v in variants.values()),
            f"--reuse {cfg.reuse}: its static run records no GEMM rate, which lrmoe's link "
            "cost is priced at; run static again")
    return None, None, rate


def _load_data(cfg: TTLConfig) -> _Data:
    """The corpus (byte tokenizer), the model config with its vocabulary, the training
    batches and the validation batches, as ``lrmoe train`` reads them (prompt/completion
    rows train their completions only)."""
    t = cfg.train
    corpus = load_corpus(t.data, max_bytes=t.max_data_bytes)
    tok = load_tokenizer("byte", None, corpus.train_texts)
    streams = build_streams(corpus, tok)
    mcfg = resolve_model_config(t, vocab_size=tok.vocab_size)
    check_vocab(tok, mcfg.vocab_size)
    batches = PackedBatches(streams.train_ids, t.seq_len, t.batch_size, t.seed,
                            target_mask=streams.train_mask, accum=t.grad_accum)
    k = val_windows(streams.val_ids.numel(), t.seq_len, t.batch_size, t.eval_batches, 1)
    val_b = validation_batches(streams.val_ids, t.seq_len, t.batch_size, num_windows=k,
                               target_mask=streams.val_mask)
    return _Data(mcfg, corpus, batches, val_b)


def _probe(cfg: TTLConfig, data: _Data, variants: dict) -> dict:
    """The ``--reuse`` file's results checked against the seed's initial model's
    validation loss; the process is warmed up on that model for the policies of
    ``variants`` (spec -> :func:`policy_variant`) that will run."""
    t, G = cfg.train, cfg.train.ep
    dev = torch.device(t.device)
    torch.manual_seed(t.seed)
    probe = MoEForCausalLM(data.mcfg).to(t.device)
    autocast = make_autocast(dev)
    reused = {}
    if cfg.reuse:
        v0 = _val_eval(probe, data.val_b, dev, autocast)["val_loss"]
        reused = load_reused(cfg, list(variants), v0)
    # each lrmoe variant that runs, unbudgeted and selecting from step 0 (a keep warm-up's
    # first selecting step must not pay for compiling): its balance quotas trim the first
    # batch, so its selection and gather kernels run
    also = []
    for p, (b, v) in variants.items():
        if p not in reused and b == "lrmoe":
            v = replace(v, lrmoe=with_knobs(v.lrmoe, {"lrmoe_select_from": 0}))
            also.append((make_policy(_choose(b, v, data.mcfg, None)[0], data.mcfg, G),
                         v.lrmoe.backward))
    warm_up(probe, G, data.batches.batch(0).to(t.device), autocast, t.compile, also)
    del probe
    _release(cfg)
    return reused


def _release(cfg: TTLConfig) -> None:
    """Free the last run's model: the emulator's layers and the model refer to each other,
    so only a collection frees them (and their device memory, for the next run's)."""
    gc.collect()
    if cfg.train.device == "cuda":
        torch.cuda.empty_cache()


def _reach_target(cfg: TTLConfig, results: dict) -> dict:
    """The target (module docstring) and, on each result, its steps and time to it (none
    for a run that stopped) and its mean step; returns the report's ``target``."""
    w = cfg.smooth_window
    base = results["static"]["evals"]
    at = math.ceil(cfg.target_fraction * cfg.train.steps)
    target = target_at(base, at, w)
    raw_eval = next(e for e in base if e["step"] >= at)
    for r in results.values():
        stopped = r.get("out_of_memory")  # a run that stopped gets no time to target
        r["steps_to_target"], r["time_to_target_emulated_s"] = (
            (None, None) if stopped else crossing(r["evals"], target, w))
        raw = None if stopped else next((e for e in r["evals"] if e["step"] > 0 and e["val_loss"]
                                         <= raw_eval["val_loss"] * (1 + cfg.target_rtol)), None)
        r["raw_steps_to_target"], r["raw_time_to_target_emulated_s"] = (
            (raw["step"], raw["cum_emulated_s"]) if raw else (None, None))
        r["mean_step_emulated_s"] = (sum(s["step_emulated_s"] for s in r["steps"])
                                     / max(len(r["steps"]), 1))
    return {"val_loss": target, "static_step": at, "fraction": cfg.target_fraction,
            "smooth_window": w, "noise": eval_noise(base, at, w),
            "raw_val_loss": raw_eval["val_loss"], "raw_static_step": raw_eval["step"],
            "rtol": cfg.target_rtol,
            "rule": "static's val curve smoothed (centred mean of smooth_window "
                    "evals) at step ceil(fraction * steps); a policy reaches it "
                    "where its smoothed curve first does (linear between evals); "
                    "raw_*: static's val at its first eval at or after that step, "
                    "reached at the first eval <= target*(1+rtol)"}
