"""The virtual EP emulator against one process and against a real gloo EP run.

For static, replicas across ranks, and a partial (LRMoE-shaped) plan, the emulator's
output, input gradient, expert gradients and router gradient must equal the real
``--ep 4`` run's per-rank tensors (and, for exact plans, one process), and its byte and
row counters must equal the real runtime's stats. The ``*_experts`` cases run with
``BackwardOptions(router_grad="experts")`` (the router gradient from the expert backward).
The sampled estimator, with each rank's generator seeded alike, must keep the same pairs
in both and give the gradients of a one-process Horvitz-Thompson reference.
"""

from __future__ import annotations

import contextlib
import statistics

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as Fn

from dist_util import FixedRouter, hot_replica_plan, run_world, trimmed
from emulated import EmulatedLayer
from lrmoe.config import ModelConfig
from lrmoe.errors import OutOfMemory
from lrmoe.ledger import Ledger
from lrmoe.model.moe import MoELayer, MoERuntime
from lrmoe.parallel.comm import EPComm
from lrmoe.parallel.exchange import BackwardOptions
from lrmoe.parallel.groups import ParallelContext, shard_experts
from lrmoe.policy.base import Policy
from lrmoe.policy.plan_numpy import full_plan
from lrmoe.policy.static import StaticPolicy
from lrmoe.sim.analytic import modelled_stats
from lrmoe.sim.cost import (
    STAGES,
    StepTimes,
    price_terms,
    rank_link_terms,
    rank_stage_seconds,
    step_times,
)
from lrmoe.sim.links import LINKS, exchange_time
from lrmoe.sim.virtual import virtual_all_to_all
from lrmoe.sim.vstats import EXCHANGES, VirtualStats
from onerank import TableRouter, zipf_routing
from shared_run import run_once

T, H, E, K, F, G = 12, 16, 8, 2, 8, 4
# sampled: partial plan, sampled estimator; *_experts: router_grad "experts"
POLICIES = ("static", "replica", "partial", "sampled", "static_experts", "replica_experts")
TOL = dict(rtol=1e-5, atol=1e-5)


class ReplicaPolicy(Policy):
    """Natives plus two replicas of the hottest experts on other ranks."""

    name = "replica-test"

    def plan(self, counts_GE, inputs):
        return hot_replica_plan(counts_GE, avoid_owner=True)


class PartialPolicy(ReplicaPolicy):
    """Replicas, 80% retained, 60% of those selected (top-k selection at runtime); the
    last plan made is kept (``last``), for reading which expert each block holds."""

    def plan(self, counts_GE, inputs):
        self.last = trimmed(super().plan(counts_GE, inputs))
        return self.last


def close(a, b, what):
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def make_policy(name):
    return {"static": StaticPolicy(), "replica": ReplicaPolicy(), "partial": PartialPolicy(),
            "sampled": PartialPolicy()}[name.removesuffix("_experts")]


def make_opts(name):
    return BackwardOptions(estimator="sampled" if name == "sampled" else "topk",
                           router_grad="experts" if name.endswith("_experts") else "home")


def make_gen(name, seed, rank):
    return torch.Generator().manual_seed(seed + rank) if name == "sampled" else None


def make_case(seed: int):
    """A full layer, a routing table, tokens and an output-gradient direction."""
    gen = torch.Generator().manual_seed(seed)
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=32, hidden_size=H, num_attention_heads=2,
                      num_key_value_heads=1, moe_intermediate_size=F, num_experts=E,
                      num_experts_per_tok=K, num_hidden_layers=1, intermediate_size=32)
    torch.manual_seed(seed)
    layer = MoELayer(cfg, 0)
    with torch.no_grad():  # O(1) outputs, so the tolerances below are meaningful
        layer.experts.gate_up_proj.normal_(0, 0.5, generator=gen)
        layer.experts.down_proj.normal_(0, 0.5, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(G * T)])
    idx[:, 0] = torch.where(torch.rand(G * T, generator=gen) < 0.4, 5, idx[:, 0])  # skew
    idx[:, 1] = torch.where(idx[:, 1] == idx[:, 0], (idx[:, 0] + 1) % E, idx[:, 1])
    layer.router = FixedRouter(idx, E, H)
    x = torch.randn(G * T, H, generator=gen)
    coeff = torch.randn(G * T, H, generator=gen)
    return layer, idx, x, coeff


def run(layer_fn, layer, x, coeff):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y = layer_fn(x)
    (y * coeff).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "g13": layer.experts.gate_up_proj.grad.clone(),
            "g2": layer.experts.down_proj.grad.clone(), "gr": layer.router.weight.grad.clone()}


