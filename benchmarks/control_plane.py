"""The control plane's cost per MoE layer, stage by stage, on one rank's real runtime path.

For each preset (one MoE layer of its shapes), EP size G (virtual), tokens per rank T,
policy (a ``bench ttl`` spec, :func:`lrmoe.sim.ttl_config.policy_variant`; symi with ``E/G + 2``
slots) and budget, ONE rank runs the real runtime (``MoELayer`` → ``ExpertExchange``,
forward and backward) with synthetic peers (``tests/onerank.py``: the count all-gather
returns the group's counts, every all-to-all allocates what a real one would). That rank
is the plan's **busiest**: largest forward load, then backward load, then index.

Stage times are what the runtime records in ``MoERuntime.stats[0]`` (CUDA event pairs
resolved as the trainer does, :func:`lrmoe.train.loop._snapshot_stats`); a stage it does
not record is reported missing, never estimated. Control plane = plan + count exchange +
local + select + gather, as a fraction of the expert kernels (forward + backward). The
synchronised layer wall beside them leaves ``unaccounted`` (router, casts, the stand-in
exchanges' copies). Host waits: ``torch.cuda.set_sync_debug_mode`` over one more pass.
Median of ``--repeats`` after ``--warmup`` calls.

Routing: each of the G·T tokens picks ``top_k`` distinct experts, popularity ``∝
1/rank^skew`` over a seeded order of the experts; skew 0.65 gives an expert max/mean of
about 7–8, the median of the registered Qwen3 workload's static run (the realised value
is reported). Budgets: ``ample`` (none) and ``binding`` (:func:`binding_budget`), under
which lrmoe trims or recomputes and the exact policies recompute (one that does not fit
even so is timed unbudgeted and marked "over").

    python3 benchmarks/control_plane.py --out DIR                     # GPU, bf16, ~2-3 min
    python3 benchmarks/control_plane.py --out DIR --preset tiny-qwen3 --eps 4 \\
        --tokens 64 --device cpu --repeats 1 --warmup 0                 # logic check only

Writes ``control_plane.json`` and ``control_plane.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # onerank: synthetic peers

from gpu_common import check_device, cli, count_syncs, csv, md_head, out_dir, run_meta, write_outputs  # noqa: E402

from lrmoe.errors import LrmoeError  # noqa: E402
from lrmoe.ledger import Ledger  # noqa: E402
from onerank import OneRankComm  # noqa: E402

STAGES = ("count_exchange_ms", "plan_ms", "local_ms", "select_ms", "gather_ms",
          "expert_fwd_ms", "expert_bwd_ms")
CONTROL = ("plan_ms", "count_exchange_ms", "local_ms", "select_ms", "gather_ms")
EXPERT = ("expert_fwd_ms", "expert_bwd_ms")
POLICIES = ("static", "symi", "lrmoe:recompute+estimator=sampled", "lrmoe:recompute")
DEFAULT_SKEW = 0.65


# ------------------------------------------------------------------- pure parts
def routing(G: int, T: int, E: int, K: int, skew: float, seed: int,
            device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx [G*T, K], counts [G, E])``: every token's ``K`` distinct experts, drawn
    without replacement with popularity ``∝ 1/rank^skew`` over a seeded random order of
    the experts (the law of :func:`onerank.zipf_routing`, drawn as Gumbel top-k,
    which is fast enough for a million tokens), and each home rank's counts (rank g owns
    tokens ``g*T .. (g+1)*T - 1``). ``idx`` is on ``device``, ``counts`` on the host."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(E, generator=gen)
    logp = torch.empty(E)
    logp[perm] = -skew * torch.log(torch.arange(1, E + 1, dtype=torch.float64)).float()
    dg = torch.Generator(device=device).manual_seed(seed + 1)
    logp = logp.to(device)
    idx = torch.empty(G * T, K, dtype=torch.long, device=device)
    step = max(1, 2**22 // E)  # rows per chunk
    for a in range(0, G * T, step):
        u = torch.rand(min(step, G * T - a), E, device=device, generator=dg).clamp_(min=1e-20)
        idx[a:a + step] = torch.topk(logp - torch.log(-torch.log(u)), K, dim=1).indices
    off = (torch.arange(G, device=device).repeat_interleave(T * K) * E).view(G * T, K)
    counts = torch.bincount((idx + off).flatten(), minlength=G * E).view(G, E)
    return idx, counts.long().cpu()


def load_skew(counts_GE: torch.Tensor) -> dict:
    """Expert max/mean of the global counts and static's rank max/mean (natives only)."""
    glob = counts_GE.sum(0).double()
    rank = glob.view(counts_GE.shape[0], -1).sum(1)
    return {"expert_max_over_mean": float(glob.max() / glob.mean()),
            "static_rank_max_over_mean": float(rank.max() / rank.mean())}


