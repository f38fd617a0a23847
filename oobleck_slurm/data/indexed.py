"""Megatron's indexed dataset (`PREFIX.bin` + `PREFIX.idx`): reader, writer, and prepared folders.

The layout, as Megatron-LM documents it (`MMapIndexedDataset`, index version 1), all little-endian:

    PREFIX.idx   9 bytes   magic b"MMIDIDX\\x00\\x00"
                 uint64    version, 1
                 uint8     dtype code of the tokens (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                           6 float64, 7 float32, 8 uint16)
                 uint64    sequence count S
                 uint64    document count D (the length of the document index array below)
                 int32[S]  sequence lengths, in tokens
                 int64[S]  sequence pointers: the byte offset of each sequence in PREFIX.bin
                 int64[D]  document indices: 0, then for each document the index of the sequence
                           just after its last one (so D = documents + 1)
    PREFIX.bin   the tokens of every sequence back to back

What `prepare` writes: one sequence per document (a document longer than an int32 count of tokens
continues in a further sequence of the same document), the document's tokens ending with the
tokenizer's end-of-document id. The reader takes any such pair whose sequences lie back to back in
the `.bin` (what every Megatron writer produces): `tokens(start, count)` reads the concatenated
stream, and documents are ranges of it.

A prepared folder (`prepare`'s output) holds numbered shards and `manifest.json`; `open_prepared`
opens a folder, a prefix, a glob of prefixes, or a flat token file of tokens.py (`TokenFile`, which
old data uses) behind the same interface.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import os
import struct
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol, overload

import numpy as np

from oobleck_slurm.errors import BadInputError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"), 5: np.dtype("<i8"),
    6: np.dtype("<f8"), 7: np.dtype("<f4"), 8: np.dtype("<u2"),
}
_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}
MAX_SEQUENCE_TOKENS = 2**31 - 1  # a sequence length is an int32
MANIFEST = "manifest.json"
PLAN = "plan.json"  # written first by `prepare`: what the folder will hold once every shard is done
MANIFEST_FORMAT = "oobleck-slurm-prepared"
MANIFEST_VERSION = 1


class IndexedDatasetError(BadInputError, ValueError):
    """An indexed dataset, a prepared folder or its manifest is missing, malformed or inconsistent."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The narrowest Megatron token dtype for ids 0 .. vocab_size-1 (Megatron has no uint32: int32)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_size <= 256:
        return np.dtype("u1")
    if vocab_size <= 65536:
        return np.dtype("<u2")
    if vocab_size <= 2**31:
        return np.dtype("<i4")
    raise ValueError(f"vocab_size {vocab_size} does not fit in int32 token ids")


