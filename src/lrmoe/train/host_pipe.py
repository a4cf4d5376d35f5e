"""The host optimizer's pipeline: per offloaded parameter, its gradient to the host (sent as
soon as it is final, on a side stream), the fused CPU AdamW on its fp32 master chunk by
chunk on the step's own thread, the updated weight back on a second side stream. When each
stage runs and why the result is bit for bit the serial update's: docs/design.md §5.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.optim.adamw import adamw

from lrmoe.errors import require

HOST_CHUNK = 1 << 21  # elements a host-update chunk: 8 MiB of fp32 gradient
CHUNK_ALIGN = 64  # chunk starts at multiples of this: no vector of AdamW's kernel is split
RING = 4  # pinned staging buffers for the weights going back


@dataclass
class HostJob:
    """One parameter's host update, as the step captured it."""

    param: Tensor  # the device parameter, written chunk by chunk
    master: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    step: Tensor  # AdamW's step counter (0-dim fp32, host)
    coef: float | None  # the clip coefficient due, or None
    group: dict  # its optimizer group: lr, betas, weight decay, eps (the step changes none)


def host_adamw(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
               exp_avg_sqs: list[Tensor], steps: list[Tensor], group: dict) -> None:
    """torch's fused AdamW with ``group``'s lr, betas, weight decay and eps."""
    beta1, beta2 = group["betas"]
    adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False, fused=True,
          amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
          weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


@dataclass
class PipeTimes:
    """The last step's pipeline, host clock; with :attr:`HostPipeline.timing`, the device's
    copy times (:meth:`HostPipeline.copy_ms`)."""

    update_s: float = 0.0  # the host update's run
    grad_wait_s: float = 0.0  # its waits for gradients
    ring_wait_s: float = 0.0  # and for ring slots
    d2h_ms: float | None = None
    h2d_ms: float | None = None

    @property
    def busy_s(self) -> float:
        """The update's own work: widening, clipping, AdamW, rounding, issuing copies."""
        return self.update_s - self.grad_wait_s - self.ring_wait_s


