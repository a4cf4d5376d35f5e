"""Training data: corpus loading, train/validation split, packed token streams, batches
(sources, splits, caps and the batch order: docs/design.md §7, "Data").
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import operator
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from lrmoe.errors import LrmoeError, require
from lrmoe.loss_mask import IGNORE, MaskedBatch, Streams, masked_targets, prompt_rows
from lrmoe.tokenizer import Tokenizer

DEFAULT_MAX_BYTES = 16 * 2**20
VAL_FRACTION = 0.05
SNIFF_BYTES = 1 << 16  # the head of a --data file checked for binary content
_STDLIB_EXCLUDED = {"site-packages", "dist-packages"}


@dataclass
class Corpus:
    """Documents of each split and a one-line description of where they came from."""

    train_texts: list[str]
    val_texts: list[str]
    source: str
    notes: list[str] = dataclasses.field(default_factory=list)  # what was skipped, and why
    # prompt/completion rows: the prompt of each document ("" for a plain text), the
    # texts being the completions; None when no row has a prompt (all trained on)
    train_prompts: list[str] | None = None
    val_prompts: list[str] | None = None


def build_streams(corpus: Corpus, tokenizer: Tokenizer) -> Streams:
    """Tokenize both splits (see the module doc for prompt/completion rows)."""
    if corpus.train_prompts is None or corpus.val_prompts is None:
        return Streams(tokenizer.encode_documents(corpus.train_texts),
                       tokenizer.encode_documents(corpus.val_texts))
    train_ids, train_mask = prompt_rows(tokenizer, corpus.train_prompts, corpus.train_texts)
    val_ids, val_mask = prompt_rows(tokenizer, corpus.val_prompts, corpus.val_texts)
    return Streams(train_ids, val_ids, train_mask, val_mask)


def _is_val(key: str) -> bool:
    h = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")
    return h < VAL_FRACTION * 2**64


def _decode(raw: bytes, truncated: bool, strict: bool) -> str | None:
    """Text of ``raw``, or None when it is not text (binary, non-UTF-8, blank)."""
    if strict and b"\0" in raw:
        return None
    # final=False drops a UTF-8 sequence that the byte cap cut in half.
    dec = codecs.getincrementaldecoder("utf-8")("strict" if strict else "replace")
    try:
        text = dec.decode(raw, final=not truncated)
    except UnicodeDecodeError:
        return None
    return text if text.strip() else None


class _Collector:
    """Routes documents into the two splits under byte budgets (None = unlimited)."""

    def __init__(self, max_bytes: int | None, val_max_bytes: int | None):
        # each split's documents as (prompt, text), the prompt "" for a plain text
        self.rows: dict[bool, list[tuple[str, str]]] = {False: [], True: []}
        self.left: dict[bool, int | None] = {False: max_bytes, True: val_max_bytes}

    def has_room(self, val: bool) -> bool:
        left = self.left[val]
        return left is None or left > 0

    def full(self) -> bool:
        return not self.has_room(False) and not self.has_room(True)

    def add_raw(self, val: bool, raw: bytes, strict: bool = True, more: bool = False) -> None:
        """``raw`` cut to the split's budget (``more``: its source goes on after it)."""
        room = self.left[val]
        truncated = more or (room is not None and len(raw) > room)
        raw = raw[:room]
        text = _decode(raw, truncated, strict)
        if text is not None:
            self.add_row(val, "", text, len(raw))

    def add_row(self, val: bool, prompt: str, text: str, nbytes: int | None = None) -> None:
        """A document of ``nbytes`` read (default: its UTF-8 size); a prompt/completion row
        comes whole (the byte budget never cuts a row)."""
        self.rows[val].append((prompt, text))
        if self.left[val] is not None:
            self.left[val] -= len((prompt + text).encode("utf-8")) if nbytes is None else nbytes

    def splits(self, what: str, why: str = "") -> tuple[list[tuple[str, str]], ...]:
        train, val = self.rows[False], self.rows[True]
        if not train and not val:
            raise LrmoeError(f"{what} holds no text{why}")
        if not train or not val:
            pool = train or val
            if len(pool) >= 2:
                (val if train else train).append(pool.pop())
            elif pool[0][0]:
                raise LrmoeError(f"{what} holds one prompt/completion row: too few to split "
                                 "into training and validation; give at least two")
            else:
                head, tail = _split_text(pool[0][1], what)
                train, val = [("", head)], [("", tail)]
        return train, val


