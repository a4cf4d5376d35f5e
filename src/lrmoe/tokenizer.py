"""Tokenizers: raw UTF-8 bytes (``byte``, vocab 256) or a byte-level BPE (``bpe:N``).

Both reserve id 0 as the end-of-document id (``Tokenizer.eos_id``): the NUL byte, which
the data loader never accepts in text, or BPE's ``<|endoftext|>`` (ids 1..256 the byte
alphabet, the rest merges). ``bpe:N`` is trained with HF ``tokenizers`` on the training
split and cached as ``tokenizer.json`` in the run directory; a small corpus can run out
of merges (``vocab_size`` below N). A model's own tokenizer: :mod:`lrmoe.tokenizer_load`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from lrmoe.errors import LrmoeError

EOS_TOKEN = "<|endoftext|>"
BYTE_VOCAB = 256
BPE_MIN_VOCAB = BYTE_VOCAB + 1  # byte alphabet + EOS_TOKEN
TOKENIZER_FILE = "tokenizer.json"
_SPEC_HELP = (f"use 'byte', 'bpe:N' with N an integer >= {BPE_MIN_VOCAB}, or a directory "
              "holding a HF tokenizer.json")
# Documents longer than this are encoded in pieces so HF can use every core.
_CHUNK_CHARS = 1 << 20


def parse_tokenizer_spec(spec: str) -> tuple[str, int | None]:
    """Parse ``"byte"`` -> ``("byte", None)``, ``"bpe:N"`` -> ``("bpe", N)`` and a
    directory -> ``("hf", None)``."""
    if not isinstance(spec, str):
        raise LrmoeError(f"tokenizer spec must be a string, got {spec!r}; {_SPEC_HELP}")
    if spec == "byte":
        return "byte", None
    # a directory: a path separator, or one here (a resumed run's saved path may no
    # longer exist, so existence is not required)
    if os.sep in spec or "/" in spec or (spec != "" and Path(spec).is_dir()):
        return "hf", None
    kind, sep, num = spec.partition(":")
    if kind != "bpe" or not sep:
        raise LrmoeError(f"tokenizer spec {spec!r} is not valid; {_SPEC_HELP}")
    try:
        n = int(num)
    except ValueError:
        raise LrmoeError(
            f"tokenizer spec {spec!r}: vocabulary size {num!r} is not an integer; {_SPEC_HELP}"
        ) from None
    if n < BPE_MIN_VOCAB:
        raise LrmoeError(
            f"tokenizer spec {spec!r}: vocabulary size {n} is too small for the data; a "
            f"byte-level BPE needs at least {BPE_MIN_VOCAB} tokens ({BYTE_VOCAB} byte tokens "
            f"+ 1 end-of-document token)"
        )
    return "bpe", n


class Tokenizer:
    """Common interface; ``spec`` is the string it was built from."""

    spec: str
    eos_id: int = 0

    @property
    def source(self) -> str:
        """Where it came from, for messages."""
        return repr(self.spec)

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode_documents(self, texts: Sequence[str]) -> torch.Tensor:
        """All documents' ids, each followed by ``eos_id``: int64 tensor ``[total_tokens]``."""
        eos = np.array([self.eos_id], dtype=np.int64)
        return _concat([x for ids in self.encode_each(texts) for x in (ids, eos)])

    def encode_each(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text's ids (int64), no ``eos_id`` added."""
        return [np.asarray(self.encode(t), dtype=np.int64) for t in texts]

    def save(self, directory: str | Path) -> Path | None:
        """Write what :func:`load_tokenizer` needs into ``directory``; return the file."""
        raise NotImplementedError


def _concat(parts: list[np.ndarray]) -> torch.Tensor:
    if not parts:
        return torch.zeros(0, dtype=torch.long)
    return torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))


