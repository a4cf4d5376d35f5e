"""The ledger against what autograd really keeps for backward, one MoE layer, per rank.

One rank of a G-rank EP group runs the real runtime (``MoELayer`` with a real router and
``ExpertExchange``) with synthetic peers (:class:`onerank.OneRankComm`, ``tests/onerank.py``). Its
forward runs under ``torch.autograd.graph.saved_tensors_hooks``; the autograd graph is
then walked node by node, custom Functions' ``ctx`` attributes included (the exchange
keeps its layouts on ``ctx.st`` and its kept rows on ``ctx.kept``, one dict per played
rank, which the hooks never see), and every tensor found is
counted once per storage. The expert path's bytes must equal the ledger's per-layer
terms exactly; every difference is itemized below:

* the owned parameters (``owned_state``, per model, not per step) and, where the
  instance weights *are* the owned parameters (compute dtype = parameter dtype and
  every rank's slots are its natives), the ledger's ``instance_weights`` term, which is
  then not a separate allocation (the ledger is conservative there);
* the router's saved tensors and the layer input it saves (outside the ledger: the same
  for every policy), itemized by formula;
* tensors derived from the plan (host memory on a GPU) and the test harness's comm.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lrmoe.config import ModelConfig
from lrmoe.ledger import Ledger
from lrmoe.model.moe import MoELayer
from lrmoe.parallel.comm import EPComm
from lrmoe.policy.base import PlanInputs
from lrmoe.policy.lrmoe import LrmoeConfig, LrmoePolicy
from lrmoe.policy.plan import Plan
from lrmoe.policy.static import StaticPolicy
from lrmoe.policy.symi import SymiPolicy
from onerank import one_rank_layer

H, F, E, K, G, T = 32, 24, 8, 2, 4, 48


def _cfg() -> ModelConfig:
    return ModelConfig(hidden_size=H, moe_intermediate_size=F, num_experts=E,
                       num_experts_per_tok=K, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=1, router_aux_loss_coef=0.01)


def _layer_and_tokens(seed: int = 0) -> tuple[MoELayer, torch.Tensor, torch.Tensor]:
    """A layer whose router prefers some experts (a hot rank), the G ranks' tokens and
    the ``[G, E]`` counts they route to."""
    torch.manual_seed(seed)
    layer = MoELayer(_cfg(), 0)
    m = torch.randn(H)
    with torch.no_grad():  # expert e's logit grows with (E - e): experts 0, 1 are hot
        layer.router.weight += torch.linspace(0.03, -0.03, E)[:, None] * m[None, :] / H ** 0.5
    x = torch.randn(G * T, H) + m
    with torch.no_grad():
        idx = layer.router(x).idx_TK
    counts = torch.stack([torch.bincount(idx[g * T:(g + 1) * T].flatten(), minlength=E)
                          for g in range(G)])
    layer.prev_counts_E = counts.sum(0)
    return layer, x, counts


def _tensors(obj, out: list, seen: set) -> None:
    """Every tensor reachable from a ctx attribute (dataclasses, containers)."""
    if id(obj) in seen or isinstance(obj, EPComm):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _tensors(getattr(obj, f.name), out, seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out, seen)


def _nodes(roots) -> list:
    out, seen, todo = [], set(), [r for r in roots if r is not None]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        out.append(n)
        todo += [m for m, _ in n.next_functions if m is not None]
    return out


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def measure(layer: MoELayer, x_TH: torch.Tensor, me: int, policy, ledger) -> dict:
    """Run rank ``me``'s forward; return the kept storages, by owner."""
    layer = one_rank_layer(layer, me, layer.runtime_peers, policy, ledger)
    hooked = []
    x = x_TH[me * T:(me + 1) * T].clone().requires_grad_()

    def pack(t):
        hooked.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x.view(1, T, H))
    by: dict[str, dict[int, int]] = {"exchange": {}, "other": {}, "host": {}}
    plan = None
    for n in _nodes([out.grad_fn, layer.last.aux_loss.grad_fn]):
        ts: list = []
        if type(n).__name__ == "ExpertExchangeBackward":
            ts += list(n.saved_tensors)
            _tensors(n.kept, ts, set())  # the kept rows, which backward frees as it goes
            _tensors(n.st, ts, set())
            plan = n.st.plan
            # plan-derived tensors: host memory on a GPU (the plan is built on the CPU)
            host: list = []
            _tensors([n.keep_G, plan], host, set())
            for t in host:
                by["host"].setdefault(*_storage(t))
            dest = "exchange"
        else:
            for k in dir(n):
                if k.startswith("_saved_") and isinstance(getattr(n, k), torch.Tensor):
                    ts.append(getattr(n, k))
            ts += [v for v in vars(n).values() if isinstance(v, torch.Tensor)] \
                if hasattr(n, "__dict__") else []
            dest = "other"
        for t in ts:
            p, nb = _storage(t)
            if p not in by["host"]:
                by[dest].setdefault(p, nb)
    # every tensor the hooks saw is attributed to a node walked above
    walked = set(by["exchange"]) | set(by["other"]) | set(by["host"])
    assert {_storage(t)[0] for t in hooked} <= walked
    params = {_storage(p)[0] for p in layer.parameters()}
    return {"plan": plan, "by": by, "params": params, "x": _storage(x)[0]}


