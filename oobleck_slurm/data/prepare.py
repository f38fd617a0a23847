"""Tokenize a text file into a token file, streaming and atomically.

The text is read in chunks of a few MiB, so a file larger than memory can be prepared. With a user
tokenizer each chunk ends at a newline, so no token straddles a chunk boundary unless a single
line is longer than a chunk. Both the `.bin` and its sidecar are written to temporary files and
moved into place with `os.replace`: concurrent workers preparing the same cache file, or a crash
half-way, never leave a reader a torn file.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from oobleck_slurm.data.tokenizers import BYTE, ByteTokenizer, Tokenizer, load_tokenizer
from oobleck_slurm.data.tokens import (
    TokenFileMeta,
    dtype_for_vocab,
    meta_to_json,
    sidecar_path,
)

CHUNK_BYTES = 4 << 20


def sha256_file(path: str | os.PathLike[str], chunk_bytes: int = CHUNK_BYTES) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def _text_chunks(raw_chunks: Iterator[bytes], where: Path) -> Iterator[str]:
    """UTF-8 text in pieces that end at a newline (except the last)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pending = ""
    offset = 0
    for raw in raw_chunks:
        try:
            pending += decoder.decode(raw)
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{where}: not UTF-8 near byte {offset + e.start} ({e.reason})"
            ) from None
        offset += len(raw)
        cut = pending.rfind("\n")
        if cut >= 0:
            yield pending[: cut + 1]
            pending = pending[cut + 1 :]
    try:
        pending += decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: ends inside a UTF-8 character ({e.reason})") from None
    if pending:
        yield pending


def _encode_chunks(
    tok: Tokenizer, is_byte: bool, raw_chunks: Iterator[bytes], where: Path, dtype: np.dtype
) -> Iterator[np.ndarray]:
    if is_byte:
        # Bytes are their own ids: no decoding, and any file (even non-UTF-8) round-trips.
        for raw in raw_chunks:
            yield np.frombuffer(raw, dtype=np.uint8).astype(dtype)
        return
    for text in _text_chunks(raw_chunks, where):
        try:
            ids = np.asarray(tok.encode(text), dtype=np.int64)
        except Exception as e:  # a user's tokenizer: say where, not just what
            raise ValueError(f"{where}: tokenizer.encode raised {type(e).__name__}: {e}") from e
        if ids.size and (ids.min() < 0 or ids.max() >= tok.vocab_size):
            raise ValueError(
                f"{where}: tokenizer produced id {int(ids.min() if ids.min() < 0 else ids.max())}"
                f" outside its vocabulary [0, {tok.vocab_size})"
            )
        yield ids.astype(dtype)


def prepare(
    text_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    tokenizer: str = BYTE,
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> TokenFileMeta:
    """Tokenize `text_path` into `out_path` (+ `out_path.json`); returns the sidecar's contents.

    Raises FileNotFoundError for a missing input, TokenizerError for a bad tokenizer string, and
    ValueError for text the tokenizer cannot handle.
    """
    src = Path(text_path)
    out = Path(out_path)
    if not src.is_file():
        raise FileNotFoundError(f"text file {src} does not exist")
    tok = load_tokenizer(tokenizer)
    is_byte = isinstance(tok, ByteTokenizer)
    dtype_name = dtype_for_vocab(tok.vocab_size)
    dtype = np.dtype("<u2" if dtype_name == "uint16" else "<u4")
    out.parent.mkdir(parents=True, exist_ok=True)

    digest = hashlib.sha256()

    def raw_chunks(f: BinaryIO) -> Iterator[bytes]:  # hashes exactly the bytes it hands out
        while block := f.read(chunk_bytes):
            digest.update(block)
            yield block

    fd, tmp_bin = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    tmp_json = None
    try:
        num_tokens = 0
        with os.fdopen(fd, "wb") as dst, open(src, "rb") as f:
            for ids in _encode_chunks(tok, is_byte, raw_chunks(f), src, dtype):
                dst.write(ids.tobytes())
                num_tokens += int(ids.size)
            dst.flush()
            os.fsync(dst.fileno())
        meta = TokenFileMeta(
            dtype=dtype_name,
            vocab_size=int(tok.vocab_size),
            tokenizer=tokenizer,
            num_tokens=num_tokens,
            source_sha256=digest.hexdigest(),
        )
        side = sidecar_path(out)
        fd_json, tmp_json = tempfile.mkstemp(prefix=f".{side.name}.", suffix=".tmp", dir=out.parent)
        with os.fdopen(fd_json, "w", encoding="utf-8") as sidecar:
            sidecar.write(meta_to_json(meta))
        # Data first, sidecar last: a reader that sees the new sidecar also sees the new data.
        os.replace(tmp_bin, out)
        os.replace(tmp_json, side)
    except BaseException:
        for tmp in (tmp_bin, tmp_json):
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
        raise
    return meta
