"""``--loss-chunk``: the final norm, the head and the cross entropy run a chunk of tokens at
a time, each chunk re-run in backward. The loss and every gradient are the whole
micro-batch's (fp32 to rounding, bf16 autocast to its tolerance), evaluation's summed loss
too, and autograd no longer keeps the micro-batch's logits (what it saved, counted by
``saved_tensors_hooks``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lrmoe.cli import main
from lrmoe.model import MoEForCausalLM
from lrmoe.presets import get_preset
from lrmoe.train.metrics import read_metrics

B, T = 3, 40


def _model(preset: str, vocab: int | None = None) -> MoEForCausalLM:
    cfg = get_preset(preset)
    if vocab is not None:
        cfg = dataclasses.replace(cfg, vocab_size=vocab)
    torch.manual_seed(0)
    return MoEForCausalLM(cfg)


def _batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    targets = torch.randint(0, vocab, (B, T), generator=g)
    targets[0, :7] = -100  # masked targets, as a prompt's
    targets[2, -3:] = -100
    return ids, targets


def _loss_and_grads(model, ids, targets, chunk, num_targets=None, autocast=False):
    model.set_loss_chunk(chunk)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        lm, obj = model.loss(ids, targets, num_targets)
    obj.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lm.detach(), obj.detach(), grads


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-glm"])
@pytest.mark.parametrize("chunk", [1, 17, 64, B * T - 1])
@pytest.mark.parametrize("num_targets", [None, 200.0])
def test_chunked_loss_and_gradients_are_the_whole_micro_batchs(preset, chunk, num_targets):
    model = _model(preset)
    ids, targets = _batch(model.config.vocab_size, seed=chunk)
    lm0, obj0, g0 = _loss_and_grads(model, ids, targets, 0, num_targets)
    lm1, obj1, g1 = _loss_and_grads(model, ids, targets, chunk, num_targets)
    torch.testing.assert_close(lm1, lm0, rtol=1e-6, atol=0)
    torch.testing.assert_close(obj1, obj0, rtol=1e-6, atol=0)
    assert g1.keys() == g0.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7, msg=n)


def test_chunked_loss_under_bf16_autocast_stays_within_its_tolerance():
    model = _model("tiny-qwen3")
    ids, targets = _batch(model.config.vocab_size, seed=3)
    lm0, _, g0 = _loss_and_grads(model, ids, targets, 0, autocast=True)
    lm1, _, g1 = _loss_and_grads(model, ids, targets, 16, autocast=True)
    torch.testing.assert_close(lm1, lm0, rtol=1e-5, atol=0)
    for n in g0:  # bf16 GEMMs: the chunks' products round alike, their sums in fp32
        scale = g0[n].abs().max().clamp_min(1e-6)
        assert (g1[n] - g0[n]).abs().max() <= 1e-2 * scale, n


def test_a_chunk_as_large_as_the_micro_batch_is_the_whole_path():
    model = _model("tiny-qwen3")
    ids, targets = _batch(model.config.vocab_size, seed=4)
    lm0, _, g0 = _loss_and_grads(model, ids, targets, 0)
    lm1, _, g1 = _loss_and_grads(model, ids, targets, B * T)
    assert torch.equal(lm1, lm0) and all(torch.equal(g1[n], g0[n]) for n in g0)


def test_evaluation_sum_is_the_whole_micro_batchs():
    model = _model("tiny-glm")
    ids, targets = _batch(model.config.vocab_size, seed=5)
    with torch.no_grad():
        logits = model(ids)
        want = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
            reduction="sum", ignore_index=-100)
        model.set_loss_chunk(0)
        assert torch.equal(model.loss_sum(ids, targets), want)
        model.set_loss_chunk(13)
        torch.testing.assert_close(model.loss_sum(ids, targets), want, rtol=1e-6, atol=0)


def _saved(model, ids, targets, chunk) -> list[torch.Size]:
    """Shapes of what autograd keeps for backward during one ``loss``."""
    model.set_loss_chunk(chunk)
    shapes = []

    def pack(t):
        shapes.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, obj = model.loss(ids, targets)
    obj.backward()
    return shapes


def test_autograd_keeps_no_micro_batch_logits():
    V = 1000  # a vocabulary no other width shares
    model = _model("tiny-qwen3", vocab=V)
    ids, targets = _batch(V, seed=6)
    whole = [s for s in _saved(model, ids, targets, 0) if s and s[-1] == V]
    chunked = [s for s in _saved(model, ids, targets, 16) if s and s[-1] == V]
    assert any(s.numel() >= B * T * V for s in whole), whole
    assert not chunked, chunked  # the head's weight is [V, H]: its last width is H


def test_train_with_loss_chunk_trains_as_without(tmp_path, capsys, monkeypatch):
    """``lrmoe train``: the same losses, gradient norms and validation losses."""
    args = ["train", "--preset", "tiny-qwen3", "--steps", "3", "--batch-size", "2",
            "--seq-len", "32", "--grad-accum", "2", "--max-data-bytes", "100000",
            "--eval-batches", "1", "--eval-every", "3", "--threads", "1", "--warmup", "1"]
    rows = {}
    for chunk in ("0", "24"):
        assert main(args + ["--out", str(tmp_path / chunk), "--loss-chunk", chunk]) == 0
        rows[chunk] = read_metrics(tmp_path / chunk / "metrics.jsonl")
    for kind, keys in (("train", ("loss", "grad_norm")), ("val", ("val_loss",))):
        for key in keys:
            got, want = ([r[key] for r in rows[c] if r["kind"] == kind] for c in ("24", "0"))
            assert got and len(got) == len(want)
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    from lrmoe.commands.eval import evaluate_run

    last = [r["val_loss"] for r in rows["24"] if r["kind"] == "val"][-1]
    chunks = []
    real = MoEForCausalLM._chunked_sum
    monkeypatch.setattr(MoEForCausalLM, "_chunked_sum",
                        lambda self, *a: chunks.append(self.loss_chunk) or real(self, *a))
    assert evaluate_run(tmp_path / "24")["val_loss"] == last
    assert chunks and set(chunks) == {24}  # `lrmoe eval` chunks as the run did
    capsys.readouterr()
    assert main(args + ["--out", str(tmp_path / "bad"), "--loss-chunk", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--loss-chunk -1" in err[0], err
    assert not (tmp_path / "bad").exists()
