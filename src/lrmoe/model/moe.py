"""The MoE layer as the named stages of docs/design.md §2: route -> count -> plan -> dispatch ->
experts -> combine. On one process dispatch and combine are local permutations and the
plan is trivial: with the static policy the local path (:mod:`lrmoe.parallel.local`)
runs the same kernels from device tensors alone, without a plan or a host wait;
otherwise (or with ``MoERuntime(fast_local=False)``) the code path is the one the
expert-parallel runtime runs.

Legend: B batch, T tokens, H hidden, E experts, K top-k, P = T*K pairs, S slots.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import Tensor, nn

from lrmoe.config import ModelConfig
from lrmoe.model.experts import Experts
from lrmoe.model.layers import MLP
from lrmoe.model.router import aux_loss, make_router
from lrmoe.parallel.comm import EPComm
from lrmoe.parallel.exchange import BackwardOptions, ExchangeState, ExpertExchange, _timed
from lrmoe.parallel.layer_checkpoint import LayerCheckpoint
from lrmoe.parallel.layout import home_layout, recv_layout, to_device
from lrmoe.parallel.local import DeviceStats, LocalExperts, expert_counts, stand_in_plan
from lrmoe.parallel.weights import instance_weight_list
from lrmoe.policy.base import PlanInputs, Policy, prepare
from lrmoe.policy.ledger_view import plan_totals
from lrmoe.policy.plan import checks_on
from lrmoe.policy.static import StaticPolicy


@dataclass
class MoERuntime:
    """What every MoE layer of a model shares: the EP group, the policy, the knobs.

    Attributes:
        comm: the expert-parallel group (``EPComm(None)`` on one process).
        policy: the planner; the runtime executes whatever plan it returns.
        backward: LRMoE backward options (inert for exact plans).
        ledger: memory ledger handed to the planner (``None``: no budget).
        step: the optimizer step, set by the trainer.
        micro: the micro-batch's index in its optimizer step (``train.accum.accumulate``).
        stats: per MoE layer, the last step's counters (filled in forward and backward).
        check_plans: validate each plan against the counts (a debugging aid, host work
            on the critical path: on with ``LRMOE_CHECK_PLANS=1``, :func:`checks_on`).
        fast_local: on one process with the static policy's trivial plan, run the
            layer's stages from device tensors alone, with no host wait
            (:mod:`lrmoe.parallel.local`; same results). ``False`` always runs the
            exchange.
    """

    comm: EPComm = field(default_factory=EPComm)
    policy: Policy = field(default_factory=StaticPolicy)
    backward: BackwardOptions = field(default_factory=BackwardOptions)
    ledger: Any = None
    step: int = 0
    micro: int = 0
    stats: dict[int, dict] = field(default_factory=dict)
    check_plans: bool = field(default_factory=checks_on)
    generator: torch.Generator | None = None
    # Under DP x EP: sums a count tensor over the expert-DP group (the other EP groups'
    # matching ranks), so the aux loss sees the whole global batch; ``None`` otherwise.
    count_reduce: Callable[[Tensor], Tensor] | None = None
    dp_size: int = 1
    fast_local: bool = True
    # also time the exchange's control-plane stages (local, select, gather) per layer
    # (``benchmarks/control_plane.py``); off in training: each region costs event records
    stage_timing: bool = False
    # ``lrmoe bench ttl``: the routed experts of every layer run over G virtual ranks
    # (:class:`lrmoe.sim.vmodel.Emulator`) instead of this process's exchange
    emulator: Any = None


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_index: int):
        super().__init__()
        self.cfg, self.moe_index = cfg, moe_index
        self.router = make_router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts > 0 else None)
        self.runtime = MoERuntime()
        self.prev_counts_E: Tensor | None = None  # global counts of the previous step
        self.step_counts_E: Tensor | None = None  # global counts accumulated this step
        self.last_aux_loss: Tensor | None = None
        self.last_path: str | None = None  # "local" or "exchange": what the last forward ran
        self._local_stats: tuple | None = None  # (plan, dtype, its stats): local path
        # activation checkpoint (lrmoe.model.checkpoint): the block is re-run in backward,
        # so the kept rows go through autograd's saved-tensor hooks; ``recomputing`` is
        # set during that re-run (the emulator's wrapper reads it)
        self.checkpointed = False
        self.recomputing = False

    def forward(self, x_BTH: Tensor) -> Tensor:
        B, T, H = x_BTH.shape
        x_TH = x_BTH.reshape(-1, H)
        # route (traced by torch.compile), then the host-driven stages (left eager)
        r = self.router(x_TH)
        out = self._routed(x_TH, r.idx_TK, r.gate_TK, r.probs_TE)
        out = out.view(B, T, H).to(x_BTH.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_BTH)
        return out

    @torch.compiler.disable
    def _routed(self, x_TH: Tensor, idx_TK: Tensor, gate_TK: Tensor, probs_TE: Tensor | None) -> Tensor:
        """count -> plan -> dispatch -> experts -> combine: ``out_TH``, the routed experts' sum.

        Under ``torch.compile`` this is one graph break: the plan is host data computed
        from the counts every step (a trace would break at each host sync and recompile
        on each new plan). The expert kernels inside fuse on their own (:mod:`lrmoe.ops.fused`).
        The one-process local path has no host sync but stays eager too: Dynamo stops at
        its expert timing and at the grouped GEMM's operand check (``data_ptr``), and its
        autograd Function frees the kept rows at their last use in backward (what the
        ledger prices), which a traced joint graph would not do.
        """
        rt = self.runtime
        if rt.emulator is not None and self.training:
            return rt.emulator.routed(self, x_TH, idx_TK, gate_TK, probs_TE)
        E = self.cfg.num_experts
        # count (on the device: no host sync yet)
        counts_E = expert_counts(idx_TK.reshape(-1), E)
        t0 = time.perf_counter()
        inputs = PlanInputs(self.moe_index, rt.step, self.prev_counts_E, rt.ledger, micro=rt.micro)
        local = None if idx_TK.numel() == 0 else stand_in_plan(rt, E, idx_TK.numel(), inputs)
        self.last_path = "exchange" if local is None else "local"
        if local is None:
            return self._exchange(x_TH, idx_TK, gate_TK, probs_TE, counts_E, inputs)
        t1 = time.perf_counter()
        self._count(counts_E, probs_TE, x_TH.shape[0])
        dtype = _compute_dtype(x_TH)
        # the unbudgeted stand-in plan is cached (one object per (E, P)): so are its stats
        cached = self._local_stats
        if cached is None or cached[0] is not local or cached[1] != dtype:
            self._local_stats = cached = (local, dtype, self._plan_stats(local, 0.0, 0.0, dtype))
        stats = DeviceStats(cached[2], plan_ms=(t1 - t0) * 1e3,
                            counts_E=counts_E)  # read (and copied to the host) lazily
        rt.stats[self.moe_index] = stats
        w13, w2 = self.experts.compute_weights(dtype)
        return LocalExperts.apply(x_TH.to(dtype), gate_TK, w13, w2, idx_TK, counts_E,
                                  self._backward_opts(), stats)

    def _exchange(self, x_TH: Tensor, idx_TK: Tensor, gate_TK: Tensor, probs_TE: Tensor | None,
                  counts_E: Tensor, inputs: PlanInputs) -> Tensor:
        """The general path: the counts on the host, the policy's plan, the exchange."""
        rt = self.runtime
        if inputs.prev_counts_E is not None and inputs.prev_counts_E.device.type != "cpu":
            # the previous step ran the local path: planners read popularity on the host
            inputs = replace(inputs, prev_counts_E=inputs.prev_counts_E.cpu())
        E = self.cfg.num_experts
        idx_P = idx_TK.reshape(-1)
        # what the policy plans from the previous step's counts, before the count
        # exchange's host wait (the device still runs the queued work meanwhile)
        inputs = prepare(rt.policy, inputs.prev_counts_E, rt.comm.size, inputs, idx_P.numel())
        t0 = time.perf_counter()
        counts_GE = rt.comm.all_gather_counts(counts_E)  # popularity exchange (+ the host sync)
        t1 = time.perf_counter()
        counts_E_all = counts_GE.sum(0)  # the group's counts per expert (host)
        self._count(counts_E_all, probs_TE, x_TH.shape[0])
        # plan
        plan = rt.policy.plan(counts_GE, inputs)
        if rt.check_plans:
            plan.check(counts_GE)
        t2 = time.perf_counter()
        # dispatch -> experts -> combine
        dtype = _compute_dtype(x_TH)
        w13, w2 = instance_weight_list(list(self.experts.compute_weights(dtype)), plan, rt.comm, E)
        stats = self._plan_stats(plan, (t1 - t0) * 1e3, (t2 - t1) * 1e3, dtype)
        stats["counts_E"] = counts_E_all.tolist()
        rt.stats[self.moe_index] = stats
        me, K, opts = rt.comm.rank, self.cfg.num_experts_per_tok, self._backward_opts()
        if plan.layer_checkpoint:  # the re-run in backward keeps its rows until their last use
            opts = replace(opts, checkpointed=False)

        def run(x: Tensor, gate: Tensor, idx: Tensor, w13: Tensor, w2: Tensor,
                stats: dict) -> Tensor:
            gate_P = gate.reshape(-1).detach()
            with _timed_if(rt.stage_timing, stats, x.device):
                home = home_layout(plan, me, idx.reshape(-1), gate_P, E)
                recv = recv_layout(plan.assign_GGS[:, me, :], x.device)
            st = ExchangeState(rt.comm, plan, home, recv, K, opts, gate_P, stats, rt.generator,
                               rt.stage_timing)
            return ExpertExchange.apply(x.to(dtype), gate, w13, w2, st)
        if plan.layer_checkpoint:  # whole-layer checkpoint (docs/design.md §5)
            return LayerCheckpoint.apply(x_TH, gate_TK, idx_TK, w13, w2, run, stats)
        return run(x_TH, gate_TK, idx_TK, w13, w2, stats)

    def _backward_opts(self) -> BackwardOptions:
        opts = self.runtime.backward
        return replace(opts, checkpointed=True) if self.checkpointed else opts

    def _count(self, glob_E: Tensor, probs_TE: Tensor | None, T: int) -> None:
        """The step's global counts and the aux loss from this layer's global counts."""
        rt = self.runtime
        if self.training:  # the local path counts on the device, the exchange on the host:
            c = self.step_counts_E  # a step that takes both sums where its first count was
            self.step_counts_E = glob_E if c is None else c + glob_E.to(c.device)
        self.last_aux_loss = None
        if probs_TE is not None and self.training:
            glob_E = to_device(glob_E, probs_TE.device)  # pinned copy: no host wait
            world_counts = glob_E if rt.count_reduce is None else rt.count_reduce(glob_E.clone())
            self.last_aux_loss = aux_loss(probs_TE, world_counts, T * rt.comm.size * rt.dp_size,
                                          self.cfg.router_aux_loss_coef)

    def _plan_stats(self, plan, count_ms: float, plan_ms: float, dtype: torch.dtype) -> dict:
        """The plan's per-layer stats (host numbers; ``counts_E`` is added by the caller)."""
        rt, me = self.runtime, self.runtime.comm.rank
        stats = {"plan_replicas": plan.num_replicas(),
                 "count_exchange_ms": count_ms, "plan_ms": plan_ms,
                 # bytes of instance weights that travel from owners to other ranks' slots
                 "weight_scatter_bytes": _weight_scatter_bytes(plan, me, self.cfg.num_experts,
                                                               self.experts, dtype),
                 "rank_load": plan.rank_load().tolist(),
                 "rank_backward_load": plan.rank_backward_load().tolist(),
                 # exact plans over a budget: rows whose gate_up output backward recomputes
                 # (a whole-layer checkpoint: every received row, its whole forward)
                 "recomputed_rows": (int(plan.rank_load()[me]) if plan.layer_checkpoint
                                     else 0 if plan.recompute_G is None
                                     else int(plan.recompute_G[me])),
                 "layer_checkpoint": plan.layer_checkpoint}
        if rt.ledger is not None:  # the ledger's prediction for this rank, all MoE layers
            stats["ledger_total_bytes"] = int(plan_totals(rt.ledger, plan)[me])
        return stats

    def end_step(self) -> Tensor | None:
        """Close the step's counting: returns this step's global counts and keeps them
        as the next step's popularity (SYMI's input)."""
        c = self.step_counts_E
        if c is not None:
            self.prev_counts_E = c
        self.step_counts_E = None
        return c


def _timed_if(on: bool, stats: dict, device: torch.device):
    """The layouts' time as ``local_ms`` when the control plane is timed."""
    return _timed(stats, "local_ms", device) if on else contextlib.nullcontext()


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The experts' compute dtype: autocast's when it is on, else the input's."""
    dev = x.device.type
    on = torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)
    return torch.get_autocast_dtype(dev) if on else x.dtype


def _weight_scatter_bytes(plan, me: int, E: int, experts: Experts, dtype: torch.dtype) -> int:
    """Bytes of expert weights this rank receives for slots whose owner is another rank
    (SYMI's weight scatter; zero for the static plan)."""
    ie = plan.inst_expert_GS.numpy()[me]
    remote = int(((ie >= 0) & (ie // (E // plan.G) != me)).sum())
    per_expert = experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()
    return remote * per_expert * torch.empty((), dtype=dtype).element_size()
