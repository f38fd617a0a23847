"""Input corpora for `prepare`: finding the files, cutting them into units of work, reading documents.

Formats, told by the file name (a `.gz` or `.zst`/`.zstd` ending is decompressed first, streaming):

    *.jsonl, *.ndjson        one document per line: a JSON object whose `text_key` (default "text")
                             holds a string; blank lines are skipped
    *.parquet                one document per row of a string column `text_key`
    *.txt, *.text, *.md      one document per file (anything else named explicitly is read as text)

One document per text file, not per blank-line-separated block: a book or a source file is one
document, and a corpus of many small documents is what jsonl is for. A directory is searched
recursively for those endings (hidden files and folders are skipped); a glob is expanded (`**`
recursive). Every input is listed once, sorted by path, so every Slurm task sees the same list.

Units of work: an uncompressed jsonl file is cut into byte ranges (a line belongs to the range its
first byte is in), a parquet file into row groups, anything else is one unit (a compressed stream
cannot be entered in the middle). `plan_shards` packs units into shards of about `shard_bytes` input
bytes, in input order; that plan is a pure function of the file list, so it is the same for every
process that computes it.

A document is read as an iterator of text chunks (a text file is never held whole); a jsonl line or a
parquet value is one string, so one such document is in memory at a time.
"""

from __future__ import annotations

import codecs
import glob as globlib
import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oobleck_slurm.errors import BadInputError

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSIONS = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}
READ_BYTES = 1 << 20  # a text file is read (and decoded) this much at a time


class CorpusError(BadInputError, ValueError):
    """An input cannot be found or read: the message names the file (and line, for jsonl)."""


@dataclass(frozen=True)
class InputFile:
    path: str  # absolute
    size: int
    mtime_ns: int
    kind: str  # "text", "jsonl" or "parquet"
    compression: str | None  # None, "gz" or "zst"


def classify(path: str, explicit: bool) -> tuple[str, str | None] | None:
    """(kind, compression) from the file name; None for a file a folder search skips. A file named
    explicitly with an unknown ending is text."""
    name = path.lower()
    compression = None
    for suffix, comp in COMPRESSIONS.items():
        if name.endswith(suffix):
            compression, name = comp, name[: -len(suffix)]
            break
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl", compression
    if name.endswith(PARQUET_SUFFIXES):
        if compression:
            return None if not explicit else ("parquet", compression)
        return "parquet", None
    if name.endswith(TEXT_SUFFIXES) or explicit:
        return "text", compression
    return None


def discover(specs: list[str]) -> list[InputFile]:
    """Every input file named by `specs` (files, folders searched recursively, globs), once each, sorted
    by absolute path. Raises CorpusError for a spec that names nothing usable."""
    found: dict[str, tuple[str, str | None]] = {}
    for spec in specs:
        p = Path(spec).expanduser()
        if p.is_file():
            c = classify(str(p), explicit=True)
            if c and c[0] == "parquet" and c[1]:
                raise CorpusError(f"{p}: a compressed parquet file; parquet compresses its own columns, give it as is")
            assert c is not None
            found[str(p.resolve())] = c
        elif p.is_dir():
            n = len(found)
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for f in files:
                    if not f.startswith(".") and (c := classify(f, explicit=False)):
                        found[str(Path(root, f).resolve())] = c
            if len(found) == n:
                raise CorpusError(f"{p}: a folder with no .jsonl, .parquet or text file in it "
                                  f"(also .gz/.zst compressed)")
        elif globlib.has_magic(spec):
            matches = [m for m in globlib.glob(os.path.expanduser(spec), recursive=True) if os.path.isfile(m)]
            if not matches:
                raise CorpusError(f"{spec}: the glob matches no file")
            for m in matches:
                c = classify(m, explicit=True)
                assert c is not None
                found[str(Path(m).resolve())] = c
        else:
            raise CorpusError(f"{spec}: no such file, folder or glob match")
    out = []
    for path in sorted(found):
        st = os.stat(path)
        out.append(InputFile(path, st.st_size, st.st_mtime_ns, *found[path]))
    return out


