"""Training from a HF model directory and back, against transformers (one process).

A tiny Qwen3-MoE and a tiny GLM-4.5-MoE are built with transformers, saved with
``save_pretrained`` in small shards beside a BPE tokenizer (``tests/hf_fixtures.py``);
``lrmoe train --init-from`` trains them on prompt/completion rows; the first step's loss
is transformers' loss of the same batch; ``lrmoe export`` hands the run back and
``AutoModelForCausalLM`` gives lrmoe's logits. Each rank's loading reads only its own
tensors (counted); bad input is one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hf_fixtures import VOCAB, hf_dir, hf_loss, save_tokenizer, write_rows
from lrmoe.cli import main

tf = pytest.importorskip("transformers")

STEPS = 3
COMMON = ["--steps", str(STEPS), "--batch-size", "4", "--seq-len", "32", "--eval-batches",
          "1", "--eval-every", "0", "--threads", "1", "--warmup", "1", "--log-every", "100"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {fam: hf_dir(root, fam, seed=i)[0] for i, fam in enumerate(("qwen3", "glm"))}
    out["rows"] = write_rows(root / "rows.jsonl", text_every=4)
    return out


def _train(models, fam: str, out: Path, *extra: str) -> None:
    argv = ["train", "--init-from", str(models[fam]), "--data", str(models["rows"]),
            "--out", str(out), *COMMON, *extra]
    assert main(argv) == 0


def _rows(run: Path, kind: str = "train") -> list[dict]:
    from lrmoe.train.metrics import read_metrics

    return [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == kind]


def _first_batch(models, fam: str):
    """The run's first batch, rebuilt as the trainer builds it (seed 0)."""
    from lrmoe.data import PackedBatches, build_streams, load_corpus
    from lrmoe.tokenizer_load import load_tokenizer

    s = build_streams(load_corpus(str(models["rows"])), load_tokenizer(str(models[fam])))
    return PackedBatches(s.train_ids, 32, 4, 0, target_mask=s.train_mask).batch(0)


def _hf(path: Path):
    return tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for fam in ("qwen3", "glm"):
        _train(models, fam, root / fam)
        out[fam] = root / fam
    return out


# ----------------------------------------------------------------------------- in
@pytest.mark.parametrize("fam", ["qwen3", "glm"])
def test_first_step_loss_is_transformers_loss(models, runs, fam):
    b = _first_batch(models, fam)
    masked = int((b.targets == -100).sum())
    assert 0 < masked < b.targets.numel()  # prompts masked, completions trained
    ref = hf_loss(_hf(models[fam]), b.ids, b.targets)
    got = _rows(runs[fam])[0]["loss"]
    assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)


@pytest.mark.parametrize("fam", ["qwen3", "glm"])
def test_the_run_keeps_the_models_config_and_tokenizer(models, runs, fam):
    from lrmoe.hf import load_hf_config

    run = runs[fam]
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"] == load_hf_config(models[fam]).to_hf_dict()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (run / "tokenizer" / name).read_bytes() == (models[fam] / name).read_bytes()
    assert cfg["tokenizer"]["spec"].startswith("hf:")
    assert cfg["tokenizer"]["vocab_size"] < VOCAB  # padding rows in the embedding: allowed
    init = _rows(run, "init")[0]
    assert init["source"] == str(models[fam]) and len(init["ranks"]) == 1


