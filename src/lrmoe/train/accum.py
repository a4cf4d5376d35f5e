"""One optimizer step, as ``lrmoe train`` and ``lrmoe bench ttl`` both run it: N
micro-batches accumulated, then one update (docs/design.md §7, "Gradient accumulation").
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
    """Forward and backward ``n`` micro-batches, adding into the parameters' ``.grad``;
    returns ``[lm, objective]`` summed over them (detached, fp32).

    ``micro_batch(m)`` gives micro-batch ``m``: ``int64 [b, L + 1]``, or a
    :class:`~lrmoe.loss_mask.MaskedBatch` (its loss is its trained targets' share of the
    step's, so the scaling stays exact with unequal counts). ``on_micro(m, None)`` runs
    before micro-batch ``m``, ``on_micro(m, pair)`` after its backward.
    ``before_last_backward`` runs before the backward that leaves each gradient final
    (the host offload arms its early sends there).
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
           check_norm: Callable[[float], None] | None = None) -> tuple[float, list]:
    """The step's update after :func:`accumulate`: gradient sync, clipping, optimizer,
    schedule, router counts closed (summed over the expert-DP group). ``check_norm(norm)``
    may refuse the update (raise) before the weights change. Returns ``(norm before
    clipping, per-layer counts)``."""
    from lrmoe.parallel.groups import clip_grad_norm, count_reducer, sync_grads
    from lrmoe.train.offload import presynced

    with _range("clip"):
        sync_grads(model, ctx, presynced(opt))
        gnorm = clip_grad_norm(model, clip, ctx, getattr(opt, "scale_grads", None))
    if check_norm is not None:
        check_norm(gnorm)
    with _range("optimizer"):
        opt.step()
        sched.step()
        reduce = count_reducer(ctx)  # None without expert DP; its sum lands on ctx.device
        counts = model.end_step(None if reduce is None else lambda c: reduce(c).to(c.device))
        return gnorm, counts


def _range(phase: str):
    """A ``step:<phase>`` profiler range (free without a profiler): what
    ``benchmarks/non_moe_profile.py`` reads a step's phases from."""
    return torch.profiler.record_function(f"step:{phase}")
