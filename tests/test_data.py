"""Corpus loading, splits, tokenizers and deterministic packed batches."""

from __future__ import annotations

import hashlib
import json
import shutil
import sysconfig

import pytest
import torch

from lrmoe.data import (
    Corpus,
    PackedBatches,
    build_streams,
    load_corpus,
    validation_batches,
)
from lrmoe.errors import LrmoeError
from lrmoe.tokenizer import (
    BPE_MIN_VOCAB,
    TOKENIZER_FILE,
    ByteTokenizer,
    check_vocab,
    parse_tokenizer_spec,
)
from lrmoe.tokenizer_load import load_tokenizer

SMALL = 64 * 1024
SAMPLE = "def f(x):\n    return x + 1  # héllo wörld ✓ 🎉\n\n\nclass A:\n  pass\n"


def _text(n_lines: int, tag: str = "") -> str:
    return "".join(f"line {i} {tag} of some text with words and numbers {i * 7}\n"
                   for i in range(n_lines))


# ---------------------------------------------------------------- corpus sources


def test_default_corpus_is_stdlib_capped_deterministic():
    a = load_corpus(None, SMALL)
    b = load_corpus(None, SMALL)
    assert a == b
    assert a.train_texts and a.val_texts
    assert sum(len(t.encode()) for t in a.train_texts) <= SMALL
    assert sum(len(t.encode()) for t in a.val_texts) <= SMALL // 16
    assert not set(a.train_texts) & set(a.val_texts)
    assert sysconfig.get_paths()["stdlib"] in a.source
    # A bigger cap extends the same sorted sequence of files.
    big = load_corpus(None, 4 * SMALL)
    assert big.train_texts[: len(a.train_texts) - 1] == a.train_texts[:-1]


def test_directory_split_by_file_and_independent_of_location(tmp_path):
    src = tmp_path / "a"
    for i in range(60):
        sub = src / f"d{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i}.md").write_text(f"# doc {i}\n" + _text(3, str(i)))
    (src / "blob.bin").write_bytes(bytes(range(256)) * 4)  # binary: skipped
    (src / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))  # non-UTF-8: skipped
    (src / ".hidden").write_text("secret\n")
    c1 = load_corpus(src, SMALL)
    shutil.copytree(src, tmp_path / "b")
    c2 = load_corpus(tmp_path / "b", SMALL)
    assert (c1.train_texts, c1.val_texts) == (c2.train_texts, c2.val_texts)
    docs = c1.train_texts + c1.val_texts
    assert len(docs) == 60 and len(c1.val_texts) >= 1
    assert all(d.startswith("# doc") for d in docs)


def test_directory_validation_never_empty(tmp_path):
    (tmp_path / "one.txt").write_text(_text(40))
    (tmp_path / "two.txt").write_text(_text(40, "two"))
    c = load_corpus(tmp_path, SMALL)  # both hash to training: the last one moves
    assert c.train_texts == [_text(40)] and c.val_texts == [_text(40, "two")]
    single = tmp_path / "s"
    single.mkdir()
    (single / "only.txt").write_text(_text(40))
    c = load_corpus(single, SMALL)
    assert c.train_texts[0] + c.val_texts[0] == _text(40)


def test_txt_file_last_lines_are_validation(tmp_path):
    p = tmp_path / "corpus.txt"
    text = _text(200)
    p.write_text(text)
    c = load_corpus(p, None)
    assert c.train_texts[0] + c.val_texts[0] == text
    assert c.val_texts[0].startswith("line ") and c.train_texts[0].endswith("\n")
    assert 0.02 < len(c.val_texts[0]) / len(text) < 0.1
    assert load_corpus(p, None) == c
    capped = load_corpus(p, 1000)
    assert len(capped.train_texts[0].encode()) <= 1000
    assert text.startswith(capped.train_texts[0])


