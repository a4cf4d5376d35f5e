"""Training data: corpus loading, train/validation split, packed token streams, batches.

Sources accepted by :func:`load_corpus`:

- ``None``: the ``.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``, without ``site-packages``/``dist-packages``),
  read at run time. Split by file: a file is validation when the SHA-256 of its
  relative POSIX path falls in the first ``VAL_FRACTION`` of the hash range, so the
  split is the same on every machine with the same stdlib.
- a directory: every regular file below it (sorted, hidden and ``__pycache__`` skipped)
  that is UTF-8 text without NUL bytes; split by file as above.
- a ``.jsonl`` file: one JSON object per line, documents from its ``text`` field;
  split by the hash of the 1-based line number. Lines without a ``text`` field are
  skipped and counted (:attr:`Corpus.notes`).
- any other file (``.txt``, ``.md``...): one document; the last ``VAL_FRACTION`` of its
  bytes (moved to the next line start) is validation. A file whose first
  ``SNIFF_BYTES`` hold a NUL byte or invalid UTF-8 is refused as binary.

Files are read in sorted order until the training split holds ``max_bytes`` bytes and
validation ``val_max_bytes`` (default ``max_bytes // 16``); the last document of a full
split is cut. Validation is never empty: if no document hashed into it, the last
training document moves there (a single document is split by lines).

:func:`build_token_streams` appends the tokenizer's ``eos_id`` (0, see
:mod:`lrmoe.tokenizer`) after every document and concatenates them.
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

from lrmoe.errors import LrmoeError
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
        self.texts: dict[bool, list[str]] = {False: [], True: []}
        self.left: dict[bool, int | None] = {False: max_bytes, True: val_max_bytes}

    def has_room(self, val: bool) -> bool:
        left = self.left[val]
        return left is None or left > 0

    def full(self) -> bool:
        return not self.has_room(False) and not self.has_room(True)

    def add_raw(self, val: bool, raw: bytes, truncated: bool, strict: bool = True) -> bool:
        text = _decode(raw, truncated, strict)
        if text is None:
            return False
        self.texts[val].append(text)
        if self.left[val] is not None:
            self.left[val] -= len(raw)
        return True

    def add_text(self, val: bool, text: str) -> None:
        raw, room = text.encode("utf-8"), self.left[val]
        cut = room is not None and len(raw) > room
        self.add_raw(val, raw[:room] if cut else raw, truncated=cut, strict=False)

    def splits(self, what: str, why: str = "") -> tuple[list[str], list[str]]:
        train, val = self.texts[False], self.texts[True]
        if not train and not val:
            raise LrmoeError(f"{what} holds no text{why}")
        if not train or not val:
            pool = train or val
            if len(pool) >= 2:
                moved = pool.pop()
                (val if train else train).append(moved)
            else:
                train, val = _split_text(pool[0], what)
        return train, val


def _split_text(text: str, what: str) -> tuple[list[str], list[str]]:
    """Last ``VAL_FRACTION`` of one text as validation, cut at a line start if possible."""
    if len(text) < 2:
        raise LrmoeError(f"{what} holds too little text to split ({len(text)} character)")
    cut = min(max(1, int(len(text) * (1 - VAL_FRACTION))), len(text) - 1)
    nl = text.find("\n", cut)
    if 0 <= nl < len(text) - 1:
        cut = nl + 1
    return [text[:cut]], [text[cut:]]


def _read_file(path: Path, room: int | None) -> tuple[bytes, bool] | None:
    try:
        with open(path, "rb") as f:
            raw = f.read() if room is None else f.read(room + 1)
    except OSError:
        return None
    if room is not None and len(raw) > room:
        return raw[:room], True
    return raw, False


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
        if not col.has_room(val):
            continue
        got = _read_file(path, col.left[val])
        if got is not None:
            col.add_raw(val, *got)


def _load_jsonl(path: Path, col: _Collector) -> list[str]:
    """Read the ``text`` fields; returns notes on the lines skipped."""
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
            if not isinstance(obj, dict) or "text" not in obj:
                no_text += 1
                continue
            text = obj["text"]
            if not isinstance(text, str):
                raise LrmoeError(f"data path {str(path)!r}: line {lineno}: field 'text' must be "
                                 f"a string, got {type(text).__name__}")
            val = _is_val(str(lineno))
            if text.strip() and col.has_room(val):
                col.add_text(val, text)
    if not col.texts[False] and not col.texts[True]:
        raise LrmoeError(f"data path {str(path)!r} holds no text: no line has a non-empty "
                         f"string field 'text'")
    if no_text:
        return [f"{path}: skipped {no_text} line(s) without a 'text' field"]
    return []


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
    if size == 0:
        raise LrmoeError(f"data path {str(path)!r} holds no text (empty file)")
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
            col.add_raw(val, f.read(stop - start), truncated=stop < size, strict=False)


def _mib(texts: list[str]) -> str:
    return f"{sum(len(t.encode('utf-8')) for t in texts) / 2**20:.2f} MiB"


def load_corpus(
    data: str | os.PathLike | None = None,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    val_max_bytes: int | None = None,
) -> Corpus:
    """Load and split a corpus (see module docstring). ``max_bytes=None``: no cap."""
    for name, value in (("max_bytes", max_bytes), ("val_max_bytes", val_max_bytes)):
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise LrmoeError(f"{name} must be a positive integer or None, got {value!r}")
    if val_max_bytes is None and max_bytes is not None:
        val_max_bytes = max(max_bytes // 16, 1)
    col = _Collector(max_bytes, val_max_bytes)
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
        if not path.exists():
            raise LrmoeError(f"data path {str(path)!r} does not exist")
        try:
            if path.is_dir():
                why = ": no regular file below it is UTF-8 text"
                _load_tree(path, col, None, set())
                desc = f"text files under {path}"
            elif path.is_file() and path.suffix == ".jsonl":
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
    source = (f"{desc}: {len(train)} train documents ({_mib(train)}), "
              f"{len(val)} validation documents ({_mib(val)})")
    return Corpus(train, val, source, notes)


def build_token_streams(corpus: Corpus, tokenizer: Tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize both splits: ``(train_ids [N_train], val_ids [N_val])``, int64, 1-D.

    Every document is followed by ``tokenizer.eos_id``.
    """
    return tokenizer.encode_documents(corpus.train_texts), tokenizer.encode_documents(
        corpus.val_texts
    )


