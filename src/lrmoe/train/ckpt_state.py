"""What a checkpoint holds, under keys that do not depend on the world or EP size: one
flat dict for DCP, ``model/NAME``, ``model/NAME/eID`` (global expert ``ID``'s row),
``optim/NAME/KEY[/eID]``, ``trainer`` and ``rng/rankRRRRR`` (docs/design.md §7).
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from lrmoe.errors import LrmoeError
from lrmoe.parallel.groups import expert_ids

TRAINER = "trainer"


def rng_key(rank: int) -> str:
    return f"rng/rank{rank:05d}"


def _named_params(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- save
def _put(out: dict, key: str, t: torch.Tensor, ids: range | None) -> None:
    """``t`` under ``key``, or its rows under ``key/eID`` for an expert tensor."""
    if ids is None or t.ndim == 0:
        out[key] = t.detach()
    else:
        for i, e in enumerate(ids):
            out[f"{key}/e{e}"] = t.detach()[i]


def state_to_save(model: nn.Module, opt: torch.optim.Optimizer, trainer: dict | None,
                  rng: dict, rank: int) -> dict:
    """This rank's part of the flat checkpoint dict (tensors are views, not copies);
    the global ``trainer`` state only where it is given (one rank)."""
    experts = expert_ids(model)
    out: dict = {}
    for name, t in model.state_dict().items():
        _put(out, f"model/{name}", t, experts.get(name))
    names = _named_params(model)
    groups = []
    for g in opt.param_groups:
        pnames = [names[id(p)] for p in g["params"]]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "names": pnames})
        for p, name in zip(g["params"], pnames):
            for k, v in opt.state.get(p, {}).items():
                _put(out, f"optim/{name}/{k}", v, experts.get(name))
    if trainer is not None:
        out[TRAINER] = {**trainer, "optim_groups": groups}
    out[rng_key(rank)] = rng
    return out


# ----------------------------------------------------------------------------- load
class Template:
    """The flat dict to load into this rank's objects, checked against the checkpoint's
    metadata. Model keys are views of the live parameters (DCP copies into them in
    place); optimizer state goes into fresh tensors for ``opt.load_state_dict``.
    """

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, saved: dict,
                 rng_rank: int | None, where: str):
        self.model, self.opt, self.where = model, opt, where
        self.saved = saved
        self.index: dict[str, dict[int, object]] = {}  # base key -> {expert id: metadata}
        for key, md in saved.items():
            base, _, last = key.rpartition("/")
            if last[:1] == "e" and last[1:].isdigit():
                self.index.setdefault(base, {})[int(last[1:])] = md
        experts = expert_ids(model)
        self.dict: dict = {TRAINER: None}
        if rng_rank is not None:
            self.dict[rng_key(rng_rank)] = None
        for name, t in model.state_dict().items():
            self._want(f"model/{name}", t, experts.get(name))
        saved_optim: dict[str, set[str]] = {}
        for key in saved:
            if key.startswith("optim/"):
                _, name, k = key.split("/")[:3]
                saved_optim.setdefault(name, set()).add(k)
        self.optim: dict[str, dict[str, torch.Tensor]] = {}
        for name, _ in model.named_parameters():
            self.optim[name] = {}
            for k in sorted(saved_optim.get(name, ())):
                key = f"optim/{name}/{k}"
                ids = None if key in saved else experts.get(name)
                md = saved.get(key) if ids is None else self.index.get(key, {}).get(ids[0])
                if md is None or not hasattr(md, "size"):
                    raise self._mismatch(f"{key} has no tensor for this rank")
                shape = tuple(md.size) if ids is None else (len(ids), *md.size)
                self.optim[name][k] = torch.empty(shape, dtype=md.properties.dtype)
                self._want(key, self.optim[name][k], ids)

    def _mismatch(self, what: str) -> LrmoeError:
        return LrmoeError(f"checkpoint {self.where} does not match this model: {what}")

    def _want(self, key: str, t: torch.Tensor, ids: range | None) -> None:
        """Ask for ``t`` (or its expert rows) under ``key``; shapes must match."""
        if ids is not None:
            held = len(self.index.get(key, {}))
            want = self.model.get_submodule(key.split("/")[1].rsplit(".", 1)[0]).num_experts
            if held != want:
                raise self._mismatch(f"{key} holds {held} experts, the model has {want}")
        _put(self.dict, key, t, ids)
        for k in ([key] if ids is None else [f"{key}/e{e}" for e in ids]):
            md = self.saved.get(k)
            if md is None or not hasattr(md, "size"):
                raise self._mismatch(f"it has no tensor {k}")
            if tuple(md.size) != tuple(self.dict[k].shape):
                raise self._mismatch(f"{k} has shape {tuple(md.size)}, the model "
                                     f"{tuple(self.dict[k].shape)}")

    def optimizer_state(self) -> dict:
        """The loaded optimizer state as ``opt.state_dict()`` lays it out."""
        groups, state, index = [], {}, 0
        saved_groups = self.dict[TRAINER]["optim_groups"]
        names = _named_params(self.model)
        if len(saved_groups) != len(self.opt.param_groups):
            raise self._mismatch(f"{len(saved_groups)} optimizer groups, the model has "
                                 f"{len(self.opt.param_groups)}")
        for g, sg in zip(self.opt.param_groups, saved_groups):
            pnames = [names[id(p)] for p in g["params"]]
            if pnames != sg["names"]:
                raise self._mismatch("its optimizer groups hold other parameters")
            ids = list(range(index, index + len(pnames)))
            state.update({i: dict(self.optim[n]) for i, n in zip(ids, pnames) if self.optim[n]})
            index += len(pnames)
            groups.append({**{k: v for k, v in sg.items() if k != "names"}, "params": ids})
        return {"state": state, "param_groups": groups}


# ----------------------------------------------------------------------------- RNG
def rng_state(generator: torch.Generator | None, device: torch.device) -> dict:
    s = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        s["cuda"] = torch.cuda.get_rng_state(device)
    if generator is not None:
        s["runtime"] = generator.get_state()
    return s


def apply_rng(s: dict | None, generator: torch.Generator | None, device: torch.device,
              reseed: tuple[int, int, int]) -> None:
    """Restore a rank's saved RNG states, or (``s`` None: the world or EP size changed)
    seed every generator from ``reseed = (seed, step, rank)``: a fresh stream per rank
    and step, reproducible, but not the stream an unresized run would have drawn."""
    if s is not None:
        torch.set_rng_state(s["torch"].cpu())
        if device.type == "cuda" and "cuda" in s:
            torch.cuda.set_rng_state(s["cuda"].cpu(), device)
        if generator is not None and "runtime" in s:
            generator.set_state(s["runtime"].cpu())
        return
    digest = hashlib.sha256("lrmoe-reseed:{}:{}:{}".format(*reseed).encode()).digest()
    seed = int.from_bytes(digest[:8], "big") >> 1
    torch.manual_seed(seed)  # CPU and every CUDA device
    if generator is not None:
        generator.manual_seed(seed + 1)