def paths(prefix: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(PREFIX.bin, PREFIX.idx)."""
    p = os.fspath(prefix)
    return Path(p + ".bin"), Path(p + ".idx")


def sha256_of(path: str | os.PathLike[str], chunk_bytes: int = 4 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------- reading


class Shard(Protocol):
    """What a reader of prepared data uses; `IndexedDataset` and `FlatTokenShard` provide it."""

    @property
    def dtype(self) -> np.dtype: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_documents(self) -> int: ...
    def document_boundaries(self) -> np.ndarray: ...
    def document_lengths(self) -> np.ndarray: ...
    def tokens(self, start: int, count: int) -> np.ndarray: ...
    def identity(self) -> str: ...


def _memmap(path: Path, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
    # np.memmap cannot map zero bytes: an empty array is still a valid part of a file.
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


class IndexedDataset:
    """`PREFIX.bin` + `PREFIX.idx`, memory-mapped: opening costs a header read, whatever the size.

    `sequence_lengths`, `sequence_pointers` and `document_indices` are the index's arrays (memmaps);
    `tokens(start, count)` is a view of the token stream; document d spans
    `document_boundaries()[d] : document_boundaries()[d + 1]` of it.
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = Path(os.fspath(prefix))
        self.bin_path, self.idx_path = paths(prefix)
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise IndexedDatasetError(f"indexed dataset {self.prefix}: {p} does not exist")
        idx_size = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as f:
            head = f.read(HEADER.size)
        if len(head) < HEADER.size:
            raise IndexedDatasetError(f"{self.idx_path}: {idx_size} bytes, shorter than the {HEADER.size}-byte header")
        magic, version, code, n_seq, n_doc = HEADER.unpack(head)
        if magic != MAGIC:
            raise IndexedDatasetError(f"{self.idx_path}: not a Megatron index (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise IndexedDatasetError(f"{self.idx_path}: index version {version}, this reader knows {VERSION}")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{self.idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self._dtype = DTYPE_CODES[code]
        if self._dtype.kind == "f":
            raise IndexedDatasetError(f"{self.idx_path}: dtype {self._dtype} holds no token ids")
        expected = HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if idx_size != expected:
            raise IndexedDatasetError(
                f"{self.idx_path}: {idx_size} bytes, but its header says {n_seq} sequences and {n_doc} "
                f"document indices = {expected} bytes (truncated, or not written by a version-1 writer)")
        off = HEADER.size
        self.sequence_lengths = _memmap(self.idx_path, np.dtype("<i4"), off, n_seq)
        self.sequence_pointers = _memmap(self.idx_path, np.dtype("<i8"), off + 4 * n_seq, n_seq)
        self.document_indices = _memmap(self.idx_path, np.dtype("<i8"), off + 12 * n_seq, n_doc)
        bin_size = self.bin_path.stat().st_size
        item = self._dtype.itemsize
        if bin_size % item:
            raise IndexedDatasetError(f"{self.bin_path}: {bin_size} bytes, not a whole number of {self._dtype} tokens")
        self._num_tokens = bin_size // item
        # The checks that cost O(1): the stream starts at 0 and ends with the file; `verify` checks
        # every pointer (O(sequences)).
        if n_seq and (int(self.sequence_pointers[0]) != 0 or int(self.sequence_pointers[-1])
                      + int(self.sequence_lengths[-1]) * item != bin_size):
            raise IndexedDatasetError(
                f"{self.bin_path}: {bin_size} bytes, but {self.idx_path}'s last sequence ends at byte "
                f"{int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * item}"
                " (truncated, or the index belongs to another .bin)")
        if not n_seq and bin_size:
            raise IndexedDatasetError(f"{self.bin_path}: {bin_size} bytes, but {self.idx_path} has no sequence")
        if n_doc < 1 or int(self.document_indices[0]) != 0 or int(self.document_indices[-1]) != n_seq:
            raise IndexedDatasetError(
                f"{self.idx_path}: document indices must run from 0 to the sequence count {n_seq}")
        self._boundaries: np.ndarray | None = None
        # One map of the whole stream, sliced by `tokens` (a map per call would cost a syscall each).
        self._stream = _memmap(self.bin_path, self._dtype, 0, self._num_tokens)

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def verify(self) -> None:
        """Check every pointer and document index (O(sequences)); raises IndexedDatasetError."""
        item = self._dtype.itemsize
        lengths = np.asarray(self.sequence_lengths, dtype=np.int64)
        if (lengths < 0).any():
            raise IndexedDatasetError(f"{self.idx_path}: negative sequence length")
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1] * item)) if len(lengths) else lengths
        bad = np.flatnonzero(np.asarray(self.sequence_pointers) != starts)
        if bad.size:
            raise IndexedDatasetError(
                f"{self.idx_path}: sequence {int(bad[0])} starts at byte {int(self.sequence_pointers[bad[0]])}, "
                f"not right after the previous one ({int(starts[bad[0]])})")
        if (np.diff(np.asarray(self.document_indices)) < 0).any():
            raise IndexedDatasetError(f"{self.idx_path}: document indices are not in increasing order")

    def document_boundaries(self) -> np.ndarray:
        """int64[num_documents + 1]: token offsets; document d is tokens [b[d], b[d+1])."""
        if self._boundaries is None:
            seq_starts = np.asarray(self.sequence_pointers, dtype=np.int64) // self._dtype.itemsize
            starts = np.append(seq_starts, np.int64(self._num_tokens))
            self._boundaries = starts[np.asarray(self.document_indices, dtype=np.int64)]
        return self._boundaries

    def document_lengths(self) -> np.ndarray:
        """int64[num_documents]: each document's token count."""
        return np.diff(self.document_boundaries())

    def tokens(self, start: int, count: int) -> np.ndarray:
        """`count` tokens of the stream from `start` (a read-only view of the memmap, in `dtype`)."""
        if start < 0 or count < 0 or start + count > self._num_tokens:
            raise IndexError(f"tokens [{start}, {start + count}) outside [0, {self._num_tokens}) of {self.bin_path}")
        return self._stream[start : start + count]

    def document(self, d: int) -> np.ndarray:
        """The tokens of document `d`."""
        b = self.document_boundaries()
        if not 0 <= d < self.num_documents:
            raise IndexError(f"document {d} outside [0, {self.num_documents}) of {self.idx_path}")
        return self.tokens(int(b[d]), int(b[d + 1] - b[d]))

    def identity(self) -> str:
        """sha256 over the `.idx` file's bytes and the `.bin` file's size (the index fixes the lengths,
        so a changed token count shows; the tokens themselves are not read)."""
        h = hashlib.sha256(b"idx\0")
        h.update(bytes.fromhex(sha256_of(self.idx_path)))
        h.update(str(self.bin_path.stat().st_size).encode())
        return h.hexdigest()

    def __repr__(self) -> str:
        return (f"IndexedDataset({str(self.prefix)!r}, {self.num_documents} documents, "
                f"{self.num_tokens} {self._dtype} tokens)")


