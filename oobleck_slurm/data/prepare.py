"""Tokenize text into training tokens: a corpus into a folder of Megatron shards (`prepare_corpus`,
at the end of this file; docs/data.md), or one text file into a flat token file (`prepare`).

The flat token file, streaming and atomically:

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
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from oobleck_slurm.cluster import durable  # one atomic, durable write for every file the project keeps
from oobleck_slurm.data.corpus import InputFile, Unit, atoms, discover, plan_shards, read_unit, row_group_bytes
from oobleck_slurm.data.hf_tokenizer import HFTokenizer, tokenizer_sha256
from oobleck_slurm.data.indexed import (
    MANIFEST,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    PLAN,
    IndexedDataset,
    IndexedDatasetError,
    IndexedWriter,
    content_hash,
    read_manifest,
    sha256_of,
)
from oobleck_slurm.data.indexed import paths as index_paths
from oobleck_slurm.data.tokenizer_base import Tokenizer
from oobleck_slurm.data.tokenizers import BYTE, BYTE_EOS, ByteTokenizer, is_hf_spec, load_tokenizer
from oobleck_slurm.data.tokens import (
    TokenFile,
    TokenFileError,
    TokenFileMeta,
    dtype_for_vocab,
    meta_to_json,
    sidecar_path,
)
from oobleck_slurm.errors import BadInputError

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

    before = src.stat()  # what the stamp records: a change during the read shows as a change next time
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
    _write_stamp(out, src, before, meta.source_sha256)
    return meta


def stamp_path(token_path: str | os.PathLike[str]) -> Path:
    """`<token file>.stamp`: the source text's path, size, mtime and inode when its sha256 was computed."""
    p = Path(token_path)
    return p.with_name(p.name + ".stamp")