class ByteTokenizer(Tokenizer):
    """ids = UTF-8 bytes of the text; vocab 256."""

    spec = "byte"

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # A model with vocab_size > 256 can sample ids no byte has; 0xFF is never valid
        # UTF-8, so they come out as U+FFFD instead of crashing generation.
        raw = bytes(i if 0 <= i < BYTE_VOCAB else 0xFF for i in (int(x) for x in ids))
        return raw.decode("utf-8", errors="replace")

    def encode_documents(self, texts: Sequence[str]) -> torch.Tensor:
        # One bytes join instead of per-byte Python ints: ~100x faster on 16 MiB.
        if not texts:
            return torch.zeros(0, dtype=torch.long)
        sep = bytes([self.eos_id])
        raw = sep.join(t.encode("utf-8") for t in texts) + sep
        return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).astype(np.int64))

    def save(self, directory: str | Path) -> Path | None:
        return None  # nothing learned, nothing to store


class BpeTokenizer(Tokenizer):
    """Wrapper around an HF ``tokenizers.Tokenizer`` byte-level BPE."""

    def __init__(self, hf_tokenizer, spec: str):
        self._tok = hf_tokenizer
        self.spec = spec

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_each(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(enc.ids, dtype=np.int64)
                for enc in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_documents(self, texts: Sequence[str]) -> torch.Tensor:
        pieces: list[str] = []
        ends: list[bool] = []  # True where a piece is the last of its document
        for t in texts:
            chunks = _split_for_encoding(t)
            pieces.extend(chunks)
            ends.extend([False] * (len(chunks) - 1) + [True])
        encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        parts: list[np.ndarray] = []
        eos = np.array([self.eos_id], dtype=np.int64)
        for start in range(0, len(pieces), 64):  # bounded batches keep Encoding objects small
            batch = pieces[start : start + 64]
            for enc, end in zip(encode_batch(batch, add_special_tokens=False), ends[start:]):
                parts.append(np.asarray(enc.ids, dtype=np.int64))
                if end:
                    parts.append(eos)
        return _concat(parts)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path))
        return path


def _split_for_encoding(text: str) -> list[str]:
    """Cut long text after newlines between two non-space characters: the byte-level
    pre-tokenizer makes such a newline a pre-token of its own, so the pieces encode to
    exactly the whole text's ids."""
    if len(text) <= _CHUNK_CHARS:
        return [text]
    out, start = [], 0
    pos = _CHUNK_CHARS
    while pos < len(text):
        nl = text.find("\n", pos)
        while 0 < nl < len(text) - 1 and (text[nl - 1].isspace() or text[nl + 1].isspace()):
            nl = text.find("\n", nl + 1)
        if not 0 < nl < len(text) - 1:
            break
        out.append(text[start : nl + 1])
        start = nl + 1
        pos = start + _CHUNK_CHARS
    out.append(text[start:])
    return out


def train_bpe(texts: Sequence[str], vocab_size: int) -> BpeTokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` tokens on ``texts``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    spec = f"bpe:{vocab_size}"
    parse_tokenizer_spec(spec)  # size check with the user-facing message
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],  # first, so it gets id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer, length=len(texts))
    return BpeTokenizer(tok, spec)


def check_vocab(tokenizer: Tokenizer, vocab_size: int, model_from: str | None = None) -> None:
    """Raise if a model with ``vocab_size`` embeddings cannot hold every tokenizer id
    (``model_from``: the HF directory the model comes from, named in the message)."""
    if vocab_size >= tokenizer.vocab_size:
        return
    if model_from is not None:
        raise LrmoeError(
            f"tokenizer {tokenizer.source} has ids up to {tokenizer.vocab_size - 1}, beyond "
            f"the embedding of {model_from} ({vocab_size} rows, its config.json's vocab_size); "
            "give the model's own tokenizer (--tokenizer DIR)")
    raise LrmoeError(f"model vocab_size {vocab_size} is smaller than the vocabulary of tokenizer "
                     f"{tokenizer.spec!r} ({tokenizer.vocab_size} tokens); set vocab_size >= "
                     f"{tokenizer.vocab_size}")