class FlatTokenShard:
    """A flat token file of tokens.py (`TokenFile`: ids + JSON sidecar) as one shard of one document."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from oobleck_slurm.data.tokens import TokenFile, TokenFileError

        try:
            self.file = TokenFile(path)
        except TokenFileError as e:
            raise IndexedDatasetError(str(e)) from None
        self.prefix = self.file.path

    @property
    def dtype(self) -> np.dtype:
        return self.file.tokens.dtype

    @property
    def num_tokens(self) -> int:
        return len(self.file)

    @property
    def num_documents(self) -> int:
        return 1

    def document_boundaries(self) -> np.ndarray:
        return np.array([0, len(self.file)], dtype=np.int64)

    def document_lengths(self) -> np.ndarray:
        return np.array([len(self.file)], dtype=np.int64)

    def tokens(self, start: int, count: int) -> np.ndarray:
        if start < 0 or count < 0 or start + count > len(self.file):
            raise IndexError(f"tokens [{start}, {start + count}) outside [0, {len(self.file)}) of {self.file.path}")
        return self.file.tokens[start : start + count]

    def identity(self) -> str:
        """From the sidecar (the source text's sha256, tokenizer, count), not the tokens."""
        m = self.file.meta
        key = f"flat\0{m.source_sha256}\0{m.tokenizer}\0{m.tokenizer_sha256}\0{m.num_tokens}\0{m.dtype}"
        return hashlib.sha256(key.encode()).hexdigest()

    def __repr__(self) -> str:
        return f"FlatTokenShard({str(self.file.path)!r}, {self.num_tokens} tokens)"


@dataclass(frozen=True)
class PreparedData(Sequence[Shard]):
    """Prepared shards in a fixed order, with what is known of their tokenizer (None where unknown:
    a bare Megatron dataset records no tokenizer)."""

    shards: tuple[Shard, ...]
    source: str  # what was opened, for messages
    manifest: dict[str, Any] | None = field(default=None, repr=False)
    vocab_size: int | None = None
    eos_id: int | None = None
    tokenizer: str | None = None
    _identity: str | None = None

    @overload
    def __getitem__(self, i: int) -> Shard: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Shard]: ...
    def __getitem__(self, i: int | slice) -> Shard | Sequence[Shard]:
        return self.shards[i]

    def __len__(self) -> int:
        return len(self.shards)

    def __iter__(self) -> Iterator[Shard]:
        return iter(self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.shards)

    def identity(self) -> str:
        """A stable hash of the set: for a folder with a manifest, its content hash (computed by `prepare`
        from the `.idx` files; the files' sizes are checked against it when opened), else the hash of
        each shard's identity in order."""
        if self._identity is not None:
            return self._identity
        h = hashlib.sha256(b"shards\0")
        for s in self.shards:
            h.update(s.identity().encode())
        return h.hexdigest()


