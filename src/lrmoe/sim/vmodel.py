"""A model whose MoE layers train through the virtual EP emulator (``lrmoe bench ttl``).

:class:`VirtualModel` swaps every MoE layer's training forward for a
:class:`lrmoe.sim.virtual.VirtualEPLayer` run over G virtual ranks (global batch rows
``g*B/G .. (g+1)*B/G - 1`` are home rank g's) and records, per step, the wall time the
MoE layers took and their routed counts. Evaluation uses the layer's own forward. The
router and the shared experts (forward and backward) are left out of that MoE wall time,
so ``bench ttl`` charges them with the non-MoE work (per rank: their time / G).
"""

from __future__ import annotations

import time

import torch


def counts_GE_of(plan, E: int) -> torch.Tensor:
    """``[G, E]`` pairs each home routed to each expert in one plan (assigned + dropped)."""
    ie = plan.inst_expert_GS.reshape(-1)
    load = plan.assign_GGS.reshape(plan.G, -1).long()  # [home, rank*slot]
    c = torch.zeros(plan.G, E, dtype=torch.long).index_add_(1, ie[ie >= 0], load[:, ie >= 0])
    return c if plan.dropped_GE is None else c + plan.dropped_GE.long()


class VirtualModel:
    """Swap every MoE layer's training forward for a :class:`VirtualEPLayer` run."""

    def __init__(self, model, G: int, policy, opts, planner_ledger, sync, recompute_ledger=None):
        from lrmoe.sim.virtual import VirtualEPLayer

        self.layers, self.sync, self.wall = [], sync, 0.0
        self.counts_E: list[torch.Tensor] = []  # this step's global counts per layer
        self.counts_GE: list[torch.Tensor] = []  # ... and per home rank
        for m in model.moe_layers:
            v = VirtualEPLayer(m, G, policy, opts, ledger=planner_ledger,
                               recompute_ledger=recompute_ledger)
            orig = m.forward
            m.forward = self._wrap(m, v, orig)
            self.layers.append(v)

    def _wrap(self, m, v, orig):
        marks: dict[str, float] = {}

        def t_now() -> float:
            self.sync()
            return time.perf_counter()

        def start(_g):
            marks["b"] = t_now()

        def stop(_g):
            # up to the end of the exchange's backward: what follows (the router's and
            # the shared experts' backward) is non-MoE work
            b = marks.pop("b", None)
            end = v.stats.bwd_end_s if v.stats is not None and v.stats.bwd_end_s else t_now()
            if b is not None:
                self.wall += max(end - b, 0.0)

        def forward(x):
            if not m.training:
                return orig(x)
            if m.recomputing:
                # an activation checkpoint's re-run in backward (lrmoe.model.checkpoint):
                # the step keeps the first forward's stats and counts; the re-run is
                # charged as a whole-layer recompute (cost: the layer's forward dispatch,
                # experts and combine again); its wall lies inside the backward window
                first = v.stats
                out = v(x)
                v.stats = first
                if first.recompute_mode in ("fits", "pairs"):
                    first.recompute_mode = "layer"
                return out
            t0 = t_now()
            with torch.profiler.record_function("ttl:moe_forward"):  # the timed span
                out = v(x)
                # handed over, not shared: the layer's is dropped after the backward
                m.last_aux_loss, v.last_aux_loss = v.last_aux_loss, None
                cge = counts_GE_of(v.stats.plan, m.cfg.num_experts)
                self.counts_GE.append(cge)
                c = cge.sum(0)
                self.counts_E.append(c)
                m.step_counts_E = c if m.step_counts_E is None else m.step_counts_E + c
                self.wall += t_now() - t0 - v.stats.dense_fwd_s
            if out.requires_grad and x.requires_grad:
                out.register_hook(start)
                x.register_hook(stop)
            return out
        return forward

    def set_step(self, step: int) -> None:
        for v in self.layers:
            v.step = step


def routed_counts(model, batch, G: int) -> list[torch.Tensor]:
    """Per MoE layer, the ``[G, E]`` counts of the first step (exact forward, no grad)."""
    got = []
    hooks = [m.router.register_forward_hook(
        lambda mod, i, r: got.append(r.idx_TK)) for m in model.moe_layers]
    model.eval()  # eval: the plain forward, no step counting; the caller sets train()
    with torch.no_grad():
        model(batch[:, :-1])
    for h in hooks:
        h.remove()
    E = model.config.num_experts
    return [torch.stack([torch.bincount(i.cpu(), minlength=E)
                         for i in idx.reshape(G, -1)]).long() for idx in got]


def warm_up(model, G: int, batch, autocast) -> None:
    """One untimed static training step (fills the allocator, lazy inits), its forward
    under the timed steps' ``autocast``: the same kernels, the same memory (in fp32 a
    grouped-query attention has no fused kernel and keeps its whole score matrix)."""
    from lrmoe.parallel.exchange import BackwardOptions
    from lrmoe.policy.static import StaticPolicy

    VirtualModel(model, G, StaticPolicy(), BackwardOptions(), None, lambda: None)
    model.train()
    with autocast():
        loss = model.loss(batch[:, :-1], batch[:, 1:])[1]
    loss.backward()
    release_graph(model)


def release_graph(model) -> None:
    """Drop the MoE layers' aux losses after the backward: each holds its step's autograd
    graph, whose nodes keep the rows the exchanges' contexts saved and the grad hooks of
    :class:`VirtualModel` (which refer back to the layer, a cycle the collector cannot
    see through the graph)."""
    for m in model.moe_layers:
        m.last_aux_loss = None
