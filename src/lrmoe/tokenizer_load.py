"""The tokenizer a spec names, loaded: ``byte``, ``bpe:N`` (cached in a run directory or
trained on the corpus) or a HF model's own (:mod:`lrmoe.hf_tokenizer`)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from lrmoe.errors import LrmoeError
from lrmoe.hf_tokenizer import load_hf_tokenizer
from lrmoe.tokenizer import (
    EOS_TOKEN,
    TOKENIZER_FILE,
    BpeTokenizer,
    ByteTokenizer,
    Tokenizer,
    parse_tokenizer_spec,
    train_bpe,
)


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
        return _load_cached(path, spec, n)
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


def _load_cached(path: Path, spec: str, n: int) -> BpeTokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as e:  # HF raises a bare Exception on bad JSON
        raise LrmoeError(f"cached tokenizer {path} cannot be read ({e}); delete it") from None
    tok = BpeTokenizer(hf, spec)
    if hf.token_to_id(EOS_TOKEN) != 0 or tok.vocab_size > n:
        raise LrmoeError(
            f"cached tokenizer {path} (vocab {tok.vocab_size}) was not built for {spec!r}; "
            f"delete it or use another run directory"
        )
    return tok