def exchange_node(y):
    """The ``ExpertExchange`` node (its ctx) in ``y``'s graph."""
    todo, seen = [y.grad_fn], set()
    while todo:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if type(n).__name__ == "ExpertExchangeBackward":
            return n
        todo += [f for f, _ in n.next_functions]
    raise AssertionError("no ExpertExchange in the graph")


def emulate(policy_name, seed, opts=None, kept=None):
    """The emulated layer's tensors and stats; ``kept`` (a dict) gets the number of
    combined-row elements the exchange keeps for backward."""
    layer, idx, x, coeff = make_case(seed)
    v = EmulatedLayer(layer, G, make_policy(policy_name), opts or make_opts(policy_name),
                      generators=[make_gen(policy_name, seed, r) for r in range(G)])
    fn = v
    if kept is not None:
        def fn(t):
            y = v(t)
            kept["y_send"] = sum(int(r["y_send"].numel()) for r in exchange_node(y).kept)
            return y
    return run(fn, layer, x, coeff), v.stats


@contextlib.contextmanager
def recorded_selections():
    """Each call of the sampled estimator's select (``select_sampled``, as the backward's
    select stage calls it) in order, as a dict: the candidates' tokens, block sizes and
    quotas, the generator's state before the draws, the inclusion probabilities and the
    keep mask."""
    import lrmoe.parallel.stages as stages

    real, log = stages.select_sampled, []

    def spy(metric, norm_T, tok_N, g_N, gate_N, size_B, quota_B, generator, *a, **k):
        state = generator.get_state()
        sel = real(metric, norm_T, tok_N, g_N, gate_N, size_B, quota_B, generator, *a, **k)
        log.append({"tok": tok_N.clone(), "size_B": size_B.clone(), "quota_B": quota_B.clone(),
                    "gen_state": state, "pi": sel.pi_N.clone(), "keep": sel.keep_N.clone()})
        return sel

    stages.select_sampled = spy
    try:
        yield log
    finally:
        stages.select_sampled = real


def _gloo_worker(rank, world, seed, outdir):
    for name in POLICIES:
        layer, idx, x, coeff = make_case(seed)
        sl = slice(rank * T, (rank + 1) * T)
        layer.router.idx = idx[sl]
        ctx = ParallelContext(world=world, rank=rank, ep_size=world, ep_group=dist.group.WORLD)
        shard_experts(layer, ctx)
        policy = make_policy(name)
        comm, sent = EPComm(dist.group.WORLD), []
        real_exchange = comm.exchange_counts

        def counted(counts_GS, real_exchange=real_exchange, sent=sent):
            sent.append(counts_GS.numel() * counts_GS.element_size())  # bytes, to all peers
            return real_exchange(counts_GS)
        comm.exchange_counts = counted
        layer.runtime = MoERuntime(comm=comm, policy=policy,
                                   backward=make_opts(name), generator=make_gen(name, seed, rank))
        with recorded_selections() as log:
            out = run(lambda t, m=layer: m(t.unsqueeze(0)).squeeze(0), layer, x[sl], coeff[sl])
        dist.all_reduce(out["gr"])
        out["stats"] = {k: v for k, v in layer.runtime.stats[0].items() if not k.startswith("_")}
        out["count_exchange_bytes"] = sum(sent)
        if name == "sampled":
            out["selections"], out["inst_expert_GS"] = log, policy.last.inst_expert_GS
        torch.save(out, f"{outdir}/{name}_{rank}.pt")


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    """Every case of ``POLICIES`` on a real ``--ep 4`` gloo group, one spawn per session
    (``shared_run``) for the tests below: ``(seed, folder of {policy}_{rank}.pt)``."""
    def make(out):
        seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh inputs every run
        run_world(G, _gloo_worker, seed, str(out), tmp_path=out)
        return {"seed": seed}

    out, rec = run_once(tmp_path_factory, "sim_gloo", make)
    return rec["seed"], out


def test_virtual_all_to_all_matches_all_to_all_single_order():
    send = [torch.arange(5) + 10 * g for g in range(3)]
    splits = [[2, 0, 3], [1, 1, 3], [0, 5, 0]]
    got = virtual_all_to_all(send, splits)
    assert got[0].tolist() == [0, 1, 10]
    assert got[1].tolist() == [11, 20, 21, 22, 23, 24]
    assert got[2].tolist() == [2, 3, 4, 12, 13, 14]


