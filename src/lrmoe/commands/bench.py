"""``lrmoe bench ttl``: time to target loss of static / symi / lrmoe on emulated EP.

Runs :mod:`lrmoe.sim.ttl` and writes ``ttl.json``, ``ttl.md``, the two loss plots and the
routing traces into ``--out`` (a run directory by :mod:`lrmoe.train.rundir`'s rules).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from lrmoe.cli_flags import BENCH, add_policy_flags, check_int, check_policy_flags
from lrmoe.commands.columns import fmt
from lrmoe.commands.train import bytes_or_all
from lrmoe.config import ModelConfig
from lrmoe.errors import require
from lrmoe.train import rundir
from lrmoe.train.checkpoint import atomic_write_text
from lrmoe.units import fmt_bytes


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks on the virtual EP emulator (emulated times)",
                       description=__doc__.splitlines()[0])
    bs = p.add_subparsers(dest="bench", required=True)
    t = bs.add_parser("ttl", help="time to target loss: static vs symi vs lrmoe (emulated)",
                      description=__doc__.splitlines()[0])
    m = t.add_mutually_exclusive_group(required=True)
    m.add_argument("--preset", help="model preset (see `lrmoe presets`)")
    m.add_argument("--config", help="HF config.json file or folder")
    t.add_argument("--ep", type=int, default=4, help="virtual EP ranks G (default 4)")
    _policies_and_budget(t)
    _training(t)
    _target_and_data(t)
    g = t.add_argument_group("policy and memory (lrmoe.cli_flags: the same flags as train "
                             "and plan; a --policies variant such as lrmoe:min_keep=0.8 "
                             "overrides them for that run)")
    add_policy_flags(g, BENCH)
    _execution(t)
    t.set_defaults(func=run)


def _policies_and_budget(t) -> None:
    from lrmoe.sim.ttl_config import VARIANT_OPTIONS

    options = ", ".join(VARIANT_OPTIONS).replace("link_cost", "link_cost=on|off")
    t.add_argument("--policies", default="static,symi,lrmoe",
                   help="comma list of static, symi, lrmoe and lrmoe variants such as "
                        "lrmoe:recompute or lrmoe:min_keep=0.8+estimator=sampled (options: "
                        f"{options}); static always runs: it sets the target")
    t.add_argument("--budget-floor-fraction", type=float, default=None, metavar="X",
                   help="instead of --mem-budget: X (>= 1) times static's whole-layer floor F "
                        "over this run's routing (the largest rank total of static's native "
                        "plan with the whole MoE layer checkpointed, over every step, read "
                        "off a calibration run of static without a budget first), so static "
                        "fits every step by construction; 1.1 is the tight regime of "
                        "RESULTS.md")
    t.add_argument("--budget-retain-fraction", nargs="?", const="", help=argparse.SUPPRESS)


def _training(t) -> None:
    t.add_argument("--steps", type=int, default=100)
    t.add_argument("--batch-size", type=int, default=16,
                   help="global micro-batch (sequences): one forward and backward")
    t.add_argument("--activation-checkpoint", default="none", metavar="none|selective|full",
                   help="as in train; full charges each MoE layer's re-run forward as a "
                        "whole-layer recompute (bwd_recompute), selective's attention re-run "
                        "lands in the measured non-MoE time")
    t.add_argument("--grad-accum", type=int, default=1, metavar="N",
                   help="micro-batches per optimizer step: each step sees N x --batch-size "
                        "sequences; the optimizer (and its offload traffic) is charged once "
                        "a step (default 1)")
    t.add_argument("--seq-len", type=int, default=128)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup", type=int, default=None,
                   help="linear warmup steps (default: 10%% of --steps)")
    t.add_argument("--seed", type=int, default=0)


def _target_and_data(t) -> None:
    t.add_argument("--link", default="nvlink",
                   help="nvlink, ib, pcie or nvlink+ib (NVLink inside nodes of 8, IB between "
                        "them): datasheet peaks at published all-to-all efficiencies "
                        "(lrmoe.sim.links)")
    t.add_argument("--target-fraction", type=float, default=0.8,
                   help="target = static's val loss at this fraction of its run")
    t.add_argument("--target-rtol", type=float, default=1e-5,
                   help="a policy reaches the target at val <= target*(1+rtol) (fp32 noise)")
    t.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    t.add_argument("--data", default=None, help="text, .jsonl or directory, as lrmoe train --data reads "
                   "it: prompt/completion rows train their completions only (default: the "
                   "Python stdlib)")
    t.add_argument("--max-data-bytes", type=bytes_or_all, default=4 * 2**20, metavar="SIZE")
    t.add_argument("--eval-every", type=int, default=10)
    t.add_argument("--eval-batches", type=int, default=4)
    t.add_argument("--smooth-window", type=int, default=3,
                   help="validation curves are smoothed by a centred mean of this many "
                        "evaluations (odd; 1 = raw) before the target and crossings are read")


def _execution(t) -> None:
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    t.add_argument("--compile", action="store_true",
                   help="torch.compile the model as lrmoe train --compile does (all but the "
                        "routed experts; compiled in the untimed warm-up step)")
    t.add_argument("--router-lr-scale", type=float, default=1.0,
                   help="the MoE routers' learning rate as a multiple of --lr, for every "
                        "policy (a wide router's logits move by up to ~lr·|x|_1 a step)")
    t.add_argument("--deterministic", action="store_true",
                   help="torch's deterministic kernels (warn-only) for every policy, so "
                        "repeated runs of a seed repeat each other (default off: GPU atomics "
                        "make them drift)")
    t.add_argument("--no-deterministic-fill", dest="deterministic_fill", action="store_false",
                   help="with --deterministic: skip torch's NaN fill of every new "
                        "uninitialized tensor (a debugging aid, one kernel per allocation; "
                        "runs with and without it are not mixed by --reuse)")
    t.add_argument("--reuse", default=None, metavar="FILE",
                   help="an earlier run's ttl.json or ttl_partial.json with the same settings: "
                        "the policies it finished are taken from it, not run again")
    t.add_argument("--out", required=True, help="output directory")


# why a policy's own rule chose replicas it did not place (Plan.given_up_for)
GIVEN_UP = {"memory": ("for memory", "its slots did not fit the budget even with recompute "
                       "and a whole-layer checkpoint; it placed its most replicas that fit"),
            "link": ("for their link cost", "their weight scatter and gradient reduce on the "
                     "link cost more than the straggler time they remove (modelled)"),
            "static": ("for static's placement", "its modelled step was not faster than on "
                       "static's placement with its trimming, which it took")}


def placement_lines(rep: dict) -> list[str]:
    """Replicas placed per layer-micro-batch on the run's link, and those each policy's
    own rule chose but gave up, with why."""
    pols = {k: r for k, r in rep["policies"].items() if r.get("layer_micro_batches")}
    if not pols:
        return []
    out = ["", f"Replicas on link {rep['link']['name']}:"]
    seen = set()
    for name, r in pols.items():
        n = r["layer_micro_batches"]
        line = f"{name} placed {r['replicas_placed'] / n:.2f} replicas per layer-micro-batch"
        for why, g in r.get("replicas_given_up", {}).items():
            seen.add(why)
            line += (f"; {name} gave up replicas {GIVEN_UP.get(why, (why,))[0]} at "
                     f"{g['layer_micro_batches']} of {n} layer-micro-batches "
                     f"({g['replicas']} in all, at most {g['most_in_one']} in one)")
        out.append(line + ".  ")
    out += [f"({GIVEN_UP[w][0]}: {GIVEN_UP[w][1]}.)  " for w in GIVEN_UP if w in seen]
    return out


def _target_line(rep: dict) -> str:
    """The target, its noise, the link, EP size and budget."""
    tg = rep["target"]
    nz = tg["noise"]
    return (f"Target val loss {tg['val_loss']:.4f} (static's val curve smoothed over "
            f"{tg['smooth_window']} evaluations, at step {tg['static_step']}, fraction "
            f"{tg['fraction']}; one evaluation's std error {fmt(nz['std_error'])} vs smoothed "
            f"change between neighbouring evaluations {fmt(nz['neighbour_change'])}: "
            f"{'below' if nz['ok'] else 'NOT below'} a quarter of it; paired std error of "
            f"the change from the previous evaluation, same batches, "
            f"{fmt(nz.get('paired_std_error'))}: "
            f"{'below' if nz.get('paired_ok') else 'NOT below'} a quarter); "
            f"link {rep['link']['name']}; EP {rep['config']['ep']}"
            f" virtual ranks; budget "
            f"{'none' if rep['budget_bytes'] is None else fmt_bytes(rep['budget_bytes'])}"
            " per rank. Times are emulated.")


def _policy_row(name: str, r: dict) -> str:
    """One policy's row of the summary table."""
    st = r["steps"]
    never = "OOM" if r.get("out_of_memory") else "never"  # its run stopped there

    def mean(key: str, spec: str = ".3f") -> str:
        return format(sum(s.get(key, 0.0) for s in st) / len(st), spec) if st else "-"
    # layer-steps per rung ("plan 236, layer 4"), none without a budget
    rungs = ", ".join(f"{k} {v}" for k, v in r["rungs"].items()) if r.get("rungs") else "-"
    return "| " + " | ".join([
        name, r["config"], r["budget_status"], fmt(r["steps_to_target"], ".1f", never),
        fmt(r["time_to_target_emulated_s"], ".4f", never), f"{r['final_val_loss']:.4f}",
        f"{r['mean_step_emulated_s'] * 1e3:.3f}" if st else "-",
        mean("expert_load_max_over_mean"), mean("fwd_load_max_over_mean"),
        mean("keep_ratio"), mean("recompute_ratio"),
        fmt_bytes(r["ledger_peak_bytes"]) if "ledger_peak_bytes" in r else "-",
        mean("replicas", ".1f"), rungs]) + " |"


