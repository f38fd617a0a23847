"""Tokenize a text file into a token file, streaming and atomically.

The text is read in chunks of a few MiB, so a file larger than memory can be prepared. With a user
tokenizer each chunk ends at a newline, so no token straddles a chunk boundary unless a single
line is longer than a chunk.

With a Hugging Face tokenizer.json the ids are those of `Tokenizer.encode` of the whole file. A chunk
ends, and is split into pieces of about HF_PIECE_CHARS that are encoded in parallel (`encode_batch`),
just before a space between two letters ("word| word"). Every common pre-tokenizer ends a pre-token
there and starts the next one with that space (byte-level GPT-2 and Llama 3/tiktoken-style regexes,
whitespace, BERT, Metaspace), and a piece that starts with a space gets no extra prefix space or '▁'
(ByteLevel's add_prefix_space and Metaspace add one only where there is none). Newlines would not do
as cut points: GPT-2's regex splits two newlines before a letter but not at the end of a piece, and
Metaspace would mark the start of every line. Not exact: an unconditional `Prepend("▁")` normalizer
(Llama 2's legacy conversion) or a `Strip` normalizer acts at the start of every piece, and a model
may merge across the cut where nothing splits there (no pre-tokenizer, or Metaspace with
split=False and a vocabulary with tokens that span a '▁'). A stretch of text without "letter space
letter" (a long run of digits or symbols) stays in one piece, held in memory. The post-processor's
special tokens are written once around the whole file (hf_tokenizer.py).

Both the `.bin` and its sidecar are written to temporary files and moved into place with
`os.replace`: concurrent workers preparing the same cache file, or a crash half-way, never leave a
reader a torn file.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from oobleck_slurm.data.hf_tokenizer import HFTokenizer, tokenizer_sha256
from oobleck_slurm.data.tokenizers import BYTE, ByteTokenizer, Tokenizer, is_hf_spec, load_tokenizer
from oobleck_slurm.data.tokens import (
    TokenFile,
    TokenFileError,
    TokenFileMeta,
    dtype_for_vocab,
    meta_to_json,
    sidecar_path,
)

CHUNK_BYTES = 4 << 20
# A Hugging Face tokenizer encodes a chunk as pieces of at least this many characters, in parallel.
HF_PIECE_CHARS = 256 << 10


def sha256_file(path: str | os.PathLike[str], chunk_bytes: int = CHUNK_BYTES) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def _last_newline(text: str, start: int) -> int:
    """The index just after the last newline at or after `start`, or -1."""
    i = text.rfind("\n", start)
    return i + 1 if i >= 0 else -1


def _is_word_gap(text: str, i: int) -> bool:
    return text[i] == " " and 0 < i < len(text) - 1 and text[i - 1].isalpha() and text[i + 1].isalpha()


def _last_word_gap(text: str, start: int) -> int:
    """The index of the last space at or after `start` with a letter on each side, or -1."""
    i = len(text)
    while (i := text.rfind(" ", start, i)) >= 0:
        if _is_word_gap(text, i):
            return i
    return -1


def _next_word_gap(text: str, start: int) -> int:
    """The index of the first space at or after `start` with a letter on each side, or -1."""
    i = start
    while (i := text.find(" ", i)) >= 0:
        if _is_word_gap(text, i):
            return i
        i += 1
    return -1


def _text_chunks(
    raw_chunks: Iterator[bytes], where: Path, last_cut: Callable[[str, int], int] = _last_newline
) -> Iterator[str]:
    """UTF-8 text in pieces that end where `last_cut` finds a cut point (by default just after a
    newline), the last one at the end of the text."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pending = ""
    offset = 0
    for raw in raw_chunks:
        # Only the new text, and the character before it (whose successor was unknown), can hold a
        # new cut point: a long line is not searched again for every chunk appended to it.
        start = max(len(pending) - 1, 0)
        try:
            pending += decoder.decode(raw)
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{where}: not UTF-8 near byte {offset + e.start} ({e.reason})"
            ) from None
        offset += len(raw)
        cut = last_cut(pending, start)
        if cut > 0:
            yield pending[:cut]
            pending = pending[cut:]
    try:
        pending += decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: ends inside a UTF-8 character ({e.reason})") from None
    if pending:
        yield pending


def _split_at_word_gaps(text: str, size: int) -> list[str]:
    """`text` in pieces of at least `size` characters (the last may be shorter), each but the last
    ending just before a space between two letters."""
    pieces = []
    pos = 0
    while len(text) - pos > size:
        cut = _next_word_gap(text, pos + size)
        if cut < 0:
            break
        pieces.append(text[pos:cut])
        pos = cut
    pieces.append(text[pos:])
    return pieces