def busiest_rank(plan) -> int:
    """The rank with the largest planned forward load, ties by backward load, then index."""
    fwd, bwd = plan.rank_load().tolist(), plan.rank_backward_load().tolist()
    return max(range(len(fwd)), key=lambda g: (fwd[g], bwd[g], -g))


def stage_row(samples: list[dict]) -> dict:
    """Median of each recorded stage over the repeats (``None``: the runtime did not
    record it), the control plane (sum of the recorded control stages), the expert
    kernel time, their ratio, and the recorded stages' sum against the layer wall."""
    out = {}
    for k in STAGES + ("wall_ms", "fwd_ms", "bwd_ms"):
        vals = [s[k] for s in samples if s.get(k) is not None]
        out[k] = statistics.median(vals) if len(vals) == len(samples) and vals else None
    rec = [k for k in CONTROL if out[k] is not None]
    out["missing_stages"] = [k for k in STAGES if out[k] is None]
    out["control_ms"] = sum(out[k] for k in rec) if rec else None
    out["control_stages"] = rec
    exp = [out[k] for k in EXPERT if out[k] is not None]
    out["expert_ms"] = sum(exp) if len(exp) == len(EXPERT) else None
    out["control_over_expert"] = (out["control_ms"] / out["expert_ms"]
                                  if out["control_ms"] is not None and out["expert_ms"] else None)
    rec_all = [out[k] for k in STAGES if out[k] is not None]
    out["stage_sum_ms"] = sum(rec_all) if rec_all else None
    out["unaccounted_ms"] = (out["wall_ms"] - out["stage_sum_ms"]
                             if out["wall_ms"] is not None and out["stage_sum_ms"] is not None
                             else None)
    return out