def content_hash(entries: list[tuple[str, str, int]]) -> str:
    """The manifest's content hash: over each shard's (name, .idx sha256, .bin size), in order."""
    h = hashlib.sha256(b"oobleck-slurm-prepared\0")
    for name, idx_sha, bin_bytes in entries:
        h.update(f"{name}\0{idx_sha}\0{bin_bytes}\n".encode())
    return h.hexdigest()


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise IndexedDatasetError(f"{path}: cannot read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IndexedDatasetError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
        raise IndexedDatasetError(f"{path}: not a manifest of prepared data (no \"format\": \"{MANIFEST_FORMAT}\")")
    if raw.get("version") != MANIFEST_VERSION:
        raise IndexedDatasetError(f"{path}: manifest version {raw.get('version')}, this reader knows {MANIFEST_VERSION}")
    if not isinstance(raw.get("shards"), list) or not isinstance(raw.get("content_hash"), str):
        raise IndexedDatasetError(f"{path}: needs a \"shards\" list and a \"content_hash\"")
    return raw


def _open_folder(folder: Path, verify: bool) -> PreparedData:
    if not (folder / MANIFEST).is_file():
        if (folder / PLAN).is_file():
            raise IndexedDatasetError(
                f"{folder}: preparation not finished (no {MANIFEST} yet): run the same `prepare` command "
                "again; it redoes only the unfinished shards")
        prefixes = sorted({p.with_suffix("") for p in folder.glob("*.idx")})
        if not prefixes:
            raise IndexedDatasetError(f"{folder}: no {MANIFEST} and no *.idx file: not prepared data")
        return _open_prefixes([str(p) for p in prefixes], str(folder), verify)
    m = read_manifest(folder)
    shards: list[Shard] = []
    entries = []
    for s in m["shards"]:
        try:
            name, idx_sha, bin_bytes, idx_bytes = s["name"], s["idx_sha256"], s["bin_bytes"], s["idx_bytes"]
        except (KeyError, TypeError):
            raise IndexedDatasetError(f"{folder / MANIFEST}: a shard entry lacks name/idx_sha256/bin_bytes/idx_bytes: "
                                      f"{s!r}") from None
        ds = IndexedDataset(folder / name)
        sizes = (ds.bin_path.stat().st_size, ds.idx_path.stat().st_size)
        if sizes != (bin_bytes, idx_bytes):
            raise IndexedDatasetError(
                f"{folder / name}: .bin/.idx are {sizes[0]}/{sizes[1]} bytes, the manifest says {bin_bytes}/{idx_bytes}"
                " (changed since it was prepared)")
        if verify:
            ds.verify()
            if sha256_of(ds.idx_path) != idx_sha:
                raise IndexedDatasetError(f"{ds.idx_path}: its sha256 differs from the manifest's")
        shards.append(ds)
        entries.append((name, idx_sha, bin_bytes))
    if content_hash(entries) != m["content_hash"]:
        raise IndexedDatasetError(f"{folder / MANIFEST}: content_hash does not match its shard list (edited?)")
    tok = m.get("tokenizer") or {}
    return PreparedData(tuple(shards), str(folder), m, tok.get("vocab_size"), tok.get("eos_id"),
                        tok.get("spec"), m["content_hash"])


def _open_prefixes(prefixes: list[str], source: str, verify: bool) -> PreparedData:
    shards: list[Shard] = []
    for p in prefixes:
        ds = IndexedDataset(p)
        if verify:
            ds.verify()
        shards.append(ds)
    dtypes = {s.dtype for s in shards}
    if len(dtypes) > 1:
        raise IndexedDatasetError(f"{source}: shards of different dtypes ({', '.join(map(str, dtypes))})")
    return PreparedData(tuple(shards), source)


def open_prepared(spec: str | os.PathLike[str], *, verify: bool = False) -> PreparedData:
    """Prepared data, from any of
        a folder            `prepare`'s output (its manifest.json), or else every PREFIX.idx in it
        a prefix            PREFIX.bin + PREFIX.idx (also given as PREFIX.bin or PREFIX.idx)
        a glob              of prefixes, .bin or .idx files (sorted, each prefix once)
        a flat token file   FILE.bin + FILE.bin.json (tokens.py), as one shard of one document
    `verify`: also check every pointer, and the manifest's hash of each .idx (reads the index files,
    never the tokens). Raises IndexedDatasetError (a BadInputError) naming the file and the problem.
    """
    s = os.fspath(spec)
    p = Path(s).expanduser()
    if p.is_dir():
        return _open_folder(p, verify)
    for suffix in (".bin", ".idx"):
        if s.endswith(suffix) and Path(s[: -len(suffix)] + ".idx").is_file():
            return _open_prefixes([s[: -len(suffix)]], s, verify)
    if Path(s + ".idx").is_file():
        return _open_prefixes([s], s, verify)
    if p.is_file() and Path(s + ".json").is_file():
        shard = FlatTokenShard(p)
        m = shard.file.meta
        return PreparedData((shard,), s, None, m.vocab_size, None, m.tokenizer)
    if globlib.has_magic(s):
        found = sorted({f[: -len(".idx")] if f.endswith(".idx") else f[: -len(".bin")]
                        for f in globlib.glob(s, recursive=True) if f.endswith((".idx", ".bin"))})
        if not found:
            raise IndexedDatasetError(f"{s}: the glob matches no .bin or .idx file")
        return _open_prefixes(found, s, verify)
    raise IndexedDatasetError(
        f"{s}: neither a prepared folder, a PREFIX with PREFIX.idx and PREFIX.bin, a glob, nor a token file with "
        "a .json sidecar")


# ----------------------------------------------------------------------------------------- writing


class IndexedWriter:
    """Writes one indexed dataset: tokens stream to `bin_file` as they come; the index arrays
    (20 bytes a document) stay in memory until `write_index`.

    Nothing here names files or renames them: prepare.py owns where and when (temporary names,
    fsync, rename into place), which keeps this the format alone.
    """

    def __init__(self, bin_file: BinaryIO, dtype: np.dtype, max_sequence_tokens: int = MAX_SEQUENCE_TOKENS) -> None:
        if np.dtype(dtype) not in _CODE_OF:
            raise ValueError(f"dtype {dtype} has no Megatron code")
        self.bin_file = bin_file
        self.dtype = np.dtype(dtype)
        self.max_sequence_tokens = max_sequence_tokens
        # Compact arrays (4 and 8 bytes an entry, not a Python int object each): a shard of millions
        # of documents keeps its index in tens of MB.
        self._lengths = array("i")
        self._doc_index = array("q", [0])
        self._open = 0  # tokens of the sequence being written
        self.num_tokens = 0

    def add(self, ids: np.ndarray) -> None:
        """Append tokens to the current document (any number of calls per document)."""
        a = np.ascontiguousarray(ids, dtype=self.dtype)
        pos = 0
        while pos < a.size:
            room = self.max_sequence_tokens - self._open
            if room == 0:  # this document continues in a new sequence (int32 lengths)
                self._lengths.append(self._open)
                self._open = 0
                room = self.max_sequence_tokens
            take = min(room, a.size - pos)
            self.bin_file.write(a[pos : pos + take].tobytes())
            self._open += take
            pos += take
        self.num_tokens += int(a.size)

    def end_document(self) -> None:
        """Close the current document (a document of no tokens is not recorded)."""
        if self._open:
            self._lengths.append(self._open)
            self._open = 0
        if len(self._lengths) > self._doc_index[-1]:
            self._doc_index.append(len(self._lengths))

    @property
    def num_documents(self) -> int:
        return len(self._doc_index) - 1

    def index_bytes(self) -> bytes:
        """The whole `.idx` file for what was added (an unfinished document is closed first)."""
        self.end_document()
        lengths = np.asarray(self._lengths, dtype="<i4")
        pointers = np.zeros(len(lengths), dtype="<i8")
        if len(lengths) > 1:
            np.cumsum(lengths[:-1], dtype="<i8", out=pointers[1:])
        pointers *= self.dtype.itemsize
        head = HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths), len(self._doc_index))
        return head + lengths.tobytes() + pointers.tobytes() + np.asarray(self._doc_index, dtype="<i8").tobytes()
