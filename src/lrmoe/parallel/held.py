"""Instance weights held over an optimizer step: a placement that stays the same across
the step's micro-batches sends its replicas' weights once and their gradients home once.

Inside the trainer's step of N > 1 micro-batches (:meth:`MoEForCausalLM.step_weights`)
each MoE layer keeps a :class:`HeldInstances`. At the first micro-batch of a placement
its occupied slots' weights are gathered from their owners (one all-to-all per weight
tensor, as :class:`~lrmoe.parallel.weights.GatherInstances` does) and kept while the
next micro-batches' placement is the same (the same occupied experts on every rank, in
slot order: the same instance weights). Each micro-batch's backward adds the slots'
weight gradient to the layer's accumulator, in the slots' compute dtype: the gradient
buffer the ledger prices per occupied slot (``instance_grads``), resident with the
weights for the step. The backward of the step's last micro-batch sends the sum home
(:func:`~lrmoe.parallel.weights.reduce_slots`, the replica-gradient reduce) through
autograd, into the owned parameters' gradients, before the gradient sync and clipping.
A placement that changes at a later micro-batch first sends home what its predecessor
accumulated (:meth:`HeldInstances.flush`, into ``.grad`` directly) and gathers its own;
a natives-only plan uses the owned tensors, nothing held.

Exactness: the weights are the same values in every micro-batch. The owner's gradient
is ``sum over instances (sum over micro-batches)`` where moving every micro-batch gives
``sum over micro-batches (sum over instances)``: bit for bit the same for an expert
with one instance (the additions are the same, in the same order), the same to
floating-point tolerance where an expert has several (its instances' partial sums are
associated differently). Under a bf16 compute dtype the accumulator adds in bf16 (the
per-micro-batch path adds each micro-batch's reduced gradient to the fp32 ``.grad``).

Legend: S occupied slots, E experts, G ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from lrmoe.parallel.comm import EPComm
from lrmoe.parallel.weights import (
    InstanceRoute,
    gather_slots,
    instance_route,
    natives_only,
    reduce_slots,
)
from lrmoe.policy.plan import Plan


def placement_key(ie_GS: np.ndarray) -> bytes:
    """What the instance weights depend on: every rank's occupied experts in slot order
    (empty slots, wherever they are, change nothing)."""
    ie = ie_GS.astype(np.int64, copy=False)
    return np.concatenate([(ie >= 0).sum(1), ie[ie >= 0]]).tobytes()


class HeldInstances:
    """One MoE layer's instance weights and their gradient accumulators over the
    ``micros`` micro-batches of an optimizer step (module doc).

    Args:
        params: the layer's owned expert parameters, in the order of the weight lists
            (``gate_up_proj``, ``down_proj``): where a flush adds its gradients.
        micros: the step's micro-batches; the last one's backward sends the sums home.
    """

    def __init__(self, params: Sequence[Tensor], micros: int):
        self.params, self.micros = list(params), micros
        self._clear()

    def _clear(self) -> None:
        self.key: bytes | None = None
        self.route: InstanceRoute | None = None
        self.comm: EPComm | None = None
        self.weights: list[Tensor | None] = []
        self.grads: list[Tensor | None] = []

    def weight_list(self, ws_own: list[Tensor], plan: Plan, comm: EPComm, E: int,
                    micro: int) -> list[Tensor]:
        """The weights of this rank's occupied slots for ``plan`` at micro-batch
        ``micro`` of the step: :func:`~lrmoe.parallel.weights.instance_weight_list`'s
        values, gathered only where the placement differs from the previous
        micro-batch's."""
        ie = plan.inst_expert_GS.numpy()
        key = None if natives_only(ie, E) else placement_key(ie)
        if self.key is not None and self.key != key:
            self.flush()
        if key is None:
            return list(ws_own)
        if self.key is None:
            route = instance_route(plan, comm.rank, E)
            with torch.no_grad():
                self.weights = [gather_slots(w.detach(), route, comm) for w in ws_own]
            self.key, self.route, self.comm = key, route, comm
            self.grads = [None] * len(ws_own)
        final = micro == self.micros - 1
        return [_Held.apply(w, self, j, final) for j, w in enumerate(ws_own)]

    def flush(self) -> None:
        """Send home what the held slots accumulated, outside autograd (a placement that
        changes within the step, or what a last backward left): each owned parameter's
        ``.grad`` gets what autograd's accumulation would add (widened to its dtype)."""
        with torch.no_grad():
            for p, acc in zip(self.params, self.grads):
                if acc is None:
                    continue
                g = reduce_slots(acc, self.route, self.comm, p.shape[0]).to(p.dtype)
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad += g
        self._clear()

    def _sent(self, j: int) -> None:
        self.weights[j] = self.grads[j] = None
        if all(w is None for w in self.weights):
            self._clear()


class _Held(torch.autograd.Function):
    """Slot weights ``held.weights[j]``, kept for the step: the forward hands out a view
    (no copy, no communication); the backward adds the slots' gradient to the step's
    sum and, at the step's last micro-batch, sends the sum home as the gradient of the
    owned ``w_own`` (the last micro-batch's is the only one autograd carries further)."""

    @staticmethod
    def forward(ctx, w_own: Tensor, held: HeldInstances, j: int, final: bool) -> Tensor:
        ctx.held, ctx.j, ctx.final, ctx.n_own = held, j, final, w_own.shape[0]
        w = held.weights[j]
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g_S: Tensor):
        held, j = ctx.held, ctx.j
        acc = held.grads[j]
        # out of place: ``g_S`` is autograd's, and the sum a fresh tensor of ours
        acc = g_S if acc is None else acc + g_S
        if not ctx.final:
            held.grads[j] = acc
            return None, None, None, None
        g_own = reduce_slots(acc, held.route, held.comm, ctx.n_own)
        held._sent(j)
        return g_own, None, None, None