def _stat_key(src: Path, st: os.stat_result) -> dict[str, Any]:
    return {"path": str(src.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


def _write_stamp(token_path: Path, src: Path, st: os.stat_result, sha256: str) -> None:
    try:
        durable.write_bytes(stamp_path(token_path), json.dumps({**_stat_key(src, st), "sha256": sha256}).encode())
    except OSError:
        pass  # only a cache: without it the next check hashes the text again


def _stamped_sha256(token_path: Path, src: Path) -> str | None:
    """The text's sha256 from the stamp, if the text's path, size, mtime and inode are still the ones
    recorded (as make and rsync judge a file unchanged); else None."""
    try:
        stamp = json.loads(stamp_path(token_path).read_text(encoding="utf-8"))
        key = _stat_key(src, src.stat())
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict) or any(stamp.get(k) != v for k, v in key.items()):
        return None
    sha = stamp.get("sha256")
    return sha if isinstance(sha, str) else None


def is_current(meta: TokenFileMeta, text_path: str | os.PathLike[str], tokenizer: str,
               token_path: str | os.PathLike[str] | None = None) -> bool:
    """Whether a token file's sidecar says it was prepared from `text_path` as it is now, with
    `tokenizer` (and, for a tokenizer.json, that file as it is now).

    Hashes the text in full, unless `token_path`'s stamp says the text's size, mtime and inode are
    those it had when last hashed (every supervisor start checks its data.text: a large text is not
    read again each time). The tokenizer.json is hashed in full. Raises TokenizerError when
    `tokenizer` names a tokenizer.json that cannot be read; a factory's code is not looked at.
    """
    if meta.tokenizer != tokenizer:
        return False
    wanted = tokenizer_sha256(tokenizer) if is_hf_spec(tokenizer) else None
    if meta.tokenizer_sha256 != wanted:
        return False
    src = Path(text_path)
    if token_path is not None and (known := _stamped_sha256(Path(token_path), src)) is not None:
        return meta.source_sha256 == known
    st = src.stat()
    digest = sha256_file(src)
    if token_path is not None and digest == meta.source_sha256:
        _write_stamp(Path(token_path), src, st, digest)
    return meta.source_sha256 == digest


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
        if is_current(tf.meta, text_path, tokenizer, out_path):
            return tf
    except TokenFileError:
        pass  # missing or broken: prepare it again
    prepare(text_path, out_path, tokenizer)
    return TokenFile(out_path)


# ------------------------------------------------------------------------------------------------
# Prepared folders: many inputs -> numbered shards in Megatron's indexed format + manifest.json
# ------------------------------------------------------------------------------------------------

DEFAULT_SHARD_BYTES = 256 << 20  # input bytes per shard: the unit of parallelism and of resumption
PIECE_CHARS = 64 << 10  # a document is tokenized in pieces of at most this many characters
BATCH_CHARS = 1 << 20  # pieces (of one or many documents) are encoded together up to this many characters
# Tokens a tokenizer.json without a tokenizer_config.json most likely means by "end of document".
KNOWN_EOS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
PLAN_FORMAT = "oobleck-slurm-prepare-plan"


class PrepareError(BadInputError, ValueError):
    """A prepared folder cannot be (re)used, or what the arguments ask for cannot be done."""


# ---- cutting a document into bounded pieces (pure) ----


def cut_point(text: str, lo: int, hi: int) -> int:
    """Where to end a piece of `text` whose length lies in [lo, hi]: the best cut in that window.

    1. just before a space between two letters ("word| word"): exact for the common pre-tokenizers
       (they end a pre-token there and start the next with the space);
    2. just after a newline followed by a non-space: a line's end (exact for Llama 3's regex, which ends
       "punctuation + newlines" there; GPT-2's may join two newlines that it would have split);
    3. just before any whitespace character;
    4. anywhere (a run of CJK text, digits or symbols with no whitespace): the one cut that may split a
       pre-token, so the tokens next to it can differ from the whole text's (docs/data.md).
    """
    hi = min(hi, len(text))
    i = hi
    while (i := text.rfind(" ", lo, i)) > 0:
        if text[i - 1].isalpha() and i + 1 < len(text) and text[i + 1].isalpha():
            return i
    i = hi
    while (i := text.rfind("\n", lo - 1, i)) >= lo - 1 and i >= 0:
        if i + 1 < len(text) and i + 1 <= hi and not text[i + 1].isspace():
            return i + 1
    for j in range(hi - 1, lo - 1, -1):
        if text[j].isspace() and j > 0:
            return j
    return hi


def split_document(chunks: Iterator[str], max_chars: int) -> Iterator[str]:
    """A document's text (given in chunks of any size) as pieces of at most `max_chars` characters, cut
    by `cut_point` in the second half of each window. At most `max_chars` + one chunk is held."""
    if max_chars < 2:
        raise ValueError(f"max_chars must be >= 2, got {max_chars}")
    pending = ""
    for chunk in chunks:
        pending = pending + chunk if pending else chunk
        while len(pending) > max_chars:
            cut = cut_point(pending, max_chars // 2, max_chars)
            yield pending[:cut]
            pending = pending[cut:]
    if pending:
        yield pending


# ---- Slurm tasks (pure) ----


def task_share(shard_of: str | None, env: dict[str, str]) -> tuple[int, int]:
    """(k, n): this process prepares the shards i with i % n == k.

    `--shard-of K/N` wins; else a Slurm job array (SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN of
    SLURM_ARRAY_TASK_COUNT) and/or an srun step (SLURM_PROCID of SLURM_STEP_NUM_TASKS: a batch script's
    own shell, not started by srun, has no step task count and does the whole share); both: every task
    of every array element gets its own share. Else (0, 1)."""
    if shard_of is not None:
        k_s, sep, n_s = shard_of.partition("/")
        try:
            k, n = int(k_s), int(n_s)
        except ValueError:
            raise PrepareError(f"--shard-of {shard_of!r}: expected K/N, e.g. 3/8") from None
        if not sep or n < 1 or not 0 <= k < n:
            raise PrepareError(f"--shard-of {shard_of!r}: expected K/N with 0 <= K < N")
        return k, n
    k, n = 0, 1
    try:
        if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
            a_min = int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
            a_max = int(env.get("SLURM_ARRAY_TASK_MAX", str(a_min + int(env["SLURM_ARRAY_TASK_COUNT"]) - 1)))
            count = int(env["SLURM_ARRAY_TASK_COUNT"])
            if a_max - a_min + 1 != count:
                raise PrepareError(
                    f"a job array of {count} tasks with ids {a_min}..{a_max} (a step or gaps): give --shard-of K/N")
            k, n = int(env["SLURM_ARRAY_TASK_ID"]) - a_min, count
        if "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env:
            tasks = int(env["SLURM_STEP_NUM_TASKS"])
            k, n = k * tasks + int(env["SLURM_PROCID"]), n * tasks
    except ValueError as e:
        raise PrepareError(f"unreadable Slurm task variables ({e}): give --shard-of K/N") from None
    return k, n


# ---- the tokenizer, per document ----


@dataclass(frozen=True)
class TokenizerInfo:
    """What a prepared folder records of its tokenizer (and what decides whether it is reusable)."""

    spec: str
    sha256: str | None  # of the tokenizer.json; None for the byte tokenizer and factories
    vocab_size: int
    eos_id: int
    dtype: str  # numpy name of the token dtype (Megatron's code is in the .idx)
    before: tuple[int, ...]  # the post-processor's tokens before a document (e.g. Llama 3's BOS)
    after: tuple[int, ...]  # ... and after it, then the eos unless `after` already ends with it


def _find_eos(tok: Tokenizer, spec: str, eos: str | int | None) -> int:
    if isinstance(tok, ByteTokenizer):
        eos_id = BYTE_EOS if eos is None else _int_eos(eos, spec)
    elif isinstance(tok, HFTokenizer):
        name = eos
        if name is None:
            cfg = tok.path.with_name("tokenizer_config.json")
            try:
                value = json.loads(cfg.read_text(encoding="utf-8")).get("eos_token") if cfg.is_file() else None
            except (OSError, ValueError, AttributeError):
                value = None
            name = value.get("content") if isinstance(value, dict) else value
        if name is None:
            name = next((t for t in KNOWN_EOS if tok._tok.token_to_id(t) is not None), None)
        if name is None:
            raise PrepareError(f"tokenizer {spec!r}: no end-of-document token found (no tokenizer_config.json "
                               f"eos_token, none of {', '.join(KNOWN_EOS)}): give --eos TOKEN")
        found = tok._tok.token_to_id(str(name))
        if found is None:
            found = _int_eos(name, spec)
        eos_id = found
    else:
        attr = getattr(tok, "eos_token_id", getattr(tok, "eos_id", None))
        if eos is None and not isinstance(attr, int):
            raise PrepareError(f"tokenizer {spec!r} has no integer eos_token_id or eos_id: give --eos ID")
        eos_id = _int_eos(eos, spec) if eos is not None else int(attr)  # type: ignore[arg-type]
    if not 0 <= eos_id < tok.vocab_size:
        raise PrepareError(f"tokenizer {spec!r}: end-of-document id {eos_id} outside its vocabulary [0, {tok.vocab_size})")
    return eos_id


def _int_eos(eos: str | int, spec: str) -> int:
    try:
        return int(eos)
    except ValueError:
        raise PrepareError(f"tokenizer {spec!r}: --eos {eos!r} is neither one of its tokens nor an id") from None


class DocumentEncoder:
    """A tokenizer applied to documents: `encode(pieces)` gives each piece's ids (no special tokens);
    `info.before`, `info.after` and `info.eos_id` frame every document."""

    def __init__(self, spec: str, eos: str | int | None = None) -> None:
        from oobleck_slurm.data.indexed import dtype_for_vocab as megatron_dtype

        tok = load_tokenizer(spec)
        self.tok = tok
        before: tuple[int, ...] = ()
        after: tuple[int, ...] = ()
        if isinstance(tok, HFTokenizer):
            around = tok.special_tokens("a") or tok.special_tokens("hello world")
            if around is not None:
                before, after = tuple(around[0]), tuple(around[1])
            # Encode without offsets and token strings when the library can (tokenizers >= 0.20): the
            # same ids, less memory and time per token.
            self._batch = getattr(tok._tok, "encode_batch_fast", tok._tok.encode_batch)
        self.info = TokenizerInfo(
            spec=spec, sha256=tok.sha256 if isinstance(tok, HFTokenizer) else None, vocab_size=int(tok.vocab_size),
            eos_id=_find_eos(tok, spec, eos), dtype=megatron_dtype(int(tok.vocab_size)).name, before=before,
            after=after)
        self.dtype = megatron_dtype(int(tok.vocab_size))
        self.is_byte = isinstance(tok, ByteTokenizer)

    def encode(self, pieces: list[str], where: str) -> list[np.ndarray]:
        if self.is_byte:
            return [np.frombuffer(p.encode("utf-8"), dtype=np.uint8) for p in pieces]
        if isinstance(self.tok, HFTokenizer):
            try:
                lists = [e.ids for e in self._batch(pieces, add_special_tokens=False)]
            except Exception as e:  # the library raises a bare Exception
                raise ValueError(f"{where}: tokenizer {self.info.spec!r} raised {type(e).__name__}: {e}") from e
        else:
            lists = [_user_encode(self.tok, p, Path(where)) for p in pieces]
        out = []
        for ids in lists:
            a = np.asarray(ids, dtype=np.int64)
            if a.size and (a.min() < 0 or a.max() >= self.info.vocab_size):
                raise ValueError(f"{where}: tokenizer produced id {int(a.min() if a.min() < 0 else a.max())} "
                                 f"outside its vocabulary [0, {self.info.vocab_size})")
            out.append(a.astype(self.dtype))
        return out

    def document_tail(self) -> np.ndarray:
        """What follows a document's text: the post-processor's `after` tokens, then the eos (once)."""
        tail = list(self.info.after)
        if not tail or tail[-1] != self.info.eos_id:
            tail.append(self.info.eos_id)
        return np.asarray(tail, dtype=self.dtype)


def encode_documents(docs: Iterator[Iterator[str]], enc: DocumentEncoder, where: str, piece_chars: int = PIECE_CHARS,
                     batch_chars: int | None = None) -> Iterator[tuple[np.ndarray, bool]]:
    """(ids, ends_document) in order: each document as `before` + its pieces' ids + `after` + eos.

    Pieces of many documents are encoded in one batch of up to `batch_chars` characters; a huge
    document spans batches, so memory stays bounded by the batch whatever the documents' sizes."""
    batch_chars = BATCH_CHARS if batch_chars is None else batch_chars
    head = np.asarray(enc.info.before, dtype=enc.dtype)
    tail = enc.document_tail()
    batch: list[str] = []
    flags: list[tuple[bool, bool]] = []  # (starts a document, ends it) per piece
    size = 0

    def flush() -> Iterator[tuple[np.ndarray, bool]]:
        for ids, (starts, ends) in zip(enc.encode(batch, where), flags):
            yield (np.concatenate((head, ids)) if starts and head.size else ids), False
            if ends:
                yield tail, True
        batch.clear()
        flags.clear()

    for doc in docs:
        pieces = split_document(doc, piece_chars)
        piece = next(pieces, None)
        first = True
        while piece is not None:
            following = next(pieces, None)  # one piece ahead: whether this one ends the document
            batch.append(piece)
            flags.append((first, following is None))
            size += len(piece)
            first = False
            piece = following
            if size >= batch_chars:
                yield from flush()
                size = 0
    yield from flush()


# ---- the plan, the shards, the manifest ----


def _file_dict(f: InputFile) -> dict[str, Any]:
    return {"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns, "kind": f.kind, "compression": f.compression}


def make_plan(files: list[InputFile], info: TokenizerInfo, text_key: str, shard_bytes: int,
              piece_chars: int) -> dict[str, Any]:
    """The folder's plan: everything that decides its contents (and nothing that does not, such as the
    number of workers or tasks). Reads only parquet footers."""
    pieces = []
    for i, f in enumerate(files):
        groups = row_group_bytes(f.path) if f.kind == "parquet" else None
        pieces += atoms(f, i, shard_bytes, groups)
    shards = plan_shards(pieces, shard_bytes)
    width = max(5, len(str(len(shards) - 1)))
    plan = {
        "format": PLAN_FORMAT, "version": 1, "tokenizer": asdict(info), "text_key": text_key,
        "shard_bytes": shard_bytes, "piece_chars": piece_chars, "inputs": [_file_dict(f) for f in files],
        "shards": [{"name": f"shard-{i:0{width}d}", "units": [[u.file, u.start, u.end] for u in s]}
                   for i, s in enumerate(shards)],
    }
    return json.loads(json.dumps(plan))  # as it reads back from plan.json (tuples as lists), to compare


def _inputs_of(plan: dict[str, Any]) -> list[InputFile]:
    return [InputFile(d["path"], d["size"], d["mtime_ns"], d["kind"], d["compression"]) for d in plan["inputs"]]


def shard_done(folder: Path, name: str) -> bool:
    """Whether shard `name` is complete: its .idx is in place (renamed there last) and fits its .bin."""
    try:
        IndexedDataset(folder / name)
    except IndexedDatasetError:
        return False
    return True


def write_shard(folder: Path, shard: dict[str, Any], files: list[InputFile], enc: DocumentEncoder, text_key: str,
                piece_chars: int) -> dict[str, int]:
    """Tokenize one shard's units into `folder/NAME.bin` + `.idx`: both written under temporary names and
    fsynced, then the .bin renamed into place and the .idx last, so an .idx in place means a whole shard.
    Returns its counts."""
    name = shard["name"]
    bin_path, idx_path = index_paths(folder / name)
    tmp_bin = folder / f".{name}.bin.{os.getpid()}.tmp"
    tmp_idx = folder / f".{name}.idx.{os.getpid()}.tmp"
    for stale in (*folder.glob(f".{name}.bin.*.tmp"), *folder.glob(f".{name}.idx.*.tmp")):
        stale.unlink(missing_ok=True)  # left by a killed run of this shard (its finished shards stay)
    units = [Unit(*u) for u in shard["units"]]
    in_bytes = sum((u.end - u.start) if files[u.file].kind == "jsonl" and files[u.file].compression is None
                   else files[u.file].size for u in units)
    try:
        with open(tmp_bin, "wb") as out:
            writer = IndexedWriter(out, enc.dtype)
            for u in units:
                f = files[u.file]
                for ids, ends in encode_documents(read_unit(f, u, text_key), enc, f.path, piece_chars):
                    writer.add(ids)
                    if ends:
                        writer.end_document()
            out.flush()
            os.fsync(out.fileno())
        with open(tmp_idx, "wb") as out:
            out.write(writer.index_bytes())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
        durable.fsync_dir(folder)
    finally:
        for tmp in (tmp_bin, tmp_idx):
            if tmp.exists():
                tmp.unlink()
    return {"num_tokens": writer.num_tokens, "num_documents": writer.num_documents, "input_bytes": in_bytes}


def write_manifest(folder: Path, plan: dict[str, Any]) -> dict[str, Any] | None:
    """manifest.json for a folder whose shards are all done (None while one is missing): the plan plus
    each shard's counts, sizes and .idx sha256, and a content hash over those. Any task may write it;
    every one writes the same bytes."""
    entries = []
    for s in plan["shards"]:
        if not shard_done(folder, s["name"]):
            return None
        ds = IndexedDataset(folder / s["name"])
        entries.append({
            "name": s["name"], "num_tokens": ds.num_tokens, "num_documents": ds.num_documents,
            "num_sequences": ds.num_sequences, "bin_bytes": ds.bin_path.stat().st_size,
            "idx_bytes": ds.idx_path.stat().st_size, "idx_sha256": sha256_of(ds.idx_path), "units": s["units"]})
    manifest = {k: v for k, v in plan.items() if k not in ("format", "shards")}
    manifest.update({
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
        "num_tokens": sum(e["num_tokens"] for e in entries),
        "num_documents": sum(e["num_documents"] for e in entries), "shards": entries,
        "content_hash": content_hash([(e["name"], e["idx_sha256"], e["bin_bytes"]) for e in entries]),
    })
    durable.write_bytes(folder / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def _claim_plan(folder: Path, plan: dict[str, Any]) -> None:
    """Write the plan, or check that the folder's plan is this one (a rerun, or another task)."""
    path = folder / PLAN
    data = (json.dumps(plan, indent=1) + "\n").encode()
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise PrepareError(f"{path}: unreadable ({e}); remove it to start this folder again") from None
        if old != plan:
            what = [k for k in ("tokenizer", "text_key", "shard_bytes", "piece_chars", "inputs", "shards")
                    if old.get(k) != plan.get(k)]
            raise PrepareError(
                f"{folder} holds a preparation with other {', '.join(what) or 'settings'} (inputs changed since, "
                f"or other arguments): give another output folder, or remove {folder} to prepare it again")
        return
    if any(folder.glob("*.idx")):
        raise PrepareError(f"{folder} holds .idx files but no {PLAN}: not a folder `prepare` made; give another one")
    durable.write_bytes(path, data)


@dataclass
class PrepareResult:
    folder: Path
    shards: int  # in the plan
    mine: int  # this task's share
    done: int  # prepared now
    skipped: int  # already complete
    num_tokens: int  # prepared now
    input_bytes: int  # read now
    manifest: dict[str, Any] | None  # written when every shard of every task is complete


_WORKER: dict[str, Any] = {}


def _init_worker(spec: str, eos: str | int | None, plan: dict[str, Any], folder: str) -> None:
    # One tokenizer thread per process: the processes are the parallelism (and the measure per core).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(enc=DocumentEncoder(spec, eos), plan=plan, files=_inputs_of(plan), folder=Path(folder))


def _work(i: int) -> tuple[int, dict[str, int]]:
    w = _WORKER
    plan = w["plan"]
    return i, write_shard(w["folder"], plan["shards"][i], w["files"], w["enc"], plan["text_key"], plan["piece_chars"])


def prepare_corpus(
    inputs: list[str],
    out_dir: str | os.PathLike[str],
    tokenizer: str = BYTE,
    *,
    text_key: str = "text",
    workers: int | None = None,
    shard_of: str | None = None,
    env: dict[str, str] | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    piece_chars: int = PIECE_CHARS,
    eos: str | int | None = None,
    on_shard: Callable[[str, dict[str, int] | None], None] | None = None,
) -> PrepareResult:
    """Tokenize `inputs` (files, folders, globs: corpus.py) into `out_dir`: numbered shards in Megatron's
    format and, once every shard exists, manifest.json.

    This process does its share of the shards (`task_share`: --shard-of, or the Slurm task variables
    in `env`, default os.environ) with `workers` processes (default: the usable CPUs). Shards already
    complete are skipped, so a rerun after a crash redoes only the unfinished ones; an error stops the
    run after the shards in progress and never removes a finished one. `on_shard(name, counts)` is
    called as each shard finishes (counts None: skipped). Raises CorpusError, TokenizerError,
    PrepareError (bad input) or ValueError (text the tokenizer cannot handle), naming the file.
    """
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise PrepareError(f"output {folder} is a file; give a folder (or a FILE.bin for one flat token file)")
    k, n = task_share(shard_of, dict(os.environ) if env is None else env)
    files = discover(inputs)
    enc = DocumentEncoder(tokenizer, eos)
    plan = make_plan(files, enc.info, text_key, shard_bytes, piece_chars)
    folder.mkdir(parents=True, exist_ok=True)
    _claim_plan(folder, plan)
    mine = [i for i in range(len(plan["shards"])) if i % n == k]
    todo = []
    skipped = 0
    for i in mine:
        if shard_done(folder, plan["shards"][i]["name"]):
            skipped += 1
            if on_shard:
                on_shard(plan["shards"][i]["name"], None)
        else:
            todo.append(i)
    done = tokens = in_bytes = 0

    def finished(i: int, counts: dict[str, int]) -> None:
        nonlocal done, tokens, in_bytes
        done += 1
        tokens += counts["num_tokens"]
        in_bytes += counts["input_bytes"]
        if on_shard:
            on_shard(plan["shards"][i]["name"], counts)

    n_workers = min(workers or len(os.sched_getaffinity(0)), max(len(todo), 1))
    if n_workers <= 1:
        for i in todo:
            finished(i, write_shard(folder, plan["shards"][i], files, enc, text_key, piece_chars))
    else:
        import concurrent.futures as cf
        import multiprocessing as mp

        # spawn: a forked copy of a process that has used the tokenizers library's thread pool may hang.
        with cf.ProcessPoolExecutor(n_workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                                    initargs=(tokenizer, eos, plan, str(folder))) as pool:
            futures = [pool.submit(_work, i) for i in todo]
            try:
                for fut in cf.as_completed(futures):
                    finished(*fut.result())
            except BaseException:
                # Let the shards in progress finish (their work is kept), start no new one.
                for f in futures:
                    f.cancel()
                raise
    manifest = write_manifest(folder, plan) if not (folder / MANIFEST).is_file() else read_manifest(folder)
    return PrepareResult(folder, len(plan["shards"]), len(mine), done, skipped, tokens, in_bytes, manifest)
