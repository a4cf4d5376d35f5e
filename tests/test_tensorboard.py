"""``--log tensorboard``: the metrics rows as TensorBoard events, read back with
TensorBoard's own reader; without the package the flag is refused in one line."""

from __future__ import annotations

import importlib.util

import pytest

from lrmoe.cli import main
from lrmoe.train.metrics import read_metrics

ARGS = ["--preset", "tiny-qwen3", "--batch-size", "4", "--seq-len", "32", "--max-data-bytes",
        "100000", "--eval-batches", "1", "--threads", "1", "--warmup", "1", "--steps", "4",
        "--eval-every", "2", "--ckpt-every", "2", "--log-every", "100"]


def _events(d):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(d), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def _numbers(row: dict, prefix: str) -> dict[str, float]:
    """The scalars a row should give (the sink's naming, spelled out independently)."""
    out = {f"{prefix}/{k}": v for k, v in row.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
    for i, v in enumerate(row.get("expert_load_max_over_mean", [])):
        out[f"moe{i}/expert_load_max_over_mean"] = v
    for i, layer in enumerate(row.get("moe", [])):
        out.update({f"moe{i}/{k}": v for k, v in layer.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def test_events_mirror_the_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    import shutil

    run = tmp_path / "run"
    assert main(["train", *ARGS, "--out", str(run), "--log", "tensorboard"]) == 0
    shutil.rmtree(run / "checkpoints" / "ckpt-00000004")  # steps 3 and 4 run again
    assert main(["train", "--out", str(run), "--resume", "--threads", "1"]) == 0
    rows = read_metrics(run / "metrics.jsonl")
    acc = _events(run / "tensorboard")
    tags = set(acc.Tags()["scalars"])
    want: dict[str, dict[int, float]] = {}
    for r in rows:
        if r["kind"] in ("train", "val"):
            for tag, v in _numbers(r, r["kind"]).items():
                want.setdefault(tag, {})[r["step"]] = v
    assert want.keys() <= tags and {"train/loss", "val/val_loss", "moe0/pairs"} <= tags
    for tag, by_step in want.items():
        events = acc.Scalars(tag)  # the resumed run's after its checkpoint: purged once
        assert [e.step for e in events] == sorted(by_step), tag
        got = {e.step: e.value for e in events}
        for step, v in by_step.items():
            assert got[step] == pytest.approx(v, rel=1e-6, abs=1e-30), (tag, step)
    train = [r for r in rows if r["kind"] == "train"]
    layers = len(train[0]["counts"])
    for k in range(layers):
        hist = sorted(acc.Histograms(f"moe{k}/expert_load"), key=lambda h: h.step)
        assert [h.step for h in hist] == [r["step"] for r in train]
        for h, r in zip(hist, train):
            v = h.histogram_value
            c = r["counts"][k]
            assert list(v.bucket) == c  # pairs per expert id
            assert v.num == sum(c)
            # bucket e spans (e - 0.5, e + 0.5]; the moments are the routed pairs' ids'
            assert list(v.bucket_limit) == [e + 0.5 for e in range(len(c))]
            assert (v.min, v.max) == (0, len(c) - 1)
            assert v.sum == sum(e * n for e, n in enumerate(c))
            assert v.sum_squares == sum(e * e * n for e, n in enumerate(c))


def test_refused_without_the_package(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    new = tmp_path / "new"
    rc = main(["train", *ARGS, "--out", str(new), "--log", "tensorboard"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "pip install 'lrmoe[tensorboard]'" in err
    assert not new.exists()