def _split_text(text: str, what: str) -> tuple[str, str]:
    """Last ``VAL_FRACTION`` of one text as validation, cut at a line start if possible."""
    require(len(text) >= 2, f"{what} holds too little text to split ({len(text)} character)")
    cut = min(max(1, int(len(text) * (1 - VAL_FRACTION))), len(text) - 1)
    nl = text.find("\n", cut)
    if 0 <= nl < len(text) - 1:
        cut = nl + 1
    return text[:cut], text[cut:]


def _tree_files(root: Path, suffix: str | None, excluded: set[str]) -> list[tuple[str, Path]]:
    """(relative POSIX path, path) of regular files below ``root``, sorted by the former."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames
                       if d not in excluded and d != "__pycache__" and not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            path = Path(dirpath) / name
            if path.is_file():
                out.append((path.relative_to(root).as_posix(), path))
    out.sort()
    return out


def _load_tree(root: Path, col: _Collector, suffix: str | None, excluded: set[str]) -> None:
    for rel, path in _tree_files(root, suffix, excluded):
        if col.full():
            break
        val = _is_val(rel)
        room = col.left[val]
        if not col.has_room(val):
            continue
        try:
            with open(path, "rb") as f:
                raw = f.read() if room is None else f.read(room + 1)
        except OSError:
            continue  # unreadable: skipped, as a binary file is
        col.add_raw(val, raw)


def _jsonl_row(path: Path, lineno: int, obj: dict) -> tuple[str, str] | None:
    """A line's ``(prompt, completion)`` (prompt "" for a ``text`` line), or None."""
    pc = [k for k in ("prompt", "completion") if k in obj]
    if pc and "text" in obj:
        raise LrmoeError(f"data path {str(path)!r}: line {lineno} has both 'text' and "
                         f"'{pc[0]}'; a line is either text or a prompt/completion row")
    if len(pc) == 1:
        other = "completion" if pc[0] == "prompt" else "prompt"
        raise LrmoeError(f"data path {str(path)!r}: line {lineno} has '{pc[0]}' without "
                         f"'{other}'")
    fields = pc or [k for k in ("text",) if k in obj]
    for k in fields:
        if not isinstance(obj[k], str):
            raise LrmoeError(f"data path {str(path)!r}: line {lineno}: field '{k}' must be "
                             f"a string, got {type(obj[k]).__name__}")
    if not fields:
        return None
    return (obj["prompt"], obj["completion"]) if pc else ("", obj["text"])


def _load_jsonl(path: Path, col: _Collector) -> list[str]:
    """Read the ``text`` fields and prompt/completion rows; returns notes on skipped lines."""
    no_text = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if col.full():
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line.strip())
            except json.JSONDecodeError as e:
                raise LrmoeError(f"data path {str(path)!r}: line {lineno} is not valid JSON "
                                 f"({e.msg} at column {e.colno})") from None
            except UnicodeDecodeError:
                raise LrmoeError(f"data path {str(path)!r}: line {lineno} is not UTF-8") from None
            row = _jsonl_row(path, lineno, obj) if isinstance(obj, dict) else None
            if row is None:
                no_text += 1
                continue
            prompt, text = row
            val = _is_val(str(lineno))
            if text.strip() and col.has_room(val):
                if prompt:
                    col.add_row(val, prompt, text)
                else:
                    col.add_raw(val, text.encode("utf-8"), strict=False)
    return [f"{path}: skipped {no_text} line(s) without a 'text' field"] if no_text else []


