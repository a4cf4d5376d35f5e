"""Virtual EP: one MoE layer's expert-parallel step for G virtual ranks in one process
(docs/design.md §9): the runtime's own autograd Function
(:class:`lrmoe.parallel.exchange.ExpertExchange`) runs its stages for every rank in turn,
each all-to-all an in-memory regrouping (:class:`VirtualTransport`). The results are
**emulated**.

Legend: G virtual ranks, T tokens per rank, K top-k, H hidden, S slots per rank,
E experts, P = T*K pairs of one rank. ``_G`` suffix: a Python list over virtual ranks.
Virtual rank g's tokens are rows ``[g*T, (g+1)*T)`` of the global token matrix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from lrmoe.model.moe import MoELayer, MoEStep, _compute_dtype, expert_counts
from lrmoe.parallel import stages
from lrmoe.parallel.exchange import ExchangeState, ExpertExchange, layouts
from lrmoe.parallel.options import BackwardOptions
from lrmoe.policy.base import PlanInputs, Policy, prepare
from lrmoe.policy.ledger_view import plan_totals
from lrmoe.policy.plan import Plan, checks_on
from lrmoe.sim.vstats import MEASURED_STAGES, Timers, VirtualStats
from lrmoe.traffic import plan_rows_GG


def virtual_all_to_all(send_G: list[Tensor], splits_G: list[list[int]]) -> list[Tensor]:
    """In-memory ``all_to_all_single`` over G virtual ranks: ``send_G[g]`` is rank g's
    send buffer, ``splits_G[g][r]`` its rows for rank r; each rank receives the rows from
    rank 0, then rank 1, ..."""
    G = len(send_G)
    chunks = [list(torch.split(send_G[g], splits_G[g])) for g in range(G)]
    out = []
    for r in range(G):
        parts = [chunks[g][r] for g in range(G)]
        out.append(torch.cat(parts) if len(parts) > 1 else parts[0].clone())
    return out


@dataclass
class VirtualTransport:
    """All G ranks of the group in one process (a
    :class:`lrmoe.parallel.exchange.Transport`): each rank's stages timed into its own
    buckets, each exchange's ``[src, dst]`` rows and bytes into the step's stats."""

    timers: Timers
    stats: VirtualStats
    # no count exchange inside a home's select: the receivers' counts are every home's
    exchange_counts = None

    @property
    def ranks(self) -> range:
        return range(self.timers.G)

    def all_to_all(self, send_G, send_splits_G, recv_splits_G) -> list[Tensor]:
        """:func:`virtual_all_to_all` inside a ``stage:link`` profiler range: its time is
        the emulator's stand-in for a link, charged by the link model, never measured."""
        with torch.profiler.record_function("stage:link"):
            return virtual_all_to_all(send_G, send_splits_G)

    def timer(self, i: int) -> stages.Timer:
        return lambda key: self.timers.time(key, i)

    def received(self, sh_G: list[stages.Shipped]) -> list[Tensor]:
        return [torch.stack([sh.sent_GS[r] for sh in sh_G]) for r in self.ranks]

    def traffic(self, name, send_splits_G, recv_splits_G, row_bytes) -> None:
        rows = torch.as_tensor(send_splits_G, dtype=torch.long).reshape(len(send_splits_G), -1)
        self.stats.rows_GG[name], self.stats.bytes_GG[name] = rows, rows * row_bytes

    def rows(self, name: str, n_G: list[int]) -> None:
        self.stats.rows[name] = n_G

    def forward_done(self, kept_G: list[int]) -> None:
        self.stats.saved_act_bytes = kept_G
        self.timers.resolve()
        self.stats.expert_ms["fwd"] = self.timers.ms.get("expert_fwd", [0.0] * self.timers.G)

    def backward_done(self, st: ExchangeState, dout_G: list[Tensor]) -> None:
        """The backward's timers resolved into the stats, the sampled estimator's count
        exchange counted (``comm.exchange_counts``: S int64 per peer) and the time the
        backward ended."""
        plan, opts, G, ms = st.plan, st.opts, self.timers.G, self.timers.ms
        if not plan.all_selected and opts.compaction and opts.estimator == "sampled":
            ones_GG = [[1] * G] * G
            self.traffic("bwd_count_exchange", ones_GG, ones_GG, plan.S * 8)
        self.timers.resolve()
        self.stats.expert_ms["bwd"] = ms.get("expert_bwd", [0.0] * G)
        if plan.layer_checkpoint:  # the forward's expert kernels again, measured in backward
            self.stats.expert_ms["recompute"] = ms.get("expert_recompute", [0.0] * G)
        for k in MEASURED_STAGES[1:]:  # forward and backward together
            self.stats.stage_ms[k] = ms.get(k, [0.0] * G)
        self.stats.bwd_end_s = now(dout_G[0].device)


