"""The model's MoE layers trained through the virtual EP emulator (``lrmoe bench ttl``):
:class:`Emulator`, installed as the model's :class:`lrmoe.model.moe.MoERuntime` ``emulator``,
runs every layer's routed experts over G virtual ranks and times them."""

from __future__ import annotations

import torch

from lrmoe.model.compile import compile_model
from lrmoe.model.moe import MoERuntime
from lrmoe.parallel.options import BackwardOptions
from lrmoe.policy.plan import fitted, layer_checkpoint_plan
from lrmoe.policy.static import StaticPolicy
from lrmoe.sim.virtual import VirtualEPLayer, now


class Emulator:
    """Every MoE layer's routed experts over G virtual ranks (see module doc).

    Attributes:
        layers: per MoE layer, its :class:`VirtualEPLayer`.
        wall: seconds of routed-expert work (forward and backward) since last reset.
    """

    def __init__(self, model, G: int, policy, opts, planner_ledger):
        self.wall = 0.0
        self.layers = [VirtualEPLayer(m, G, policy, opts, ledger=planner_ledger)
                       for m in model.moe_layers]
        model.set_runtime(MoERuntime(emulator=self))

    def routed(self, m, x_TH, idx_TK, gate_TK, probs_TE):
        """:meth:`MoELayer.stages` of layer ``m`` over the virtual ranks, timed."""
        v = self.layers[m.moe_index]
        if m.recomputing:
            # an activation checkpoint's re-run in backward (lrmoe.model.checkpoint): the
            # step keeps the first forward's stats (the layer does not take the re-run's
            # step); the re-run is charged as a whole-layer recompute (the layer's forward
            # dispatch, experts and combine again); its wall lies inside the backward window
            out, step = v.routed(x_TH, idx_TK, gate_TK, probs_TE)
            if v.stats.recompute_mode in ("fits", "pairs"):
                v.stats.recompute_mode = "layer"
            return out, step
        dev = x_TH.device
        t0 = now(dev)
        with torch.profiler.record_function("ttl:moe_forward"):  # the timed span
            out, step = v.routed(x_TH, idx_TK, gate_TK, probs_TE)
        self.wall += now(dev) - t0
        v.stats = step.stats
        if out.requires_grad and x_TH.requires_grad:
            marks: dict[str, float] = {}
            out.register_hook(lambda g: marks.__setitem__("b", now(dev)))
            x_TH.register_hook(lambda g: self._backward_done(v, marks, dev))
        return out, step

    def _backward_done(self, v, marks: dict, dev: torch.device) -> None:
        """Up to the end of the exchange's backward: what follows (the router's and the
        shared experts' backward) is the layer's dense work."""
        b = marks.pop("b", None)
        end = v.stats.bwd_end_s if v.stats is not None and v.stats.bwd_end_s else now(dev)
        if b is not None:
            self.wall += max(end - b, 0.0)

    def set_step(self, step: int) -> None:
        for v in self.layers:
            v.step = step

    def stats(self) -> list:
        """This micro-batch's stats, one per MoE layer."""
        return [v.stats for v in self.layers]


class RecomputeWarmUp(StaticPolicy):
    """Static's plan under a budget fallback, forced: ``mode`` ``"pairs"`` recomputes half
    of each rank's rows, ``"layer"`` checkpoints the layer (:func:`warm_up`)."""

    def __init__(self, mode: str):
        super().__init__(name=f"static, {mode} recomputed")
        self.mode = mode

    def plan(self, counts_GE, inputs):
        plan = super().plan(counts_GE, inputs)
        if self.mode == "layer":
            return layer_checkpoint_plan(plan)
        return fitted(plan, "pairs", (plan.rank_load() // 2).numpy())


def warm_up(model, G: int, batch, autocast, compile: bool = False, also=()) -> None:
    """One untimed static training step (fills the allocator, lazy inits, compiles what
    the timed steps compile), its forward under the timed steps' ``autocast``: the same
    kernels, the same memory (in fp32 a grouped-query attention has no fused kernel and
    keeps its whole score matrix). Then one untimed step with static's rows partly
    recomputed and one with its layer checkpointed (the budget fallbacks' kernels), and
    one for each ``(policy, options)`` of ``also``: the kernels only some policies or
    fallbacks launch (lrmoe's selection and gathers) compile here, not inside the first
    timed step that meets them, whichever policy's it is."""
    if compile:
        compile_model(model)
    model.train()
    plain = BackwardOptions()
    for policy, opts in [(StaticPolicy(), plain), (RecomputeWarmUp("pairs"), plain),
                         (RecomputeWarmUp("layer"), plain), *also]:
        Emulator(model, G, policy, opts, None)
        with autocast():
            loss = model.loss(batch[:, :-1], batch[:, 1:])[1]
        loss.backward()
        release_graph(model)


def release_graph(model) -> None:
    """Drop the MoE layers' last steps after the backward: each aux loss holds its step's
    autograd graph, whose nodes keep the rows the exchanges' contexts saved."""
    for m in model.moe_layers:
        m.last = None
