"""``lrmoe train --init-from`` under torchrun ``--ep 2`` (gloo): each rank reads the
dense tensors and its own experts; the first step's loss is transformers' loss of the
same batch, the training that of one process; the EP checkpoint exports as a HF
directory. The workers are ``tests/test_ep_training.py``'s (one gloo group, the jobs
run one after another)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hf_fixtures import GLM, hf_dir, hf_loss, write_rows
from test_ep_training import (
    COMMON,
    STEPS,
    _launch,
    _stop,
    _wait,
    assert_same_weights,
    final_state,
    rows,
    series,
)

pytestmark = [pytest.mark.dist, pytest.mark.slow]
tf = pytest.importorskip("transformers")


def _job(d: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--init-from", str(d), "--data", str(data), "--out", str(out), *COMMON,
            *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    from lrmoe.cli import main

    root = tmp_path_factory.mktemp("hfep")
    models = {fam: hf_dir(root, fam, seed=i)[0] for i, fam in enumerate(("qwen3", "glm"))}
    data = write_rows(root / "rows.jsonl", n=200, text_every=3)
    jobs = [_job(models[f], data, root / f"{f}-ep2", "--ep", "2") for f in models]
    w2 = _launch(2, jobs, root, "hf")
    try:
        for f in models:
            assert main(_job(models[f], data, root / f"{f}-1")) == 0
        _wait(w2, 150)
    finally:
        _stop(w2)
    return {"root": root, "data": data, **{f"{f}-dir": d for f, d in models.items()},
            **{f"{f}-{n}": root / f"{f}-{n}" for f in models for n in ("1", "ep2")}}


@pytest.mark.parametrize("fam", ["qwen3", "glm"])
def test_ep2_first_loss_is_transformers_and_training_is_one_process(runs, fam):
    from lrmoe.data import PackedBatches, build_streams, load_corpus
    from lrmoe.tokenizer_load import load_tokenizer

    s = build_streams(load_corpus(str(runs["data"]), max_bytes=100_000),
                      load_tokenizer(str(runs[f"{fam}-dir"])))
    b = PackedBatches(s.train_ids, 32, 8, 0, target_mask=s.train_mask).batch(0)
    hf = tf.AutoModelForCausalLM.from_pretrained(runs[f"{fam}-dir"], dtype=torch.float32,
                                                 attn_implementation="eager")
    ref = hf_loss(hf.eval(), b.ids, b.targets)
    for name in (f"{fam}-1", f"{fam}-ep2"):
        got = rows(runs[name])[0]["loss"]
        assert abs(got - ref) <= 1e-5 * abs(ref), (name, got, ref)
    _same_training(runs[f"{fam}-1"], runs[f"{fam}-ep2"])


def _same_training(a: Path, b: Path) -> None:
    """Per-step losses and grad norms, and the final weights (test_ep_training's
    check), but for the channels of GLM's key biases that rotary leaves alone (GLM
    rotates half of each head): a bias there shifts all of a query's scores alike, so
    its gradient is zero in exact arithmetic and Adam's steps on it are rounding noise,
    normalised to about lr, that differs between one process and EP."""
    torch.testing.assert_close(torch.tensor(series(b, "loss")), torch.tensor(series(a, "loss")),
                               rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(series(b, "grad_norm")),
                               torch.tensor(series(a, "grad_norm")), rtol=1e-4, atol=0)
    (sa, _), (sb, _) = final_state(a), final_state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        wa, wb = sa[k], sb[k]
        if k.endswith("self_attn.k_proj.bias") and "glm" in a.name:
            rotary = GLM["head_dim"] // 2  # partial_rotary_factor 0.5
            wa, wb = (w.view(-1, GLM["head_dim"])[:, :rotary] for w in (wa, wb))
        assert_same_weights(wb, wa, k)


@pytest.mark.parametrize("fam", ["qwen3", "glm"])
def test_each_rank_read_the_dense_tensors_and_half_the_experts(runs, fam):
    from lrmoe.hf_load import open_checkpoint
    from lrmoe.train.metrics import read_metrics

    ck = open_checkpoint(runs[f"{fam}-dir"])
    keys = {pc.key for pc in ck.pieces}
    experts = {pc.key for pc in ck.pieces
               if pc.target.endswith((".experts.gate_up_proj", ".experts.down_proj"))}
    total, expert = (sum(math.prod(ck.meta[k][1]) * 4 for k in ks) for ks in (keys, experts))
    one = [r for r in read_metrics(runs[f"{fam}-1"] / "metrics.jsonl") if r["kind"] == "init"]
    two = [r for r in read_metrics(runs[f"{fam}-ep2"] / "metrics.jsonl") if r["kind"] == "init"]
    assert [r["bytes_read"] for r in one[0]["ranks"]] == [total]
    assert [r["bytes_read"] for r in two[0]["ranks"]] == [total - expert // 2] * 2
    assert expert > total / 3  # the experts are a good part of the model


def test_an_ep2_checkpoint_exports(runs, tmp_path):
    from lrmoe.hf_export import export_run
    from lrmoe.hf_load import load_hf
    from lrmoe.train import checkpoint as ckpt

    run = runs["glm-ep2"]
    ck = ckpt.latest_checkpoint(run)
    assert (ck.world, ck.ep_size, ck.step) == (2, 2, STEPS)
    export_run(run, tmp_path / "x", max_shard_bytes=50_000)
    state, _ = ckpt.merged_model_state(ck)
    back = load_hf(tmp_path / "x").state_dict()
    assert all(torch.equal(back[k], state[k]) for k in state)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["train"]["init_from"] == str(runs["glm-dir"])
