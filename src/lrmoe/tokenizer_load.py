"""The tokenizer a spec names, loaded: ``byte``, ``bpe:N`` (cached in a run directory or
trained on the corpus) or a pretrained model's own, its ``tokenizer.json`` read with HF
``tokenizers`` and copied with its companions into a run's ``tokenizer/`` (docs/design.md
§7, "The tokenizer")."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

from lrmoe.config import read_config_json
from lrmoe.errors import LrmoeError
from lrmoe.tokenizer import (
    EOS_TOKEN,
    TOKENIZER_FILE,
    BpeTokenizer,
    ByteTokenizer,
    Tokenizer,
    parse_tokenizer_spec,
    train_bpe,
)

RUN_SUBDIR = "tokenizer"  # in a run directory
# What a HF model directory holds for its tokenizer (generation_config.json names the
# end-of-sequence ids generation stops at): copied into runs and exports when present.
FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json",
         "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
         "chat_template.jinja", "chat_template.json", "generation_config.json")


def load_tokenizer(
    spec: str, directory: str | Path | None = None, train_texts: Sequence[str] | None = None
) -> Tokenizer:
    """Build the tokenizer for ``spec``; ``bpe:N`` is read from ``directory`` where cached
    there, else trained on ``train_texts`` (and cached in ``directory`` when given)."""
    kind, n = parse_tokenizer_spec(spec)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        return load_hf_tokenizer(spec, directory)
    assert n is not None
    path = Path(directory) / TOKENIZER_FILE if directory is not None else None
    if path is not None and path.exists():
        hf = _read_json_tokenizer(path, "cached tokenizer", "; delete it")
        tok = BpeTokenizer(hf, spec)
        if hf.token_to_id(EOS_TOKEN) != 0 or tok.vocab_size > n:
            raise LrmoeError(
                f"cached tokenizer {path} (vocab {tok.vocab_size}) was not built for {spec!r}; "
                f"delete it or use another run directory"
            )
        return tok
    if train_texts is None:
        raise LrmoeError(
            f"tokenizer {spec!r}: no cached {TOKENIZER_FILE} in {directory!s} and no training "
            f"texts given to train one"
        )
    if not any(t.strip() for t in train_texts):
        raise LrmoeError(f"tokenizer {spec!r}: the training texts hold no text to train on")
    tok = train_bpe(train_texts, n)
    if directory is not None:
        tok.save(directory)
    return tok


def _read_json_tokenizer(path: Path, what: str, remedy: str = ""):
    """``tokenizers.Tokenizer.from_file(path)``, or one line naming ``what`` it is."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        return HFTokenizer.from_file(str(path))
    except Exception as e:  # HF raises a bare Exception on bad JSON
        raise LrmoeError(f"{what} {path} cannot be read ({e}){remedy}") from None


class HfTokenizer(BpeTokenizer):
    """A HF ``tokenizers.Tokenizer``, the end-of-document id and the files (name -> bytes)."""

    def __init__(self, hf_tokenizer, eos_id: int, files: dict[str, bytes], source: str):
        digest = hashlib.sha256(files[TOKENIZER_FILE] + f"\0eos={eos_id}".encode())
        super().__init__(hf_tokenizer, f"hf:{digest.hexdigest()[:16]}")
        self.eos_id = eos_id
        self.files = files
        self._source = source
        self._size = max(hf_tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def source(self) -> str:
        return self._source

    # whole documents: the newline cuts of the byte-level BPE need not be exact for
    # another pre-tokenizer
    encode_documents = Tokenizer.encode_documents

    def save(self, directory: str | Path) -> Path:
        """Copy the tokenizer files into ``directory/tokenizer/`` (atomically each)."""
        from lrmoe.train.checkpoint import atomic_write_bytes

        out = Path(directory) / RUN_SUBDIR
        for name, data in self.files.items():
            if not (out / name).is_file() or (out / name).read_bytes() != data:
                atomic_write_bytes(out / name, data)
        return out / TOKENIZER_FILE


def _eos_id(d: Path, tok) -> int:
    """``tokenizer_config.json``'s ``eos_token``, else ``generation_config.json``'s first
    ``eos_token_id``."""
    tc = d / "tokenizer_config.json"
    if tc.is_file():
        eos = read_config_json(tc).get("eos_token")
        if isinstance(eos, dict):  # an AddedToken: {"content": "<|im_end|>", ...}
            eos = eos.get("content")
        if eos is not None:
            i = tok.token_to_id(eos) if isinstance(eos, str) else None
            if i is None:
                raise LrmoeError(f"{tc} names eos_token {eos!r}, which {d / TOKENIZER_FILE} "
                                 "does not hold")
            return i
    gc = d / "generation_config.json"
    if gc.is_file():
        ids = read_config_json(gc).get("eos_token_id")
        first = ids[0] if isinstance(ids, list) and ids else ids
        if isinstance(first, int) and not isinstance(first, bool):
            if tok.id_to_token(first) is None:
                raise LrmoeError(f"{gc} names eos_token_id {first}, which "
                                 f"{d / TOKENIZER_FILE} does not hold")
            return first
    raise LrmoeError(f"tokenizer {d} names no end-of-document token: neither "
                     "tokenizer_config.json's eos_token nor generation_config.json's "
                     "eos_token_id is set; add eos_token to tokenizer_config.json")


def load_hf_tokenizer(spec: str, run_dir: str | Path | None = None) -> HfTokenizer:
    """The tokenizer of directory ``spec``; with ``run_dir`` the run's copy of it
    (``run_dir/tokenizer/``) when there is one."""
    d = Path(spec)
    if run_dir is not None and (Path(run_dir) / RUN_SUBDIR / TOKENIZER_FILE).is_file():
        d = Path(run_dir) / RUN_SUBDIR
    elif not d.is_dir():
        what = "is a file" if d.exists() else "does not exist"
        raise LrmoeError(f"tokenizer {d} {what}; give the directory holding the model's "
                         f"{TOKENIZER_FILE} (or byte, bpe:N)")
    path = d / TOKENIZER_FILE
    if not path.is_file():
        raise LrmoeError(f"tokenizer directory {d} has no {TOKENIZER_FILE} (a HF fast "
                         "tokenizer's file); give the model's directory, or byte, bpe:N")
    tok = _read_json_tokenizer(path, "tokenizer")
    files = {n: (d / n).read_bytes() for n in FILES if (d / n).is_file()}
    return HfTokenizer(tok, _eos_id(d, tok), files, str(d))