def _f(v, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def markdown(meta: dict, rows: list[dict]) -> str:
    """The report: one row per (preset, EP, tokens, policy, budget); missing stages say so."""
    lines = [f"# Control plane per MoE layer, one rank ({meta['device']}, {meta['dtype']})", "",
             f"Command: `{meta['command']}`; date {meta['date']}; torch {meta['torch']}. "
             f"Routing: Zipf skew {meta['skew']} over experts (top-k distinct); the busiest "
             "rank of each plan runs the real runtime with synthetic peers. ms per layer, "
             f"median of {meta['repeats']} after {meta['warmup']} warm-up. control = plan + "
             "count exchange + local + select + gather (recorded ones); ctl/exp = control / "
             "(expert fwd + bwd). unacc. = layer wall − recorded stages. syncs: host waits "
             "in forward / backward.", ""]
    missing = [k for k in STAGES
               if any(k in (r.get("stages") or {}).get("missing_stages", []) for r in rows)]
    if missing:
        lines += [f"Not recorded by the runtime (shown n/a, not in control): "
                  f"{', '.join(missing)}.", ""]
    lines += md_head("preset", "EP", "tok/rank", "expert max/mean", "policy", "budget", "rank",
                     "fwd rows", "bwd rows", "keep / retain / recomputed", "count exch", "plan",
                     "local", "select", "gather", "**control**", "expert fwd", "expert bwd",
                     "**ctl/exp**", "layer wall", "unacc.", "syncs f/b")
    for r in rows:
        head = (f"| {r['preset']} | {r['ep']} | {r['tokens_per_rank']} | "
                f"{r['expert_max_over_mean']:.2f} | {r['policy']} | {r['budget']} | ")
        if r.get("error"):
            lines.append(head + f"— | {r['error']} |" + " |" * 14)
            continue
        s = r["stages"]
        syncs = r.get("syncs") or {}
        sy = (f"{syncs['forward']}/{syncs['backward']}" if syncs else "n/a")
        lines.append(head + f"{r['rank']} | {r['fwd_rows']} | {r['bwd_rows']} | "
                     f"{r['keep_ratio']:.3f} / {r['retain_ratio']:.3f} / {r['recompute_rows']} | "
                     + " | ".join(_f(s[k]) for k in CONTROL[1:2] + CONTROL[:1] + CONTROL[2:])
                     + f" | **{_f(s['control_ms'])}** | {_f(s['expert_fwd_ms'])} | "
                     f"{_f(s['expert_bwd_ms'])} | **{_f(s['control_over_expert'], '.2f')}** | "
                     f"{_f(s['wall_ms'])} | {_f(s['unaccounted_ms'])} | {sy} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- runtime
def make_policy(spec: str, cfg, G: int, budgeted: bool):
    """``(policy, BackwardOptions)`` for a ``bench ttl`` policy spec."""
    from lrmoe.policy.registry import PolicyConfig
    from lrmoe.policy.registry import make_policy as registry_policy
    from lrmoe.sim.ttl_config import TTLConfig, policy_variant

    base, v = policy_variant(spec, TTLConfig())
    pc = PolicyConfig(name=base, lrmoe=v.lrmoe.planner, recompute=budgeted and base != "lrmoe")
    return registry_policy(pc, cfg, G), v.lrmoe.backward


BINDING_FRACTIONS = (0.4, 0.55, 0.7, 0.85, 0.95)


def binding_budget(cfg, G: int, counts_GE: torch.Tensor, dtype: str,
                   fractions=BINDING_FRACTIONS) -> tuple[int | None, float | None]:
    """``(bytes, fraction)``: lrmoe's fixed bytes (its unbounded plan's largest rank need
    less its retained activations) plus the smallest ``fraction`` of its largest retained
    bytes in which the headline variant still plans (``benchmarks/plan_speed.py``'s
    rule): memory binds lrmoe by construction. ``(None, None)`` if none does."""
    from lrmoe.policy.base import PlanInputs
    from lrmoe.policy.lrmoe import LrmoePolicy

    free = Ledger.for_dtype(cfg, G, None, dtype, num_moe_layers=1)
    inputs = PlanInputs(0, 0, counts_GE.sum(0), free)
    terms = free.rank_terms(LrmoePolicy().plan(counts_GE, inputs))
    fixed = max(t["total"] - t["retained_acts"] for t in terms)
    kept = max(t["retained_acts"] for t in terms)
    policy, _ = make_policy(POLICIES[2], cfg, G, True)
    for f in fractions:
        b = int(fixed + f * kept)
        try:
            policy.plan(counts_GE, PlanInputs(0, 0, counts_GE.sum(0),
                                              Ledger.for_dtype(cfg, G, b, dtype, num_moe_layers=1)))
            return b, f
        except LrmoeError:
            continue
    return None, None


class PlannedPeersComm(OneRankComm):
    """:class:`OneRankComm` whose peers, in the sampled backward's count exchange, send
    this rank what the plan selects for its slots (``select_GGS[:, me]``: the expected
    count of the sampled selection). What this rank sends itself arrives as sent: its
    rows carry real positions inside their blocks, which must land in their own block
    (a planned count there would shift rows across blocks and past the saved ones)."""

    def __init__(self, me: int, peers_GE: torch.Tensor, plan):
        super().__init__(me, peers_GE)
        self.select_GS = plan.select_GGS[:, me, :].clone()

    def exchange_counts(self, counts_GS: torch.Tensor) -> torch.Tensor:
        recv = self.select_GS.to(counts_GS.device, counts_GS.dtype).clone()
        recv[self.rank] = counts_GS[self.rank]
        return recv


def build_rank(cfg, me: int, counts_GE, idx_TK, policy, ledger, opts, device, plan):
    """Rank ``me``'s layer (owned experts only, on ``device``, random weights) whose
    router returns ``idx_TK`` (``plan``: what its policy plans for these counts)."""
    from lrmoe.model.moe import MoELayer
    from onerank import TableRouter, one_rank_layer

    with torch.device("meta"):
        base = MoELayer(cfg, 0)
    layer = one_rank_layer(base, me, counts_GE, policy, ledger, backward=opts).to_empty(device=device)
    layer.runtime.comm = PlannedPeersComm(me, counts_GE, plan)
    layer.runtime.stage_timing = True  # local, select and gather too
    g = torch.Generator(device=device).manual_seed(me)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02, generator=g)
    layer.router = TableRouter(layer.router.weight, idx_TK.to(device))
    layer.prev_counts_E = counts_GE.sum(0)
    return layer


def run_once(layer, x, dy, cuda: bool) -> dict:
    """One synchronised forward + backward: the runtime's recorded stages and the walls."""
    from lrmoe.train.loop import _snapshot_stats

    layer.runtime.stats.clear()
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    if cuda:
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    t0 = time.perf_counter()
    if cuda:
        ev[0].record()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=cuda):
        out = layer(x)
    if cuda:
        ev[1].record()
    t1 = time.perf_counter()
    out.backward(dy)
    if cuda:
        ev[2].record()
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    st = _snapshot_stats(layer.runtime)[0]
    row = {k: st.get(k) for k in STAGES}
    row["wall_ms"] = (t2 - t0) * 1e3
    row["fwd_ms"] = ev[0].elapsed_time(ev[1]) if cuda else (t1 - t0) * 1e3
    row["bwd_ms"] = ev[1].elapsed_time(ev[2]) if cuda else (t2 - t1) * 1e3
    row["_stats"] = st
    return row


