"""A placement held over an optimizer step in the distributed runtime (gloo, EP 2):
its replicas' weights are scattered once, their gradients accumulate on the slots and
go home once, in the last micro-batch's backward (``parallel/instances.py``).

Against the same step with the weights moved every micro-batch (the runtime outside a
step scope) and against static: the same losses (bit for bit), the same gradients (bit
for bit for experts with one instance, to fp tolerance where an expert has several),
the weight all-to-alls counted per step, with and without activation checkpointing, a
placement that changes within the step, and the bytes held checked against the ledger
by the storages alive (fp32, and bf16 under autocast on one rank with synthetic
peers)."""

from __future__ import annotations

import os
import sys
import time
import weakref

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dist_util import run_world
from lrmoe.config import ModelConfig
from lrmoe.model.router import Routing
from lrmoe.parallel.instances import placement_key
from lrmoe.policy.base import PlanInputs, Policy
from lrmoe.policy.plan import layer_checkpoint_plan
from lrmoe.policy.plan_numpy import full_plan
from lrmoe.presets import PRESETS

N, B, T, LAYERS = 3, 4, 16, 2  # micro-batches, sequences a micro-batch (2 ranks), tokens
HOT = [(3, 11), (3, 5), (12, 3)]  # per micro-batch: the experts most tokens go to


def tiny() -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(PRESETS["tiny-qwen3"], num_hidden_layers=LAYERS,
                                         router_aux_loss_coef=0.0))


class MicroRouter(nn.Module):
    """Routes micro-batch m of the step by its own table (its hot experts differ), so a
    placement made per micro-batch moves and one held for the step does not; the gates
    stay differentiable."""

    def __init__(self, tables: list[torch.Tensor], E: int, H: int, micro):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, H) * 0.5)
        self.tables, self.micro = tables, micro

    def forward(self, x):
        idx = self.tables[self.micro()]
        probs = torch.softmax(x @ self.weight.t(), dim=-1)
        return Routing(idx, probs.gather(1, idx), None)


def tables(cfg: ModelConfig, rank: int, per: int, seed: int) -> list[torch.Tensor]:
    """Per micro-batch, this rank's ``[per·T, 2]`` expert ids: 70% of first choices on
    the micro-batch's two hot experts, the second choice another expert."""
    g = np.random.default_rng(seed)
    E, out = cfg.num_experts, []
    for hot in HOT:
        first = np.where(g.random(B * T) < 0.7, g.choice(hot, B * T), g.integers(0, E, B * T))
        second = (first + g.integers(1, E, B * T)) % E
        idx = torch.from_numpy(np.stack([first, second], 1)).long()
        out.append(idx[rank * per * T:(rank + 1) * per * T])
    return out


class Scripted(Policy):
    """Natives plus replicas given per micro-batch (``{micro: [(expert, rank), ...]}``,
    ``[]``: natives only), every pair kept (exact); the micro-batches in ``whole`` run
    under a whole-layer checkpoint (the exchange re-run in backward)."""

    name = "scripted"

    def __init__(self, script: dict[int, list[tuple[int, int]]], whole: tuple[int, ...] = ()):
        self.script, self.whole = script, whole

    def plan(self, counts_GE, inputs):
        G, E = counts_GE.shape
        per = E // G
        extra = self.script[inputs.micro]
        ie = torch.full((G, per + max(map(len, self.script.values()))), -1, dtype=torch.long)
        ie[:, :per] = torch.arange(E).reshape(G, per)
        for k, (e, r) in enumerate(extra):
            ie[r, per + k] = e
        plan = full_plan(counts_GE, ie)
        return layer_checkpoint_plan(plan) if inputs.micro in self.whole else plan


