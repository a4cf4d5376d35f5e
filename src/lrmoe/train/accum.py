"""Gradient accumulation: N micro-batches, one optimizer step.

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
optimizer and the scheduler run once.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import Tensor, nn


def accumulate(model: nn.Module, micro_batch: Callable[[int], Tensor], n: int,
               autocast=None, before_last_backward: Callable[[], None] | None = None) -> Tensor:
    """Forward and backward ``n`` micro-batches into the parameters' ``.grad``.

    ``micro_batch(m) -> int64 [b, L + 1]`` gives micro-batch ``m`` (inputs ``[:, :-1]``,
    targets ``[:, 1:]``). Returns ``[lm, objective]`` summed over the micro-batches
    (detached, fp32, on the model's device): divide by ``n`` for the step's mean.
    Gradients add to what ``.grad`` holds (zero it before the step).
    ``before_last_backward`` runs just before the last backward, the one that leaves
    each gradient final (the host offload arms its early sends there).
    """
    sums = None
    for m in range(n):
        batch = micro_batch(m)
        with (autocast() if autocast is not None else contextlib.nullcontext()):
            lm, obj = model.loss(batch[:, :-1], batch[:, 1:])
        if m == n - 1 and before_last_backward is not None:
            before_last_backward()
        (obj / n).backward()
        pair = torch.stack([lm.detach(), obj.detach()]).float()
        sums = pair if sums is None else sums + pair
    assert sums is not None
    return sums