@pytest.mark.parametrize("source", ["txt", "jsonl"])
def test_tiny_texts_split_at_the_first_line_start_past_the_cut(tmp_path, source):
    """Texts of 2 to 60 characters, one file or one jsonl document: the split keeps every
    character, and validation starts after the first newline at or
    past ``max(1, int(n·(1 − VAL_FRACTION)))`` that is not the last character (else there)."""
    import random

    from lrmoe.data import VAL_FRACTION

    rng = random.Random(3)
    for n in range(2, 61):
        for i in range(4):
            # a letter first and a letter last, or "b\n" last where validation holds at least
            # two characters: neither side is blank (a blank side is dropped)
            end = "b\n" if n >= 40 and i % 2 else "b"
            text = "a" + "".join(rng.choice("ab\n") for _ in range(n - 1 - len(end))) + end
            if source == "txt":
                (p := tmp_path / f"t{n}.txt").write_text(text)
            else:
                (p := tmp_path / f"t{n}.jsonl").write_text(json.dumps({"text": text}) + "\n")
            c = load_corpus(p, None)
            train, val = c.train_texts[0], c.val_texts[0]
            assert train + val == text and train and val, (text, train, val)
            cut = max(1, int(n * (1 - VAL_FRACTION)))
            nl = text.find("\n", cut)
            want = nl + 1 if 0 <= nl < n - 1 else cut
            assert len(train) == want, (text, train, val)