@pytest.mark.dist
def test_emulator_matches_one_process_and_gloo(gloo_run):
    seed, tmp_path = gloo_run
    layer, idx, x, coeff = make_case(seed)
    ref = run(lambda t: layer(t.unsqueeze(0)).squeeze(0), layer, x, coeff)  # one process
    per = E // G
    home = {}
    for name in POLICIES:
        kept = {}
        emu, stats = emulate(name, seed, kept=kept)
        real = [torch.load(tmp_path / f"{name}_{r}.pt") for r in range(G)]
        msg = f"policy={name} seed={seed}"
        base = name.removesuffix("_experts")
        if name == base:
            home[name] = emu, stats, kept["y_send"]
        else:  # router gradient at the experts: no combined rows kept, each backward row
            # brings its router gradient home (4 bytes), the same numbers to rounding
            assert home[base][2] == sum(stats.rows["fwd"]) * H > 0 and kept["y_send"] == 0, msg
            rows = stats.rows_GG["bwd_combine"]
            assert torch.equal(stats.bytes_GG["bwd_combine"], rows * (H * 4 + 4)), msg
            assert torch.equal(home[base][1].bytes_GG["bwd_combine"], rows * H * 4), msg
            for k in ("y", "dx", "g13", "g2", "gr"):
                close(emu[k], home[base][0][k], f"{msg} {k} vs home")
            modelled = modelled_stats(stats.plan, layer.cfg, 1e12, 4, 4,
                                      router_grad_at_experts=True)  # plan --compare's model
            assert torch.equal(modelled.bytes_GG["bwd_combine"], stats.bytes_GG["bwd_combine"])
        if name not in ("partial", "sampled"):  # exact plans: equal to one process, static plan
            for k in ("y", "dx", "g13", "g2", "gr"):
                close(emu[k], ref[k], f"{msg} {k}")
        else:  # the forward and the router gradient stay exact
            for k in ("y", "gr"):
                close(emu[k], ref[k], f"{msg} {k}")
            assert not torch.allclose(emu["g13"], ref["g13"], **TOL)
        # per-rank numerics of the real distributed run
        for r in range(G):
            sl, own = slice(r * T, (r + 1) * T), slice(r * per, (r + 1) * per)
            for k, a, b in (("y", emu["y"][sl], real[r]["y"]), ("dx", emu["dx"][sl], real[r]["dx"]),
                            ("g13", emu["g13"][own], real[r]["g13"]),
                            ("g2", emu["g2"][own], real[r]["g2"]), ("gr", emu["gr"], real[r]["gr"])):
                close(a, b, f"{msg} rank {r} {k}")
            # exact counters: the real runtime's stats, rank by rank
            mine, theirs = _rank_stats(stats, r), real[r]["stats"]
            for k, v in mine.items():
                assert theirs[k] == v, f"{msg} rank {r} {k}: emulated {v}, real {theirs[k]}"
        assert stats.rows["fwd"] == [real[r]["stats"]["fwd_rows"] for r in range(G)]
        # the backward's count exchange (the sampled estimator's): what each rank sent
        cx = stats.bytes_GG.get("bwd_count_exchange", torch.zeros(G, G, dtype=torch.long))
        assert cx.sum(1).tolist() == [real[r]["count_exchange_bytes"] for r in range(G)], msg
        assert (name == "sampled") == (cx.sum() > 0), msg
        if name in ("partial", "sampled"):
            assert sum(stats.rows["bwd"]) < sum(stats.rows["fwd"])
        b = stats.bytes_GG["weight_scatter"]
        sent = int((b - torch.diag(torch.diagonal(b))).sum())  # self-copies aside
        assert sent == (0 if base == "static" else 2 * (2 * F * H + H * F) * 4)


def test_router_grad_experts_leaves_a_trimmed_plan_alone():
    """On a partial (LRMoE-trimmed) plan ``router_grad="experts"`` changes nothing: the
    unselected pairs never reach an expert in backward, so the combined rows are kept and
    the router gradient is taken at home, bit for bit as with "home"."""
    kept_home, kept_exp = {}, {}
    a, sa = emulate("partial", 11, kept=kept_home)
    b, sb = emulate("partial", 11, BackwardOptions(router_grad="experts"), kept=kept_exp)
    assert not sb.plan.exact and kept_exp["y_send"] == kept_home["y_send"] > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for ex in sa.bytes_GG:
        assert torch.equal(sa.bytes_GG[ex], sb.bytes_GG[ex]), ex


