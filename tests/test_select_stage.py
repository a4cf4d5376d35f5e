"""lrmoe's backward select stage (``select_and_compact``) on one synthetic home rank: the
rank is a valid send layout (rows grouped by block, quotas within blocks), the stage
selects what the quotas say, and its sampled branch keeps select_sampled's rows."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bits import same_bits
from lrmoe.parallel.options import BackwardOptions
from lrmoe.parallel.stages import select_and_compact


def home_case(T: int, K: int, H: int, E: int, G: int, S: int, skew: float, keep: float,
              dev: torch.device, seed: int = 0) -> dict:
    """One home rank's candidates in send order (grouped by block), with the plan and
    layout fields select_and_compact reads."""
    gen = torch.Generator().manual_seed(seed)
    w = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** skew
    idx = torch.stack([torch.multinomial(w, K, replacement=False, generator=gen)
                       for _ in range(T)])  # [T, K] distinct experts per token
    pair_expert = idx.reshape(-1)
    order = torch.argsort(pair_expert, stable=True)  # send order: by block (expert's slot)
    E_per = E // G
    block_of_expert = (pair_expert // E_per) * S + pair_expert % E_per  # global block g*S+s
    assign_I = torch.bincount(block_of_expert, minlength=G * S)
    quota_I = torch.floor(assign_I.double() * keep).long()
    plan = SimpleNamespace(assign_GGS=torch.zeros(G, G, S, dtype=torch.long))
    plan.assign_GGS[0] = assign_I.reshape(G, S)
    home = SimpleNamespace(retain_I=assign_I, select_I=quota_I, splits_shape=(G, S))
    gates = torch.rand(T * K, generator=gen)
    return dict(dout=torch.randn(T, H, generator=gen).to(dev, torch.bfloat16),
                tok=(order // K).to(dev), g=gates[order].to(dev), gate=gates[order].to(dev),
                home=home, plan=plan, n_blocks=G * S)


def run_select(case: dict, estimator: str, gen: torch.Generator | None):
    opts = BackwardOptions(estimator=estimator)
    return select_and_compact(case["dout"], case["tok"], case["g"], case["gate"], case["home"],
                              opts, gen)


def assert_picked_is(picked, ref: tuple, case: dict) -> None:
    """The runtime's :class:`Picked` against the frozen select stage's tuple
    ``(tok_s, scale, sent_I, recv_GS, keep, sel_idx)``, bit for bit: the same shipped
    candidates, scales, counts and output-gradient rows."""
    tok_s, scale, sent_I, recv_GS, _, sel_idx = ref
    assert (picked.idx is None) == (sel_idx is None)
    if sel_idx is not None:
        assert same_bits(picked.idx, sel_idx)
    assert same_bits(picked.scale, scale)
    assert torch.equal(picked.sent_B, sent_I)
    assert (picked.recv_GS is None) == (recv_GS is None)
    if recv_GS is not None:
        assert torch.equal(picked.recv_GS, recv_GS)
    assert same_bits(picked.dy, case["dout"][tok_s])


def test_home_case_is_a_send_layout_and_select_meets_the_quotas():
    T, K, E, G, S = 96, 3, 16, 4, 5
    c = home_case(T, K, 8, E, G, S, skew=1.0, keep=0.5, dev=torch.device("cpu"), seed=3)
    assign, quota = c["home"].retain_I, c["home"].select_I
    assert int(assign.sum()) == T * K == c["tok"].numel()
    assert bool((quota <= assign).all()) and int(quota.sum()) > 0
    # each token appears once per expert it chose: k rows per token
    assert torch.equal(torch.bincount(c["tok"], minlength=T), torch.full((T,), K))
    # empty slots (S > E/G) stay empty
    assert int(assign.reshape(G, S)[:, E // G:].sum()) == 0
    p = run_select(c, "topk", None)
    assert torch.equal(p.sent_B, quota) and p.idx.numel() == p.dy.shape[0] == int(quota.sum())
    gen = torch.Generator().manual_seed(0)
    p = run_select(c, "sampled", gen)
    assert int(p.sent_B.sum()) == p.idx.numel() == p.scale.numel() > 0
    assert bool((p.scale > 0).all())


def test_select_stage_sampled_branch_matches_select_sampled():
    """The select stage's sampled branch keeps the rows select_sampled keeps (same
    generator state) and ships each with scale g / pi (the Horvitz-Thompson weight),
    in send order, with the kept count of every block."""
    from references.layout import send_blocks
    from references.select_runtime import metric_grad_norm
    from references.selection import select_sampled
    case = home_case(300, 4, 16, 32, 4, 9, 1.0, 0.6, torch.device("cpu"), seed=3)
    p = run_select(case, "sampled", torch.Generator().manual_seed(4))
    m = metric_grad_norm(case["dout"], case["tok"], case["gate"])
    blocks = send_blocks(case["plan"], 0)
    keep_ref, w_ref = select_sampled(m, blocks, case["home"].select_I,
                                     torch.Generator().manual_seed(4))
    assert 0 < int(keep_ref.sum()) < keep_ref.numel()
    assert torch.equal(p.idx, torch.nonzero(keep_ref).flatten())
    torch.testing.assert_close(p.scale, case["g"][p.idx] * w_ref[p.idx].float())
    assert torch.equal(p.dy, case["dout"][case["tok"][p.idx]])
    assert torch.equal(p.sent_B, torch.bincount(blocks[p.idx], minlength=case["n_blocks"]))