def _notes(rep: dict) -> list[str]:
    """What the run's settings change: symi without replicas, the router gradient at
    the experts, steps that compiled, host optimizer offload."""
    lines = []
    sy = rep["policies"].get("symi")
    if sy is not None and sy["steps"] and not any(s["replicas"] for s in sy["steps"]):
        E, G = ModelConfig.from_hf_dict(rep["model"]).num_experts, rep["config"]["ep"]
        lines += ["", f"**SYMI ran with no replicas (s = E/G = {E // G})**: it was static EP"
                      + (" with recompute" if rep["budget_bytes"] is not None else "") + "."]
    if rep["config"].get("router_grad") == "experts":
        lines += ["", "static and symi take the router gradient at the experts "
                      "(--router-grad experts): their expert backward computes each pair's "
                      "<dy, y> and ships it home beside dx (4 bytes per row in bwd_combine), "
                      "so they keep no combined expert outputs (ledger combine_rows 0: less "
                      "recompute, room for more symi slots); lrmoe keeps them (router "
                      "gradient at home), as with --router-grad home."]
    compiled = {n: [s["step"] for s in r["steps"] if s.get("compiles")]
                for n, r in rep["policies"].items()}
    if any(compiled.values()):
        lines += ["", "Steps that compiled (a one-off cost inside their measured times): "
                      + "; ".join(f"{n} {', '.join(map(str, c)) or 'none'}"
                                  for n, c in compiled.items()) + "."]
    if rep["config"].get("optimizer_offload") == "host":
        lines += ["", "Every policy keeps the experts' optimizer state in host memory "
                      "(--optimizer-offload host); opt_d2h, opt_host_update and opt_h2d are "
                      "modelled: " + rep.get("offload_model", "")]
    return lines


