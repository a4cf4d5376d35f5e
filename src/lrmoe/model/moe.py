"""The MoE layer as the named stages of docs/design.md §2: route -> count -> plan ->
instance weights -> exchange (dispatch, experts, combine). Each forward returns its
:class:`MoEStep` (counts, aux loss, path, stats), which the layer takes as its last.

Read with it :mod:`lrmoe.parallel.instances`, :mod:`lrmoe.parallel.exchange` and
:mod:`lrmoe.parallel.stages` (docs/design.md §2). On one process with static's plan
within the budget the local path runs instead (:func:`runs_locally`); under a whole-layer
checkpoint the exchange runs again in backward (``Plan.layer_checkpoint``, §3).

Legend: B batch, T tokens, H hidden, E experts, K top-k, P = T*K pairs, S slots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import Tensor, nn

from lrmoe.config import ModelConfig
from lrmoe.model.experts import Experts
from lrmoe.model.layers import MLP
from lrmoe.model.router import aux_loss, make_router
from lrmoe.ops.rowops import to_device
from lrmoe.parallel.comm import EPComm
from lrmoe.parallel.exchange import BackwardOptions, run_exchange, run_local
from lrmoe.parallel.instances import HeldInstances, instance_weight_list
from lrmoe.policy.base import PlanInputs, Policy, prepare
from lrmoe.policy.ledger_view import plan_totals
from lrmoe.policy.plan import Plan, checks_on
from lrmoe.policy.static import StaticPolicy
from lrmoe.traffic import weight_scatter_bytes


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
        fast_local: where :func:`runs_locally` says so (one process, static's plan
            within the budget), run the layer's stages from device tensors alone, with
            no host wait (same results). ``False`` always runs the exchange.
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


@dataclass
class MoEStep:
    """What one forward of a layer's routed experts leaves for its step, returned with
    the output by :meth:`MoELayer.stages` (the re-run of an activation checkpoint returns
    one too, which nobody takes).

    Attributes:
        path: ``"local"`` (one process, :func:`runs_locally`), ``"exchange"``
            (the plan and the exchange) or ``"emulated"`` (the virtual EP emulator).
        counts_E: the EP group's pairs per expert (a device tensor on the local path).
        aux_loss: the router's balancing loss from those counts; ``None`` outside
            training or without one (GLM balances by bias).
        stats: the layer's counters: the plan's, then the exchange's forward and backward
            add theirs (:class:`lrmoe.sim.vstats.VirtualStats` when emulated); readers
            resolve the local path's device ``counts_E`` (:func:`host_stats`).
    """

    path: str
    counts_E: Tensor
    aux_loss: Tensor | None
    stats: Any


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
        self.last: MoEStep | None = None  # the last forward's step (aux loss, path, stats)
        # inside a step of several micro-batches: the instance weights kept while the
        # placement stays, and their gradients' sums (MoEForCausalLM.step_weights)
        self.held: HeldInstances | None = None
        # activation checkpoint (lrmoe.model.checkpoint): the block is re-run in backward,
        # so the kept rows go through autograd's saved-tensor hooks; ``recomputing`` is
        # set during that re-run, whose step is not taken
        self.checkpointed = False
        self.recomputing = False

    def forward(self, x_BTH: Tensor) -> Tensor:
        B, T, H = x_BTH.shape
        x_TH = x_BTH.reshape(-1, H)
        # route (traced by torch.compile), then the host-driven stages (left eager)
        r = self.router(x_TH)
        out = self.routed(x_TH, r.idx_TK, r.gate_TK, r.probs_TE).view(B, T, H).to(x_BTH.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_BTH)
        return out

    @torch.compiler.disable
    def routed(self, x_TH: Tensor, idx_TK: Tensor, gate_TK: Tensor, probs_TE: Tensor | None
               ) -> Tensor:
        """``out_TH``, the routed experts' sum (:meth:`stages`), its step taken as the
        layer's last but on an activation checkpoint's re-run.

        Under ``torch.compile`` this is one graph break: the plan is host data computed
        from the counts every step (a trace would break at each host sync and recompile
        on each new plan). The expert kernels inside fuse on their own (:mod:`lrmoe.ops.fused`).
        The one-process local path stays eager too (why: docs/design.md §2).
        """
        out_TH, step = self.stages(x_TH, idx_TK, gate_TK, probs_TE)
        if not self.recomputing:
            self.take(step)
        return out_TH

    def stages(self, x_TH: Tensor, idx_TK: Tensor, gate_TK: Tensor, probs_TE: Tensor | None
               ) -> tuple[Tensor, MoEStep]:
        """count -> plan -> instance weights -> exchange (dispatch, experts, combine):
        ``out_TH`` and this forward's :class:`MoEStep`."""
        rt = self.runtime
        if rt.emulator is not None and self.training:
            return rt.emulator.routed(self, x_TH, idx_TK, gate_TK, probs_TE)
        counts_E = expert_counts(idx_TK.reshape(-1), self.cfg.num_experts)  # on the device
        if runs_locally(rt, self.cfg.num_experts, idx_TK.numel()):
            return self._local(x_TH, idx_TK, gate_TK, probs_TE, counts_E)
        return self._exchange(x_TH, idx_TK, gate_TK, probs_TE, counts_E)

    def _local(self, x_TH: Tensor, idx_TK: Tensor, gate_TK: Tensor, probs_TE: Tensor | None,
               counts_E: Tensor) -> tuple[Tensor, MoEStep]:
        """One process, the natives exactly: the stages from device tensors alone."""
        dtype = _compute_dtype(x_TH)
        stats = local_stats(self.runtime.ledger, self.cfg.num_experts, counts_E, idx_TK.numel())
        w13, w2 = self.experts.compute_weights(dtype)
        out = run_local(x_TH.to(dtype), gate_TK, w13, w2, idx_TK, counts_E,
                        self._backward_opts(), stats)
        return out, MoEStep("local", counts_E, self.aux_loss(counts_E, probs_TE, x_TH.shape[0]),
                            stats)

    def _exchange(self, x_TH: Tensor, idx_TK: Tensor, gate_TK: Tensor, probs_TE: Tensor | None,
                  counts_E: Tensor) -> tuple[Tensor, MoEStep]:
        """The general path: count, plan, instance weights, exchange."""
        rt, dtype = self.runtime, _compute_dtype(x_TH)
        inputs = self._plan_inputs(idx_TK.numel())
        t0 = time.perf_counter()
        counts_GE = rt.comm.all_gather_counts(counts_E)  # count: the group's (+ a host sync)
        t1 = time.perf_counter()
        plan = rt.policy.plan(counts_GE, inputs)  # plan
        if rt.check_plans:
            plan.check(counts_GE)
        t2 = time.perf_counter()
        w13, w2 = self._instance_weights(plan, dtype)  # instance weights
        stats = self._plan_stats(plan, (t1 - t0) * 1e3, (t2 - t1) * 1e3, dtype)
        counts_E_all = counts_GE.sum(0)  # the group's counts per expert (host)
        stats["counts_E"] = counts_E_all.tolist()
        # the exchange (re-run in backward under a whole-layer checkpoint, docs/design.md §5)
        out = run_exchange(rt.comm, plan, self.cfg.num_experts, self.cfg.num_experts_per_tok,
                           self._backward_opts(), rt.generator, rt.stage_timing, x_TH.to(dtype),
                           gate_TK, idx_TK, w13, w2, stats)
        return out, MoEStep("exchange", counts_E_all,
                            self.aux_loss(counts_E_all, probs_TE, x_TH.shape[0]), stats)

    def _instance_weights(self, plan: Plan, dtype: torch.dtype) -> list[Tensor]:
        """Each slot's expert weights, replicas from their owners (inside a step of
        several micro-batches, kept while the placement stays: :class:`HeldInstances`)."""
        rt, E = self.runtime, self.cfg.num_experts
        ws_own = list(self.experts.compute_weights(dtype))
        if self.held is not None and torch.is_grad_enabled():
            return self.held.weight_list(ws_own, plan, rt.comm, E, rt.micro)
        return instance_weight_list(ws_own, plan, rt.comm, E)

    def _plan_inputs(self, home_pairs: int) -> PlanInputs:
        """What the policy plans from besides the counts, its prepared part included:
        computed from the previous step's counts before the count exchange's host wait
        (the device still runs the queued work meanwhile)."""
        rt, prev = self.runtime, self.prev_counts_E
        prev = None if prev is None else prev.cpu()  # the local path counts on the device
        inputs = PlanInputs(self.moe_index, rt.step, prev, rt.ledger, micro=rt.micro)
        return prepare(rt.policy, prev, rt.comm.size, inputs, home_pairs)

    def _backward_opts(self) -> BackwardOptions:
        opts = self.runtime.backward
        return replace(opts, checkpointed=True) if self.checkpointed else opts

    def aux_loss(self, glob_E: Tensor, probs_TE: Tensor | None, T: int) -> Tensor | None:
        """The aux loss from this layer's global counts (training only)."""
        rt = self.runtime
        if probs_TE is None or not self.training:
            return None
        glob_E = to_device(glob_E, probs_TE.device)  # pinned copy: no host wait
        world_counts = glob_E if rt.count_reduce is None else rt.count_reduce(glob_E.clone())
        return aux_loss(probs_TE, world_counts, T * rt.comm.size * rt.dp_size,
                        self.cfg.router_aux_loss_coef)

    def take(self, step: MoEStep) -> None:
        """Make ``step`` the layer's last: its counts join the step's (training), its
        stats are the runtime's for this layer."""
        if self.training:  # the local path counts on the device, the exchange on the host:
            c = self.step_counts_E  # a step that takes both sums where its first count was
            self.step_counts_E = step.counts_E if c is None else c + step.counts_E.to(c.device)
        self.runtime.stats[self.moe_index] = step.stats
        self.last = step

    def _plan_stats(self, plan: Plan, count_ms: float, plan_ms: float, dtype: torch.dtype) -> dict:
        """The plan's per-layer stats (host numbers; ``counts_E`` is added by the caller)."""
        rt, me = self.runtime, self.runtime.comm.rank
        stats = {"plan_replicas": plan.num_replicas(),
                 "count_exchange_ms": count_ms, "plan_ms": plan_ms,
                 # bytes of instance weights that travel from owners to other ranks' slots
                 # (the placement's: a step's micro-batches that share it move them once)
                 "weight_scatter_bytes": weight_scatter_bytes(
                     plan, self.cfg.num_experts, me, self.experts.instance_bytes(dtype)),
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


# ------------------------------------------------------- count; the one-process rule
def expert_counts(idx_P: Tensor, E: int) -> Tensor:
    """Pairs per expert ``[E]`` (int64), without the host sync of CUDA's ``bincount``
    (which reads the largest index to size its output)."""
    return torch.zeros(E, dtype=torch.long, device=idx_P.device).scatter_add_(
        0, idx_P, torch.ones_like(idx_P))


def runs_locally(rt: MoERuntime, E: int, P: int) -> bool:
    """The rule of the one-process path (``E`` experts, ``P`` pairs; docs/design.md §2):
    one rank, at least one pair, plain static (``plans_natives_exactly()``), the selection
    knobs at their defaults (``router_grad`` is honoured), and no budget or one the ledger
    says the identity plan fits. Over the budget the exchange runs, where the policy
    recomputes or raises, as on any rank count."""
    if not rt.fast_local or rt.comm.size != 1 or P == 0 or not rt.policy.plans_natives_exactly():
        return False
    if replace(rt.backward, router_grad="home") != BackwardOptions():
        return False
    budget = None if rt.ledger is None else rt.ledger.budget_bytes
    return budget is None or one_rank_total(rt.ledger, E, P) <= budget


def one_rank_total(ledger, E: int, P: int) -> int:
    """The ledger's total for the identity plan on one rank: ``E`` instances, ``P``
    pairs received, home and retained, nothing recomputed."""
    return ledger.terms(E, P, P, P, exact=True)["total"]


def local_stats(ledger, E: int, counts_E: Tensor, P: int) -> dict:
    """The plan's stats of the identity plan (as :meth:`MoELayer._plan_stats` has
    them); ``counts_E`` stays the device tensor (no host sync): readers resolve it
    (:func:`host_stats`)."""
    stats = {"plan_replicas": 0, "count_exchange_ms": 0.0, "plan_ms": 0.0,
             "weight_scatter_bytes": 0, "rank_load": [P], "rank_backward_load": [P],
             "recomputed_rows": 0, "layer_checkpoint": False, "counts_E": counts_E}
    if ledger is not None:
        stats["ledger_total_bytes"] = one_rank_total(ledger, E, P)
    return stats


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The experts' compute dtype: autocast's when it is on, else the input's."""
    dev = x.device.type
    on = torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)
    return torch.get_autocast_dtype(dev) if on else x.dtype


def host_stats(stats: dict) -> dict:
    """``stats`` with its device tensors (the local path's ``counts_E``) read to Python
    numbers: the one host sync, made by whoever reads the stats."""
    return {k: v.tolist() if isinstance(v, Tensor) else v for k, v in stats.items()}