def layer_syncs(layer, x, dy) -> dict:
    """Host waits in one forward and one backward."""
    layer.runtime.stats.clear()
    x.grad = None
    torch.cuda.synchronize()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, f = count_syncs(lambda: layer(x))
    b = count_syncs(lambda: out.backward(dy))[1]
    torch.cuda.synchronize()
    layer.runtime.stats.clear()  # drop the unresolved events of this pass
    return {"forward": f, "backward": b}


def measure(cfg, G: int, T: int, spec: str, budget_name: str, budget: int | None,
            idx_NK, counts_GE, dev: torch.device, warmup: int, repeats: int) -> dict:
    from lrmoe.policy.base import PlanInputs

    dtype = "bf16" if dev.type == "cuda" else "fp32"
    policy, opts = make_policy(spec, cfg, G, budget is not None)
    ledger = Ledger.for_dtype(cfg, G, budget, dtype, num_moe_layers=1)
    row = {"policy": spec, "budget": budget_name, "budget_bytes": budget}
    try:
        plan = policy.plan(counts_GE, PlanInputs(0, 0, counts_GE.sum(0), ledger))
    except LrmoeError as e:
        if spec.startswith("lrmoe") or budget is None:
            return {**row, "error": f"no plan: {str(e)[:80]}"}
        # an exact policy over the budget even recomputing every pair: time it unbudgeted
        # (as bench ttl runs it, marked over budget)
        policy, _ = make_policy(spec, cfg, G, False)
        ledger = Ledger.for_dtype(cfg, G, None, dtype, num_moe_layers=1)
        plan = policy.plan(counts_GE, PlanInputs(0, 0, counts_GE.sum(0), ledger))
        row["budget"] = f"{budget_name} (over: ran unbudgeted)"
    me = busiest_rank(plan)
    row.update(rank=me, fwd_rows=int(plan.rank_load()[me]),
               bwd_rows=int(plan.rank_backward_load()[me]), replicas=plan.num_replicas(),
               ledger_rank_bytes=int(ledger.rank_terms(plan)[me]["total"]),
               keep_ratio=float(plan.select_GGS.sum() / plan.assign_GGS.sum().clamp(min=1)),
               retain_ratio=float(plan.retain_GGS.sum() / plan.assign_GGS.sum().clamp(min=1)),
               recompute_rows=0 if plan.recompute_G is None else int(plan.recompute_G[me]))
    layer = build_rank(cfg, me, counts_GE, idx_NK[me * T:(me + 1) * T], policy, ledger, opts, dev,
                       plan)
    H = cfg.hidden_size
    g = torch.Generator(device=dev).manual_seed(1000 + me)
    x = torch.randn(1, T, H, device=dev, generator=g).requires_grad_()
    dy = torch.randn(1, T, H, device=dev, generator=g)
    cuda = dev.type == "cuda"
    samples = [run_once(layer, x, dy, cuda) for _ in range(warmup + repeats)][warmup:]
    row["stages"] = stage_row(samples)
    row["samples"] = [{k: v for k, v in s.items() if k != "_stats"} for s in samples]
    row["runtime_stat_keys"] = sorted(k for k in samples[-1]["_stats"] if k.endswith("_ms"))
    row["syncs"] = layer_syncs(layer, x, dy) if cuda else None
    del layer, x, dy
    if cuda:
        torch.cuda.empty_cache()
    return row