def selected_pairs(rec: dict, home: int, inst_expert_GS) -> dict:
    """``{(token, expert): pi}`` of the pairs one home rank's sampled select kept, from a
    recorded call: candidate i sits in block ``b`` (blocks of ``size_B`` rows in order,
    block ``b`` = destination slot ``b`` of ``inst_expert_GS``), token ``tok[i]`` of the
    home's ``T``."""
    blk = torch.repeat_interleave(torch.arange(rec["size_B"].numel()), rec["size_B"])
    exp = inst_expert_GS.reshape(-1)[blk]
    keep = rec["keep"].nonzero().view(-1).tolist()
    return {(home * T + int(rec["tok"][i]), int(exp[i])): float(rec["pi"][i]) for i in keep}


def check_inclusion_probs(rec: dict, home: int, inst_expert_GS, metric_NE, msg: str) -> None:
    """The recorded draws against the estimator's definition: ``pi`` capped at 1,
    ``pi ∝ |gate|·||dout||`` below the cap, ``sum(pi)`` = the block's quota; a
    candidate is kept iff its uniform draw (``torch.rand(N, float64)`` on the rank's
    generator) is below its ``pi``."""
    pi, size_B, quota_B = rec["pi"], rec["size_B"].tolist(), rec["quota_B"].tolist()
    blk = torch.repeat_interleave(torch.arange(len(size_B)), rec["size_B"])
    exp = inst_expert_GS.reshape(-1)[blk]
    m = metric_NE[home * T + rec["tok"], exp].double()
    gen = torch.Generator()
    gen.set_state(rec["gen_state"])
    u = torch.rand(pi.shape, dtype=torch.float64, generator=gen)
    assert torch.equal(rec["keep"], u < pi), f"{msg}: kept rows are not those with u < pi"
    first = 0
    for b, (n, q) in enumerate(zip(size_B, quota_B)):
        p, mb = pi[first:first + n], m[first:first + n]
        first += n
        assert torch.all((p > 0) & (p <= 1) if q > 0 else p == 0), \
            f"{msg} block {b}: pi {p} with quota {q} (want (0, 1], or 0 without a quota)"
        assert float(p.sum()) == pytest.approx(min(q, n), rel=1e-9), \
            f"{msg} block {b}: sum(pi) {float(p.sum())}, quota {q} of {n} rows"
        free = p < 1
        if free.any():  # below the cap pi/metric is one constant; capped rows score higher
            c = p[free] / mb[free]
            torch.testing.assert_close(c, c[0].expand_as(c), rtol=1e-5, atol=0,
                                       msg=lambda s, b=b: f"{msg} block {b}: pi not ∝ metric: {s}")
            assert torch.all(mb[~free] * c[0] >= 1 - 1e-5), f"{msg} block {b}: a capped row " \
                "scores below the cap"


def ht_reference(layer, x, coeff, weight: dict) -> dict:
    """One process, every expert local: the forward and the router gradient exact, each
    kept pair's expert path weighted ``weight[(token, expert)]`` (1/pi) in backward, the
    other pairs' not at all (the Horvitz-Thompson estimator of the expert gradients)."""
    layer.zero_grad()
    x = x.clone().requires_grad_()
    w13, w2 = layer.experts.gate_up_proj, layer.experts.down_proj
    probs = torch.softmax(x @ layer.router.weight.t(), dim=-1)
    out = torch.zeros_like(x)
    for e in range(E):
        tok = (layer.router.idx == e).any(1).nonzero().view(-1)
        gu = x[tok] @ w13[e].t()
        y = (Fn.silu(gu[:, :F]) * gu[:, F:]) @ w2[e].t()
        g = probs[tok, e]
        w = torch.tensor([weight.get((t, e), 0.0) for t in tok.tolist()])
        path = (g.detach() * w)[:, None] * (y - y.detach())  # zero forward, weighted backward
        out = out.index_add(0, tok, g[:, None] * y.detach() + path)
    (out * coeff).sum().backward()
    return {"y": out.detach(), "dx": x.grad, "g13": w13.grad.clone(), "g2": w2.grad.clone(),
            "gr": layer.router.weight.grad.clone()}