def test_end_of_document_id_from_the_tokenizer_config(models, tmp_path):
    """tokenizer_config.json's eos_token first; generation_config.json's first
    eos_token_id when the config names none."""
    from lrmoe.tokenizer_load import load_tokenizer

    tok = load_tokenizer(str(models["qwen3"]))
    assert tok.eos_id == 1 == tok._tok.token_to_id("<|im_end|>")
    ids = tok.encode_documents(["ab", "c"]).tolist()
    assert ids == tok.encode("ab") + [1] + tok.encode("c") + [1]
    d = _copy(models, tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["eos_token"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(str(d)).eos_id == 0  # generation_config.json's [0, 1]


def test_resume_reads_the_checkpoint_not_the_hf_weights(models, runs, tmp_path):
    """Stopped after step 2 and resumed with the HF directory gone: the same steps as
    the uninterrupted run, bit for bit; eval reads the run's tokenizer copy."""
    from lrmoe.commands.eval import evaluate_run

    src = tmp_path / "qwen3"
    shutil.copytree(models["qwen3"], src)
    run = tmp_path / "run"
    argv = ["train", "--init-from", str(src), "--data", str(models["rows"]), "--out", str(run),
            *COMMON]
    assert main([*argv, "--stop-after", "2"]) == 0
    shutil.rmtree(src)
    assert main(["train", "--out", str(run), "--resume", "--threads", "1"]) == 0
    want, got = _rows(runs["qwen3"]), _rows(run)
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in want]
    assert len(_rows(run, "init")) == 1  # written by the first invocation only
    val = _rows(runs["qwen3"], "val")[-1]["val_loss"]
    assert evaluate_run(run)["val_loss"] == pytest.approx(val, rel=1e-6)


# ----------------------------------------------------------------------------- out
@pytest.mark.parametrize("fam", ["qwen3", "glm"])
def test_export_loads_in_transformers_with_lrmoes_logits(runs, fam, tmp_path, capsys):
    from lrmoe.config import ModelConfig
    from lrmoe.model import MoEForCausalLM
    from lrmoe.train import checkpoint as ckpt

    run, out = runs[fam], tmp_path / "export"
    assert main(["export", str(run), str(out), "--max-shard-size", "40KB"]) == 0
    said = capsys.readouterr()
    assert said.out.strip() == str(out)
    names = sorted(p.name for p in out.iterdir())
    # the summary line: the index's tensors and bytes (in MiB), every file written
    index = json.loads((out / "model.safetensors.index.json").read_text())
    mib = index["metadata"]["total_size"] / 2**20
    assert (f"step {STEPS}, {len(index['weight_map'])} tensors ({mib:,.1f} MiB) in "
            f"{len(names)} files") in said.err
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) > 3 and "model.safetensors.index.json" in names
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(names)
    state, _ = ckpt.merged_model_state(ckpt.latest_checkpoint(run))
    ours = MoEForCausalLM(ModelConfig.from_hf_dict(json.loads(
        (run / "config.json").read_text())["model"]))
    ours.load_state_dict(state)
    ours.eval()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = ours(ids), _hf(out)(ids).logits
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert float(want.std()) > 0.3  # the weights matter
    tok = tf.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>"
    # and back in: the export is a HF directory lrmoe loads, tensor for tensor
    from lrmoe.hf_load import load_hf
    back = load_hf(out).state_dict()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_export_streams_one_shard_at_a_time(runs, tmp_path):
    from lrmoe.hf_export import export_run

    limit = 30_000
    r = export_run(runs["glm"], tmp_path / "x", max_shard_bytes=limit)
    row = 2 * 32 * 64 * 4  # one expert's gate_up row: read whole for gate and up
    embedding = VOCAB * 64 * 4  # a tensor above the limit is a shard of its own
    assert len(r.files) > 10
    assert embedding <= r.most_read_at_once <= max(limit + row, embedding)
    assert r.most_read_at_once < r.bytes_written / 8
    r2 = export_run(runs["glm"], tmp_path / "x", max_shard_bytes=limit, step=STEPS)
    assert r2.step == STEPS  # the same model again into its own export: replaced


def test_export_writes_the_fp32_masters_where_the_optimizer_kept_them(runs, tmp_path):
    """A checkpoint whose optimizer kept fp32 masters apart from bf16 weights (the host
    offload on a GPU) exports the masters, in fp32: dense and per-expert tensors alike."""
    import safetensors

    from lrmoe.config import ModelConfig
    from lrmoe.hf_export import export_run
    from lrmoe.hf_load import load_hf
    from lrmoe.model.transformer import MoEForCausalLM
    from lrmoe.train import checkpoint as ckpt
    from lrmoe.train import ckpt_state
    from lrmoe.train.config import read_run_config

    run = tmp_path / "run"
    shutil.copytree(runs["qwen3"], run)
    model = MoEForCausalLM(ModelConfig.from_hf_dict(read_run_config(run)["model"]))
    opt = torch.optim.AdamW(model.parameters())
    masters = {}
    for name, p in model.named_parameters():
        masters[name] = p.detach().float() + 0.5  # not what the bf16 weights round to
        opt.state[p]["master"] = masters[name]
    model.to(torch.bfloat16)
    ckpt.save_checkpoint(run, 100, model, opt, trainer={"progress": {}},
                         rng=ckpt_state.rng_state(None, torch.device("cpu")), rank=0, world=1,
                         ep_size=1)
    export_run(run, tmp_path / "out")
    for f in (tmp_path / "out").glob("model*.safetensors"):
        with safetensors.safe_open(str(f), "pt") as st:
            assert {st.get_slice(k).get_dtype() for k in st.keys()} == {"F32"}
    back = load_hf(tmp_path / "out").state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in masters)
    for k, v in masters.items():
        assert torch.equal(back[k], v), k