# ---------------------------------------------------------------------------------- planning (pure)


@dataclass(frozen=True)
class Unit:
    """Part of one input: bytes [start, end) of an uncompressed jsonl file, row groups [start, end) of
    a parquet file, or the whole file (start 0, end its size)."""

    file: int  # index into the input list
    start: int
    end: int


def atoms(f: InputFile, index: int, shard_bytes: int, row_group_bytes: list[int] | None = None) -> list[tuple[Unit, int]]:
    """The smallest pieces `f` may be cut into, each with its size in input bytes."""
    if f.kind == "parquet" and row_group_bytes is not None:
        return [(Unit(index, g, g + 1), b) for g, b in enumerate(row_group_bytes)]
    if f.kind == "jsonl" and f.compression is None and f.size > shard_bytes:
        return [(Unit(index, s, min(s + shard_bytes, f.size)), min(shard_bytes, f.size - s))
                for s in range(0, f.size, shard_bytes)]
    return [(Unit(index, 0, f.size), f.size)]


def plan_shards(pieces: list[tuple[Unit, int]], shard_bytes: int) -> list[list[Unit]]:
    """Pack `pieces` (in order) into shards of about `shard_bytes` input bytes: a shard is closed when
    the next piece would take it past `shard_bytes`. Adjacent pieces of one file merge into one unit."""
    if shard_bytes < 1:
        raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
    shards: list[list[Unit]] = []
    current: list[Unit] = []
    size = 0
    for unit, nbytes in pieces:
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        last = current[-1] if current else None
        if last is not None and last.file == unit.file and last.end == unit.start:
            current[-1] = Unit(unit.file, last.start, unit.end)
        else:
            current.append(unit)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def row_group_bytes(path: str) -> list[int]:
    """The compressed size of each row group of a parquet file (from its footer only)."""
    pq = _pyarrow_parquet(path)
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow raises its own ArrowInvalid and OSError kinds
        raise CorpusError(f"{path}: not a readable parquet file ({e})") from None
    return [max(1, meta.row_group(g).total_byte_size) for g in range(meta.num_row_groups)]


# ------------------------------------------------------------------------------------------ reading

Document = Iterator[str]  # a document's text, in chunks


def _open_binary(f: InputFile) -> io.BufferedIOBase:
    raw = open(f.path, "rb")  # closed by the caller, through the wrapper when there is one
    if f.compression == "gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if f.compression == "zst":
        try:
            import zstandard
        except ImportError as e:
            raw.close()
            raise CorpusError(f"{f.path}: reading .zst needs the 'zstandard' library "
                              f"(pip install 'oobleck-slurm[data]'): {e}") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return raw


def read_unit(f: InputFile, unit: Unit, text_key: str = "text") -> Iterator[Document]:
    """The documents of one unit, in order. Raises CorpusError naming the file (and line) on bad input;
    a compressed stream that is cut short or corrupt is reported the same way."""
    try:
        if f.kind == "jsonl":
            yield from _jsonl(f, unit, text_key)
        elif f.kind == "parquet":
            yield from _parquet(f, unit, text_key)
        else:
            yield _text(f)
    except CorpusError:
        raise
    except (OSError, EOFError) as e:  # gzip's and zstandard's errors for a broken stream included
        raise CorpusError(f"{f.path}: cannot read ({e})") from None
    except Exception as e:
        if type(e).__module__.startswith("zstandard"):
            raise CorpusError(f"{f.path}: not a valid zstd stream ({e})") from None
        raise