@cli
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for control_plane.json and .md")
    ap.add_argument("--preset", default="qwen3-30b-a3b,glm-4.5-air",
                    help="comma-separated presets (one MoE layer of each)")
    ap.add_argument("--eps", default="8,16,32,64")
    ap.add_argument("--tokens", default="4096,16384", help="tokens per rank, comma-separated")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--budgets", default="ample,binding")
    ap.add_argument("--skew", type=float, default=DEFAULT_SKEW)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from lrmoe.presets import get_preset
    from lrmoe.sim.ttl_config import TTLConfig, policy_variant

    presets = {n: get_preset(n) for n in csv(a.preset)}
    eps, toks = csv(a.eps, int, "--eps"), csv(a.tokens, int, "--tokens")
    specs, budgets = csv(a.policies), csv(a.budgets)
    for s in specs:
        policy_variant(s, TTLConfig())
    for n, c in presets.items():
        if bad := [G for G in eps if G < 2 or c.num_experts % G]:
            raise LrmoeError(f"--eps {bad}: each must be >= 2 and divide {n}'s "
                             f"{c.num_experts} experts")
    if any(t < 1 for t in toks) or a.repeats < 1 or a.warmup < 0:
        raise LrmoeError(f"--tokens {a.tokens} must be >= 1, --repeats {a.repeats} >= 1, "
                         f"--warmup {a.warmup} >= 0")
    if not set(budgets) <= {"ample", "binding"} or not budgets:
        raise LrmoeError(f"--budgets {a.budgets!r}: use ample, binding or both")
    check_device(a.device)
    out = out_dir(a.out)
    dev = torch.device(a.device)
    dtype = "bf16" if dev.type == "cuda" else "fp32"
    meta = run_meta(a.device, argv=argv, dtype=dtype, skew=a.skew, repeats=a.repeats,
                    warmup=a.warmup, binding_fractions=BINDING_FRACTIONS)
    rows, t0 = [], time.perf_counter()
    n_total = len(presets) * len(eps) * len(toks) * len(specs) * len(budgets)
    for pname, cfg in presets.items():
        for G in eps:
            for T in toks:
                idx, counts = routing(G, T, cfg.num_experts, cfg.num_experts_per_tok, a.skew,
                                      a.seed, dev)
                skew = load_skew(counts)
                bind, frac = (binding_budget(cfg, G, counts, dtype) if "binding" in budgets
                              else (None, None))
                for spec in specs:
                    for b in budgets:
                        if b == "binding" and bind is None:
                            rows.append({"preset": pname, "ep": G, "tokens_per_rank": T,
                                         "policy": spec, "budget": b, **skew,
                                         "error": "no binding budget: lrmoe plans in none"})
                            continue
                        budget = None if b == "ample" else bind
                        r = measure(cfg, G, T, spec, b, budget, idx, counts, dev, a.warmup,
                                    a.repeats)
                        r.update(preset=pname, ep=G, tokens_per_rank=T,
                                 binding_fraction=frac, **skew)
                        rows.append(r)
                        s = r.get("stages") or {}
                        print(f"[{len(rows)}/{n_total} {time.perf_counter() - t0:.0f}s] {pname} "
                              f"EP{G} T{T} {spec} {b}: "
                              + (r["error"] if r.get("error") else
                                 f"rank {r['rank']} control {_f(s['control_ms'])} ms, experts "
                                 f"{_f(s['expert_ms'])} ms, wall {_f(s['wall_ms'])} ms"),
                              flush=True)
    meta["wall_s"] = time.perf_counter() - t0
    md = markdown(meta, rows)
    write_outputs(out, "control_plane", meta, rows, md)
    print(md)


if __name__ == "__main__":
    sys.exit(main())