def _hf_ids(tok: HFTokenizer, texts: Iterator[str], piece_chars: int) -> Iterator[list[int]]:
    """The ids of the concatenated `texts` as one sequence: each text's pieces encoded in parallel,
    the post-processor's special tokens once before the first token and once after the last."""
    after: list[int] | None = None
    for text in texts:
        pieces = _split_at_word_gaps(text, piece_chars)
        if after is None:  # nothing written yet: the special tokens before the first one come first
            around = next((a for p in pieces if (a := tok.special_tokens(p)) is not None), None)
            if around is not None:
                yield around[0]
                after = around[1]
        yield from tok.encode_pieces(pieces)
    # A text without a token of its own still gets every special token, as encode("") does.
    yield tok.specials_alone() if after is None else after


def _encode_chunks(
    tok: Tokenizer, is_byte: bool, raw_chunks: Iterator[bytes], where: Path, dtype: np.dtype, piece_chars: int
) -> Iterator[np.ndarray]:
    if is_byte:
        # Bytes are their own ids: no decoding, and any file (even non-UTF-8) round-trips.
        for raw in raw_chunks:
            yield np.frombuffer(raw, dtype=np.uint8).astype(dtype)
        return
    if isinstance(tok, HFTokenizer):
        id_lists = _hf_ids(tok, _text_chunks(raw_chunks, where, _last_word_gap), piece_chars)
    else:
        id_lists = (_user_encode(tok, text, where) for text in _text_chunks(raw_chunks, where))
    for id_list in id_lists:
        ids = np.asarray(id_list, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= tok.vocab_size):
            raise ValueError(
                f"{where}: tokenizer produced id {int(ids.min() if ids.min() < 0 else ids.max())}"
                f" outside its vocabulary [0, {tok.vocab_size})"
            )
        yield ids.astype(dtype)


def _user_encode(tok: Tokenizer, text: str, where: Path) -> list[int]:
    try:
        return tok.encode(text)
    except Exception as e:  # a user's tokenizer: say where, not just what
        raise ValueError(f"{where}: tokenizer.encode raised {type(e).__name__}: {e}") from e


def prepare(
    text_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    tokenizer: str = BYTE,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    piece_chars: int = HF_PIECE_CHARS,
) -> TokenFileMeta:
    """Tokenize `text_path` into `out_path` (+ `out_path.json`); returns the sidecar's contents.

    `tokenizer` is "byte", a Hugging Face tokenizer.json (or a folder holding one) or a factory
    "package.module:function" (tokenizers.py). Raises FileNotFoundError for a missing input,
    TokenizerError for a bad tokenizer string or tokenizer.json, and ValueError for text the
    tokenizer cannot handle. `chunk_bytes`: how much text is read (and, with a tokenizer.json,
    encoded) at a time; `piece_chars`: how a tokenizer.json's chunk is split for `encode_batch`.
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
            for ids in _encode_chunks(tok, is_byte, raw_chunks(f), src, dtype, piece_chars):
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
            tokenizer_sha256=tok.sha256 if isinstance(tok, HFTokenizer) else None,
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


def is_current(meta: TokenFileMeta, text_path: str | os.PathLike[str], tokenizer: str) -> bool:
    """Whether a token file's sidecar says it was prepared from `text_path` as it is now, with
    `tokenizer` (and, for a tokenizer.json, that file as it is now).

    Hashes the text (and the tokenizer.json) in full. Raises TokenizerError when `tokenizer` names a
    tokenizer.json that cannot be read; a factory's code is not looked at, only its name.
    """
    if meta.tokenizer != tokenizer:
        return False
    wanted = tokenizer_sha256(tokenizer) if is_hf_spec(tokenizer) else None
    return meta.tokenizer_sha256 == wanted and meta.source_sha256 == sha256_file(text_path)


def prepared(
    text_path: str | os.PathLike[str], out_path: str | os.PathLike[str], tokenizer: str = BYTE
) -> TokenFile:
    """The token file `out_path` made from `text_path` with `tokenizer`: reused when its sidecar says
    it is current (`is_current`), prepared again when it is missing, broken or stale.

    Safe to call from many processes at once: `prepare` writes atomically, so the worst case is
    that several of them prepare the same (identical) file.
    """
    try:
        tf = TokenFile(out_path)
        if is_current(tf.meta, text_path, tokenizer):
            return tf
    except TokenFileError:
        pass  # missing or broken: prepare it again
    prepare(text_path, out_path, tokenizer)
    return TokenFile(out_path)