def _text(f: InputFile) -> Document:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with _open_binary(f) as src:
        while block := src.read(READ_BYTES):
            try:
                text = decoder.decode(block)
            except UnicodeDecodeError as e:
                raise CorpusError(f"{f.path}: not UTF-8 near byte {offset + e.start} of the text ({e.reason})") from None
            offset += len(block)
            if text:
                yield text
    try:
        tail = decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise CorpusError(f"{f.path}: ends inside a UTF-8 character ({e.reason})") from None
    if tail:
        yield tail


def _line_number(path: str, compression: str | None, line_start: int) -> int:
    """The 1-based number of the line starting at byte `line_start` (counted only when reporting an
    error: a unit that starts mid-file does not know it)."""
    if compression is not None:
        return -1
    n = 1
    with open(path, "rb") as src:
        left = line_start
        while left > 0 and (block := src.read(min(left, 4 << 20))):
            n += block.count(b"\n")
            left -= len(block)
    return n


def _jsonl(f: InputFile, unit: Unit, text_key: str) -> Iterator[Document]:
    whole = f.compression is not None or (unit.start == 0 and unit.end >= f.size)
    with _open_binary(f) as src:
        pos = 0
        line_no = 1
        if not whole and unit.start > 0:
            # A line belongs to the unit holding its first byte: skip the one that began earlier.
            src.seek(unit.start - 1)
            pos = unit.start - 1 + len(src.readline())
            line_no = 0  # unknown until an error needs it
        while whole or pos < unit.end:
            line = src.readline()
            if not line:
                break
            start, pos = pos, pos + len(line)
            if line.strip():
                try:
                    obj = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise CorpusError(f"{_where(f, start, line_no)}: not valid JSON ({e})") from None
                if not isinstance(obj, dict) or text_key not in obj:
                    what = f"no key {text_key!r}" if isinstance(obj, dict) else f"a JSON {type(obj).__name__}"
                    keys = f" (keys: {', '.join(sorted(obj)[:8])})" if isinstance(obj, dict) else ""
                    raise CorpusError(f"{_where(f, start, line_no)}: {what}, expected an object with a "
                                      f"string {text_key!r} (--text-key){keys}")
                text = obj[text_key]
                if not isinstance(text, str):
                    raise CorpusError(f"{_where(f, start, line_no)}: {text_key!r} is a {type(text).__name__}, "
                                      "expected a string")
                if text:
                    yield iter((text,))
            if line_no:
                line_no += 1


def _where(f: InputFile, line_start: int, line_no: int) -> str:
    n = line_no or _line_number(f.path, f.compression, line_start)
    return f"{f.path}: line {n}" if n > 0 else f"{f.path}: the line at byte {line_start}"


def _pyarrow_parquet(path: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise CorpusError(f"{path}: reading parquet needs the 'pyarrow' library "
                          f"(pip install 'oobleck-slurm[data]'): {e}") from None
    return pq


def _parquet(f: InputFile, unit: Unit, text_key: str) -> Iterator[Document]:
    pq = _pyarrow_parquet(f.path)
    try:
        pf = pq.ParquetFile(f.path)
        names = pf.schema_arrow.names
    except Exception as e:
        raise CorpusError(f"{f.path}: not a readable parquet file ({e})") from None
    if text_key not in names:
        raise CorpusError(f"{f.path}: no column {text_key!r} (--text-key); columns: {', '.join(names[:12])}")
    groups = range(unit.start, unit.end) if unit.end <= pf.metadata.num_row_groups else range(pf.metadata.num_row_groups)
    for g in groups:
        try:
            column = pf.read_row_group(g, columns=[text_key]).column(0)
        except Exception as e:
            raise CorpusError(f"{f.path}: cannot read row group {g} ({e})") from None
        for row, value in enumerate(column.to_pylist()):
            if value is None:
                continue
            if not isinstance(value, str):
                raise CorpusError(f"{f.path}: row group {g}, row {row}: column {text_key!r} holds "
                                  f"{type(value).__name__}, expected a string")
            if value:
                yield iter((value,))
