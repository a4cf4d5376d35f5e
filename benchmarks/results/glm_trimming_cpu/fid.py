"""Analysis only (not a library mode): where does lrmoe's loss gap come from?

Trains the tiny GLM config as `bench ttl` does (same data, batches, optimizer, schedule,
seed, VirtualModel over G virtual ranks) in one of these modes:
  static   exact gradients (StaticPolicy through the emulator)
  lrmoe    lrmoe's trimmed backward (dropped pairs: no dW, no dX)   [= bench ttl's lrmoe]
  dw_only  expert weight grads trimmed, everything else exact (dX of dropped pairs kept)
  dx_only  expert weight grads exact, everything else trimmed (dX of dropped pairs missing)
Every step of the three non-static modes also runs the exact backward on the same
weights and batch (the model's own one-process forward) and records the fidelity:
cosine and norm ratio of the trimmed vs exact expert weight gradient (the single MoE
layer is the last one, so its output gradient is exact: design §4's monitor), and of
the upstream gradient (params below the MoE layer's output, which see its dX).
"""
import argparse, json, math, sys, time
import torch
from lrmoe.data import PackedBatches, build_token_streams, load_corpus, validation_batches
from lrmoe.model import MoEForCausalLM
from lrmoe.parallel.exchange import BackwardOptions
from lrmoe.policy.lrmoe import LrmoeConfig
from lrmoe.policy.registry import PolicyConfig, make_policy
from lrmoe.sim.ttl import _val_eval
from lrmoe.sim.vmodel import VirtualModel
from lrmoe.tokenizer import load_tokenizer
from lrmoe.train.config import TrainConfig, resolve_model_config
from lrmoe.train.loop import val_windows
from lrmoe.train.optim import build_optimizer, build_scheduler

ap = argparse.ArgumentParser()
ap.add_argument("--config", required=True)
ap.add_argument("--mode", required=True, choices=["static", "lrmoe", "dw_only", "dx_only"])
ap.add_argument("--ep", type=int, default=4)
ap.add_argument("--steps", type=int, default=150)
ap.add_argument("--batch-size", type=int, default=32)
ap.add_argument("--seq-len", type=int, default=128)
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--max-slots", type=int, default=None)
ap.add_argument("--min-keep", type=float, default=0.5)
ap.add_argument("--estimator", default="topk")
ap.add_argument("--eval-every", type=int, default=10)
ap.add_argument("--out", required=True)
a = ap.parse_args()
torch.set_num_threads(1)
G = a.ep
tc = TrainConfig(config=a.config)
corpus = load_corpus(None, max_bytes=4 * 2**20)
tok = load_tokenizer("byte", None, corpus.train_texts)
train_ids, val_ids = build_token_streams(corpus, tok)
mcfg = resolve_model_config(tc, vocab_size=tok.vocab_size)
batches = PackedBatches(train_ids, a.seq_len, a.batch_size, a.seed)
k = val_windows(val_ids.numel(), a.seq_len, a.batch_size, 4, 1)
val_b = validation_batches(val_ids, a.seq_len, a.batch_size, num_windows=k)
dev = torch.device("cpu")
name = "static" if a.mode == "static" else "lrmoe"
pc = PolicyConfig(name=name, slots_per_rank=a.max_slots if name == "lrmoe" else None,
                  lrmoe=LrmoeConfig(min_keep=a.min_keep))
policy = make_policy(pc, mcfg, G)
torch.manual_seed(a.seed)
model = MoEForCausalLM(mcfg).to(dev)
vm = VirtualModel(model, G, policy, BackwardOptions(estimator=a.estimator), None, lambda: None)
opt = build_optimizer(model, a.lr, 0.1, offload="device", host=dev)
sched = build_scheduler(opt, max(1, a.steps // 10), a.steps, 0.1)
moe_names = {f"layers.{i}.mlp.{p}" for i in mcfg.moe_layers for p in ("experts.gate_up_proj", "experts.down_proj")}
top = max(mcfg.moe_layers)
exact_names = {n for n, _ in model.named_parameters()
               if n.startswith(("lm_head", "norm.")) or n.startswith(f"layers.{top}.mlp.")}
up_names = {n for n, _ in model.named_parameters() if n not in exact_names}
null = lambda: __import__("contextlib").nullcontext()
evals = [{"step": 0, **_val_eval(model, val_b, dev, null)}]
rows = []
t0 = time.time()

def flat(gr, names):
    return torch.cat([gr[n].flatten() for n in sorted(names)]).double()

def cos_ratio(a_, b_):
    return float(torch.nn.functional.cosine_similarity(a_, b_, dim=0)), float(a_.norm() / b_.norm())

for step in range(a.steps):
    vm.set_step(step)
    batch = batches.batch(step)
    rec = {"step": step + 1}
    exact = None
    if a.mode != "static":  # the exact backward on the same weights and batch
        model.eval()
        opt.zero_grad(set_to_none=True)
        model.loss(batch[:, :-1], batch[:, 1:])[1].backward()
        exact = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.train()
    opt.zero_grad(set_to_none=True)
    lm, obj = model.loss(batch[:, :-1], batch[:, 1:])
    obj.backward()
    if exact is not None:
        trim = {n: p.grad.clone() for n, p in model.named_parameters()}
        rec["cos_dw"], rec["norm_dw"] = cos_ratio(flat(trim, moe_names), flat(exact, moe_names))
        rec["cos_up"], rec["norm_up"] = cos_ratio(flat(trim, up_names), flat(exact, up_names))
        swap = moe_names if a.mode == "dx_only" else (up_names if a.mode == "dw_only" else set())
        for n, p in model.named_parameters():
            if n in swap:
                p.grad.copy_(exact[n])
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    model.end_step()
    st = [v.stats for v in vm.layers]
    rec["train_loss"] = float(lm.detach())
    rec["keep"] = sum(int(s.plan.select_GGS.sum()) for s in st) / sum(int(s.plan.assign_GGS.sum()) for s in st)
    rec["loadmax"] = sum(float(c.max() / c.double().mean()) for c in vm.counts_E) / len(vm.counts_E)
    vm.counts_E, vm.counts_GE = [], []
    rows.append(rec)
    if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
        evals.append({"step": step + 1, **_val_eval(model, val_b, dev, null)})
        print(f"[{a.mode}] {step+1} val {evals[-1]['val_loss']:.4f} keep {rec['keep']:.3f} "
              f"cos_dw {rec.get('cos_dw', 1):.4f} cos_up {rec.get('cos_up', 1):.4f} {time.time()-t0:.0f}s", flush=True)
json.dump({"args": vars(a), "evals": evals, "steps": rows}, open(a.out, "w"))