def _stage_table(rep: dict) -> list[str]:
    """Mean emulated ms per step by stage, one row per policy."""
    lines = ["",
             "Mean emulated ms per step by stage (slowest virtual rank per stage, summed "
             "over MoE layers; non_moe = measured / G). Measured per rank: plan (the "
             "policy's planning, charged to every rank), local, select, gather and the "
             "expert kernels; modelled from bytes: count_exchange and the exchanges; "
             "bwd_recompute: per-row recompute modelled from the forward kernels, a "
             "whole-layer checkpoint's re-run measured (its exchanges from bytes):", ""]
    stages = list(next(iter(rep["policies"].values()))["steps"][0]["stages_emulated_s"])
    lines += ["| policy | " + " | ".join(stages + ["non_moe", "total"]) + " |",
              "|" + "---|" * (len(stages) + 3)]
    for name, r in rep["policies"].items():
        st, n = r["steps"], max(len(r["steps"]), 1)
        vals = [sum(s["stages_emulated_s"][k] for s in st) / n for k in stages]
        vals += [sum(s["non_moe_s"] for s in st) / n, r["mean_step_emulated_s"]]
        lines.append(f"| {name} | " + " | ".join(f"{v * 1e3:.3f}" for v in vals) + " |")
    return lines


def table(rep: dict) -> str:
    """``ttl.md``'s body: the target, one row per policy, the ratios, the placements,
    the notes and the stage table."""
    head = ["policy", "config", "budget", "steps→target", "time→target (emulated s)",
            "final val", "mean step (emulated ms)", "expert load max/mean",
            "rank load max/mean", "keep ratio", "recompute ratio", "ledger peak",
            "replicas per step (all MoE layers)", "rungs (layer-steps)"]
    lines = [_target_line(rep), "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [_policy_row(name, r) for name, r in rep["policies"].items()]
    lines.append("")
    for name, ratio in rep["ratios_over_symi_time_to_target_emulated"].items():
        shown = ratio if isinstance(ratio, str) else fmt(ratio, ".3f", "n/a")  # or OOM
        lines.append(f"{name} / symi emulated time-to-target: {shown}  ")
    return "\n".join(lines + placement_lines(rep) + _notes(rep) + _stage_table(rep))


def plots(rep: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key, xlabel, fname in (("cum_emulated_s", "cumulative step time (emulated, s)",
                                "ttl_loss_vs_time.png"),
                               ("step", "step", "ttl_loss_vs_step.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, (name, r) in enumerate(rep["policies"].items()):
            c = f"C{i}"
            ax.plot([s[key] for s in r["steps"]], [s["train_loss"] for s in r["steps"]],
                    color=c, alpha=0.35, lw=1, label=f"{name} train")
            ax.plot([e[key] for e in r["evals"]], [e["val_loss"] for e in r["evals"]],
                    color=c, marker="o", lw=2, label=f"{name} val")
        ax.axhline(rep["target"]["val_loss"], color="k", ls="--", lw=1, label="target")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss")
        ax.set_title(f"time to target, EP {rep['config']['ep']} virtual ranks, "
                     f"{rep['link']['name']} (emulated)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)


# the policy flags whose settings ttl.json records under their older, shorter names
RECORDED_AS = {"lrmoe_min_keep": "min_keep", "lrmoe_balance": "balance",
               "lrmoe_estimator": "estimator"}


def run(args: argparse.Namespace) -> int:
    from lrmoe.sim.ttl import bench_ttl
    from lrmoe.sim.ttl_config import TTLConfig, check_ttl_config, recorded_settings

    # its budget (a fraction of a balanced static rank) left static out of memory at skewed steps
    require(args.budget_retain_fraction is None,
            "--budget-retain-fraction was replaced by --budget-floor-fraction X: the budget is "
            "X (>= 1) times static's whole-layer floor over the run's routing, which static "
            "fits at every step (e.g. --budget-floor-fraction 1.1)")
    check_policy_flags({k: getattr(args, k) for k in BENCH})
    known = TTLConfig().flat()
    flat = {RECORDED_AS.get(k, k): v for k, v in vars(args).items()
            if RECORDED_AS.get(k, k) in known}
    flat["policies"] = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    if args.warmup is None:
        flat["warmup"] = max(1, args.steps // 10)
    cfg = TTLConfig.from_flat(**flat)
    check_ttl_config(cfg)  # before --out is touched
    check_int("threads", args.threads, 1, allow_none=True)
    require(args.device != "cuda" or torch.cuda.is_available(),
            "--device cuda: no CUDA device is available")
    out = Path(args.out)
    rundir.check_bench_out(out, args.reuse is not None)  # reads only: before any work
    was_empty = not out.exists() or not any(out.iterdir())
    created = rundir.take(out)
    threads = torch.get_num_threads()
    done: dict = {}
    try:
        rundir.check_bench_out(out, args.reuse is not None)  # again, under the lock
        rundir.mark(out, rundir.BENCH_MARKER, "lrmoe bench ttl")
        if args.threads:
            torch.set_num_threads(args.threads)

        def save_partial(name: str, res: dict) -> None:
            """Each finished policy's raw result, so a run cut short keeps what it made."""
            done[name] = {k: v for k, v in res.items() if k != "routing_trace"}
            atomic_write_text(out / "ttl_partial.json", json.dumps(
                {"label": "emulated (partial: policies finished so far)",
                 "config": recorded_settings(cfg), "policies": done}))

        rep = bench_ttl(cfg, log=lambda m: print(m, file=sys.stderr, flush=True),
                        on_policy=save_partial)
        _write_outputs(rep, out)
    except BaseException:
        rundir.give_up(out, created and not done)  # a new --out with nothing in it goes
        if was_empty and not done:  # an empty --out is left empty
            (out / rundir.BENCH_MARKER).unlink(missing_ok=True)
        raise
    finally:
        rundir.release_lock(out)
        torch.set_num_threads(threads)
    print(table(rep))
    return 0


def _write_outputs(rep: dict, out: Path) -> None:
    """ttl.json, ttl.md, the plots and a routing trace per policy run here, each
    written whole (temporary file, then rename)."""
    for name, r in rep["policies"].items():
        if "routing_trace" not in r:  # reused (--reuse): its trace stays with the run that made it
            continue
        trace = {"label": f"routing trace of lrmoe bench ttl, policy {name}",
                 "model": rep["model"], "ep": rep["config"]["ep"],
                 "tokens_per_rank": rep["config"]["batch_size"] * rep["config"]["seq_len"]
                 // rep["config"]["ep"],
                 "format": "steps[step][moe_layer][expert] = global pairs routed",
                 "steps": r.pop("routing_trace")}
        # a policy spec (lrmoe:min_keep=0.8) as a file-name part (lrmoe_min_keep-0.8)
        safe = name.replace("=", "-").replace(":", "_").replace("+", "_")
        atomic_write_text(out / f"routing_trace_{safe}.json", json.dumps(trace))
    atomic_write_text(out / "ttl.json", json.dumps(rep, indent=1))
    (out / "ttl_partial.json").unlink(missing_ok=True)
    atomic_write_text(out / "ttl.md", "# Time to target loss (emulated)\n\n" + table(rep) + "\n")
    plots(rep, out)