class HostPipeline:
    """The three stages for ``params``; ``alloc(param, dtype)`` gives host memory shaped as
    ``param``, and ``grad_buf`` (``id(param) -> host gradient buffer``) is filled here."""

    def __init__(self, params: list[Tensor], alloc: Callable[[Tensor, torch.dtype], Tensor],
                 grad_buf: dict[int, Tensor], chunk: int = HOST_CHUNK):
        require(chunk > 0 and chunk % CHUNK_ALIGN == 0,
                f"host update chunk {chunk}: use a positive multiple of {CHUNK_ALIGN}")
        self.chunk, self._alloc, self._grad_buf = chunk, alloc, grad_buf
        self._device = params[0].device
        self._cuda = self._device.type == "cuda"
        self._d2h = torch.cuda.Stream(self._device) if self._cuda else None
        self._h2d = torch.cuda.Stream(self._device) if self._cuda else None
        self._landed: dict[int, torch.cuda.Event | None] = {}  # sent this step, in order
        self._early: set[int] = set()  # sent by the hook, ``finish`` applied
        self._finish: Callable[[Tensor], None] | None = None  # armed for this backward
        self._scratch: Tensor | None = None  # one chunk of widened gradient
        self._ring: list[Tensor] = []
        self._ring_ev: list[torch.cuda.Event | None] = [None] * RING
        self._slot = 0
        self.times = PipeTimes()
        self.timing = False  # time each copy with CUDA events (benchmarks)
        self._copies: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._span = max(1, min(chunk, max(p.numel() for p in params)))  # a chunk's elements
        me = weakref.WeakMethod(self._on_final)  # the hooks must not keep the pipeline alive

        def hook(p: Tensor) -> None:
            f = me()
            if f is not None:
                f(p)
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in params]

    def __del__(self) -> None:
        for h in getattr(self, "_hooks", ()):
            h.remove()

    # ------------------------------------------------------------------ stage 1
    def arm(self, finish: Callable[[Tensor], None]) -> None:
        """As each gradient of the next backward becomes final, apply ``finish`` and send it; from
        then on it may change only through the step's clip coefficient, never in place."""
        self._finish = finish

    @property
    def presynced(self) -> frozenset[int]:
        """``id``s of the parameters whose gradient ``finish`` was applied to."""
        return frozenset(self._early)

    def _on_final(self, p: Tensor) -> None:
        if self._finish is None or p.grad is None or id(p) in self._landed:
            return
        self._finish(p.grad)
        self._early.add(id(p))
        self.send(p)

    def send(self, p: Tensor) -> None:
        """Copy ``p.grad`` into its host buffer, behind the compute stream's queued work."""
        g = p.grad.detach()
        buf = self._grad_buf.get(id(p))
        if buf is None or buf.dtype != g.dtype:
            buf = self._grad_buf[id(p)] = self._alloc(p, g.dtype)
        if not self._cuda:
            buf.copy_(g)
            self._landed[id(p)] = None
            return
        self._d2h.wait_stream(torch.cuda.current_stream(self._device))
        with self._timed("d2h", self._d2h) as ev:
            buf.copy_(g, non_blocking=True)
        g.record_stream(self._d2h)  # its memory is not reused before the copy has read it
        self._landed[id(p)] = ev

    def reset(self) -> None:
        """Forget the last step's sends and copy timings, and disarm."""
        self._disarm()
        self._copies.clear()

    def _disarm(self) -> None:
        self._finish = None
        self._landed.clear()
        self._early.clear()

    # ------------------------------------------------------------------ stages 2 and 3
    def send_rest(self, jobs: list[HostJob]) -> list[HostJob]:
        """Send the gradients of ``jobs`` not sent yet; ``jobs`` in the order sent."""
        self._finish = None
        for j in jobs:
            if id(j.param) not in self._landed:
                self.send(j.param)
        if self._cuda:  # the weights are written once the compute stream is done with them
            self._h2d.wait_stream(torch.cuda.current_stream(self._device))
        order = {k: i for i, k in enumerate(self._landed)}
        return sorted(jobs, key=lambda j: order[id(j.param)])

    def update(self, jobs: list[HostJob]) -> None:
        """Update ``jobs`` (as :meth:`send_rest` ordered them) on this thread, each gradient
        once it has landed; the compute stream then waits for the weights' copies. On this
        thread, not a worker: a second thread's OpenMP team contends with the step's own for
        the cores (`benchmarks/offload_step.py`)."""
        t0, waited = time.perf_counter(), 0.0
        self.times.ring_wait_s = 0.0
        try:
            for j in jobs:
                ev = self._landed[id(j.param)]
                if ev is not None:
                    t = time.perf_counter()
                    ev.synchronize()  # this gradient has landed in host memory
                    waited += time.perf_counter() - t
                self._update(j)
        finally:
            self.times.update_s, self.times.grad_wait_s = time.perf_counter() - t0, waited
            if self._cuda:
                torch.cuda.current_stream(self._device).wait_stream(self._h2d)
            self._disarm()

    def _update(self, j: HostJob) -> None:
        """Widen, clip, AdamW and round back, chunk by chunk."""
        grad = self._grad_buf[id(j.param)].view(-1)
        master, m1, m2 = (t.view(-1) for t in (j.master, j.exp_avg, j.exp_avg_sq))
        weight = j.param.detach().view(-1)
        for a in range(0, grad.numel(), self.chunk):
            b = min(grad.numel(), a + self.chunk)
            if self._scratch is None:
                self._scratch = torch.empty(self._span, dtype=torch.float32)
            g = self._scratch[:b - a].copy_(grad[a:b])
            if j.coef is not None:
                g.mul_(j.coef)
            # AdamW adds one to the step it is given: each chunk gets its own copy
            host_adamw([master[a:b]], [g], [m1[a:b]], [m2[a:b]], [j.step.clone()], j.group)
            self._put(weight, master, a, b)
        j.step.add_(1)

    def _put(self, weight: Tensor, master: Tensor, a: int, b: int) -> None:
        """The master's chunk ``[a, b)`` rounded into the weight (on CUDA via a pinned ring slot)."""
        if not self._cuda:
            weight[a:b].copy_(master[a:b])
            return
        k, self._slot = self._slot, (self._slot + 1) % RING
        if not self._ring or self._ring[0].dtype != weight.dtype:
            self._ring = [torch.empty(self._span, dtype=weight.dtype, pin_memory=True)
                          for _ in range(RING)]
            self._ring_ev = [None] * RING
        if self._ring_ev[k] is not None:
            t = time.perf_counter()
            self._ring_ev[k].synchronize()  # the slot's last copy has left it
            self.times.ring_wait_s += time.perf_counter() - t
        out = self._ring[k][:b - a].copy_(master[a:b])
        with self._timed("h2d", self._h2d) as ev:
            weight[a:b].copy_(out, non_blocking=True)
        self._ring_ev[k] = ev

    @contextlib.contextmanager
    def _timed(self, kind: str, stream: torch.cuda.Stream):
        """Run the body's copy on ``stream``; yields the event recorded after it."""
        end = torch.cuda.Event(enable_timing=self.timing)
        start = None
        if self.timing:
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
        with torch.cuda.stream(stream):
            yield end
        end.record(stream)
        if start is not None:
            self._copies.append((kind, start, end))

    def copy_ms(self) -> dict[str, float]:
        """Device milliseconds of the last step's copies by direction (with :attr:`timing`)."""
        ms = {"d2h": 0.0, "h2d": 0.0}
        for kind, a, b in self._copies:
            b.synchronize()
            ms[kind] += a.elapsed_time(b)
        self.times.d2h_ms, self.times.h2d_ms = ms["d2h"], ms["h2d"]
        return ms

