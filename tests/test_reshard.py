"""Resume on another world / EP size (gloo on loopback, tiny-qwen3, a few steps).

One checkpoint is written at step 2 by 4 processes at ``--ep 4``; copies of it resume
for one more step at ``--ep 4`` (the same-size reference), under DP2 x EP2 (4
processes), at ``--ep 2`` (2 processes) and on one process. Each checks:

* the state right after loading (model, AdamW moments and steps, scheduler), on every
  rank, equals the saving ranks' state exactly (expert rows by global id);
* step 3's loss equals the same-size resume's within 1e-5 relative.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_util import run_world
from lrmoe.errors import LrmoeError
from lrmoe.parallel.groups import expert_ids
from lrmoe.train import checkpoint as ckpt
from lrmoe.train import ckpt_state
from lrmoe.train.loop import TrainConfig, train
from lrmoe.train.metrics import read_metrics

SAVED_AT = 2
BASE = dict(preset="tiny-qwen3", steps=4, batch_size=8, seq_len=32, max_data_bytes=100_000,
            eval_batches=1, eval_every=0, ckpt_every=2, warmup=1, threads=1, log_every=100,
            timeout_s=120.0, progress=False)
E = 16  # tiny-qwen3's routed experts
# name -> (world size, --ep) of each resume from the --ep 4 checkpoint
RESUMES = {"ep4": (4, 4), "dp2ep2": (4, 2), "ep2": (2, 2), "ep1": (1, 1)}


# ----------------------------------------------------------------------------- helpers
def _snapshot(model, opt, sched_state: dict) -> dict:
    """Model, name-keyed optimizer state and scheduler, copied, with expert ids."""
    names = {id(p): n for n, p in model.named_parameters()}
    optim = {names[id(p)]: {k: v.detach().clone() for k, v in st.items()}
             for p, st in opt.state.items()}
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": optim, "experts": {k: list(v) for k, v in expert_ids(model).items()},
            "sched": sched_state}


@contextlib.contextmanager
def _dumping(path_of_rank):
    """Record each rank's state as it is saved and right after it is loaded."""
    save, load = ckpt.save_checkpoint, ckpt.load_checkpoint

    def save_hook(run_dir, step, model, opt, **kw):
        torch.save(_snapshot(model, opt, kw["trainer"]["scheduler"]),
                   path_of_rank("saved", kw["rank"]))
        return save(run_dir, step, model, opt, **kw)

    def load_hook(ck, model, opt, sched, *a, **kw):
        out = load(ck, model, opt, sched, *a, **kw)
        torch.save(_snapshot(model, opt, sched.state_dict()), path_of_rank("loaded", kw["ctx"].rank))
        return out

    ckpt.save_checkpoint, ckpt.load_checkpoint = save_hook, load_hook
    try:
        yield
    finally:
        ckpt.save_checkpoint, ckpt.load_checkpoint = save, load


def _dump_path(root: Path, run: str):
    return lambda what, rank: root / f"{what}-{run}-{rank}.pt"


def _resume(root: Path, name: str, ep: int) -> None:
    with _dumping(_dump_path(root, name)):
        train(TrainConfig.from_flat(out=str(root / name), resume=True, ep=ep, stop_after=SAVED_AT + 1,
                          **BASE))


def _copy_saved(root: Path, names: list[str], rank: int) -> None:
    if rank == 0:
        for n in names:
            shutil.copytree(root / "saved", root / n)
    if dist.is_initialized():
        dist.barrier()


def _world4(rank: int, world: int, root: Path) -> None:
    with _dumping(_dump_path(root, "saved")):
        train(TrainConfig.from_flat(out=str(root / "saved"), ep=4, stop_after=SAVED_AT, **BASE))
    _copy_saved(root, ["ep4", "dp2ep2"], rank)
    _resume(root, "ep4", 4)
    _resume(root, "dp2ep2", 2)