def _check_text_head(path: Path) -> None:
    """Refuse a binary file: a NUL byte or invalid UTF-8 in its first bytes."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    nul = head.find(b"\0")
    if nul >= 0:
        raise LrmoeError(f"data path {str(path)!r} is not text (a NUL byte at offset {nul}); "
                         "give a UTF-8 text file, a .jsonl file or a directory")
    try:  # final=False: a character cut by the head's end is not an error
        codecs.getincrementaldecoder("utf-8")("strict").decode(head, final=False)
    except UnicodeDecodeError as e:
        raise LrmoeError(f"data path {str(path)!r} is not UTF-8 text (invalid byte at offset "
                         f"{e.start}); give a UTF-8 text file, a .jsonl file or a "
                         "directory") from None


def _load_text_file(path: Path, col: _Collector) -> None:
    """Train = bytes before the split point, validation = bytes after it, each capped."""
    size = path.stat().st_size
    require(size > 0, f"data path {str(path)!r} holds no text (empty file)")
    _check_text_head(path)
    with open(path, "rb") as f:
        cut = max(1, int(size * (1 - VAL_FRACTION)))
        f.seek(cut)
        nl = f.read(1 << 16).find(b"\n")
        if nl >= 0 and cut + nl + 1 < size:
            cut += nl + 1
        for val, start, end in ((False, 0, cut), (True, cut, size)):
            room = col.left[val]
            stop = end if room is None else min(end, start + room)
            f.seek(start)
            col.add_raw(val, f.read(stop - start), strict=False, more=stop < size)


def _mib(rows: list[tuple[str, str]]) -> str:
    return f"{sum(len((p + t).encode('utf-8')) for p, t in rows) / 2**20:.2f} MiB"


def load_corpus(
    data: str | os.PathLike | None = None,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
) -> Corpus:
    """Load and split a corpus (see module docstring). ``max_bytes=None``: no cap; the
    validation split's cap is a sixteenth of it."""
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
        raise LrmoeError(f"max_bytes must be a positive integer or None, got {max_bytes!r}")
    col = _Collector(max_bytes, None if max_bytes is None else max(max_bytes // 16, 1))
    why, notes = "", []
    if data is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        what = f"the Python stdlib at {root}"
        why = ": no readable UTF-8 .py files found there; pass --data PATH"
        _load_tree(root, col, ".py", _STDLIB_EXCLUDED)
        desc = f"Python {sys.version.split()[0]} stdlib .py files under {root}"
    else:
        path = Path(data)
        what = f"data path {str(path)!r}"
        require(path.exists(), f"data path {str(path)!r} does not exist")
        try:
            if path.is_dir():
                why = ": no regular file below it is UTF-8 text"
                _load_tree(path, col, None, set())
                desc = f"text files under {path}"
            elif path.is_file() and path.suffix == ".jsonl":
                why = ": no line has a non-empty string field 'text' (or 'completion')"
                notes = _load_jsonl(path, col)
                desc = f"'text' fields of {path}"
            elif path.is_file():
                _load_text_file(path, col)
                desc = f"text of {path}"
            else:
                raise LrmoeError(f"data path {str(path)!r} is neither a file nor a directory")
        except OSError as e:  # unreadable (permissions, I/O error): a read, not a write
            where = e.filename or path
            raise LrmoeError(f"cannot read data path {str(where)!r}: {e.strerror or e}; "
                             "give --data a file or directory this user can read") from None
    train, val = col.splits(what, why)
    prompted = any(p for p, _ in train + val)
    if prompted:
        desc = f"prompt/completion rows of {data} (trained on the completions)"
    source = (f"{desc}: {len(train)} train documents ({_mib(train)}), "
              f"{len(val)} validation documents ({_mib(val)})")
    return Corpus([t for _, t in train], [t for _, t in val], source, notes,
                  train_prompts=[p for p, _ in train] if prompted else None,
                  val_prompts=[p for p, _ in val] if prompted else None)


def _check_int(name: str, value: object, low: int = 1) -> int:
    try:  # operator.index also admits numpy/torch integer scalars, but not floats/bools
        v = -1 if isinstance(value, bool) else operator.index(value)
    except TypeError:
        v = low - 1
    if v < low:
        raise LrmoeError(f"{name} must be an integer >= {low}, got {value!r}")
    return v


def _check_rank(rank: object, world: object) -> int:
    """``world``, checked, once ``rank`` is checked to be one of its ranks."""
    world = _check_int("world", world)
    if not 0 <= _check_int("rank", rank, low=0) < world:
        raise LrmoeError(f"rank {rank} is out of range for world size {world}")
    return world


def _windows(ids: torch.Tensor, seq_len: int, what: str) -> int:
    require(ids.dim() == 1, f"{what} token stream must be 1-D, got shape {tuple(ids.shape)}")
    n = (ids.numel() - 1) // seq_len
    if n < 1:
        raise LrmoeError(
            f"{what} token stream has {ids.numel()} tokens, shorter than one window of "
            f"seq_len + 1 = {seq_len + 1} tokens; use more data or a smaller seq_len"
        )
    return n


class PackedBatches:
    """Global batches of packed windows of one token stream, batch ``step`` a function of
    ``(ids, seq_len, batch_size, seed, step)`` alone (docs/design.md §7, "Data")."""

    def __init__(self, ids: torch.Tensor, seq_len: int, batch_size: int, seed: int = 0,
                 target_mask: torch.Tensor | None = None, accum: int = 1):
        self.seq_len = _check_int("seq_len", seq_len)
        self.batch_size = _check_int("batch_size", batch_size)
        self.num_windows = _windows(ids, self.seq_len, "training")
        self.ids = ids.long()
        self.seed = int(seed)
        self._perms: dict[int, torch.Tensor] = {}
        # with a mask, batch() gives MaskedBatch: each window's trained targets counted
        # once, a step's total from its accum global batches (cached)
        self.mask = None if target_mask is None else target_mask.bool()
        self.accum = _check_int("accum", accum)
        if self.mask is not None:
            if self.mask.shape != self.ids.shape:
                raise LrmoeError(f"target mask of shape {tuple(self.mask.shape)} does not "
                                 f"match the token stream's {tuple(self.ids.shape)}")
            c = torch.cat([torch.zeros(1, dtype=torch.long), self.mask.long().cumsum(0)])
            w = torch.arange(self.num_windows) * self.seq_len
            self._win_targets = c[w + self.seq_len + 1] - c[w + 1]
        self._step_total: tuple[int, int] | None = None

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) >= 4:
                self._perms.pop(next(iter(self._perms)))
            digest = hashlib.sha256(f"lrmoe-data:{self.seed}:{epoch}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)
            self._perms[epoch] = torch.randperm(self.num_windows, generator=g)
        return self._perms[epoch]

    def window_indices(self, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        """Window ids of rank's rows of global batch ``step``: int64 ``[B // world]``."""
        step = _check_int("step", step, low=0)
        world = _check_rank(rank, world)
        if self.batch_size % world:
            raise LrmoeError(f"global batch size {self.batch_size} is not divisible by the "
                             f"data-parallel world size {world}")
        local = self.batch_size // world
        first = step * self.batch_size + rank * local
        out = torch.empty(local, dtype=torch.long)
        done = 0
        while done < local:
            epoch, pos = divmod(first + done, self.num_windows)
            take = min(local - done, self.num_windows - pos)
            out[done : done + take] = self._perm(epoch)[pos : pos + take]
            done += take
        return out

    def batch(self, step: int, rank: int = 0, world: int = 1) -> torch.Tensor | MaskedBatch:
        """Rank's contiguous rows of global batch ``step``: int64 ``[B // world, L + 1]`` (inputs
        ``[:, :-1]``, targets ``[:, 1:]``); with a target mask a :class:`MaskedBatch`."""
        starts = self.window_indices(step, rank, world) * self.seq_len
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        rows = self.ids[idx]
        if self.mask is None:
            return rows
        total = self.step_targets(step // self.accum)
        return MaskedBatch(rows, masked_targets(rows, self.mask[idx[:, 1:]]),
                           max(total, 1) / (world * self.accum))

    def step_targets(self, opt_step: int) -> int:
        """Trained targets of optimizer step ``opt_step`` (its ``accum`` global batches)."""
        if self._step_total is None or self._step_total[0] != opt_step:
            first = opt_step * self.accum
            n = sum(int(self._win_targets[self.window_indices(g)].sum())
                    for g in range(first, first + self.accum))
            self._step_total = (opt_step, n)
        return self._step_total[1]


def validation_batches(
    ids: torch.Tensor, seq_len: int, batch_size: int, num_windows: int | None = None,
    rank: int = 0, world: int = 1, target_mask: torch.Tensor | None = None,
) -> list[torch.Tensor] | list[MaskedBatch]:
    """The first ``num_windows`` windows of ``ids`` (None: all) in order, as batches of at most
    ``batch_size`` rows; each rank a contiguous share, within one window of the others' (reduce
    sums, not means), maybe none; with ``target_mask``, :class:`MaskedBatch` es."""
    seq_len = _check_int("seq_len", seq_len)
    batch_size = _check_int("batch_size", batch_size)
    world = _check_rank(rank, world)
    k = _windows(ids, seq_len, "validation")
    if num_windows is not None:
        k = min(k, _check_int("num_windows", num_windows))
    mine = torch.tensor_split(torch.arange(k), world)[rank]
    idx = mine[:, None] * seq_len + torch.arange(seq_len + 1)
    rows = ids.long()[idx]
    if target_mask is None:
        return list(torch.split(rows, batch_size)) if len(rows) else []
    targets = masked_targets(rows, target_mask.bool()[idx[:, 1:]])
    return [MaskedBatch(r, t, float((t != IGNORE).sum()))
            for r, t in zip(torch.split(rows, batch_size), torch.split(targets, batch_size))]