def _check_int(name: str, value: object, low: int = 1) -> int:
    try:  # operator.index also admits numpy/torch integer scalars, but not floats/bools
        v = -1 if isinstance(value, bool) else operator.index(value)
    except TypeError:
        v = low - 1
    if v < low:
        raise LrmoeError(f"{name} must be an integer >= {low}, got {value!r}")
    return v


def _windows(ids: torch.Tensor, seq_len: int, what: str) -> int:
    if ids.dim() != 1:
        raise LrmoeError(f"{what} token stream must be 1-D, got shape {tuple(ids.shape)}")
    n = (ids.numel() - 1) // seq_len
    if n < 1:
        raise LrmoeError(
            f"{what} token stream has {ids.numel()} tokens, shorter than one window of "
            f"seq_len + 1 = {seq_len + 1} tokens; use more data or a smaller seq_len"
        )
    return n


class PackedBatches:
    """Deterministic global batches of packed windows of one token stream.

    Window ``w`` is ``ids[w*L : w*L + L + 1]`` (``L = seq_len``); consecutive windows
    share only their boundary token, so each token (bar the first and the tail that
    fills no window) is a target exactly once per epoch. Samples form one endless
    sequence: epoch ``e`` visits all windows in a permutation seeded by ``(seed, e)``,
    and global batch ``step`` is samples ``step*B .. step*B + B - 1`` of it, so it
    depends only on ``(ids, seq_len, batch_size, seed, step)``, never on earlier calls.
    """

    def __init__(self, ids: torch.Tensor, seq_len: int, batch_size: int, seed: int = 0):
        self.seq_len = _check_int("seq_len", seq_len)
        self.batch_size = _check_int("batch_size", batch_size)
        self.num_windows = _windows(ids, self.seq_len, "training")
        self.ids = ids.long()
        self.seed = int(seed)
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) >= 4:
                self._perms.pop(next(iter(self._perms)))
            digest = hashlib.sha256(f"lrmoe-data:{self.seed}:{epoch}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)
            self._perms[epoch] = torch.randperm(self.num_windows, generator=g)
        return self._perms[epoch]

    def epoch(self, step: int) -> float:
        """Fractional epoch reached at the start of ``step``."""
        return step * self.batch_size / self.num_windows

    def window_indices(self, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        """Window ids of rank's rows of global batch ``step``: int64 ``[B // world]``."""
        step = _check_int("step", step, low=0)
        world = _check_int("world", world)
        if self.batch_size % world:
            raise LrmoeError(f"global batch size {self.batch_size} is not divisible by the "
                             f"data-parallel world size {world}")
        if not 0 <= _check_int("rank", rank, low=0) < world:
            raise LrmoeError(f"rank {rank} is out of range for world size {world}")
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

    def batch(self, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        """Rank's contiguous rows of global batch ``step``: int64 ``[B // world, L + 1]``.

        Inputs are ``batch[:, :-1]``, targets ``batch[:, 1:]``.
        """
        starts = self.window_indices(step, rank, world) * self.seq_len
        return self.ids[starts[:, None] + torch.arange(self.seq_len + 1)]


def validation_batches(
    ids: torch.Tensor, seq_len: int, batch_size: int, num_windows: int | None = None,
    rank: int = 0, world: int = 1,
) -> list[torch.Tensor]:
    """The first ``num_windows`` windows of ``ids`` (all when None) as batches.

    Windows are laid out as in :class:`PackedBatches`, in order; rank ``r`` of ``world``
    takes a contiguous share (shares differ by at most one window, so reduce summed
    losses and token counts, not means). Returns int64 tensors ``[b, L + 1]`` with
    ``b <= batch_size``; only the last may be smaller. A rank may get an empty list.
    """
    seq_len = _check_int("seq_len", seq_len)
    batch_size = _check_int("batch_size", batch_size)
    world = _check_int("world", world)
    if not 0 <= _check_int("rank", rank, low=0) < world:
        raise LrmoeError(f"rank {rank} is out of range for world size {world}")
    k = _windows(ids, seq_len, "validation")
    if num_windows is not None:
        k = min(k, _check_int("num_windows", num_windows))
    mine = torch.tensor_split(torch.arange(k), world)[rank]
    rows = ids.long()[mine[:, None] * seq_len + torch.arange(seq_len + 1)]
    return list(torch.split(rows, batch_size)) if len(rows) else []
