"""benchmarks/select_cost.py: its synthetic home rank is a valid send layout (rows grouped
by block, quotas within blocks), the timed call selects what the quotas say, and the
smoke run writes its table. Its times are not results (CPU, logic only)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

_SPEC = importlib.util.spec_from_file_location(
    "select_cost", Path(__file__).resolve().parents[1] / "benchmarks" / "select_cost.py")
sc = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sc)


def test_home_case_is_a_send_layout_and_select_meets_the_quotas():
    T, K, E, G, S = 96, 3, 16, 4, 5
    c = sc.home_case(T, K, 8, E, G, S, skew=1.0, keep=0.5, dev=torch.device("cpu"), seed=3)
    assign, quota = c["home"].retain_I, c["home"].select_I
    assert int(assign.sum()) == T * K == c["tok"].numel()
    assert bool((quota <= assign).all()) and int(quota.sum()) > 0
    # each token appears once per expert it chose: k rows per token
    assert torch.equal(torch.bincount(c["tok"], minlength=T), torch.full((T,), K))
    # empty slots (S > E/G) stay empty
    assert int(assign.reshape(G, S)[:, E // G:].sum()) == 0
    tok_s, scale, sent_I, _, keep, sel_idx = sc.run_select(c, "topk", None)
    assert torch.equal(sent_I, quota) and tok_s.numel() == int(quota.sum())
    gen = torch.Generator().manual_seed(0)
    tok_s, scale, sent_I, _, keep, sel_idx = sc.run_select(c, "sampled", gen)
    assert int(sent_I.sum()) == tok_s.numel() == int(keep.sum())
    assert bool((scale > 0).all())


def test_select_stage_sampled_branch_matches_select_sampled():
    """The select stage's sampled branch keeps the rows select_sampled keeps (same
    generator state) and ships each with scale g / pi (the Horvitz-Thompson weight),
    in send order, with the kept count of every block."""
    from lrmoe.parallel.exchange import metric_grad_norm, select_sampled, send_blocks
    case = sc.home_case(300, 4, 16, 32, 4, 9, 1.0, 0.6, torch.device("cpu"), seed=3)
    tok_s, scale, sent_I, _, keep, sel_idx = sc.run_select(case, "sampled",
                                                        torch.Generator().manual_seed(4))
    m = metric_grad_norm(case["dout"], case["tok"], case["gate"])
    blocks = send_blocks(case["plan"], 0, torch.device("cpu"))
    keep_ref, w_ref = select_sampled(m, blocks, case["home"].select_I,
                                     torch.Generator().manual_seed(4))
    assert torch.equal(keep, keep_ref) and 0 < int(keep.sum()) < keep.numel()
    assert torch.equal(sel_idx, torch.nonzero(keep_ref).flatten())
    torch.testing.assert_close(scale, case["g"][sel_idx] * w_ref[sel_idx].float())
    assert torch.equal(tok_s, case["tok"][sel_idx])
    assert torch.equal(sent_I, torch.bincount(blocks[sel_idx], minlength=case["n_blocks"]))

def test_smoke_run_writes_every_row(tmp_path):
    assert sc.main(["--out", str(tmp_path), "--smoke"]) == 0
    rows = json.loads((tmp_path / "select_cost.json").read_text())["rows"]
    assert {(r["estimator"], r["deterministic"]) for r in rows} == {
        (e, d) for e in ("topk", "sampled") for d in ("no", "yes", "yes+fill")}
    assert all(0 < r["kernel_ops"] <= r["ops"] for r in rows)
    md = (tmp_path / "select_cost.md").read_text()
    assert "| sampled | yes+fill |" in md and "## profile, sampled, deterministic=yes+fill" in md
    # every setting it touched is back as it was
    import torch.utils.deterministic as tud
    assert not torch.are_deterministic_algorithms_enabled() and tud.fill_uninitialized_memory


def test_bad_slots_is_one_line_exit_2(tmp_path, capsys):
    assert sc.main(["--out", str(tmp_path / "o"), "--slots", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--slots 4" in err[0]
    assert not (tmp_path / "o").exists()