def test_export_casts_to_its_dtype_but_glms_router(runs, tmp_path):
    """``--dtype bfloat16``: every tensor in the files is the checkpoint's cast to bf16,
    except GLM's router, which HF keeps in fp32 and the export leaves exact."""
    import safetensors

    from lrmoe.hf_load import load_hf
    from lrmoe.train import checkpoint as ckpt

    out = tmp_path / "bf16"
    assert main(["export", str(runs["glm"]), str(out), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    dtypes = {}
    for f in out.glob("model*.safetensors"):
        with safetensors.safe_open(str(f), "pt") as st:
            dtypes |= {k: st.get_slice(k).get_dtype() for k in st.keys()}
    router = {k for k in dtypes if ".mlp.gate." in k}
    assert router and all(dtypes[k] == "F32" for k in router)
    assert {dtypes[k] for k in dtypes.keys() - router} == {"BF16"}
    state, _ = ckpt.merged_model_state(ckpt.latest_checkpoint(runs["glm"]))
    back = load_hf(out).state_dict()
    for k, v in state.items():
        want = v if ".mlp.router." in k else v.to(torch.bfloat16).to(v.dtype)
        assert torch.equal(back[k], want), k


def test_export_of_a_bpe_run_carries_its_tokenizer(models, tmp_path):
    """A ``bpe:N`` run's export: the run's ``tokenizer.json`` and a ``tokenizer_config.json``
    that transformers reads as the same tokenizer, with the run's end-of-document token."""
    from lrmoe.tokenizer import EOS_TOKEN
    from lrmoe.tokenizer_load import load_tokenizer

    run, out = tmp_path / "bpe", tmp_path / "x"
    assert main(["train", "--preset", "tiny-qwen3", "--tokenizer", "bpe:300", "--data",
                 str(models["rows"]), "--out", str(run), *COMMON]) == 0
    assert main(["export", str(run), str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN}
    tok = tf.AutoTokenizer.from_pretrained(out)
    ours = load_tokenizer("bpe:300", run)
    text = "the quick brown fox, 42 times" + EOS_TOKEN + "again"
    assert tok.eos_token == EOS_TOKEN
    assert tok.encode(text, add_special_tokens=False) == ours.encode(text)


def test_export_of_a_step_without_a_checkpoint_names_the_steps_there(runs, tmp_path, capsys):
    assert main(["export", str(runs["qwen3"]), str(tmp_path / "x"), "--step", "2"]) == 2
    err = capsys.readouterr().err
    assert f"no complete checkpoint of step 2; it has {STEPS}" in err
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- local loading
def _count_reads(monkeypatch) -> list[tuple[str, slice | None, int]]:
    import lrmoe.hf_load as H

    seen = []
    real = H._read_into

    def spy(dst, file, key, rows):
        seen.append((key, rows, dst.numel() * dst.element_size()))
        real(dst, file, key, rows)
    monkeypatch.setattr(H, "_read_into", spy)
    return seen


def _fused_copy(src: Path, dst: Path) -> Path:
    """``src`` rewritten with the fused expert tensors (HF's in-memory names)."""
    import safetensors.torch

    hf = _hf(src)
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    sd = {k: v.detach().contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    safetensors.torch.save_file(sd, str(dst / "model.safetensors"), {"format": "pt"})
    return dst


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("world,ep", [(1, 1), (2, 2), (4, 4), (4, 2)])
def test_each_rank_reads_only_its_tensors(models, monkeypatch, tmp_path, layout, world, ep):
    """Every rank (EP rank = rank % ep) reads the dense tensors and exactly its own
    experts' (of a fused tensor, its rows), bytes = dense + experts / ep; its tensors
    equal the whole model's load bit for bit."""
    from lrmoe.hf_load import empty_model, load_hf, load_owned, open_checkpoint
    from lrmoe.parallel.groups import ParallelContext

    d = models["glm"] if layout == "per-expert" else _fused_copy(models["glm"], tmp_path / "f")
    ck = open_checkpoint(d)
    full = load_hf(d).state_dict()
    expert_bytes = sum(t.numel() * 4 for k, t in full.items() if ".experts." in k
                       and "shared" not in k)
    dense_bytes = sum(t.numel() * 4 for k, t in full.items()
                      if not (".experts." in k and "shared" not in k))
    seen = _count_reads(monkeypatch)
    experts_read = {}
    for rank in range(world):
        seen.clear()
        ctx = ParallelContext(world=world, rank=rank, ep_size=ep)
        model = empty_model(ck.config, ctx)
        rep = load_owned(model, ck)
        mine = {k: v for k, v in model.state_dict().items()}
        assert rep.bytes_read == sum(b for *_, b in seen)  # fp32 file: read = filled
        assert rep.bytes_read == dense_bytes + expert_bytes // ep
        assert rep.tensors == len(seen)
        per = ck.config.num_experts // ep
        own = range(ctx.ep_rank * per, (ctx.ep_rank + 1) * per)
        for key, rows, _ in seen:
            if ".experts." in key and "shared" not in key:
                if layout == "fused":
                    assert rows == (None if ep == 1 else slice(own.start, own.stop)), key
                else:
                    assert int(key.split(".experts.")[1].split(".")[0]) in own, key
        experts_read.setdefault(ctx.ep_rank, set()).update(
            k for k, *_ in seen if ".experts." in k and "shared" not in k)
        for k, v in mine.items():
            if ".experts.gate_up_proj" in k or ".experts.down_proj" in k:
                assert torch.equal(v, full[k][own.start:own.stop]), k
            else:
                assert torch.equal(v, full[k]), k
    if layout == "per-expert":  # the EP ranks' expert reads partition the checkpoint's
        sets = list(experts_read.values())
        assert sum(len(s) for s in sets) == len(set().union(*sets))
        assert set().union(*sets) == {k for k in ck.meta if ".experts." in k
                                      and "shared" not in k}


# ----------------------------------------------------------------------------- bad input
def _run_bad(argv: list[str], capsys, new: Path) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("lrmoe: error: "), err
    assert out == ""
    assert not new.exists()
    return err


def _copy(models, tmp_path, fam="qwen3") -> Path:
    d = tmp_path / "model"
    shutil.copytree(models[fam], d)
    return d


def _train_argv(models, d: Path, new: Path, *extra: str) -> list[str]:
    return ["train", "--init-from", str(d), "--data", str(models["rows"]), "--out", str(new),
            *COMMON, *extra]


def test_directory_without_weights(models, tmp_path, capsys):
    d = _copy(models, tmp_path)
    for p in d.glob("model*.safetensors*"):
        p.unlink()
    err = _run_bad(_train_argv(models, d, tmp_path / "new"), capsys, tmp_path / "new")
    assert "neither model.safetensors nor model.safetensors.index.json" in err


def test_shard_missing_from_the_index(models, tmp_path, capsys):
    d = _copy(models, tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[2]
    (d / shard).unlink()
    err = _run_bad(_train_argv(models, d, tmp_path / "new"), capsys, tmp_path / "new")
    assert shard in err and "not in" in err


def test_tokenizer_larger_than_the_embedding(models, tmp_path, capsys):
    tok = tmp_path / "tok"
    tok.mkdir()
    save_tokenizer(tok, added=VOCAB - 300 + 1)  # ids up to VOCAB: one too many
    new = tmp_path / "new"
    err = _run_bad(_train_argv(models, models["qwen3"], new, "--tokenizer", str(tok)),
                   capsys, new)
    assert f"has ids up to {VOCAB}, beyond the embedding of {models['qwen3']} ({VOCAB} rows" in err


def test_unknown_model_type(models, tmp_path, capsys):
    d = _copy(models, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    err = _run_bad(_train_argv(models, d, tmp_path / "new"), capsys, tmp_path / "new")
    assert "model_type='llama' is not supported" in err


def test_tokenizer_without_an_end_of_document_token(models, tmp_path, capsys):
    d = _copy(models, tmp_path)
    (d / "tokenizer_config.json").write_text("{}")
    (d / "generation_config.json").unlink()
    err = _run_bad(_train_argv(models, d, tmp_path / "new"), capsys, tmp_path / "new")
    assert "names no end-of-document token" in err


def test_init_from_with_a_preset_or_config(models, tmp_path, capsys):
    new = tmp_path / "new"
    for flag, value in (("--preset", "tiny-qwen3"), ("--config", str(models["qwen3"]))):
        err = _run_bad(_train_argv(models, models["qwen3"], new, flag, value), capsys, new)
        assert f"drop {flag}" in err


def test_export_refuses_another_models_directory(runs, models, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(models["glm"], out)  # another model (and another model's weights)
    (out / "tokenizer.json").unlink()  # ... so that the refusal is about the model
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    rc = main(["export", str(runs["qwen3"]), str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "another model's checkpoint" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_export_refuses_to_replace_a_users_tokenizer(runs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    assert main(["export", str(runs["qwen3"]), str(out)]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json that is not this run's" in err
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json"]


def test_export_refuses_a_corrupt_checkpoint(runs, tmp_path, capsys):
    """One byte flipped in the checkpoint's largest file (its size unchanged): export checks
    the manifest's SHA-256 before it reads a tensor, says which file, and writes nothing."""
    from lrmoe.train import checkpoint as ckpt

    run = tmp_path / "run"
    shutil.copytree(runs["qwen3"], run)
    f = max(ckpt.latest_checkpoint(run).path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert main(["export", str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{f} is corrupt (SHA-256" in err
    assert not out.exists()


def test_export_refuses_a_checkpoint_of_another_shape(runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs["qwen3"], run)
    saved = json.loads((run / "config.json").read_text())
    saved["model"]["moe_intermediate_size"] += 8  # the run's model no longer matches
    (run / "config.json").write_text(json.dumps(saved))
    assert main(["export", str(run), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "does not match the run's model" in err and "gate_up_proj" in err
    assert not (tmp_path / "out").exists()
