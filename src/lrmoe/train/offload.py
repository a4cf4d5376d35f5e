"""``--optimizer-offload host``: the experts' AdamW state and fp32 master weights live in
host (CPU) memory and are updated there.

:class:`HostOffloadAdamW` is a ``torch.optim.AdamW`` whose *offloaded* parameters (the
expert weights) are stepped on the host; every other parameter is stepped on the device
by ``torch.optim.AdamW`` itself. The update is AdamW's (decoupled weight decay, same
hyper-parameters, same schedule), so a run with and without offload follows the same
trajectory to fp32 tolerance (``tests/test_offload.py``) for a few steps. Over tens of
steps under bf16 autocast, runs that differ in a single rounding part (a flipped bf16
weight rounding changes some routing choices): on the CPU, 30 steps of tiny-qwen3 end
with validation losses up to about 0.03 apart.

How an offloaded parameter is stepped: through :mod:`lrmoe.train.host_pipe` when it has
a master of its own (the trainer on CUDA): its gradient goes to a pinned host buffer in
its own dtype as soon as it is final (on the last micro-batch, while the backward goes
on: :func:`last_backward_hook`), the fused CPU AdamW updates the master and moments on
a worker thread chunk by chunk, and the weight goes back on a side stream, while the
device steps the other parameters. The step returns once the host is done; the compute
stream then waits for the copies. The masters, moments and weights are bit for bit those
of the serial update this replaced (``tests/references/offload_adamw.py``).

Where the state lives: the moments and ``step`` of an offloaded parameter are CPU
tensors in ``self.state[p]`` (keyed by the device parameter, so checkpoints save and
load them like any AdamW state; :meth:`load_state_dict` moves them back to the host).
The fp32 master of an offloaded parameter is a host copy of it, taken at construction
and again after a load (the device parameter is fp32 in this trainer, so it is exact).

What stays on the device: the expert parameters in ``compute_dtype`` and their
gradients (in that dtype too). With ``compute_dtype=torch.bfloat16`` (the trainer's
choice on CUDA, where autocast computes in bf16) the GPU holds only the bf16 compute
weights and bf16 gradients of the experts, as SYMI and ZeRO-Offload do and as the
ledger's offload design (:mod:`lrmoe.ledger`) prices it: the fp32 master (state key
``master``, so checkpoints carry it exactly) and both moments live on the host; each
step the bf16 gradient crosses to the host as bf16 and is widened there, and the updated
master is rounded back into the bf16 device weight on the host. Without
``compute_dtype`` the device parameters keep the model's dtype (fp32).

Gradient clipping (:meth:`scale_grads`): under autocast the device path's experts
compute in bf16 too (:mod:`lrmoe.model.moe` casts their fp32 weights), so both paths
get the same bf16 gradient values; the device path widens them to fp32 (the cast's
backward) and clips there. Multiplied in place, a bf16 gradient would round every
clipped product to bf16 (up to 2^-9 relative, on every clipped step, passed on to the
update), so the clip coefficient of an offloaded gradient is applied on the host, to its
fp32 widening (the gradient may already be on its way there when the norm is known):
the host update sees the device path's fp32 gradient, and with the same AdamW kernel
the masters are the device path's fp32 weights bit for bit (tested on the CPU under
bf16 autocast). One difference remains: with ``--grad-accum N`` autograd sums the
micro-batches' gradients in the parameter's dtype, bf16 here, where the device path
sums them in fp32.

Host memory, with the parameters on CUDA: the masters and the gradient buffers (bf16,
the gradients' dtype) are pinned (so the copies run asynchronously), and the caching
host allocator rounds each up to a power of two; the moments (never copied to the
device) are pageable; the pipeline adds one chunk of fp32 scratch and a ring of pinned
chunk buffers (:meth:`staging_bytes`). A load allocates them the same way
(:meth:`HostOffloadAdamW._host_alloc`). The step ledger prices them so
(:func:`lrmoe.step_ledger.host_state`).

When the "host" is the parameters' own device and a parameter is fp32 (the emulator's
case, and a CPU run), a separate master would be a second copy of the same numbers and a
host gradient buffer a second copy of the gradient: the master is then the parameter
itself and the update reads the gradient in place, after backward, in the step
(synchronised, timed as :attr:`HostOffloadAdamW.host_s`). The update is the same fused
AdamW on the same values, so the trajectory is bitwise that of a separate master.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from torch import Tensor
from torch.optim.adamw import adamw

from lrmoe.errors import require
from lrmoe.train.host_pipe import HOST_CHUNK, HostJob, HostPipeline, PipeTimes

OFFLOAD_CHOICES = ("device", "host")
HOST_STEP_RANGE = "offload:host_step"  # the profiler range of a step's host part


class HostOffloadAdamW(torch.optim.AdamW):
    """AdamW; the parameters in ``host_params`` are updated in host memory.

    Args:
        params: parameter groups, as for ``torch.optim.AdamW``.
        host_params: the parameters to offload (a subset of ``params``).
        lr, betas, eps, weight_decay: AdamW's hyper-parameters (per group as usual).
        host: where the offloaded state lives: ``"cpu"`` (the real offload), or the
            parameters' own device with fp32 parameters (each its own master, updated in
            place, no transfers; the emulator uses it so that one process holding every
            virtual rank's experts does not spend its device time in a CPU update whose
            cost it models).
        compute_dtype: the dtype the device keeps the offloaded weights in.
        chunk: elements of a host-update chunk (:mod:`lrmoe.train.host_pipe`).

    Attributes:
        host_s: wall seconds the last step spent on its host part beyond the device's
            own AdamW (the own-master update, synchronised, and the wait for the
            pipeline's worker), so a caller that times the step can tell it apart.
        pipe_times: the pipeline's timings of the last step (all zero without one).
    """

    def __init__(self, params, host_params: Iterable[Tensor], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 1e-2, host: str | torch.device = "cpu",
                 compute_dtype: torch.dtype | None = None, chunk: int = HOST_CHUNK):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        ids = {id(p) for p in host_params}
        mine = [p for g in self.param_groups for p in g["params"]]
        require(ids <= {id(p) for p in mine},
                "optimizer offload: some offloaded parameters are not in the optimizer")
        self._host = {id(p) for p in mine if id(p) in ids}
        self._host_dev = torch.device(host)
        if self._host_dev.type == "cuda" and self._host_dev.index is None:
            # "cuda" as the parameters report it, so a same-device check compares alike
            self._host_dev = torch.device("cuda", torch.cuda.current_device())
        cuda = any(p.is_cuda for p in mine if id(p) in ids)
        self._pin = self._host_dev.type == "cpu" and cuda and torch.cuda.is_available()
        self._sync = torch.cuda.synchronize if cuda else (lambda: None)
        self._master: dict[int, Tensor] = {}
        self._grad_buf: dict[int, Tensor] = {}  # the pipeline's host gradient buffers
        self._grad_scale: dict[int, float] = {}  # clip coefficients due on the host
        self.host_s = 0.0
        # one decision per parameter, taken once: fp32 on the host device and kept in fp32,
        # it is its own master and the update reads its gradient in place (no host copies)
        self._own_master = {id(p) for p in mine if id(p) in self._host
                            and p.device == self._host_dev and p.dtype == torch.float32
                            and compute_dtype in (None, torch.float32)}
        self._refresh_masters()
        if compute_dtype is not None:  # the masters hold the fp32 values from here on
            for p in mine:
                if id(p) in self._host and p.dtype != compute_dtype:
                    p.data = p.data.to(compute_dtype)
        piped = [p for p in mine if id(p) in self._host and id(p) not in self._own_master]
        require(not piped or self._host_dev.type == "cpu",
                f"optimizer offload to {self._host_dev}: a host other than the CPU takes "
                "parameters of its own device in fp32 (each its own master)")
        self._piped = {id(p) for p in piped}
        self._pipe = (HostPipeline(piped, self._host_empty, self._grad_buf, chunk)
                      if piped else None)

    # ------------------------------------------------------------------ host memory
    def _host_empty(self, like: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Host memory for a master (fp32) or a gradient buffer (the gradient's dtype),
        the tensors that cross to and from the device each step: pinned when the
        parameters are on CUDA."""
        return torch.empty(like.shape, dtype=dtype, device=self._host_dev, pin_memory=self._pin)

    def _host_alloc(self, key: str, like: Tensor) -> Tensor:
        """Host memory for state ``key`` shaped as ``like``, fresh or loaded alike: the
        master as :meth:`_host_empty`; the moments and ``step``, which never leave the
        host, pageable and zeroed."""
        if key == "master":
            return self._host_empty(like)
        return torch.zeros(like.shape, dtype=torch.float32, device=self._host_dev)

    def staging_bytes(self) -> int:
        """Host bytes of the pipeline's scratch and staging ring (allocated at the first
        step)."""
        return 0 if self._pipe is None else self._pipe.staging_bytes()

    def _refresh_masters(self) -> None:
        """fp32 host masters: the state's ``master`` when it has one (a loaded
        checkpoint), else a copy of the device parameter (exact while it is fp32). A
        parameter that is its own master (``_own_master``) takes a loaded master's
        values and then stands for it."""
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) in self._host:
                    st = self.state[p]
                    if id(p) in self._own_master:
                        m = p.detach()
                        if "master" in st and st["master"].data_ptr() != m.data_ptr():
                            m.copy_(st["master"])
                        st["master"] = m
                    elif "master" not in st:
                        st["master"] = self._host_alloc("master", p).copy_(p.detach())
                    self._master[id(p)] = st["master"]

    def _host_state(self, p: Tensor) -> dict:
        st = self.state[p]
        if "step" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=self._host_dev)
            st["exp_avg"] = self._host_alloc("exp_avg", p)
            st["exp_avg_sq"] = self._host_alloc("exp_avg_sq", p)
        return st

    # ------------------------------------------------------------------ early sends
    @property
    def pipelined(self) -> bool:
        """Some offloaded parameters go through the pipeline (they have a master)."""
        return self._pipe is not None

    def arm(self, finish: Callable[[Tensor], None]) -> None:
        """The next backward leaves the gradients final: send each offloaded one to the
        host as it arrives, ``finish`` (what the gradient sync would do to it) applied
        first (:meth:`lrmoe.train.host_pipe.HostPipeline.arm`)."""
        if self._pipe is not None:
            self._pipe.arm(finish)

    @property
    def presynced(self) -> frozenset[int]:
        """``id``s of the parameters whose gradient the armed ``finish`` was applied to
        (the gradient sync leaves them alone)."""
        return frozenset() if self._pipe is None else self._pipe.presynced

    @property
    def pipe_times(self) -> PipeTimes:
        return PipeTimes() if self._pipe is None else self._pipe.times

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def scale_grads(self, params: Iterable[Tensor], coef: float) -> None:
        """Multiply the gradients of ``params`` by ``coef`` (gradient clipping): in place,
        except an offloaded gradient with a master of its own, whose product the next
        :meth:`step` takes in fp32 on the host (see the module's docstring)."""
        for p in params:
            if id(p) in self._piped:
                self._grad_scale[id(p)] = self._grad_scale.get(id(p), 1.0) * coef
            else:
                p.grad.mul_(coef)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grad_scale.clear()  # the coefficients belong to the gradients dropped here
        if self._pipe is not None:
            self._pipe.reset()
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """The offloaded parameters' host update (started first, on the pipeline's
        worker), the device AdamW on the other parameters, then the own-master update;
        returns once the host is done."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        jobs = self._jobs()
        if jobs:
            self._pipe.start(jobs)
        waited = False
        try:
            self._device_step()
            own = self._own_rows()
            if own:
                self._sync()  # the device step's work is not the host part's
            t0 = time.perf_counter()
            with torch.profiler.record_function(HOST_STEP_RANGE):
                if own:
                    self._own_step(own)
                waited = True
                if jobs:
                    self._pipe.wait()
            self.host_s = time.perf_counter() - t0
        finally:
            if jobs and not waited:
                self._pipe.wait()
        return loss

    def _device_step(self) -> None:
        """``torch.optim.AdamW``'s step on the parameters that are not offloaded."""
        held = {}
        for g in self.param_groups:  # the device step must not see the offloaded grads
            for p in g["params"]:
                if id(p) in self._host:
                    held[id(p)] = p.grad
                    p.grad = None
        try:
            super().step()
        finally:
            for g in self.param_groups:
                for p in g["params"]:
                    if id(p) in held:
                        p.grad = held[id(p)]

    def _jobs(self) -> list[HostJob]:
        """The pipelined parameters' updates, with their hyper-parameters and clip
        coefficients as they are now."""
        jobs = []
        for g in self.param_groups:
            beta1, beta2 = g["betas"]
            for p in g["params"]:
                if id(p) in self._piped and p.grad is not None:
                    st = self._host_state(p)
                    jobs.append(HostJob(p, self._master[id(p)], st["exp_avg"], st["exp_avg_sq"],
                                        st["step"], self._grad_scale.pop(id(p), None),
                                        g["lr"], beta1, beta2, g["weight_decay"], g["eps"]))
        return jobs

    def _own_rows(self) -> list[tuple[dict, list[Tensor]]]:
        """Per group, the parameters that are their own masters and have a gradient."""
        todo = []
        for g in self.param_groups:
            rows = [p for p in g["params"] if id(p) in self._own_master and p.grad is not None]
            if rows:
                todo.append((g, rows))
        return todo

    def _own_step(self, todo: list[tuple[dict, list[Tensor]]]) -> None:
        """The fused AdamW on the parameters that are their own masters, reading their
        gradients in place; synchronised at the end (``host_s`` times it)."""
        for g, rows in todo:
            states = [self._host_state(p) for p in rows]
            beta1, beta2 = g["betas"]
            adamw([p.detach() for p in rows], [p.grad.detach() for p in rows],
                  [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
                  [s["step"] for s in states], foreach=False, fused=True, amsgrad=False,
                  beta1=beta1, beta2=beta2, lr=g["lr"], weight_decay=g["weight_decay"],
                  eps=g["eps"], maximize=False)
        self._sync()

    # ------------------------------------------------------------------ checkpoints
    def load_state_dict(self, state_dict: dict) -> None:
        """AdamW's load for the device parameters; the offloaded parameters' state goes
        straight to host memory in fp32 (AdamW's load would cast it to the parameter's
        dtype, bf16 under ``compute_dtype``), allocated as a fresh run's
        (:meth:`_host_alloc`: the masters pinned when the parameters are on CUDA, so a
        resumed run's copies stay asynchronous and its memory is what the step ledger
        prices). A state without ``master`` (an older checkpoint) takes the master from
        the (already loaded) device parameter."""
        mine = [p for g in self.param_groups for p in g["params"]]
        order = [i for g in state_dict["param_groups"] for i in g["params"]]
        rest, host = dict(state_dict["state"]), {}
        for i, p in zip(order, mine):
            if id(p) in self._host and i in rest:
                host[id(p)] = rest.pop(i)
        super().load_state_dict({**state_dict, "state": rest})
        for p in mine:
            if id(p) in self._host:
                self.state[p] = {k: self._host_alloc(k, v).copy_(v.detach())
                                 for k, v in host.get(id(p), {}).items()}
        self._refresh_masters()


def last_backward_hook(opt: torch.optim.Optimizer, ctx) -> Callable[[], None] | None:
    """What the trainer runs before a step's last backward
    (:func:`lrmoe.train.accum.accumulate`): arm the host offload's sends of final
    gradients, with what the gradient sync does to each
    (:func:`lrmoe.parallel.groups.expert_grad_finish`). ``None`` where nothing is to be
    armed: no pipelined host offload, or DP x EP (its gradients are sent after the
    sync)."""
    from lrmoe.parallel.groups import expert_grad_finish

    if not isinstance(opt, HostOffloadAdamW) or not opt.pipelined:
        return None
    finish = expert_grad_finish(ctx)
    return None if finish is None else (lambda: opt.arm(finish))


def presynced(opt: torch.optim.Optimizer) -> frozenset[int]:
    """``id``s of the parameters whose gradient sync was done as they became final
    (:attr:`HostOffloadAdamW.presynced`; none for another optimizer)."""
    return opt.presynced if isinstance(opt, HostOffloadAdamW) else frozenset()


def offloaded_params(model: torch.nn.Module) -> list[Tensor]:
    """The parameters ``--optimizer-offload host`` puts in host memory: the experts'."""
    from lrmoe.parallel.groups import is_expert_param

    return [p for n, p in model.named_parameters() if p.requires_grad and is_expert_param(n)]