def virtual_instance_weights(w_E: Tensor, plan: Plan) -> Tensor:
    """All ranks' slot weights ``[G*S, ...]`` from the full experts ``[E, ...]`` (empty
    slots zero); the gather's backward sums every instance's gradient into its expert."""
    ie = plan.inst_expert_GS.reshape(-1).to(w_E.device)
    w = w_E[ie.clamp(min=0)]
    if bool((ie < 0).any()):
        w = w * (ie >= 0).to(w.dtype).view(-1, *([1] * (w.dim() - 1)))
    return w


class VirtualEPLayer:
    """The routed experts of ``layer`` (a full, unsharded :class:`MoELayer`) as G virtual
    EP ranks (:meth:`routed`, what :class:`lrmoe.sim.vmodel.Emulator` runs for the layer);
    :attr:`stats` holds the step's :class:`VirtualStats`.

    ``ledger`` is the planner's (``None``: no budget; an exact policy fits it with
    ``recompute=True``, :func:`lrmoe.policy.plan.fit_exact`); :attr:`generators`: per
    rank, the ``sampled`` estimator's generator (``None``: the global RNG). Plans are
    checked as the runtime checks them (:func:`lrmoe.policy.plan.checks_on`); ``fidelity``
    is not emulated.
    """

    def __init__(self, layer: MoELayer, G: int, policy: Policy,
                 backward_opts: BackwardOptions | None = None, ledger=None):
        self.layer, self.G, self.policy = layer, G, policy
        self.opts = backward_opts or BackwardOptions()
        self.ledger = ledger
        self.check_plans = checks_on()
        self.generators: list[torch.Generator | None] = [None] * G
        self.step = 0
        self.stats: VirtualStats | None = None

    def routed(self, x_NH: Tensor, idx_NK: Tensor, gate_NK: Tensor, probs_NE: Tensor | None
               ) -> tuple[Tensor, MoEStep]:
        """count -> plan -> dispatch -> experts -> combine of the routed experts, over the
        G virtual ranks (:meth:`MoELayer.stages`'s work on G ranks at once): the output
        and the step (its ``stats`` the :class:`VirtualStats`), the aux loss from the
        group's counts as the runtime has it."""
        layer, G = self.layer, self.G
        N = x_NH.shape[0]
        T, E, K = N // G, layer.cfg.num_experts, layer.cfg.num_experts_per_tok
        dev = x_NH.device
        timers = Timers(G, dev)
        # what the policy can plan from the previous step's counts: before this step's
        # counts exist, so off the critical path when it overlaps earlier work (charged
        # to no stage; reported as VirtualStats.prepare_ms)
        with torch.profiler.record_function("stage:prepare"):
            t1 = time.perf_counter()
            prev = layer.prev_counts_E
            prev = prev.cpu() if prev is not None else None
            inputs = prepare(self.policy, prev, G,
                             PlanInputs(layer.moe_index, self.step, prev, self.ledger,
                                        micro=layer.runtime.micro), T * K)
            prepare_ms = (time.perf_counter() - t1) * 1e3
        idx_GP = idx_NK.reshape(G, T * K)
        gate_GP = gate_NK.reshape(G, T * K)
        # count
        counts = []
        for g in range(G):
            with timers.time("local", g):
                counts.append(expert_counts(idx_GP[g], E))
        counts_GE = torch.stack(counts).cpu()  # the count all-gather's host copy
        # the aux loss from the group's counts (as the runtime); equal-sized shards: the
        # mean of the ranks' losses is the loss on all tokens
        with torch.profiler.record_function("stage:route"):
            aux = layer.aux_loss(counts_GE.sum(0), probs_NE, N)
        # plan: every rank computes the same plan, so every rank is charged its time
        with torch.profiler.record_function("stage:plan"):
            plan, stats, plan_ms = self._plan(counts_GE, inputs)
        stats.prepare_ms, stats.counts_GE = prepare_ms, counts_GE
        tp, ones_GG = VirtualTransport(timers, stats), [[1] * G] * G
        # the count all-gather (comm.all_gather_counts): E int64 to every peer
        tp.traffic("count_allgather", ones_GG, ones_GG, E * 8)
        dtype = _compute_dtype(x_NH)
        with torch.profiler.record_function("stage:weight_scatter"):
            w13, w2 = (virtual_instance_weights(w, plan)
                       for w in layer.experts.compute_weights(dtype))
        rows_GG = plan_rows_GG(plan, E)
        for name in ("weight_scatter", "grad_reduce"):
            tp.traffic(name, rows_GG[name], rows_GG[name].t(), layer.experts.instance_bytes(dtype))
        gate_P_G = [gate_GP[g].detach() for g in range(G)]
        homes, recvs = layouts(tp, plan, idx_GP, gate_P_G, E, dev)
        st = ExchangeState(tp, plan, homes, K, self.opts, gate_P_G, self.generators, num_experts=E)
        stats.stage_ms["plan"] = [plan_ms] * G
        keep_G = [stages.retention(plan, g) for g in range(G)]
        out = ExpertExchange.apply(x_NH.to(dtype), gate_NK, w13, w2, st, recvs, keep_G, idx_NK)
        return out, MoEStep("emulated", counts_GE.sum(0), aux, stats)

    def _plan(self, counts_GE: Tensor, inputs: PlanInputs
              ) -> tuple[Plan, VirtualStats, float]:
        """The policy's plan, its fallbacks to fit a budget included (charged: the third
        value, ms; a plan over budget even so raises :class:`lrmoe.errors.OutOfMemory` in
        the policy, as a GPU would), then, uncharged, its check and ledger pricing."""
        t0 = time.perf_counter()
        plan = self.policy.plan(counts_GE, inputs)
        plan_ms = (time.perf_counter() - t0) * 1e3
        if self.check_plans:
            plan.check(counts_GE)
        stats = VirtualStats(plan)
        if plan.recompute_G is not None:  # the planner recomputes (real-runtime semantics)
            stats.recompute_mode, stats.recompute_rows = "pairs", plan.recompute_G.tolist()
        elif plan.layer_checkpoint:  # the planner checkpoints the layer
            stats.recompute_mode, stats.recompute_rows = "layer", plan.rank_load().tolist()
        stats.rung = plan.rung or _EXACT_RUNG[stats.recompute_mode]
        if self.ledger is not None:
            stats.ledger_total_bytes = plan_totals(self.ledger, plan).tolist()
        return plan, stats, plan_ms


# an exact policy's fallback (Ledger.exact_fit's mode) as a rung of the ladder
_EXACT_RUNG = {"fits": "plan", "pairs": "recompute", "layer": "layer"}


def now(dev: torch.device) -> float:
    """``perf_counter`` after the device's queued work (a wall time of device work)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()
