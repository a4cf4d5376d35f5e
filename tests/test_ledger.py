"""The memory ledger: byte sizes, formulas against real tensors, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError
from lrmoe.ledger import BackwardRows, Ledger, recompute_bounds
from lrmoe.policy.plan_numpy import full_plan
from lrmoe.units import fmt_bytes, parse_bytes
from references.plans import native_placement

GiB = 2**30


@pytest.mark.parametrize("text, want", [
    ("40GiB", 40 * GiB), ("123456", 123456), ("1.5GB", 1_500_000_000),
    ("512 MiB", 512 * 2**20), ("2k", 2048), ("3kb", 3000), ("1TiB", 2**40),
    ("7B", 7), ("1e3", 1000), ("0.5gib", GiB // 2), (1024, 1024),
    # every unit of the table, and the largest size below 2^63 bytes
    ("3m", 3 * 2**20), ("2g", 2 * GiB), ("1t", 2**40), ("4mb", 4 * 10**6), ("2tb", 2 * 10**12),
    ("1kib", 1024), ("2mib", 2 * 2**20), ("8388607TiB", 8388607 * 2**40),
])
def test_parse_bytes(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize("bad", ["", "abc", "-5GiB", "0", "5XB", "nan", "GiB", "1.5.2GB",
                                 "0.1", 0, -3, True, "8388608TiB", "1e19", "inf"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(LrmoeError, match="memory size"):
        parse_bytes(bad)


def test_fmt_bytes():
    assert fmt_bytes(41.25 * GiB) == "41.2 GiB"
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(-1.5 * 2**20) == "-1.5 MiB"
    assert fmt_bytes(3 * 2**40) == "3.0 TiB" and fmt_bytes(2**40 - 2**30) == "1023.0 GiB"
    assert fmt_bytes(1023) == "1023 B" and fmt_bytes(1024) == "1.0 KiB"


def actual_param_bytes(tensors) -> int:
    """Bytes held by the given tensors, each counted once."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def _cfg(**kw) -> ModelConfig:
    base = dict(hidden_size=32, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    base.update(kw)
    return ModelConfig(**base)


def test_owned_state_matches_adamw_tensors():
    """Owner bytes = fp32 master + fp32 grad + AdamW exp_avg/exp_avg_sq, really allocated."""
    cfg = _cfg()
    G = 4
    led = Ledger(cfg, G, num_moe_layers=1)
    H, F = cfg.hidden_size, cfg.moe_intermediate_size
    params = []
    for _ in range(cfg.num_experts // G):
        params.append(torch.nn.Parameter(torch.randn(2 * F, H)))  # gate_up_proj
        params.append(torch.nn.Parameter(torch.randn(H, F)))  # down_proj
    opt = torch.optim.AdamW(params, lr=1e-3)
    sum((p * p).sum() for p in params).backward()
    opt.step()
    state = [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
    actual = actual_param_bytes(params + [p.grad for p in params] + state)
    assert actual == led.owner_bytes()  # one layer
    assert Ledger(cfg, G, num_moe_layers=5).owner_bytes() == 5 * actual
    assert Ledger(cfg, G).L == len(cfg.moe_layers)


@pytest.mark.parametrize("dtype, nbytes", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_instance_and_activation_bytes(dtype, nbytes):
    cfg = _cfg()
    led = Ledger(cfg, 2, bytes_w=nbytes, bytes_act=nbytes, num_moe_layers=1)
    H, F = cfg.hidden_size, cfg.moe_intermediate_size
    w = [torch.zeros(2 * F, H, dtype=dtype), torch.zeros(H, F, dtype=dtype)]
    g = [torch.zeros_like(t) for t in w]
    assert actual_param_bytes(w + g) == led.P
    n = 7  # retained pairs: the input rows and the gate_up pre-activations
    x = torch.randn(n, H, dtype=dtype)
    gate_up = x @ w[0].T
    assert actual_param_bytes([x, gate_up]) == n * led.A


def test_backward_rows_carry_their_index_bytes():
    """Per backward row the expert backward holds 20 bytes of indices and scales, 16 more
    when the saved rows are gathered (docs/design.md §5): where the backward is the peak,
    the plan's buffers are its largest point plus 20 or 36 bytes per row."""
    cfg = _cfg()
    led = Ledger(cfg, 1, num_moe_layers=1)
    R, h = 64, 16
    T = -(-h // cfg.num_experts_per_tok)
    fwd = max(led.forward_points(T, R, h, R, 0, h).values()) * led.bytes_act
    for n, gathered, per_row in ((R, False, 20), (R - 4, True, 36)):
        back = max(led.backward_points(T, n, h, R, 0, h, gathered).values()) * led.bytes_act
        assert back + per_row * n > fwd  # the backward is the peak
        assert led.rows_buffer_bytes(R, h, R, 0, BackwardRows(n, h, gathered)) == back + per_row * n


def test_kept_terms_are_per_home_pair_and_per_layer():
    """combine_rows (y_send, for the router gradient) and pair_index are kept for every
    home pair whatever is retained, and count once per MoE layer."""
    cfg = _cfg()
    H = cfg.hidden_size
    led = Ledger(cfg, 2, bytes_w=2, bytes_act=2, num_moe_layers=3)
    t = led.terms(4, 10, 6, 0)
    assert t["combine_rows"] == 3 * 6 * H * 2
    assert t["pair_index"] == 3 * 6 * (4 + 3 * 8)
    assert led.terms(4, 10, 6, 10)["combine_rows"] == t["combine_rows"]
    assert t["total"] == sum(v for k, v in t.items() if k != "total")


def exact_plan_buffers(T: int, R: int, h: int, H: int, F: int, b: int) -> int:
    """Hand count of one layer's transients on a rank of an exact plan (every received
    row retained and in backward, nothing recomputed, the router gradient at home): the
    row elements alive at each step of the forward and backward, written out tensor by
    tensor, minus the rows the layer keeps for backward (x ``R·H``, gate_up ``R·2F``,
    combined rows ``h·H``, counted in their own terms); the largest, in bytes ``b`` per
    element, plus the expert backward's indices and scales (int64 + int64 + fp32 per
    received row). T home tokens, R received and h home pairs."""
    kept = R * H + R * 2 * F + h * H
    x, gu, act, y_R, y_h, out = R * H, R * 2 * F, R * F, R * H, h * H, T * H
    fwd = {  # the layer input (T·H) throughout
        "dispatch": T * H + h * H + R * H,              # rows sent, rows received (x)
        "experts": T * H + x + gu + act + y_R,          # x, gate_up, act, y
        "unpermute": T * H + x + gu + 2 * y_R,          # y in instance and arrival order
        "ship": T * H + x + gu + y_R + y_h,             # y sent and arrived home
        "combine": T * H + x + gu + y_h + out,          # the layer output
    }
    bwd = {  # the output gradient (T·H) throughout; the combined rows until the router grad
        "router_grad": T * H + kept,
        "ship": T * H + x + gu + h * H + R * H,         # dout rows sent and arrived
        "permute": T * H + x + gu + 2 * R * H,          # arrived, and in instance order
        "dw2": T * H + x + gu + R * H + act,            # x, gate_up, dy, act
        "dgate_up": T * H + x + gu + act + gu,          # x, gate_up, dact, dgate_up
        "dx_home": T * H + h * H + out,                 # dx home and combined
    }
    return max(max(fwd.values()) * b, max(bwd.values()) * b + R * (8 + 8 + 4)) - kept * b


def test_rank_terms_and_check():
    """Every term of an exact plan from the shapes and dtypes (bf16 instances and
    activations, fp32 optimizer state, 3 MoE layers)."""
    cfg = _cfg()
    G, E, L, K = 2, cfg.num_experts, 3, cfg.num_experts_per_tok
    H, F = cfg.hidden_size, cfg.moe_intermediate_size
    expert = 2 * F * H + H * F  # gate_up_proj [2F, H] + down_proj [H, F] parameters
    led = Ledger(cfg, G, bytes_w=2, bytes_act=2, num_moe_layers=L)
    counts = torch.tensor([[5, 0, 3, 1, 0, 0, 2, 9], [1, 1, 1, 1, 4, 4, 4, 4]])
    plan = full_plan(counts, native_placement(G, E))
    terms = led.rank_terms(plan)
    recv = counts.sum(0).reshape(G, E // G).sum(1)  # natives only: an owner receives its pairs
    for r in range(G):
        t, R, h = terms[r], int(recv[r]), int(counts[r].sum())
        want = {
            "owned_state": L * (E // G) * expert * (4 + 4 + 4 + 4),  # master, grad, 2 moments
            "instance_weights": L * (E // G) * expert * 2,
            "instance_grads": L * (E // G) * expert * 2,
            "buffers": exact_plan_buffers(-(-h // K), R, h, H, F, 2),  # once, not per layer
            "retained_acts": L * R * (H + 2 * F) * 2,  # input row + gate_up row per pair
            "combine_rows": L * h * H * 2,
            "pair_index": L * h * (4 + 3 * 8),  # gate fp32 + three int64 indices
        }
        for k, v in want.items():
            assert t[k] == v, f"rank {r} {k}: ledger {t[k]}, by hand {v}"
        assert t["total"] == sum(want.values()), f"rank {r}: total {t['total']}"

    worst = max(t["total"] for t in terms)
    Ledger(cfg, G, worst, 2, 2, 3).check(plan)  # exactly at budget fits
    with pytest.raises(LrmoeError) as ei:
        Ledger(cfg, G, worst - 1000, 2, 2, 3).check(plan)
    msg = str(ei.value)
    r = max(range(G), key=lambda r: terms[r]["total"])
    assert f"rank {r} needs" in msg and "short by" in msg and "budget" in msg
    largest = max(("owned_state", "instance_weights", "instance_grads", "buffers",
                   "retained_acts"), key=lambda k: terms[r][k])
    assert msg.split(": ")[2].startswith(largest)


def test_feasible_minimum():
    """Before any pair is routed: the natives' weights and state, each home's kept rows
    for its routed tokens, nothing retained."""
    cfg = _cfg()
    G, E, K = 4, cfg.num_experts, cfg.num_experts_per_tok
    H, F = cfg.hidden_size, cfg.moe_intermediate_size
    led = Ledger(cfg, G, num_moe_layers=2)
    mins = led.feasible_minimum(tokens_per_rank_home=10)
    assert len(mins) == G
    for t in mins:  # fp32, 2 layers
        assert t["instance_weights"] == 2 * (E // G) * 3 * H * F * 4
        assert t["owned_state"] == 2 * (E // G) * 3 * H * F * 16
        assert t["retained_acts"] == 0
        assert t["combine_rows"] == 2 * 10 * K * H * 4
        assert t["pair_index"] == 2 * 10 * K * (4 + 3 * 8)
    none = led.feasible_minimum()
    assert none[0]["buffers"] == none[0]["combine_rows"] == none[0]["pair_index"] == 0


def test_ledger_rejects_bad_fields():
    cfg = _cfg()
    with pytest.raises(LrmoeError, match="not divisible"):
        Ledger(cfg, 3)
    for G in (0, -2, 2.0):
        with pytest.raises(LrmoeError, match=f"EP size G={G!r} must be >= 1"):
            Ledger(cfg, G)
    with pytest.raises(LrmoeError, match="bytes_w"):
        Ledger(cfg, 2, bytes_w=3)
    with pytest.raises(LrmoeError, match="dtype"):
        Ledger.for_dtype(cfg, 2, None, "fp8")
    assert Ledger.for_dtype(cfg, 2, None, "bf16").bytes_act == 2


def test_recompute_bounds_against_brute_force():
    """Pieces ``a + d·rec <= B`` on small random integers, rising, falling and flat slopes:
    some ``1 <= rec <= k`` fits exactly when a search over every count finds one, and the
    fewest is the first it finds."""
    rng = np.random.default_rng(0)
    for _ in range(400):
        P = int(rng.integers(1, 4))
        a = rng.integers(-20, 21, (3, P))
        d = rng.integers(-4, 5, (3, P))
        k = rng.integers(0, 9, 3)
        B = int(rng.integers(-5, 15))
        ok, lo = recompute_bounds(B, a, d, k)
        for i in range(3):
            fit = [r for r in range(1, int(k[i]) + 1) if (a[i] + d[i] * r <= B).all()]
            assert bool(ok[i]) == bool(fit), (B, a[i], d[i], k[i])
            if fit:
                assert int(lo[i]) == fit[0], (B, a[i], d[i], k[i])


def test_recompute_needed_is_the_fewest_pairs_that_fit():
    """The total is not monotone in the recomputed count (recomputing frees a pair's
    gate_up rows on every layer, but the backward's rebuild points grow with it), so the
    ledger's interval arithmetic is checked against a brute force over every count, for
    both accounts (exact and trimmed plans), for budgets across the whole range."""
    cfg = _cfg()
    G = 2
    led0 = Ledger(cfg, G)
    n_inst, recv, home, kept = 4, 50, 40, 50
    assert led0.A_recompute == cfg.hidden_size * 4
    g = torch.Generator().manual_seed(0)
    for exact in (True, False):
        tot = [led0.terms(n_inst, recv, home, kept, m, exact)["total"] for m in range(kept + 1)]
        assert tot[kept] < tot[0]  # recomputing everything does help here (L = 3)
        lo, hi = min(tot) - 50, tot[0] + 50
        for budget in torch.randint(lo, hi + 1, (40,), generator=g).tolist() + [min(tot)]:
            led = Ledger(cfg, G, budget)
            n = led.recompute_needed(n_inst, recv, home, kept, exact)
            want = next((m for m, t in enumerate(tot) if t <= budget), -1)
            assert n == want, (exact, budget, n, want)
        assert Ledger(cfg, G, tot[0]).recompute_needed(n_inst, recv, home, kept, exact) == 0
    assert led0.recompute_needed(n_inst, recv, home, kept) == 0  # no budget
    with pytest.raises(LrmoeError, match="recomputed_pairs"):
        led0.terms(n_inst, recv, home, kept, kept + 1)


def test_exact_fit_modes():
    """fits -> pairs (fewest gate_up recomputes per rank) -> layer (no retained
    activations, every received row re-run) -> over, as the budget shrinks."""
    cfg = _cfg()
    G, E = 2, cfg.num_experts
    counts = torch.tensor([[30, 1, 1, 1, 9, 1, 1, 1], [25, 2, 0, 1, 3, 1, 1, 1]])
    plan = full_plan(counts, native_placement(G, E))
    free = Ledger(cfg, G)
    plain = free.rank_terms(plan)
    recv = plan.assign_GGS.sum(dim=(0, 2)).tolist()
    # the least any recompute count needs (not monotone in the count: see above)
    full_rec = [min(free.terms(4, recv[r], int(counts[r].sum()), recv[r], m, True)["total"]
                    for m in range(recv[r] + 1)) for r in range(G)]
    none_kept = [free.layer_terms(4, recv[r], int(counts[r].sum()))["total"]
                 for r in range(G)]  # the whole-layer checkpoint (Ledger.layer_terms)
    assert Ledger(cfg, G, max(t["total"] for t in plain)).exact_fit(plan)[:2] == ("fits", [0, 0])
    # rank 0 (hot) over, rank 1 fits: only rank 0 recomputes, the fewest pairs
    assert plain[0]["total"] > max(full_rec[0], plain[1]["total"])
    budget = (plain[0]["total"] + max(full_rec[0], plain[1]["total"])) // 2
    led = Ledger(cfg, G, budget)
    mode, rec, terms = led.exact_fit(plan)
    # the fewest recomputed pairs whose total fits, rank by rank (a brute force)
    fewest = [next(m for m in range(recv[r] + 1) if free.terms(
        4, recv[r], int(counts[r].sum()), recv[r], m, True)["total"] <= budget) for r in range(G)]
    assert rec == fewest, f"recomputed pairs {rec}, fewest that fit {fewest}"
    assert mode == "pairs" and rec[0] > 0 and rec[1] == 0 and terms[1] == plain[1]
    assert max(t["total"] for t in terms) <= budget
    # below what recomputing every pair allows, but above the layer checkpoint's need
    led = Ledger(cfg, G, (max(full_rec) + max(none_kept)) // 2)
    mode, rows, terms = led.exact_fit(plan)
    assert mode == "layer" and rows == recv
    assert all(t["retained_acts"] == t["combine_rows"] == 0 for t in terms)
    assert max(t["total"] for t in terms) <= led.budget_bytes
    assert Ledger(cfg, G, max(none_kept)).exact_fit(plan)[0] == "layer"  # to the byte
    assert Ledger(cfg, G, max(none_kept) - 1).exact_fit(plan)[0] == "over"


def test_a_ranks_home_pairs_include_those_its_plan_dropped():
    """A capacity plan drops pairs over each expert's capacity; the home's buffers still
    hold every pair its router chose, so the ledger's home pairs are the rank's routed
    pairs, and its received pairs are the kept ones that reach it."""
    from lrmoe.ledger import plan_counts
    from lrmoe.policy.capacity import plan_capacity

    g = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 40, (4, 8), generator=g)
    counts[:, 0] += 200  # one hot expert, over its capacity
    plan = plan_capacity(counts, 0.8)
    assert int(plan.dropped_GE.sum()) > 0
    n, received, home, _ = plan_counts(plan)
    assert home.tolist() == counts.sum(1).tolist()
    kept_E = counts.sum(0) - plan.dropped_GE.sum(0)
    assert received.tolist() == kept_E.view(4, 2).sum(1).tolist()
    assert n.tolist() == [2] * 4
