"""Prompt/completion rows: the mask of the trained targets and the exact loss.

Masked targets contribute nothing; a step's loss is the sum over its trained targets,
every micro-batch and every rank, divided by their number, so accumulation and data
parallelism give the gradient of one big batch even when the counts differ."""

from __future__ import annotations

import json

import pytest
import torch

from lrmoe.config import ModelConfig
from lrmoe.data import PackedBatches, build_streams, load_corpus, validation_batches
from lrmoe.errors import LrmoeError
from lrmoe.loss_mask import IGNORE, MaskedBatch, loss_args
from lrmoe.model import MoEForCausalLM
from lrmoe.tokenizer_load import load_tokenizer
from lrmoe.train.accum import accumulate

ROWS = [{"prompt": "Q: 2+2?\nA:", "completion": " 4"},
        {"text": "plain text, all of it trained"},
        {"prompt": "Q: capital of France?\nA:", "completion": " Paris"},
        {"prompt": "say hi", "completion": " hi there"}]


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_mask_marks_completions_and_their_end(tmp_path):
    corpus = load_corpus(_jsonl(tmp_path / "d.jsonl", ROWS * 30))
    assert corpus.train_prompts is not None and len(corpus.train_prompts) == len(
        corpus.train_texts)
    tok = load_tokenizer("byte")
    s = build_streams(corpus, tok)
    # rebuild the stream row by row: prompt bytes untrained, completion bytes and the
    # closing end-of-document id trained; a text line trained in full
    ids, mask = [], []
    for p, c in zip(corpus.train_prompts, corpus.train_texts):
        ids += list(p.encode()) + list(c.encode()) + [tok.eos_id]
        mask += [False] * len(p.encode()) + [True] * (len(c.encode()) + 1)
    assert s.train_ids.tolist() == ids and s.train_mask.tolist() == mask
    assert "" in corpus.train_prompts  # the text line: a row without prompt
    assert not s.train_mask.all() and s.train_mask.any()


def test_plain_text_has_no_mask(tmp_path):
    corpus = load_corpus(_jsonl(tmp_path / "d.jsonl", [{"text": "abc def"}] * 40))
    assert corpus.train_prompts is None
    assert build_streams(corpus, load_tokenizer("byte")).train_mask is None


def test_rows_count_their_prompts_against_the_byte_cap(tmp_path):
    p = tmp_path / "rows.jsonl"  # rows of 200,010 bytes, nearly all of them prompt
    p.write_text("".join(json.dumps({"prompt": "p" * 200_000, "completion": f"c{i:09d}"}) + "\n"
                         for i in range(40)))
    corpus = load_corpus(p, max_bytes=2**20)
    assert len(corpus.train_texts) == 6  # the sixth passes the cap, the seventh is left
    assert "6 train documents (1.14 MiB)" in corpus.source


@pytest.mark.parametrize("line,msg", [
    ({"prompt": "a"}, "'prompt' without 'completion'"),
    ({"completion": "a"}, "'completion' without 'prompt'"),
    ({"text": "a", "prompt": "b", "completion": "c"}, "both 'text' and 'prompt'"),
    ({"prompt": 3, "completion": "c"}, "field 'prompt' must be a string"),
])
def test_bad_rows(tmp_path, line, msg):
    with pytest.raises(LrmoeError, match=msg):
        load_corpus(_jsonl(tmp_path / "d.jsonl", [ROWS[0], line]))


def _model(seed=0) -> MoEForCausalLM:
    torch.manual_seed(seed)
    return MoEForCausalLM(ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, moe_intermediate_size=16,
                                      num_experts=4, num_experts_per_tok=2,
                                      router_aux_loss_coef=0.0))


def _batches(tmp_path, batch_size=4, seq_len=16, accum=1):
    corpus = load_corpus(_jsonl(tmp_path / "d.jsonl", ROWS * 40))
    s = build_streams(corpus, load_tokenizer("byte"))
    return PackedBatches(s.train_ids, seq_len, batch_size, 0, target_mask=s.train_mask,
                         accum=accum)


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_masked_targets_contribute_nothing(tmp_path):
    """The loss is the mean over the trained targets: a masked position's logits get no
    gradient, every trained one does, and the value is the masked mean."""
    b = _batches(tmp_path).batch(0)
    assert isinstance(b, MaskedBatch)
    x, y, n = loss_args(b)
    masked = y == IGNORE
    assert masked.any() and (~masked).any()
    assert n == float((~masked).sum())  # one rank, one micro-batch: its own count
    m = _model()
    logits = m(x)
    logits.retain_grad()
    lm, _ = m._objective(logits, y, n)
    lm.backward()
    g = logits.grad.abs().sum(-1)
    assert (g[masked] == 0).all() and (g[~masked] > 0).all()
    want = torch.nn.functional.cross_entropy(logits[~masked], y[~masked])
    torch.testing.assert_close(lm, want, rtol=1e-6, atol=0)