CASES = ["static", "symi_replicas", "lrmoe_trimmed", "lrmoe_recompute", "static_recompute",
         "one_row_recompute", "one_row_recompute_trimmed"]


def _one_row_recompute(cls):
    """``cls``'s plan with one retained row recomputed on every other rank: the backward's
    rebuild of the recomputed rows at its smallest."""

    class OneRow(cls):
        def plan(self, counts_GE, inputs):
            plan = super().plan(counts_GE, inputs)
            return dataclasses.replace(plan, recompute_G=torch.arange(plan.G) % 2)
    return OneRow


def _policy_and_ledger(case: str, counts: torch.Tensor):
    """The policy and its planning ledger. The recompute cases plan for 4 MoE layers:
    with one, recomputing frees one layer's gate_up rows while the backward's rebuild
    points (``Ledger.backward_points``) cost about as much, so the planners find that
    recompute does not fit where keeping does (the test then measures one layer)."""
    cfg = _cfg()
    L = 4 if case.endswith("recompute") else None
    free = Ledger(cfg, G, num_moe_layers=L)
    if case == "static":
        return StaticPolicy(), None
    if case == "symi_replicas":
        return SymiPolicy(slots_per_rank=E // G + 1), None
    if case == "one_row_recompute":
        return _one_row_recompute(StaticPolicy)(), None
    if case == "static_recompute":
        terms = free.rank_terms(StaticPolicy().plan(counts, PlanInputs()))
        need, ret = max(t["total"] for t in terms), max(t["retained_acts"] for t in terms)
        return StaticPolicy(recompute=True), Ledger(cfg, G, need - ret // 3, num_moe_layers=L)
    cls = _one_row_recompute(LrmoePolicy) if case.startswith("one_row") else LrmoePolicy
    pol = cls(LrmoeConfig(max_slots_per_rank=E // G + 2, recompute=case == "lrmoe_recompute"))
    terms = free.rank_terms(pol.plan(counts, PlanInputs(ledger=free)))
    need, ret = max(t["total"] for t in terms), max(t["retained_acts"] for t in terms)
    # recompute makes room for every pair down to a cut of about ret here: cut more, so
    # that it trims too
    cut = ret * 6 // 5 if case == "lrmoe_recompute" else ret // 2
    return pol, Ledger(cfg, G, need - cut, num_moe_layers=L)


def router_bytes() -> int:
    """The softmax router's saved tensors for T tokens (outside the ledger): the layer
    input it multiplies ``T·H``, the probabilities ``T·E`` (softmax, and the aux loss's
    mean), the top-k indices ``T·K`` (int64), the top-k gates ``T·K`` and their sum
    ``T`` (renormalisation), all fp32 but the indices; plus the aux loss's global count
    fractions ``[E]`` and one scalar (8 bytes)."""
    return 4 * (T * H + T * E + T * K + T) + 8 * T * K + 4 * E + 8


@pytest.mark.parametrize("case", CASES)
def test_ledger_equals_what_autograd_keeps(case):
    layer, x, counts = _layer_and_tokens()
    layer.runtime_peers = counts
    policy, ledger = _policy_and_ledger(case, counts)
    one = Ledger(_cfg(), G, num_moe_layers=1)  # per-layer terms (L = 1)
    seen_trim = seen_rec = seen_copy = False
    for me in range(G):
        got = measure(layer, x, me, policy, ledger)
        plan: Plan = got["plan"]
        n_inst, recv, home, kept = one._rank_counts(plan)[me]
        rec = 0 if plan.recompute_G is None else int(plan.recompute_G[me])
        t = one.terms(n_inst, recv, home, kept, rec)
        expected = {k: t[k] for k in ("instance_weights", "retained_acts", "combine_rows",
                                      "pair_index")}
        ex = got["by"]["exchange"]
        # itemized: instance weights that are the owned parameters themselves
        as_params = sum(nb for p, nb in ex.items() if p in got["params"])
        if as_params:
            assert as_params == expected["instance_weights"]
            expected["instance_weights"] = 0
        else:
            seen_copy = True
        measured = sum(nb for p, nb in ex.items() if p not in got["params"])
        assert measured == sum(expected.values()), (case, me, expected, measured)
        # itemized outside the ledger: the router's tensors (+ the owned router weight)
        other = {p: nb for p, nb in got["by"]["other"].items()
                 if p not in got["params"] and p not in ex}
        assert sum(other.values()) == router_bytes(), (case, me)
        assert got["x"] in other  # the layer input, saved by the router's linear
        seen_trim |= kept < recv
        seen_rec |= rec > 0
    # each case exercises what it names
    if case in ("lrmoe_trimmed", "lrmoe_recompute", "one_row_recompute_trimmed"):
        assert seen_trim
    if "recompute" in case:
        assert seen_rec
    if case == "symi_replicas":
        assert seen_copy and plan.num_replicas() > 0


def test_ledger_peak_script_logic_on_cpu(tmp_path):
    """benchmarks/ledger_peak.py on CPU (nothing measured there): every policy and rank
    gets a row whose ledger total is the ledger's for that rank's plan; bad input is
    one line and exit code 2, writing nothing."""
    import json

    from dist_util import load_benchmark

    mod = load_benchmark("ledger_peak")
    out = tmp_path / "lp"
    assert mod.main(["--out", str(out), "--preset", "tiny-qwen3", "--device", "cpu",
                     "--tokens-per-rank", "32", "--ep", "4"]) == 0
    rows = json.loads((out / "ledger_peak.json").read_text())["results"]
    assert [(r["policy"], r["rank"]) for r in rows] == [
        (p, g) for p in ("static", "symi", "lrmoe") for g in range(4)]
    for r in rows:
        assert r["measured_requested_peak_bytes"] is None  # CPU: nothing measured
        assert r["measured_block_peak_bytes"] is None and r["measured_over_ledger"] is None
        assert r["ledger_bytes"] == sum(r["ledger_terms"].values())
        assert r["ledger_plan_bytes"] == (r["ledger_bytes"] - r["ledger_terms"]["buffers"]
                                          + r["ledger_plan_buffers"])
    assert "| static | 0 |" in (out / "ledger_peak.md").read_text()
    assert mod.main(["--out", str(tmp_path / "bad"), "--ep", "3", "--device", "cpu"]) == 2
    assert not (tmp_path / "bad").exists()


def exchange_node(out: torch.Tensor):
    """The layer's ``ExpertExchange`` backward node (its ``ctx``) below ``out``."""
    node = out.grad_fn
    while type(node).__name__ != "ExpertExchangeBackward":
        node = node.next_functions[0][0]
    return node


@pytest.mark.parametrize("case", CASES)
def test_buffers_equal_the_rows_alive_at_the_backward_peak(case):
    """Ledger.rows_buffer_bytes against the code: at every point of one rank's forward
    and backward (every line of the exchange's forward or backward and of the functions
    it hands its rows to, and every op they call; :class:`live_rows.LiveRows`) the row
    tensors alive (``[N, H]``, ``[N, F]``, ``[N, 2F]``, by storage) are summed, the
    layer input and the layer's kept rows included while they live (the forward makes
    them, the backward frees them as it goes). Per pass, the largest sum minus the kept
    rows must be the largest of the ledger's points for that rank's plan (backward: its
    selected rows), every one of those points must occur, and the ledger's plan-priced
    buffers must be the larger of the two passes' largest sums (the backward's plus its
    per-row index bytes)."""
    from live_rows import LiveRows, exchange_code, row_seams

    layer, x, counts = _layer_and_tokens()
    policy, ledger = _policy_and_ledger(case, counts)
    one = Ledger(_cfg(), G, num_moe_layers=1)
    b = one.bytes_act
    fwd_code, traced = exchange_code()
    seams = row_seams()
    seen = {"gathered": False, "rec": False, "copy": False, "one": False, "rebuild_peak": False}
    for me in range(G):
        lay = one_rank_layer(layer, me, counts, policy, ledger)
        xin = x[me * T:(me + 1) * T].clone().requires_grad_()
        live_fwd = LiveRows((H, F, 2 * F), fwd_code, seams, count=[xin])
        with live_fwd:
            out = lay(xin.view(1, T, H))
        node = exchange_node(out)
        plan = node.st.plan
        dout = torch.ones_like(out)
        kept = {_storage(t)[0]: t.untyped_storage().nbytes() for t in node.kept[0].values()}
        forward = {sum(p.values()) - sum(kept.values()) for _, p in live_fwd.points}
        live = LiveRows((H, F, 2 * F), traced, seams, count=[*node.kept[0].values(), dout])
        with live:
            out.backward(dout)
        measured = {sum(p.values()) - sum(kept.values()) for _, p in live.points}
        n_inst, R, h, k = one._rank_counts(plan)[me]
        rec = 0 if plan.recompute_G is None else int(plan.recompute_G[me])
        bw = one.backward_rows(plan, me)
        n, ps, gth = bw.rows_in, bw.rows_out, bw.gathered
        Tt = -(-h // K)
        points = one.backward_points(Tt, n, ps, k, rec, h, gth)
        assert max(measured) == b * max(points.values()), (case, me, max(measured), points)
        missing = {name: v for name, v in points.items() if b * v not in measured}
        assert not missing, (case, me, missing)
        # the forward: the layer input, the exchange's rows, the kept rows as they are made
        fpoints = one.forward_points(Tt, R, h, k, rec, h)
        assert max(forward) == b * max(fpoints.values()), (case, me, max(forward), fpoints)
        missing = {name: v for name, v in fpoints.items() if b * v not in forward}
        assert not missing, (case, me, missing)
        buf = one.rank_terms(plan, plan_buffers=True)[me]["buffers"]
        assert buf == one.rows_buffer_bytes(R, h, k, rec, bw, plan.exact)
        assert buf == max(max(forward), max(measured) + n * (20 + 16 * gth)), (case, me)
        seen["gathered"] |= bool(gth)
        seen["rec"] |= rec > 0
        seen["one"] |= rec == 1
        seen["rebuild_peak"] |= max(points, key=points.get).startswith("rebuild")
        seen["copy"] |= buf == b * fpoints.get("keep_copy", -1)  # the kept rows' copy is the peak
    if case == "lrmoe_trimmed":
        assert seen["gathered"] and seen["copy"]
    if case == "one_row_recompute_trimmed":  # with rows trimmed, the rebuild is the peak
        assert seen["rebuild_peak"]
    if "recompute" in case:
        assert seen["rec"]
    if case.startswith("one_row"):
        assert seen["one"]
