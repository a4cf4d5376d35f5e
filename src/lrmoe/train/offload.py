"""``--optimizer-offload host``: the experts' AdamW state and fp32 master weights live in
host memory and are updated there, pipelined with the backward (:mod:`.host_pipe`).

The design (where each tensor lives, clipping on the host, the own-master case, what is
bit for bit the device path's): docs/design.md §5, "Optimizer offload".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from lrmoe.errors import require
from lrmoe.parallel.groups import expert_grad_finish, is_expert_param
from lrmoe.train.host_pipe import HOST_CHUNK, HostJob, HostPipeline, PipeTimes, host_adamw

HOST_STEP_RANGE = "offload:host_step"  # the profiler range of a step's host part


class HostOffloadAdamW(torch.optim.AdamW):
    """AdamW whose ``host_params`` are updated in host memory; ``host`` is ``"cpu"`` (the
    real offload) or the parameters' own device, each fp32 parameter its own master."""

    def __init__(self, params, host_params: Iterable[Tensor], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 1e-2, host: str | torch.device = "cpu",
                 compute_dtype: torch.dtype | None = None, chunk: int = HOST_CHUNK):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        ids = {id(p) for p in host_params}
        mine = [p for g in self.param_groups for p in g["params"]]
        self._host = {id(p) for p in mine if id(p) in ids}
        self._host_dev = torch.device(host)
        if self._host_dev.type == "cuda" and self._host_dev.index is None:
            # "cuda" as the parameters report it, so a same-device check compares alike
            self._host_dev = torch.device("cuda", torch.cuda.current_device())
        cuda = any(p.is_cuda for p in mine if id(p) in ids)
        self._pin = self._host_dev.type == "cpu" and cuda and torch.cuda.is_available()
        self._sync = torch.cuda.synchronize if cuda else (lambda: None)
        self._grad_buf: dict[int, Tensor] = {}  # the pipeline's host gradient buffers
        self._grad_scale: dict[int, float] = {}  # clip coefficients due on the host
        self.host_s = 0.0  # wall seconds of the last step's host part beyond the device's
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

    def _host_empty(self, like: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Host memory for a master or a gradient buffer: pinned when the parameters are on CUDA."""
        return torch.empty(like.shape, dtype=dtype, device=self._host_dev, pin_memory=self._pin)

    def _host_alloc(self, key: str, like: Tensor) -> Tensor:
        """Host memory for state ``key``, fresh or loaded alike (moments pageable, zeroed)."""
        if key == "master":
            return self._host_empty(like)
        return torch.zeros(like.shape, dtype=torch.float32, device=self._host_dev)

    def _refresh_masters(self) -> None:
        """fp32 host masters: a loaded ``master``, else a copy of the device parameter; a parameter
        that is its own master takes a loaded master's values."""
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

    def _host_state(self, p: Tensor) -> dict:
        st = self.state[p]
        if "step" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=self._host_dev)
            st["exp_avg"] = self._host_alloc("exp_avg", p)
            st["exp_avg_sq"] = self._host_alloc("exp_avg_sq", p)
        return st

    @property
    def pipelined(self) -> bool:
        return self._pipe is not None

    @property
    def pipe_times(self) -> PipeTimes:
        return PipeTimes() if self._pipe is None else self._pipe.times

    @torch.no_grad()
    def scale_grads(self, params: Iterable[Tensor], coef: float) -> None:
        """Multiply the gradients of ``params`` by ``coef`` (clipping): in place, except a pipelined
        gradient, whose coefficient the host applies to its fp32 widening."""
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
        """The device AdamW (queued first, so it runs while the host works), the host
        update, then the own-master update; returns once the host is done. No ``closure``."""
        require(closure is None, "HostOffloadAdamW.step takes no closure: run the backward first")
        jobs = self._jobs()
        if jobs:
            jobs = self._pipe.send_rest(jobs)
        self._device_step()
        own = self._own_rows()
        if own:
            self._sync()  # the device step's work is not the host part's
        t0 = time.perf_counter()
        with torch.profiler.record_function(HOST_STEP_RANGE):
            if jobs:
                self._pipe.update(jobs)
            if own:
                self._own_step(own)
        self.host_s = time.perf_counter() - t0

    def _device_step(self) -> None:
        # the device step must not see the offloaded grads
        held = [(p, p.grad) for g in self.param_groups for p in g["params"] if id(p) in self._host]
        for p, _ in held:
            p.grad = None
        try:
            super().step()
        finally:
            for p, grad in held:
                p.grad = grad

    def _jobs(self) -> list[HostJob]:
        jobs = []
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) in self._piped and p.grad is not None:
                    st = self._host_state(p)
                    jobs.append(HostJob(p, st["master"], st["exp_avg"], st["exp_avg_sq"],
                                        st["step"], self._grad_scale.pop(id(p), None), g))
        return jobs

    def _own_rows(self) -> list[tuple[dict, list[Tensor]]]:
        todo = []
        for g in self.param_groups:
            rows = [p for p in g["params"] if id(p) in self._own_master and p.grad is not None]
            if rows:
                todo.append((g, rows))
        return todo

    def _own_step(self, todo: list[tuple[dict, list[Tensor]]]) -> None:
        """The fused AdamW on the parameters that are their own masters, gradients read in place."""
        for g, rows in todo:
            states = [self._host_state(p) for p in rows]
            host_adamw([p.detach() for p in rows], [p.grad.detach() for p in rows],
                       [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                       [s["step"] for s in states], g)
        self._sync()

    def load_state_dict(self, state_dict: dict) -> None:
        """AdamW's load; the offloaded parameters' state goes to host memory in fp32 (a state
        without ``master`` takes the device parameter's)."""
        mine = [p for g in self.param_groups for p in g["params"]]
        order = [i for g in state_dict["param_groups"] for i in g["params"]]
        rest = dict(state_dict["state"])
        host = [(p, rest.pop(i, {})) for i, p in zip(order, mine) if id(p) in self._host]
        super().load_state_dict({**state_dict, "state": rest})
        for p, st in host:
            self.state[p] = {k: self._host_alloc(k, v).copy_(v.detach()) for k, v in st.items()}
        self._refresh_masters()


def last_backward_hook(opt: torch.optim.Optimizer, ctx) -> Callable[[], None] | None:
    """What the trainer runs before a step's last backward: arm the host offload's sends;
    ``None`` without a pipelined offload, or under DP x EP (sent after the sync)."""
    if not isinstance(opt, HostOffloadAdamW) or not opt.pipelined:
        return None
    finish = expert_grad_finish(ctx)
    return None if finish is None else (lambda: opt._pipe.arm(finish))


def presynced(opt: torch.optim.Optimizer) -> frozenset[int]:
    """``id``s of the parameters whose gradient sync was done as they became final (the
    sync skips them)."""
    pipe = opt._pipe if isinstance(opt, HostOffloadAdamW) else None
    return frozenset() if pipe is None else pipe.presynced


def offloaded_params(model: torch.nn.Module) -> list[Tensor]:
    """The parameters ``--optimizer-offload host`` puts in host memory: the experts'."""
    return [p for n, p in model.named_parameters() if p.requires_grad and is_expert_param(n)]