@pytest.mark.dist
def test_sampled_estimator_matches_gloo_and_horvitz_thompson(gloo_run):
    """The sampled estimator, emulated and on a real gloo group, each rank's generator
    seeded alike: every home rank keeps the same pairs with the same ``pi`` in both;
    the draws and ``pi`` follow the estimator's definition; and both runs' gradients
    equal a one-process reference that weights each kept pair's expert path by 1/pi."""
    seed, folder = gloo_run
    with recorded_selections() as log:
        emu, stats = emulate("sampled", seed)
    real = [torch.load(folder / f"sampled_{r}.pt") for r in range(G)]
    ie = stats.plan.inst_expert_GS
    assert len(log) == G and all(len(r["selections"]) == 1 for r in real), \
        f"select calls: emulated {len(log)}, real {[len(r['selections']) for r in real]}"
    layer, idx, x, coeff = make_case(seed)
    with torch.no_grad():
        gate_NE = torch.softmax(x @ layer.router.weight.t(), dim=-1)
        metric_NE = gate_NE * coeff.norm(dim=1, keepdim=True)  # dout = coeff
    weight = {}
    for g in range(G):
        msg = f"seed={seed} home {g}"
        assert torch.equal(real[g]["inst_expert_GS"], ie), f"{msg}: plans differ"
        mine, theirs = log[g], real[g]["selections"][0]
        check_inclusion_probs(mine, g, ie, metric_NE, f"{msg} emulated")
        check_inclusion_probs(theirs, g, ie, metric_NE, f"{msg} gloo")
        a, b = selected_pairs(mine, g, ie), selected_pairs(theirs, g, ie)
        assert a.keys() == b.keys(), f"{msg}: kept pairs differ: emulated only " \
            f"{sorted(a.keys() - b.keys())}, gloo only {sorted(b.keys() - a.keys())}"
        assert all(a[p] == pytest.approx(b[p], rel=1e-6) for p in a), f"{msg}: pi differ"
        weight.update({p: 1.0 / pi for p, pi in a.items()})
    n_kept, n_pairs = len(weight), G * T * K
    assert 0 < n_kept < n_pairs, f"seed={seed}: kept {n_kept} of {n_pairs} pairs"
    ref = ht_reference(layer, x, coeff, weight)
    per, tol = E // G, dict(rtol=1e-4, atol=1e-4)
    for k in ("y", "dx", "g13", "g2", "gr"):
        torch.testing.assert_close(emu[k], ref[k], **tol,
                                   msg=lambda s, k=k: f"seed={seed} emulated {k} vs HT: {s}")
    for r in range(G):
        sl, own = slice(r * T, (r + 1) * T), slice(r * per, (r + 1) * per)
        for k, got, want in (("y", real[r]["y"], ref["y"][sl]), ("dx", real[r]["dx"], ref["dx"][sl]),
                             ("g13", real[r]["g13"], ref["g13"][own]),
                             ("g2", real[r]["g2"], ref["g2"][own]), ("gr", real[r]["gr"], ref["gr"])):
            torch.testing.assert_close(got, want, **tol,
                                       msg=lambda s, k=k, r=r: f"seed={seed} gloo rank {r} {k} "
                                       f"vs HT: {s}")
    # rows each rank receives in backward = rows the homes shipped to it = the kept pairs
    assert stats.rows["bwd"] == stats.rows_GG["bwd_dispatch"].sum(0).tolist(), stats.rows
    assert stats.rows["selected"] == stats.rows["bwd"], stats.rows
    assert sum(stats.rows["bwd"]) == n_kept, f"{sum(stats.rows['bwd'])} rows shipped, {n_kept} kept"


def test_step_times_from_stats():
    _, stats = emulate("replica", 3)
    link = LINKS["nvlink"]
    st = step_times(stats, link, non_moe_s=1e-3)
    assert isinstance(st, StepTimes) and st.label == "emulated"
    want = max(exchange_time(stats.bytes_GG["fwd_dispatch"], link))
    assert st.fwd_dispatch == pytest.approx(want)
    assert st.fwd_experts == pytest.approx(max(stats.expert_ms["fwd"]) / 1e3)
    assert st.total == pytest.approx(sum(st.stages().values()) + 1e-3)
    assert st.weight_scatter > 0
    # bandwidth model: 450 GB/s at its all-to-all efficiency, 3 us per peer message
    t = exchange_time([[0, 450e9, 0], [0, 0, 225e9], [0, 0, 0]], link)
    one = 1.0 / link.efficiency
    assert t == pytest.approx([one + 6e-6, one + 6e-6, one / 2 + 6e-6])