def test_accumulation_and_ranks_give_the_big_batch_gradient(tmp_path):
    """Two micro-batches on each of two ranks (unequal trained counts), averaged as the
    trainer averages them (divide by accum, then by world), equal one backward of the
    masked mean over all 16 sequences."""
    world, accum = 2, 2
    pb = _batches(tmp_path, batch_size=4, accum=accum)
    m = _model()
    counts, per_rank = [], []
    for r in range(world):
        m.zero_grad()
        parts = [pb.batch(0 * accum + k, r, world) for k in range(accum)]
        counts += [int((p.targets != IGNORE).sum()) for p in parts]
        sums = accumulate(m, lambda k, parts=parts: parts[k], accum)
        per_rank.append((_grads(m), float(sums[0])))
    assert len(set(counts)) > 1  # the micro-batches really hold different counts
    grads = [sum(g[i] for g, _ in per_rank) / world for i in range(len(per_rank[0][0]))]
    loss = sum(s for _, s in per_rank) / (world * accum)
    every = [pb.batch(k, 0, 1) for k in range(accum)]
    x = torch.cat([b.ids[:, :-1] for b in every])
    y = torch.cat([b.targets for b in every])
    m.zero_grad()
    ref, _ = m.loss(x, y)  # plain masked mean over the whole step
    ref.backward()
    torch.testing.assert_close(torch.tensor(loss), ref.detach(), rtol=1e-6, atol=0)
    for a, c in zip(grads, _grads(m)):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)


def test_a_step_without_trained_targets_is_zero_not_nan():
    ids = torch.randint(0, 256, (2, 9))
    b = MaskedBatch(ids, torch.full((2, 8), IGNORE), 1.0)
    m = _model()
    lm, obj = m.loss(*loss_args(b))
    obj.backward()
    assert float(lm.detach()) == 0.0
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_validation_counts_only_trained_targets(tmp_path):
    from lrmoe.parallel.groups import ParallelContext
    from lrmoe.train.loop import evaluate

    corpus = load_corpus(_jsonl(tmp_path / "d.jsonl", ROWS * 40))
    s = build_streams(corpus, load_tokenizer("byte"))
    vb = validation_batches(s.train_ids, 16, 4, num_windows=8, target_mask=s.train_mask)
    m = _model()
    loss, n = evaluate(m, vb, ParallelContext(), lambda: torch.autocast("cpu", enabled=False))
    assert n == sum(int((b.targets != IGNORE).sum()) for b in vb) < 8 * 16
    x = torch.cat([b.ids[:, :-1] for b in vb])
    y = torch.cat([b.targets for b in vb])
    with torch.no_grad():
        want = float(m.loss(x, y)[0])
    assert loss == pytest.approx(want, rel=1e-6)


def test_validation_batches_divide_by_their_own_trained_targets():
    """A masked validation batch's loss is a mean over its own trained targets: its
    ``num_targets`` counts the windows' masked-in targets, batch by batch."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 50, (1000,), generator=g)
    keep = torch.rand(1000, generator=g) < 0.3
    out = validation_batches(ids, 16, 4, target_mask=keep)
    assert len(out) > 3
    for i, b in enumerate(out):
        rows = torch.arange(i * 4, i * 4 + len(b.ids))  # the windows of this batch
        trained = keep[rows[:, None] * 16 + torch.arange(1, 17)]
        assert torch.equal(b.targets != IGNORE, trained)
        nxt = ids[rows[:, None] * 16 + torch.arange(1, 17)]  # each input's next token
        assert torch.equal(b.targets, nxt.masked_fill(~trained, IGNORE))
        assert b.num_targets == float(trained.sum()) > 0


def test_loss_args_shift_targets_and_keep_the_denominator():
    """A plain window batch: inputs all but the last token, targets all but the first, no
    denominator; a masked batch keeps its denominator, also when moved to a device."""
    rows = torch.arange(10).view(2, 5)
    x, y, n = loss_args(rows)
    assert x.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]] and y.tolist() == [[1, 2, 3, 4], [6, 7, 8, 9]]
    assert n is None
    b = MaskedBatch(rows, torch.full((2, 4), IGNORE), 2.5).to("cpu")
    assert loss_args(b)[2] == 2.5


def test_prompt_rows_end_each_row_with_the_tokenizers_end_id():
    """Rows ``prompt + completion + eos`` with a tokenizer whose end id is not 0."""
    from types import SimpleNamespace

    import numpy as np

    from lrmoe.loss_mask import prompt_rows
    tok = SimpleNamespace(eos_id=300, encode_each=lambda xs: [np.array([ord(c) for c in x], dtype=np.int64)
                                                             for x in xs])
    ids, mask = prompt_rows(tok, ["ab", ""], ["c", "de"])
    assert ids.tolist() == [97, 98, 99, 300, 100, 101, 300]
    assert mask.tolist() == [False, False, True, True, True, True, True]
