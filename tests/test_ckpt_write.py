"""A checkpoint save stages at most one file's tensors in host memory at a time, and
its files (several per rank) load back exactly (:mod:`lrmoe.train.ckpt_write`)."""

from __future__ import annotations

import weakref

import torch

from lrmoe.model import MoEForCausalLM
from lrmoe.parallel.groups import ParallelContext
from lrmoe.presets import get_preset
from lrmoe.train import checkpoint as ckpt
from lrmoe.train import ckpt_state, ckpt_write
from lrmoe.train.optim import build_optimizer, build_scheduler

LIMIT = 256 * 1024  # bytes a file: tiny-qwen3's expert rows (48 KiB) span many files


def _stepped(seed: int):
    """tiny-qwen3 with host-offloaded AdamW state after one step on random gradients."""
    torch.manual_seed(seed)
    model = MoEForCausalLM(get_preset("tiny-qwen3"))
    opt = build_optimizer(model, 1e-3, 0.1, offload="host")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt, build_scheduler(opt, 1, 10)


def _save(root, model, opt, sched):
    return ckpt.save_checkpoint(root, 1, model, opt, rank=0, world=1, ep_size=1,
                                rng=ckpt_state.rng_state(None, torch.device("cpu")),
                                trainer={"scheduler": sched.state_dict(), "progress": {}})


def test_save_stages_one_file_at_a_time(tmp_path, monkeypatch):
    """Every staged copy (an expert row's compact clone) is dropped when its file is
    closed: the copies alive at once never exceed one file's bytes."""
    model, opt, sched = _stepped(0)
    live_state = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    live_state |= {v.untyped_storage().data_ptr() for st in opt.state.values()
                   for v in st.values()}
    staged: list[tuple[weakref.ref, int]] = []
    most = [0]
    save = torch.save

    def counting_save(obj, f, *a, **kw):
        if isinstance(obj, torch.Tensor) and obj.untyped_storage().data_ptr() not in live_state:
            staged.append((weakref.ref(obj), obj.nbytes))
            most[0] = max(most[0], sum(n for r, n in staged if r() is not None))
        return save(obj, f, *a, **kw)

    monkeypatch.setattr(ckpt_write, "FILE_BYTES", LIMIT)
    monkeypatch.setattr(torch, "save", counting_save)
    d = _save(tmp_path, model, opt, sched)
    total = sum(n for _, n in staged)
    assert total > 32 * LIMIT, "too few staged bytes for the bound to mean anything"
    assert most[0] <= LIMIT, f"{most[0]} staged bytes alive at once, a file holds {LIMIT}"
    assert len(list(d.glob("*.distcp"))) > 32


def test_a_save_in_many_files_loads_back_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_write, "FILE_BYTES", LIMIT)
    model, opt, sched = _stepped(0)
    _save(tmp_path, model, opt, sched)
    ck = ckpt.latest_checkpoint(tmp_path)
    ckpt.verify_files(ck)
    merged, _ = ckpt.merged_model_state(ck)
    assert merged.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(merged[k], v), k
    fresh, fresh_opt, fresh_sched = _stepped(1)
    ckpt.load_checkpoint(ck, fresh, fresh_opt, fresh_sched, None, None, ctx=ParallelContext(),
                         seed=0)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
        for k, v in opt.state[p].items():
            assert torch.equal(fresh_opt.state[q][k], v), k


def test_files_of_cuts_in_order():
    class Item:  # a tensor write item's shape as files_of reads it
        def __init__(self, n):
            self.type = None
            self.tensor_data = type("T", (), {"size": torch.Size([n]), "properties":
                                              type("P", (), {"dtype": torch.float32})})

    items = [Item(n) for n in (10, 10, 30, 5, 40, 1)]  # 4 bytes each element
    cut = ckpt_write.files_of(items, 80)
    assert [[4 * i.tensor_data.size.numel() for i in f] for f in cut] == [
        [40, 40], [120], [20], [160], [4]]
    # a pickled object (no tensor bytes) comes first: it opens the first file
    sizes = [0, 1, 0, 80, 0]
    assert ckpt_write.files_of(list(range(5)), 80, nbytes=sizes.__getitem__) == [
        [0, 1, 2], [3, 4]]