def test_an_exchange_without_traffic_costs_nothing():
    """Static's plan at G = 4 scatters no replica weights: that exchange costs no latency
    either, while the dispatch pays bandwidth plus a latency per peer."""
    cfg = ModelConfig(hidden_size=H, moe_intermediate_size=F, num_experts=E,
                      num_experts_per_tok=K, num_attention_heads=2, num_key_value_heads=2)
    counts = torch.tensor([[3, 1, 2, 0, 4, 1, 0, 1]] * G)
    plan = full_plan(counts, torch.arange(E).reshape(G, E // G))
    per = rank_stage_seconds(modelled_stats(plan, cfg, 1e12), LINKS["nvlink"])
    assert per["weight_scatter"] == per["grad_reduce"] == [0.0] * G
    assert min(per["fwd_dispatch"]) > LINKS["nvlink"].latency_s * (G - 1)


def test_a_whole_layer_checkpoint_not_run_is_charged_the_forward_again():
    """A ``layer`` recompute the emulator did not run (a modelled plan, an activation
    checkpoint's re-run) costs the forward's dispatch, experts and combine again, and its
    link-free terms re-price to that charge."""
    cfg = ModelConfig(hidden_size=H, moe_intermediate_size=F, num_experts=E,
                      num_experts_per_tok=K, num_attention_heads=2, num_key_value_heads=2)
    counts = torch.tensor([[3, 1, 2, 0, 4, 1, 0, 1]] * G)
    plan = full_plan(counts, torch.arange(E).reshape(G, E // G))
    link = LINKS["nvlink"]
    stats = modelled_stats(plan, cfg, 1e12, recompute_rows=[1] * G, recompute_mode="layer")
    per = rank_stage_seconds(stats, link)
    want = [a + b + c for a, b, c in
            zip(per["fwd_dispatch"], per["fwd_experts"], per["fwd_combine"])]
    assert min(per["fwd_combine"]) > 0 and min(per["fwd_experts"]) > 0
    assert per["bwd_recompute"] == pytest.approx(want, rel=1e-12)
    terms = rank_link_terms(stats)["bwd_recompute"]
    assert price_terms(list(terms), link, G) == pytest.approx(max(want), rel=1e-12)


def _rank_stats(stats: VirtualStats, g: int) -> dict:
    """Rank g's emulated counters under the real runtime's stat names (``MoERuntime.stats``)."""
    d = {"fwd_rows": stats.rows["fwd"][g], "retained_rows": stats.rows["retained"][g],
         "saved_act_bytes": stats.saved_act_bytes[g]}
    for ex in EXCHANGES[:4]:
        if ex in stats.bytes_GG:
            d[f"{ex}_bytes_sent"] = int(stats.bytes_GG[ex][g].sum())  # self-copy included
            d[f"{ex}_bytes_recv"] = int(stats.bytes_GG[ex][:, g].sum())
    if "bwd" in stats.rows:
        d["bwd_rows"] = stats.rows["bwd"][g]
        d["selected_rows"] = stats.rows["selected"][g]
    return d


def emulate_step(model_cfg, policy, G: int, tokens_per_rank: int, *, skew: float, ledger,
                 link: str, repeats: int) -> tuple[StepTimes, VirtualStats]:
    """Emulated forward+backward time of one MoE layer at ``model_cfg``'s shapes: a random
    layer routes ``G * tokens_per_rank`` random tokens (Zipf popularity with exponent
    ``skew``), the virtual EP emulator runs it once untimed and ``repeats`` times timed;
    the per-stage median :class:`StepTimes` and the last run's stats."""
    link = LINKS[link]
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = MoELayer(model_cfg, 0)
    N, E, K = G * tokens_per_rank, model_cfg.num_experts, model_cfg.num_experts_per_tok
    idx = zipf_routing(N, E, K, skew, gen)
    layer.router = TableRouter(layer.router.weight, idx)
    # steady state: SYMI's popularity is the previous step's counts, taken to equal these
    layer.prev_counts_E = torch.bincount(idx.flatten(), minlength=E)
    v = EmulatedLayer(layer, G, policy, None, ledger=ledger)
    x = torch.randn(N, model_cfg.hidden_size, generator=gen)
    dy = torch.randn(N, model_cfg.hidden_size, generator=gen)
    runs = []
    for i in range(1 + repeats):
        layer.zero_grad(set_to_none=True)
        v(x.clone().requires_grad_()).backward(dy)
        if i >= 1:
            runs.append(step_times(v.stats, link))
    med = StepTimes(link=link.name)  # median over runs: robust to noise
    for s in STAGES:
        setattr(med, s, statistics.median(getattr(r, s) for r in runs))
    return med, v.stats


def test_emulate_step_with_registry_policies():
    from lrmoe.policy.registry import PolicyConfig
    from lrmoe.policy.registry import make_policy as registry_policy

    cfg = ModelConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    idx = zipf_routing(64, 8, 2, 1.5, torch.Generator().manual_seed(0))
    assert all(len(set(r)) == 2 for r in idx.tolist())
    for name in ("static", "symi", "lrmoe"):
        st, stats = emulate_step(cfg, registry_policy(PolicyConfig(name=name), cfg, 4), 4, 16,
                                 skew=1.5, ledger=Ledger(cfg, 4), link="ib", repeats=2)
        assert st.label == "emulated" and st.link == "ib" and st.total > 0
        assert sum(stats.rows["fwd"]) == 4 * 16 * 2
        assert len(stats.ledger_total_bytes) == 4


def test_recompute_ledger_charges_time_not_math():
    """An exact policy over budget recomputes: same tensors as without; the ledger
    decides the mode and rows; ``pairs`` runs as the runtime runs it (the rows keep their
    input only; their gate_up is recomputed inside the expert backward, measured there:
    no separate charge); a whole-layer checkpoint runs (``Plan.layer_checkpoint``): its backward
    re-sends the forward's dispatch and combine and re-runs its expert kernels, and is
    charged what it measured there."""
    from lrmoe.ledger import Ledger

    base, _ = emulate("static", 5)
    layer, idx, x, coeff = make_case(5)
    Hd, Fd = layer.cfg.hidden_size, layer.cfg.moe_intermediate_size
    plan = full_plan(torch.stack([torch.bincount(i, minlength=E) for i in idx.reshape(G, -1)]),
                     torch.arange(E).reshape(G, E // G))
    # planned for 4 layers: with one, recomputing saves about what the backward's
    # rebuild points cost (Ledger.recompute_needed), so "pairs" would never be the mode
    free = Ledger(layer.cfg, G, num_moe_layers=4)
    plain = max(t["total"] for t in free.rank_terms(plan))
    cnt = free._rank_counts(plan)
    all_rec = max(min(free.terms(*c, m, exact=True)["total"] for m in range(c[3] + 1))
                  for c in cnt)
    none_kept = max(free.layer_terms(*c[:3])["total"] for c in cnt)  # the checkpoint
    assert none_kept < all_rec < plain
    led = Ledger(layer.cfg, G, none_kept - 1, num_moe_layers=4)
    v = EmulatedLayer(layer, G, StaticPolicy(recompute=True), BackwardOptions(), ledger=led)
    with pytest.raises(OutOfMemory, match="static, even with a whole-layer checkpoint, does not "
                                          "fit mem_budget: rank") as e:  # stops the step
        run(v, layer, x, coeff)
    assert (e.value.needs_bytes, e.value.budget_bytes) == (none_kept, none_kept - 1)
    for budget, want in (((all_rec + plain) // 2, "pairs"), ((none_kept + all_rec) // 2, "layer")):
        led = Ledger(layer.cfg, G, budget, num_moe_layers=4)
        v = EmulatedLayer(layer, G, StaticPolicy(recompute=True), BackwardOptions(), ledger=led)
        got = run(v, layer, x, coeff)
        for k in got:
            close(got[k], base[k], k)
        mode, rows, _ = led.exact_fit(v.stats.plan)
        assert mode == want == v.stats.recompute_mode and v.stats.recompute_rows == rows
        assert v.stats.rung == {"pairs": "recompute", "layer": "layer"}[want]
        per = rank_stage_seconds(v.stats, LINKS["nvlink"])
        for r in range(G):
            if want == "pairs":  # run inside the expert backward, measured there
                exp = 0.0
                # the recomputed rows keep their input row, not their gate_up output
                kept_rows = int(v.stats.plan.retain_GGS[:, r, :].sum())
                es = x.element_size()
                assert v.stats.saved_act_bytes[r] == es * (kept_rows * Hd
                                                           + (kept_rows - rows[r]) * 2 * Fd)
            else:  # measured in backward: the expert kernels again, the exchanges re-sent
                exp = (v.stats.expert_ms["recompute"][r] / 1e3 + per["fwd_dispatch"][r]
                       + per["fwd_combine"][r])
                assert v.stats.expert_ms["recompute"][r] > 0
            assert per["bwd_recompute"][r] == pytest.approx(exp)
        assert v.stats.plan.layer_checkpoint == (want != "pairs")
        if want != "pairs":
            assert v.stats.saved_act_bytes == [0] * G
            for a, b in (("recompute_dispatch", "fwd_dispatch"),
                         ("recompute_combine", "fwd_combine")):
                assert torch.equal(v.stats.bytes_GG[a], v.stats.bytes_GG[b])
        if want == "pairs":
            assert any(n == 0 for n in rows) and any(n > 0 for n in rows)
            assert v.stats.plan.recompute_G.tolist() == list(rows)
        assert step_times(v.stats, LINKS["nvlink"]).bwd_recompute == pytest.approx(
            max(per["bwd_recompute"]))


def test_router_grad_experts_frees_the_combined_rows_in_the_recompute_ledger():
    """An exact policy whose plan needs one byte more than the budget with the combined
    rows kept must recompute with ``router_grad`` "home"; at the experts
    (``Ledger(router_grad_at_experts=True)``) it fits as it is."""

    layer, idx, x, coeff = make_case(5)
    plan = full_plan(torch.stack([torch.bincount(i, minlength=E) for i in idx.reshape(G, -1)]),
                     torch.arange(E).reshape(G, E // G))
    budget = max(t["total"] for t in Ledger(layer.cfg, G, num_moe_layers=4).rank_terms(plan)) - 1
    got = {}
    for rg in ("home", "experts"):  # 4 layers: recompute pays (see the test above)
        led = Ledger(layer.cfg, G, budget, num_moe_layers=4,
                     router_grad_at_experts=rg == "experts")
        v = EmulatedLayer(layer, G, StaticPolicy(recompute=True), BackwardOptions(router_grad=rg),
                          ledger=led)
        run(v, layer, x, coeff)
        got[rg] = v.stats
        assert max(v.stats.ledger_total_bytes) <= budget
    assert got["home"].recompute_mode == "pairs" and sum(got["home"].recompute_rows) > 0
    assert got["experts"].recompute_mode == "fits" and got["experts"].recompute_rows is None


def test_lrmoe_whole_layer_rung_runs_exact_and_below_it_is_out_of_memory():
    """At the smallest budget lrmoe meets (4 layers planned: the trimmed plan's retained
    pairs no longer fit), its ladder's whole-layer rung runs: every pair in backward (the
    same tensors as static), its own replicas, the layer re-run in backward and charged as
    measured, the ledger's ``layer`` mode; one
    byte less and the step stops with :class:`OutOfMemory` instead of running some other
    plan."""
    from lrmoe.policy.lrmoe import LrmoeConfig, LrmoePolicy, plan_lrmoe

    base, _ = emulate("static", 6)
    layer, idx, x, coeff = make_case(6)
    counts = torch.stack([torch.bincount(i, minlength=E) for i in idx.reshape(G, -1)])

    def fits(b):
        try:
            return plan_lrmoe(counts, LrmoeConfig(), Ledger(layer.cfg, G, b, num_moe_layers=4)).plan
        except OutOfMemory:
            return None
    lo, hi = 1, 1 << 40
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) is not None else (mid + 1, hi)
    led = Ledger(layer.cfg, G, lo, num_moe_layers=4)
    policy = LrmoePolicy(LrmoeConfig())
    v = EmulatedLayer(layer, G, policy, BackwardOptions(), ledger=led)
    got = run(v, layer, x, coeff)
    for k in got:
        close(got[k], base[k], k)
    assert v.stats.rung == v.stats.plan.rung == "layer" and v.stats.plan.exact
    assert policy.rungs == {"layer": 1}
    mode, rows, terms = led.exact_fit(v.stats.plan)
    assert (v.stats.recompute_mode, v.stats.recompute_rows) == ("layer", rows)
    assert max(v.stats.ledger_total_bytes) == max(t["total"] for t in terms) <= lo
    per = rank_stage_seconds(v.stats, LINKS["nvlink"])
    assert v.stats.plan.layer_checkpoint  # the runtime's checkpoint runs, measured
    assert per["bwd_recompute"] == pytest.approx(
        [v.stats.expert_ms["recompute"][r] / 1e3 + per["fwd_dispatch"][r]
         + per["fwd_combine"][r] for r in range(G)])
    assert min(v.stats.expert_ms["recompute"]) > 0
    with pytest.raises(OutOfMemory, match="no plan fits mem_budget at any rung"):
        run(EmulatedLayer(layer, G, policy, BackwardOptions(),
                          ledger=Ledger(layer.cfg, G, lo - 1, num_moe_layers=4)), layer, x, coeff)
    # a roomy budget: the trimmed plan, rung "plan"
    v = EmulatedLayer(layer, G, policy, BackwardOptions(), ledger=Ledger(layer.cfg, G, 2 * lo))
    run(v, layer, x, coeff)
    assert v.stats.rung == "plan"