def _world2(rank: int, world: int, root: Path) -> None:
    _copy_saved(root, ["ep2"], rank)
    _resume(root, "ep2", 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run of this file; the one-process resume also captures its stderr."""
    root = tmp_path_factory.mktemp("reshard")
    run_world(4, _world4, root, tmp_path=root)
    run_world(2, _world2, root, tmp_path=root)
    _copy_saved(root, ["ep1"], 0)
    # a newer checkpoint directory without a manifest: skipped, and said so
    ckpt.ckpt_dir(root / "ep1", 9).mkdir()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        _resume(root, "ep1", 1)
    return {"root": root, "ep1_stderr": err.getvalue()}


@pytest.fixture(scope="module")
def saved_full(runs) -> dict:
    """The --ep 4 ranks' saved state merged into one process's: experts by global id."""
    root = runs["root"]
    parts = [torch.load(_dump_path(root, "saved")("saved", r)) for r in range(4)]
    full = {"model": dict(parts[0]["model"]), "optim": dict(parts[0]["optim"]),
            "sched": parts[0]["sched"]}
    for kind in ("model", "optim"):
        for name in parts[0]["experts"]:
            # rank r of --ep 4 owns experts 4r..4r+3
            assert [parts[r]["experts"][name] for r in range(4)] == [
                list(range(4 * r, 4 * r + 4)) for r in range(4)]
            if kind == "model":
                full[kind][name] = torch.cat([parts[r]["model"][name] for r in range(4)])
            else:
                full[kind][name] = {k: (torch.cat([parts[r]["optim"][name][k] for r in range(4)])
                                        if v.ndim else v)
                                    for k, v in parts[0]["optim"][name].items()}
    return full


def _train_loss(run: Path, step: int) -> float:
    rows = [r for r in read_metrics(run / "metrics.jsonl")
            if r["kind"] == "train" and r["step"] == step]
    assert len(rows) == 1, rows
    return rows[0]["loss"]


# ----------------------------------------------------------------------------- tests
@pytest.mark.dist
@pytest.mark.parametrize("name", list(RESUMES))
def test_resumed_state_equals_saved(runs, saved_full, name):
    root, full = runs["root"], saved_full
    world, ep = RESUMES[name]
    for rank in range(world):
        got = torch.load(_dump_path(root, name)("loaded", rank))
        assert got["sched"] == full["sched"]
        assert set(got["model"]) == set(full["model"])
        assert set(got["optim"]) == set(full["optim"])
        for name_, t in got["model"].items():
            ids = got["experts"].get(name_)
            want = full["model"][name_] if ids is None else full["model"][name_][ids]
            if ids is not None:
                assert ids == list(range(rank % ep * E // ep, (rank % ep + 1) * E // ep))
            assert torch.equal(t, want), (name, rank, name_)
        for name_, st in got["optim"].items():
            ids = got["experts"].get(name_)
            assert set(st) == set(full["optim"][name_]) == {"step", "exp_avg", "exp_avg_sq"}
            for k, t in st.items():
                want = full["optim"][name_][k]
                want = want[ids] if ids is not None and t.ndim else want
                assert t.dtype == want.dtype and torch.equal(t, want), (name, rank, name_, k)
                if k == "step":
                    assert float(t) == SAVED_AT


@pytest.mark.dist
@pytest.mark.parametrize("name", ["dp2ep2", "ep2", "ep1"])
def test_next_step_loss_matches_same_size_resume(runs, name):
    root = runs["root"]
    want = _train_loss(root / "ep4", SAVED_AT + 1)
    got = _train_loss(root / name, SAVED_AT + 1)
    print(f"{name}: step {SAVED_AT + 1} loss {got!r} vs --ep 4 resume {want!r} "
          f"(rel {abs(got - want) / abs(want):.1e})")
    assert abs(got - want) <= 1e-5 * abs(want)
    # the steps before the checkpoint were kept from the --ep 4 run
    assert _train_loss(root / name, SAVED_AT) == _train_loss(root / "saved", SAVED_AT)


@pytest.mark.dist
def test_resume_names_the_checkpoint_and_what_it_skipped(runs):
    err = runs["ep1_stderr"]
    line = next(x for x in err.splitlines() if x.startswith("resuming from"))
    assert "ckpt-00000002" in line and "world size 4 with --ep 4" in line
    assert "ckpt-00000009" in line and "no manifest.json" in line
    m = json.loads((ckpt.ckpt_dir(runs["root"] / "ep1", 3) / ckpt.MANIFEST).read_text())
    assert (m["step"], m["world"], m["ep_size"]) == (3, 1, 1)


@pytest.mark.dist
def test_manifest_and_layout(runs):
    ck = ckpt.latest_checkpoint(runs["root"] / "saved")
    assert (ck.step, ck.world, ck.ep_size, ck.notes) == (SAVED_AT, 4, 4, [])
    names = sorted(p.name for p in ck.path.iterdir())
    assert names == sorted([*ck.manifest["files"], ckpt.MANIFEST])
    assert ".metadata" in names and any(n.endswith(".distcp") for n in names)
    assert not ckpt.partial_dirs(runs["root"] / "saved")
    ckpt.verify_files(ck)
    state, trainer = ckpt.merged_model_state(ck)
    gate_up = "layers.0.mlp.experts.gate_up_proj"
    assert state[gate_up].shape[0] == E and trainer["progress"]["tokens"] == SAVED_AT * 8 * 32


def test_old_format_is_refused(tmp_path):
    d = ckpt.ckpt_dir(tmp_path, 5)
    d.mkdir(parents=True)
    (d / ckpt.MANIFEST).write_text(json.dumps({"format": "lrmoe-checkpoint-v1"}))
    with pytest.raises(LrmoeError, match="old lrmoe-checkpoint-v1 format"):
        ckpt.latest_checkpoint(tmp_path)


def test_resume_with_an_ep_that_does_not_fit_says_so(tmp_path):
    with pytest.raises(LrmoeError, match="pass --ep N"):
        train(TrainConfig.from_flat(out=str(tmp_path), resume=True, ep=4, **BASE))


def test_reseed_is_reproducible_and_per_rank():
    g = torch.Generator()
    draws = []
    for rank in (0, 0, 1):
        ckpt_state.apply_rng(None, g, torch.device("cpu"), (7, 100, rank))
        draws.append((torch.rand(3), torch.rand(3, generator=g)))
    assert all(torch.equal(a, b) for a, b in zip(draws[0], draws[1]))
    assert not torch.equal(*draws[0])  # the runtime generator's stream is not torch's
    assert not torch.equal(draws[0][0], draws[2][0])
    assert not torch.equal(draws[0][1], draws[2][1])
    # the step is part of the seed too: a resume at another step draws another stream
    ckpt_state.apply_rng(None, g, torch.device("cpu"), (7, 101, 0))
    assert not torch.equal(torch.rand(3), draws[0][0])


def test_saved_rng_states_are_restored():
    """A rank's saved states put the global and the runtime generators back where they were:
    the draws after the save repeat exactly after the restore."""
    g = torch.Generator().manual_seed(3)
    torch.rand(5), torch.rand(5, generator=g)
    saved = ckpt_state.rng_state(g, torch.device("cpu"))
    want = (torch.rand(4), torch.rand(4, generator=g))
    torch.rand(7), torch.rand(7, generator=g)  # the run goes on, then resumes
    ckpt_state.apply_rng(saved, g, torch.device("cpu"), (0, 0, 0))
    assert torch.equal(torch.rand(4), want[0])
    assert torch.equal(torch.rand(4, generator=g), want[1])
