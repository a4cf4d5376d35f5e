"""One optimizer step, as ``lrmoe train`` and ``lrmoe bench ttl`` both run it: N
micro-batches accumulated (:func:`accumulate`), then one update (:func:`update`).

``--batch-size`` is the micro-batch (one forward and one backward, what the memory
ledger and every policy's plan see); ``--grad-accum N`` runs N of them before each
optimizer step, which so sees ``N x batch_size`` sequences.

Scaling. Each micro-batch's objective is divided by N before its backward. Every
micro-batch holds the same number of target tokens (``batch_size x seq_len``), so the
summed cross-entropy gradient is exactly that of the per-token mean over the N-times
larger batch. The router's load-balancing loss (Qwen3) is computed per micro-batch from
that micro-batch's counts and averaged over the N micro-batches: its gradient needs the
whole batch's expert fractions, which are known only after the last micro-batch's
forward, so no single backward pass per micro-batch could use them. Megatron-Core's
default aux loss and the HF Trainer's are per micro-batch too. GLM balances by bias
(no aux loss), and there accumulation is exact.

Per optimizer step, not per micro-batch: routers' counts add up over the micro-batches
and are closed once by ``model.end_step`` (the step's popularity SYMI plans the next
step's micro-batches from, and the GLM bias update); gradient sync, clipping, the
optimizer and the scheduler run once. So do the weight scatter and the replica-gradient
reduce of a placement every micro-batch shares (:mod:`lrmoe.parallel.instances`): the reduce
in the last micro-batch's backward, before the sync.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import Tensor, nn

from lrmoe.loss_mask import loss_args


def accumulate(model: nn.Module, micro_batch: Callable[[int], Tensor], n: int,
               autocast=None, on_micro: Callable[[int, Tensor | None], None] | None = None,
               before_last_backward: Callable[[], None] | None = None) -> Tensor:
    """Forward and backward ``n`` micro-batches into the parameters' ``.grad``.

    ``micro_batch(m) -> int64 [b, L + 1]`` gives micro-batch ``m`` (inputs ``[:, :-1]``,
    targets ``[:, 1:]``), or a :class:`~lrmoe.loss_mask.MaskedBatch` (fine-tuning rows:
    its loss is its trained targets' share of the step's, so the scaling above stays
    exact with unequal counts). Returns ``[lm, objective]`` summed over the micro-batches
    (detached, fp32, on the model's device): divide by ``n`` for the step's mean.
    Gradients add to what ``.grad`` holds (zero it before the step). ``on_micro(m,
    None)`` is called before micro-batch ``m`` and ``on_micro(m, pair)`` after its
    backward (``pair``: its ``[lm, objective]``), e.g. to time it.
    ``before_last_backward`` runs just before the last backward, the one that leaves
    each gradient final (the host offload arms its early sends there).
    """
    sums = None
    # the expert weights cast once, instance weights moved once per placement
    with model.step_weights(n):
        for m in range(n):
            if on_micro is not None:
                on_micro(m, None)
            model.set_micro_batch(m)
            batch = micro_batch(m)
            with _range("forward"), (autocast() if autocast is not None else contextlib.nullcontext()):
                x, y, num = loss_args(batch)
                lm, obj = model.loss(x, y) if num is None else model.loss(x, y, num)
            if m == n - 1 and before_last_backward is not None:
                before_last_backward()
            with _range("backward"):
                (obj / n).backward()
            pair = torch.stack([lm.detach(), obj.detach()]).float()
            del lm, obj
            if on_micro is not None:
                on_micro(m, pair)
            sums = pair if sums is None else sums + pair
    assert sums is not None
    return sums


def update(model: nn.Module, opt, sched, clip: float, ctx,
           check_norm: Callable[[float], None] | None = None, reduce=None) -> tuple[float, list]:
    """The step's update after :func:`accumulate`: gradient sync over the data-parallel
    ranks, clipping by the global norm (the host optimizer scales its own copies), the
    optimizer and the schedule, and the step's router counts closed
    (``model.end_step``). ``check_norm(norm)`` may refuse the update (raise) before the
    weights change. Returns ``(norm before clipping, per MoE layer the step's counts)``."""
    from lrmoe.parallel.groups import clip_grad_norm, sync_grads
    from lrmoe.train.offload import presynced

    with _range("clip"):
        sync_grads(model, ctx, presynced(opt))
        gnorm = clip_grad_norm(model, clip, ctx, getattr(opt, "scale_grads", None))
    if check_norm is not None:
        check_norm(gnorm)
    with _range("optimizer"):
        opt.step()
        sched.step()
        return gnorm, model.end_step(reduce=reduce)


def _range(phase: str):
    """A ``step:<phase>`` profiler range (free without a profiler): what
    ``benchmarks/non_moe_profile.py`` reads a step's phases from."""
    return torch.profiler.record_function(f"step:{phase}")