def make_policy(case: str, cfg: ModelConfig, G: int):
    """``(policy, ledger)`` of a case; every one keeps every pair (exact)."""
    from lrmoe.ledger import Ledger
    from lrmoe.policy.lrmoe import LrmoeConfig, LrmoePolicy
    from lrmoe.policy.static import StaticPolicy
    from lrmoe.policy.symi import SymiPolicy

    ledger = Ledger.for_dtype(cfg, G, 2**30, "fp32")
    if case.startswith("lrmoe-"):
        return LrmoePolicy(LrmoeConfig(placement=case[6:], selection=False)), ledger
    return {"static": StaticPolicy(), "symi": SymiPolicy(cfg.num_experts // G + 2),
            # replicas that change at the last micro-batch / give way to the natives
            "changes": Scripted({0: [(3, 1), (11, 0)], 1: [(3, 1), (11, 0)], 2: [(5, 1)]}),
            "natives-between": Scripted({0: [(3, 1)], 1: [], 2: [(3, 1)]}),
            # the held placement under a whole-layer checkpoint at micro-batch 1
            "layer-checkpoint": Scripted({m: [(3, 1), (11, 0)] for m in range(N)}, (1,)),
            }[case], ledger


def build(case: str, rank: int, world: int, checkpoint: str = "none"):
    """A 2-layer tiny-qwen3 sharded over EP ``world``; its policy records each layer's
    placement per micro-batch (first forward only: a re-run repeats it)."""
    import torch.distributed as dist

    from lrmoe.model import MoEForCausalLM
    from lrmoe.model.moe import MoERuntime
    from lrmoe.parallel.groups import ParallelContext, shard_experts

    cfg = tiny()
    per = B // world
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    for i, layer in enumerate(model.moe_layers):
        layer.router = MicroRouter(tables(cfg, rank, per, 10 + i), cfg.num_experts,
                                   cfg.hidden_size, lambda m=layer: m.runtime.micro)
    ctx = ParallelContext(world=world, rank=rank, ep_size=world, ep_group=dist.group.WORLD)
    shard_experts(model, ctx)
    policy, ledger = make_policy(case, cfg, world)
    placements: dict[tuple[int, int], np.ndarray] = {}
    plan = policy.plan

    def recording(counts_GE, inputs):
        p = plan(counts_GE, inputs)
        placements.setdefault((inputs.layer, inputs.micro), p.inst_expert_GS.numpy().copy())
        return p

    policy.plan = recording
    model.set_runtime(MoERuntime(comm=ctx.comm(), policy=policy, ledger=ledger))
    model.set_activation_checkpoint(checkpoint)
    if case == "symi":  # the previous step's popularity: two hot experts
        pop = torch.full((cfg.num_experts,), 4, dtype=torch.long)
        pop[3], pop[11] = 200, 120
        for layer in model.moe_layers:
            layer.prev_counts_E = pop
    return model, placements


def count_weight_all_to_alls():
    """Patch ``EPComm.all_to_all`` to count the calls made from ``parallel/instances.py``
    (the weight scatter and the replica-gradient reduce, one per weight tensor)."""
    from lrmoe.parallel.comm import EPComm

    calls = [0]
    orig = EPComm.all_to_all
    here = os.path.join("parallel", "instances.py")

    def counting(self, x, send, recv):
        if sys._getframe(1).f_code.co_filename.endswith(here):
            calls[0] += 1
        return orig(self, x, send, recv)

    EPComm.all_to_all = counting
    return calls


def run_step(model, rank: int, world: int, held: bool, on_micro=None) -> list[torch.Tensor]:
    """One step's N micro-batches of this rank's data; returns each one's [lm, objective].
    ``held``: the trainer's :func:`accumulate`; else every micro-batch moves its weights
    (the same forward and backward, outside the step's scope)."""
    from lrmoe.train.accum import accumulate

    g = torch.Generator().manual_seed(4)
    mbs = [torch.randint(0, model.config.vocab_size, (B, T + 1), generator=g) for _ in range(N)]
    per = B // world
    mine = [b[rank * per:(rank + 1) * per] for b in mbs]
    pairs = []
    if held:
        def record(m, pair):
            if pair is not None:
                pairs.append(pair)
            if on_micro is not None:
                on_micro(m, pair)
        accumulate(model, lambda i: mine[i], N, on_micro=record)
        return pairs
    for m in range(N):
        model.set_micro_batch(m)
        lm, obj = model.loss(mine[m][:, :-1], mine[m][:, 1:])
        (obj / N).backward()
        pairs.append(torch.stack([lm.detach(), obj.detach()]).float())
    return pairs


def runs(placements: dict, layer: int, E: int) -> tuple[int, int]:
    """``(runs of micro-batches sharing a placement that moves weights, micro-batches
    whose placement moves weights)`` of one layer's step."""
    from lrmoe.parallel.instances import natives_only

    keys = [None if natives_only(placements[(layer, m)], E) else placement_key(
        placements[(layer, m)]) for m in range(N)]
    starts = sum(k is not None and (m == 0 or k != keys[m - 1]) for m, k in enumerate(keys))
    return starts, sum(k is not None for k in keys)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(held: dict, moved: dict, placements: dict, rank: int, per: int
            ) -> tuple[int, int]:
    """Dense gradients bit for bit; an owned expert's rows bit for bit where it has one
    instance in every micro-batch, to fp tolerance where it has several. Returns how
    many owned experts of each kind were compared."""
    assert held.keys() == moved.keys()
    single = several = 0
    for n, g in held.items():
        if ".experts." not in n:
            assert torch.equal(g, moved[n]), n
            continue
        layer = int(n.split(".")[1])
        for row in range(per):
            e = rank * per + row
            if all((placements[(layer, m)] == e).sum() == 1 for m in range(N)):
                single += 1
                assert torch.equal(g[row], moved[n][row]), f"{n} expert {e}"
            else:
                several += 1
                torch.testing.assert_close(g[row], moved[n][row], rtol=1e-5, atol=1e-7)
    return single, several


def close_to(got: dict, want: dict, rtol: float = 1e-4) -> None:
    for n in want:
        d, scale = float((got[n] - want[n]).norm()), float(want[n].norm())
        assert d <= rtol * scale + 1e-7, f"{n}: |diff| {d:.3e} vs |grad| {scale:.3e}"


def _worker(rank: int, world: int, cases: list[str], checkpoint: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    calls = count_weight_all_to_alls()
    E, per = tiny().num_experts, tiny().num_experts // world
    model, _ = build("static", rank, world, checkpoint)
    static_pairs = run_step(model, rank, world, held=True)
    static = grads(model)
    for case in cases:
        got = {}
        for held in (True, False):
            model, placements = build(case, rank, world, checkpoint)
            calls[0] = 0
            pairs = run_step(model, rank, world, held)
            got[held] = (pairs, grads(model), calls[0], placements)
        (hp, hg, hc, pl), (mp, mg, mc, _) = got[True], got[False]
        assert all(torch.equal(a, b) for a, b in zip(hp, mp)), case  # same forward
        kinds = torch.tensor(compare(hg, mg, pl, rank, per))
        dist.all_reduce(kinds)
        assert (kinds > 0).all(), (case, kinds)  # both kinds compared, over the ranks
        close_to(hg, static)
        assert all(torch.allclose(a, b, rtol=1e-5) for a, b in zip(hp, static_pairs)), case
        r = [runs(pl, i, E) for i in range(LAYERS)]
        # two weight tensors a layer: a scatter per run of a placement, and its reduce
        assert hc == 4 * sum(s for s, _ in r), (case, hc, r)
        if checkpoint == "none":  # moved: a scatter and a reduce in every micro-batch
            assert mc == 4 * sum(m for _, m in r), (case, mc, r)
        want_runs = {"lrmoe-step": 1, "symi": 1, "changes": 2, "natives-between": 2,
                     "layer-checkpoint": 1, "lrmoe-current": N}[case]
        assert all(s == want_runs for s, _ in r), (case, r)


@pytest.mark.dist
def test_held_placement_moves_once_and_keeps_the_math(tmp_path):
    """lrmoe's held placement and SYMI's (from the previous step's popularity) scatter
    their weights once and reduce their gradients once a step (4 all-to-alls a layer,
    against 4 a micro-batch moved), with the same losses and gradients as moving them
    every micro-batch, and as static; lrmoe placing per micro-batch moves in each; a
    placement that changes within the step sends its sums home first; a whole-layer
    checkpoint's re-run in backward takes the held weights."""
    run_world(2, _worker, ["lrmoe-step", "symi", "lrmoe-current", "changes",
                           "natives-between", "layer-checkpoint"], "none", tmp_path=tmp_path)


@pytest.mark.dist
def test_held_placement_under_full_activation_checkpoint(tmp_path):
    """The block's re-run in backward plans the same placement and takes the held
    weights: no weight all-to-all beyond the step's scatter and reduce, the same
    gradients as moving the weights every micro-batch (whose re-runs gather again)."""
    run_world(2, _worker, ["lrmoe-step", "changes"], "full", tmp_path=tmp_path)


# ----------------------------------------------------------------------------- memory
class Storages(TorchDispatchMode):
    """Weak references to the storage of every tensor an op makes while active (a
    storage's Python object lives exactly as long as the storage), with the shape of
    the tensor it was made for."""

    def __init__(self):
        super().__init__()
        self.made: dict[int, tuple[weakref.ref, int, tuple]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                s = t.untyped_storage()
                old = self.made.get(id(s))
                if old is None or old[0]() is not s:  # new: a view keeps the first shape
                    self.made[id(s)] = (weakref.ref(s), s.nbytes(), tuple(t.shape[1:]))
        return out

    def alive(self, tails: set[tuple], skip: set[int]) -> int:
        """Bytes of the storages alive now, made while active by a tensor whose shape
        past the first dimension is in ``tails``, and not in ``skip``."""
        return sum(nb for i, (ref, nb, tail) in self.made.items()
                   if tail in tails and i not in skip and ref() is not None)


def held_bytes(model, mode: Storages) -> int:
    """What :class:`Storages` saw made and alive now of the experts' weight shapes,
    beyond the parameters, their gradients and the step's compute-dtype casts."""
    cfg = model.config
    H, Fd = cfg.hidden_size, cfg.moe_intermediate_size
    skip = {id(t.untyped_storage()) for p in model.parameters() for t in (p, p.grad)
            if t is not None}  # (an op's view of a parameter registers its storage)
    skip |= {id(c.untyped_storage()) for m in model.moe_layers
             for c in (m.experts.casts or {}).values()}
    return mode.alive({(2 * Fd, H), (H, Fd)}, skip)


def _memory_worker(rank: int, world: int) -> None:
    from lrmoe.ledger import Ledger
    from lrmoe.parallel.instances import natives_only

    torch.set_num_threads(1)
    cfg = tiny()
    H, Fd, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    model, placements = build("lrmoe-step", rank, world)
    plans = {}  # the plans themselves, for the ledger
    plan = model.moe_layers[0].runtime.policy.plan

    def keep(counts_GE, inputs):
        p = plan(counts_GE, inputs)
        plans.setdefault((inputs.layer, inputs.micro), p)
        return p

    model.moe_layers[0].runtime.policy.plan = keep
    one = Ledger.for_dtype(cfg, world, None, "fp32", num_moe_layers=1)

    def priced() -> int:  # each layer's instance terms for its step's placement
        out = 0
        for i in range(LAYERS):
            p = plans[(i, 0)]
            assert not natives_only(p.inst_expert_GS.numpy(), E)  # replicas held
            t = one.rank_terms(p)[rank]
            assert t["instance_weights"] == int((p.inst_expert_GS[rank] >= 0).sum()) * 3 * H * Fd * 4
            out += t["instance_weights"] + t["instance_grads"]
        return out

    seen, want = [], []

    def measure(m, pair):
        if pair is None:
            return
        want.append(priced() if m < N - 1 else 0)
        # a collective's buffers are let go by gloo's worker thread a moment after the
        # call returns: wait (a bounded while) for them to go; held bytes never do
        for _ in range(100):
            got = held_bytes(model, mode)
            if got == want[-1]:
                break
            time.sleep(0.01)
        seen.append(got)

    with Storages() as mode:
        run_step(model, rank, world, held=True, on_micro=measure)
    assert placements.keys() == plans.keys()
    # between micro-batches: every layer's slots' weights and gradient sums, as priced;
    # after the last backward: sent home and freed
    assert want == [priced()] * (N - 1) + [0] and priced() > 0
    assert seen == want, (seen, want)


@pytest.mark.dist
def test_held_bytes_are_what_the_ledger_prices(tmp_path):
    """The storages alive between a held step's micro-batches beyond the parameters and
    their gradients (the held slots' weights and gradient sums) are the ledger's
    instance_weights + instance_grads of each layer's plan, the terms every budget check
    adds per occupied slot; after the step's last backward they are gone."""
    run_world(2, _memory_worker, tmp_path=tmp_path)


def test_placement_key_reads_the_occupied_slots_only():
    a = np.array([[0, 1, 3, -1], [2, 3, -1, -1]])
    b = np.array([[0, -1, 1, 3], [2, 3, -1, -1]])  # empty slots elsewhere: same weights
    c = np.array([[0, 1, -1, -1], [2, 3, 3, -1]])  # a replica on the other rank
    assert placement_key(a) == placement_key(b) == placement_key(a[:, :3])
    assert placement_key(a) != placement_key(c)
    # expert 2's replica on rank 0 or beside its native on rank 1: the occupied experts
    # read in rank order are the same, the slots' weights are not
    d = np.array([[0, 1, 2, -1], [2, 3, -1, -1]])
    e = np.array([[0, 1, -1, -1], [2, 2, 3, -1]])
    assert placement_key(d) != placement_key(e)


def test_held_bytes_in_the_compute_dtype():
    """Under bf16 autocast (rank 0 of 4, peers synthetic: ``tests/onerank.py``) the held
    weights and their gradient sums are bf16: the ledger's bf16 instance terms; the
    owned experts' fp32 gradients appear at the last micro-batch only."""
    from lrmoe.ledger import Ledger
    from lrmoe.model import MoEForCausalLM
    from lrmoe.model.moe import MoERuntime
    from lrmoe.parallel.groups import ParallelContext, shard_experts
    from lrmoe.train.accum import accumulate
    from onerank import OneRankComm

    cfg, G = tiny(), 4
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    for i, layer in enumerate(model.moe_layers):
        layer.router = MicroRouter(tables(cfg, 0, 1, 10 + i), cfg.num_experts,
                                   cfg.hidden_size, lambda m=layer: m.runtime.micro)
    shard_experts(model, ParallelContext(world=G, rank=0, ep_size=G))
    policy = Scripted({m: [(5, 0), (3, 1), (9, 0)] for m in range(N)})
    peers = torch.full((G, cfg.num_experts), 8, dtype=torch.long)
    model.set_runtime(MoERuntime(comm=OneRankComm(0, peers), policy=policy))
    g = torch.Generator().manual_seed(4)
    mbs = [torch.randint(0, cfg.vocab_size, (1, T + 1), generator=g) for _ in range(N)]
    experts = [p for m in model.moe_layers for p in (m.experts.gate_up_proj, m.experts.down_proj)]
    seen, untouched = [], []

    def measure(m, pair):
        if pair is not None:
            seen.append(held_bytes(model, mode))
            untouched.append(all(p.grad is None for p in experts))

    with Storages() as mode:
        accumulate(model, lambda i: mbs[i], N, lambda: torch.autocast("cpu", torch.bfloat16),
                   on_micro=measure)
    # the owned gradients come once, at the last backward (no zeros through the cast)
    assert untouched == [True] * (N - 1) + [False]
    plan = policy.plan(peers, PlanInputs())
    t = Ledger.for_dtype(cfg, G, None, "bf16", num_moe_layers=1).rank_terms(plan)[0]
    assert int((plan.inst_expert_GS[0] >= 0).sum()) == cfg.num_experts // G + 2  # replicas
    assert seen == [LAYERS * (t["instance_weights"] + t["instance_grads"])] * (N - 1) + [0]
