"""The host-offload AdamW as it ran before its pipeline (tests and benchmarks only): after
backward, every offloaded gradient widened to fp32 on the device and copied to the host,
a device-wide wait, the clip coefficient and the fused CPU AdamW on each whole tensor,
each fp32 master copied back into its bf16 device weight, a device-wide wait.

:class:`lrmoe.train.offload.HostOffloadAdamW` must leave the same masters, moments,
steps and device weights, bit for bit (tests/test_offload_pipeline.py);
``benchmarks/offload_step.py`` times it as the "serial" mode. A copy, not shared with
the runtime, so that a change there cannot move both sides of the comparison.
:func:`staging_bytes` reads what the pipelined one holds in host staging.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import Tensor
from torch.optim.adamw import adamw

from lrmoe.errors import require


class SerialHostOffloadAdamW(torch.optim.AdamW):
    """AdamW; the parameters in ``host_params`` are updated in host memory.

    Args:
        params: parameter groups, as for ``torch.optim.AdamW``.
        host_params: the parameters to offload (a subset of ``params``).
        lr, betas, eps, weight_decay: AdamW's hyper-parameters (per group as usual).
        host: where the offloaded state lives: ``"cpu"`` (the real offload), or the
            parameters' own device (the same code path without the host transfers; the
            emulator uses it so that one process holding every virtual rank's experts
            does not spend its device time in a CPU update whose cost it models).

    Attributes:
        host_s: wall seconds of the last step's host part (copies and host update),
            so a caller that times the step can tell it apart.
    """

    def __init__(self, params, host_params: Iterable[Tensor], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 1e-2, host: str | torch.device = "cpu",
                 compute_dtype: torch.dtype | None = None):
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
        self._grad_buf: dict[int, Tensor] = {}
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

    # ------------------------------------------------------------------ host memory
    def _host_empty(self, like: Tensor) -> Tensor:
        """fp32 host memory for a master or a gradient buffer, the tensors that cross to
        and from the device each step: pinned when the parameters are on CUDA."""
        return torch.empty(like.shape, dtype=torch.float32, device=self._host_dev,
                           pin_memory=self._pin)

    def _host_alloc(self, key: str, like: Tensor) -> Tensor:
        """Host memory for state ``key`` shaped as ``like``, fresh or loaded alike: the
        master as :meth:`_host_empty`; the moments and ``step``, which never leave the
        host, pageable and zeroed."""
        if key == "master":
            return self._host_empty(like)
        return torch.zeros(like.shape, dtype=torch.float32, device=self._host_dev)

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

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def scale_grads(self, params: Iterable[Tensor], coef: float) -> None:
        """Multiply the gradients of ``params`` by ``coef`` (gradient clipping): in place,
        except an offloaded gradient held below fp32, whose product the next :meth:`step`
        takes in fp32 on the host (see the module's docstring)."""
        for p in params:
            if id(p) in self._host and p.grad.dtype != torch.float32:
                self._grad_scale[id(p)] = self._grad_scale.get(id(p), 1.0) * coef
            else:
                p.grad.mul_(coef)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grad_scale.clear()  # the coefficients belong to the gradients dropped here
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """Device AdamW on the other parameters, then the host update of the offloaded."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
        self._sync()
        t0 = time.perf_counter()
        self._host_step()
        self._sync()
        self.host_s = time.perf_counter() - t0
        return loss

    def _host_step(self) -> None:
        todo = []  # (group, [(device param, master, host grad)])
        for g in self.param_groups:
            rows = []
            for p in g["params"]:
                if id(p) not in self._host or p.grad is None:
                    continue
                if id(p) in self._own_master:
                    rows.append((p, self._master[id(p)], p.grad.detach()))  # read in place
                    continue
                buf = self._grad_buf.get(id(p))
                if buf is None:
                    buf = self._grad_buf[id(p)] = self._host_empty(p)
                buf.copy_(p.grad.detach(), non_blocking=self._pin)  # gradient to the host
                rows.append((p, self._master[id(p)], buf))
            if rows:
                todo.append((g, rows))
        if self._pin:
            torch.cuda.synchronize()  # the gradients have landed in host memory
        for g, rows in todo:
            for p, _, b in rows:  # clip coefficients, in fp32 as the device path applies them
                if id(p) in self._grad_scale:
                    b.mul_(self._grad_scale.pop(id(p)))
            states = [self._host_state(p) for p, _, _ in rows]
            beta1, beta2 = g["betas"]
            adamw([m for _, m, _ in rows], [b for _, _, b in rows],
                  [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
                  [s["step"] for s in states], foreach=False, fused=True, amsgrad=False,
                  beta1=beta1, beta2=beta2, lr=g["lr"], weight_decay=g["weight_decay"],
                  eps=g["eps"], maximize=False)
            for p, m, _ in rows:  # updated weights back to the device
                if id(p) not in self._own_master:
                    p.detach().copy_(m, non_blocking=self._pin)

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


def staging_bytes(opt) -> int:
    """Host bytes of a pipelined offload's scratch and ring (before the pinned allocator's
    rounding): what the step ledger prices as the pipeline's staging."""
    pipe = opt._pipe
    if pipe is None:
        return 0
    held = ([pipe._scratch] if pipe._scratch is not None else []) + pipe._ring
    return sum(t.numel() * t.element_size() for t in held)
