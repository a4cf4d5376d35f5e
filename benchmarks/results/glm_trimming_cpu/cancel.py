"""One step's anatomy of the hot expert's down_proj gradient (slow-bias tiny GLM, seed 1):
train static N steps, then on the next batch compare exact vs lrmoe-trimmed (topk) gradient
of the hottest expert, and how much its per-pair contributions cancel."""
import sys, torch
sys.argv = [sys.argv[0], "--config", "/tmp/glm/tiny-glm-slowbias.json", "--mode", "static", "--seed", "1",
            "--steps", sys.argv[1] if len(sys.argv) > 1 else "40", "--out", "/tmp/glm/cancel_train.json"]
exec(open("/tmp/glm/fid.py").read())  # trains static for --steps (model, vm, batches in scope)
from lrmoe.policy.registry import PolicyConfig, make_policy
batch = batches.batch(a.steps)
m = model.moe_layers[0]
F = mcfg.moe_intermediate_size
# exact pass, with the MoE layer's input and output gradient captured
cap = {}
orig = m.forward.__closure__  # wrapped; eval path calls the layer's own forward
model.eval()
h1 = m.register_forward_hook(lambda mod, i, o: cap.update(x=i[0].detach().reshape(-1, i[0].shape[-1])))
h2 = m.register_full_backward_hook(lambda mod, gi, go: cap.update(dy=go[0].detach().reshape(-1, go[0].shape[-1])))
opt.zero_grad(set_to_none=True)
model.loss(batch[:, :-1], batch[:, 1:])[1].backward()
h1.remove(); h2.remove()
exact = m.experts.down_proj.grad.clone()
# trimmed pass: lrmoe (max slots 9) through the emulator on the same weights and batch
pol = make_policy(PolicyConfig(name="lrmoe", slots_per_rank=9, lrmoe=LrmoeConfig()), mcfg, G)
for v in vm.layers: v.policy = pol
model.train(); opt.zero_grad(set_to_none=True)
model.loss(batch[:, :-1], batch[:, 1:])[1].backward()
trim = m.experts.down_proj.grad.clone()
st = vm.layers[0].stats
print("keep", float(st.plan.select_GGS.sum() / st.plan.assign_GGS.sum()))
with torch.no_grad():
    r = m.router(cap["x"])
    cnt = torch.bincount(r.idx_TK.flatten(), minlength=mcfg.num_experts)
    e = int(cnt.argmax())
    tok, k = torch.nonzero(r.idx_TK == e, as_tuple=True)
    g = r.gate_TK[tok, k]
    gu = cap["x"][tok] @ m.experts.gate_up_proj[e].t()
    h = torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]
    contrib = g[:, None, None] * cap["dy"][tok][:, :, None] * h[:, None, :]  # [n, H, F]
    tot = contrib.sum(0)
    print(f"hot expert {e}: {cnt[e]} of {cap['x'].shape[0]} tokens; exact down_proj grad matches "
          f"per-pair sum: {float((tot - exact[e]).norm() / exact[e].norm()):.1e}")
    print(f"  ||sum of pairs|| / sum of ||pair|| = {float(tot.norm() / contrib.flatten(1).norm(dim=1).sum()):.4f}")
    D = exact[e] - trim[e]
    cos = lambda u, w: float(torch.nn.functional.cosine_similarity(u.flatten(), w.flatten(), dim=0))
    print(f"  dropped part: ||D||/||exact|| = {float(D.norm() / exact[e].norm()):.3f}, cos(D, exact) = {cos(D, exact[e]):.3f}, "
          f"cos(trimmed, exact) = {cos(trim[e], exact[e]):.3f}, ||trimmed||/||exact|| = {float(trim[e].norm()/exact[e].norm()):.3f}")
    # a random drop of the same number of this expert's pairs, unweighted and HT-weighted
    n_drop = None
    metric = g * cap["dy"][tok].norm(dim=1)
    for frac in (0.1, 0.2):
        nd = int(frac * len(tok))
        low = torch.argsort(metric)[:nd]
        rnd = torch.randperm(len(tok), generator=torch.Generator().manual_seed(0))[:nd]
        for nm, idx in (("lowest-metric", low), ("random", rnd)):
            kept = tot - contrib[idx].sum(0)
            print(f"  drop {frac:.0%} {nm:13s}: cos(kept, exact) = {cos(kept, tot):.3f}, ||dropped||/||exact|| = {float(contrib[idx].sum(0).norm() / tot.norm()):.3f}")