def test_jsonl_file(tmp_path):
    p = tmp_path / "c.jsonl"
    lines = [json.dumps({"text": f"document {i} " + _text(2, str(i)), "id": i}) for i in range(80)]
    lines.insert(5, json.dumps({"other": "no text field here"}))
    lines.insert(9, "")
    p.write_text("\n".join(lines) + "\n")
    c = load_corpus(p, SMALL)
    assert len(c.train_texts) + len(c.val_texts) == 80
    assert c.val_texts and c == load_corpus(p, SMALL)
    assert all(t.startswith("document ") for t in c.train_texts + c.val_texts)
    # the split is the documented one: line n (1-based, blank and skipped lines counted)
    # is validation when SHA-256 of "n" falls in the first 5% of the hash range
    val = {json.loads(line)["text"] for n, line in enumerate(lines, start=1) if '"text":' in line
           and int.from_bytes(hashlib.sha256(str(n).encode()).digest()[:8], "big") < 2**64 // 20}
    assert val and set(c.val_texts) == val


@pytest.mark.parametrize(
    "setup, words",
    [
        (lambda d: d / "missing.txt", ["missing.txt", "does not exist"]),
        (lambda d: _write(d / "empty.txt", ""), ["empty.txt", "no text"]),
        (lambda d: _write(d / "blank.txt", "  \n\n "), ["blank.txt", "no text"]),
        (lambda d: _mkdir(d / "nodocs"), ["nodocs", "no text"]),
        (lambda d: _write(d / "x.jsonl", '{"a": 1}\n{"b": 2}\n'), ["x.jsonl", "no text", "text"]),
        (lambda d: _write(d / "y.jsonl", '{"text": "ok"}\n{"text": \n'), ["y.jsonl", "line 2"]),
        (lambda d: _write(d / "z.jsonl", '{"text": 5}\n'), ["z.jsonl", "line 1", "string"]),
    ],
)
def test_corpus_errors(tmp_path, setup, words):
    path = setup(tmp_path)
    with pytest.raises(LrmoeError) as e:
        load_corpus(path, SMALL)
    for w in words:
        assert w in str(e.value)


def _write(path, text):
    path.write_text(text)
    return path


def _mkdir(path):
    path.mkdir()
    (path / "bin.dat").write_bytes(b"\0\1\2")
    return path


def test_bad_max_bytes():
    with pytest.raises(LrmoeError, match="max_bytes"):
        load_corpus(None, 0)


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip_and_stream():
    tok = load_tokenizer("byte")
    assert tok.vocab_size == 256 and tok.spec == "byte" and tok.eos_id == 0
    ids = tok.encode(SAMPLE)
    assert ids == list(SAMPLE.encode()) and tok.decode(ids) == SAMPLE
    assert tok.decode([104, 105, 300]) == "hi\ufffd"
    s = build_streams(Corpus(["ab", "c"], ["d"], "t"), tok)
    train, val = s.train_ids, s.val_ids
    assert train.dtype == torch.long and train.tolist() == [97, 98, 0, 99, 0]
    assert val.tolist() == [100, 0]
    assert tok.save("/nonexistent") is None


def test_parse_tokenizer_spec():
    assert parse_tokenizer_spec("byte") == ("byte", None)
    assert parse_tokenizer_spec("bpe:300") == ("bpe", 300)
    for bad in ("bytes", "bpe", "bpe:", "bpe:abc", "wordpiece:300", ""):
        with pytest.raises(LrmoeError, match="byte.*bpe:N"):
            parse_tokenizer_spec(bad)


def test_bpe_too_small_vocab():
    with pytest.raises(LrmoeError) as e:
        load_tokenizer("bpe:100", None, [SAMPLE])
    msg = str(e.value)
    assert "100" in msg and str(BPE_MIN_VOCAB) in msg and "too small" in msg


def test_bpe_trains_caches_and_reloads(tmp_path):
    texts = load_corpus(None, SMALL).train_texts
    tok = load_tokenizer("bpe:300", tmp_path, texts)
    assert tok.vocab_size == 300 and tok.spec == "bpe:300"
    assert (tmp_path / TOKENIZER_FILE).exists()
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE and len(ids) < len(SAMPLE.encode())
    again = load_tokenizer("bpe:300", tmp_path)  # no texts: must come from the cache
    assert again.encode(SAMPLE) == ids and again.vocab_size == 300
    train = build_streams(Corpus(texts[:3], ["x"], "t"), again).train_ids
    expect = [i for t in texts[:3] for i in tok.encode(t) + [tok.eos_id]]
    assert train.tolist() == expect
    with pytest.raises(LrmoeError, match="bpe:260"):
        load_tokenizer("bpe:260", tmp_path)  # cache holds a bigger vocabulary
    with pytest.raises(LrmoeError, match="no cached"):
        load_tokenizer("bpe:300", tmp_path / "empty")


def test_bpe_long_document_chunking_is_exact(monkeypatch):
    import lrmoe.tokenizer as T

    tok = load_tokenizer("bpe:400", None, [SAMPLE * 50])
    big = SAMPLE * 40
    whole = tok.encode(big) + [tok.eos_id]
    monkeypatch.setattr(T, "_CHUNK_CHARS", 37)
    assert len(T._split_for_encoding(big)) > 10
    assert tok.encode_documents([big]).tolist() == whole


def test_check_vocab():
    check_vocab(ByteTokenizer(), 256)
    with pytest.raises(LrmoeError) as e:
        check_vocab(ByteTokenizer(), 200)
    assert "200" in str(e.value) and "256" in str(e.value)


# ---------------------------------------------------------------- batches


def _stream(n: int = 1000) -> torch.Tensor:
    return torch.arange(n, dtype=torch.long)


def test_batches_shapes_and_windows():
    pb = PackedBatches(_stream(), seq_len=10, batch_size=4, seed=0)
    assert pb.num_windows == 99
    b = pb.batch(0)
    assert b.shape == (4, 11) and b.dtype == torch.long
    for row in b:  # windows are contiguous and start at multiples of seq_len
        assert row[0] % 10 == 0 and torch.equal(row, torch.arange(row[0], row[0] + 11))


def test_batches_deterministic_and_seeded():
    a = PackedBatches(_stream(), 10, 4, seed=1)
    b = PackedBatches(_stream(), 10, 4, seed=1)
    c = PackedBatches(_stream(), 10, 4, seed=2)
    steps = range(60)
    assert all(torch.equal(a.batch(s), b.batch(s)) for s in steps)
    assert not all(torch.equal(a.batch(s), c.batch(s)) for s in steps)


def test_epochs_are_permutations_with_new_order():
    pb = PackedBatches(_stream(), 10, 9, seed=3)  # 99 windows = 11 steps per epoch
    epoch = [torch.cat([pb.window_indices(s) for s in range(e * 11, e * 11 + 11)])
             for e in range(3)]
    for w in epoch:
        assert sorted(w.tolist()) == list(range(99))
    assert not torch.equal(epoch[0], epoch[1]) and not torch.equal(epoch[1], epoch[2])


def test_resume_is_history_independent():
    fresh = PackedBatches(_stream(), 10, 8, seed=5)
    replayed = PackedBatches(_stream(), 10, 8, seed=5)
    for s in range(37):
        replayed.batch(s)
    for s in (37, 12, 80, 0, 500):  # crosses epochs in any order
        assert torch.equal(fresh.batch(s), replayed.batch(s))


def test_batch_larger_than_epoch():
    pb = PackedBatches(_stream(45), 10, 16, seed=0)  # 4 windows
    w = pb.window_indices(0)
    for e in range(4):
        assert sorted(w[4 * e : 4 * e + 4].tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_dp_sharding_covers_global_batch(world):
    pb = PackedBatches(_stream(), 10, 8, seed=0)
    for step in (0, 13):
        shards = [pb.batch(step, r, world) for r in range(world)]
        assert all(s.shape == (8 // world, 11) for s in shards)
        assert torch.equal(torch.cat(shards), pb.batch(step))


def test_batch_errors():
    pb = PackedBatches(_stream(), 10, 6, seed=0)
    with pytest.raises(LrmoeError, match="6.*not divisible.*4"):
        pb.batch(0, 0, 4)
    with pytest.raises(LrmoeError, match="rank 3"):
        pb.batch(0, 3, 3)
    with pytest.raises(LrmoeError) as e:
        PackedBatches(_stream(10), seq_len=16, batch_size=2)
    assert "10 tokens" in str(e.value) and "17" in str(e.value)
    with pytest.raises(LrmoeError, match="seq_len"):
        PackedBatches(_stream(), seq_len=0, batch_size=2)


def test_validation_batches():
    ids = _stream(1000)
    vb = validation_batches(ids, 10, 4, num_windows=10)
    assert [b.shape[0] for b in vb] == [4, 4, 2]
    rows = torch.cat(vb)
    assert torch.equal(rows[:, 0], torch.arange(10) * 10)
    assert torch.equal(torch.cat(validation_batches(ids, 10, 4, 10)), rows)  # fixed
    shards = [torch.cat(validation_batches(ids, 10, 4, 10, r, 3)) for r in range(3)]
    assert torch.equal(torch.cat(shards), rows)
    assert len(torch.cat(validation_batches(ids, 10, 4))) == 99
    with pytest.raises(LrmoeError, match="validation.*5 tokens"):
        validation_batches(_stream(5), 10, 4)


def test_end_to_end_small_txt(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text(_text(400))
    tok = load_tokenizer("byte")
    s = build_streams(load_corpus(p, SMALL), tok)
    train, val = s.train_ids, s.val_ids
    pb = PackedBatches(train, 32, 4, seed=0)
    x = pb.batch(3)
    assert tok.decode(x[0].tolist()) in _text(400)
    assert validation_batches(val, 32, 4, 8)[0].shape == (4, 33)


def test_missing_stdlib_and_cut_utf8(tmp_path, monkeypatch):
    import lrmoe.data as D

    (tmp_path / "lib").mkdir()
    monkeypatch.setattr(D.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path / "lib")})
    with pytest.raises(LrmoeError, match="stdlib.*no text.*--data"):
        load_corpus(None, SMALL)
    # A byte cap that lands inside a multi-byte character drops it instead of garbling it.
    (tmp_path / "lib" / "a.py").write_text("é" * 100)
    (tmp_path / "lib" / "b.py").write_text("ü" * 100)
    c = load_corpus(None, 51)
    texts = c.train_texts + c.val_texts
    assert all(set(t) <= {"é", "ü"} for t in texts) and "\ufffd" not in "".join(texts)
    assert all(len(t.encode()) <= 51 for t in texts)


def test_step_accepts_integer_scalars_only():
    pb = PackedBatches(_stream(), 10, 4, seed=0)
    assert torch.equal(pb.batch(torch.tensor(3)), pb.batch(3))
    for bad in (-1, 1.0, True):
        with pytest.raises(LrmoeError, match="step"):
            pb.batch(bad)
