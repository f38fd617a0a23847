"""Training samples cut from token streams: non-overlapping windows of seq_len + 1 tokens.

Sample i of a stream is tokens[i*seq_len : i*seq_len + seq_len + 1]; x is its first seq_len tokens
and y the same window shifted by one (the next-token targets). Consecutive samples share one boundary
token, so every token except the very last is a target exactly once per pass. A source of several
streams (a glob of token files, or a prepared set's shards) numbers its streams' samples back to back;
no window spans two streams.

A stream is anything with `num_tokens` and `tokens(start, count)`: today's flat token file
(`FlatTokens` over a `TokenFile`) or a shard of a prepared set (`oobleck_slurm.data.indexed`, where
installed). `open_source(path)` opens either; `source_identity` says what a checkpoint records of it.

Every dataset is a `Samples`: it writes the windows of given samples into a buffer the caller owns
(`read_windows`), so the engine's reader thread fills pinned memory directly (engine/worker.py).
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from oobleck_slurm.data.tokenizers import BYTE, BYTE_EOS
from oobleck_slurm.data.tokens import TokenFile, TokenFileError

EDGE_BYTES = 1 << 20  # a flat file's identity hashes its first and last MiB, not the whole file


class TokenStream(Protocol):
    @property
    def num_tokens(self) -> int: ...

    def tokens(self, start: int, count: int) -> np.ndarray: ...


@dataclass(frozen=True)
class OpenedSource:
    """One source's streams, its vocabulary where known, what identifies it (`identity`), and the id
    that ends each of its documents where known (document masking)."""

    streams: list[TokenStream]
    vocab_size: int | None
    identity: dict[str, Any]
    eos_id: int | None = None


class FlatTokens:
    """A flat token file (`TokenFile`) as a stream."""

    def __init__(self, token_file: TokenFile) -> None:
        self.token_file = token_file
        self.num_tokens = len(token_file)

    def tokens(self, start: int, count: int) -> np.ndarray:
        return self.token_file.tokens[start : start + count]


def flat_identity(tf: TokenFile) -> dict[str, Any]:
    """What identifies a flat token file without reading it all: its size, its sidecar's token count
    and source-text hash, and a sha256 of its first and last MiB. mtime is recorded for people
    (`compare` in engine/checkpoint.py ignores it: a copy to another file system keeps the data)."""
    st = tf.path.stat()
    h = hashlib.sha256()
    with open(tf.path, "rb") as f:
        h.update(f.read(EDGE_BYTES))
        if st.st_size > EDGE_BYTES:
            f.seek(max(EDGE_BYTES, st.st_size - EDGE_BYTES))
            h.update(f.read())
    return {"path": str(tf.path), "bytes": st.st_size, "num_tokens": tf.meta.num_tokens,
            "source_sha256": tf.meta.source_sha256, "edges_sha256": h.hexdigest(), "mtime_ns": st.st_mtime_ns}


class Samples:
    """Samples of `seq_len + 1` tokens (x: the first seq_len, y: the last seq_len), numbered 0 ..
    num_samples - 1. A subclass writes windows into a caller's buffer (`read_windows`); `windows`
    and `batch` are built on it once for all."""

    num_samples: int
    seq_len: int

    def read_windows(self, sample_ids: np.ndarray, out: np.ndarray) -> None:
        """Write the windows of `sample_ids` (int64) into the rows of `out` (int64, (n, seq_len + 1))."""
        raise NotImplementedError

    def windows(self, sample_ids: np.ndarray | list[int], pin: bool = False) -> torch.Tensor:
        """The windows of `sample_ids`, int64 (n, seq_len + 1); in pinned memory with `pin` (CUDA only),
        so that its copy to a GPU can be asynchronous."""
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        out = torch.empty((len(ids), self.seq_len + 1), dtype=torch.int64, pin_memory=pin)
        if len(ids):
            self.read_windows(ids, out.numpy())
        return out

    def batch(self, sample_ids: np.ndarray | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each int64 of shape (len(sample_ids), seq_len)."""
        t = self.windows(sample_ids)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class TokenDataset(Samples):
    """The samples of one or more token streams (or `TokenFile`s) for sequences of `seq_len` tokens."""

    def __init__(self, streams: TokenFile | TokenStream | Sequence[TokenFile | TokenStream], seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        items = list(streams) if isinstance(streams, Sequence) else [streams]
        if not items:
            raise ValueError("a dataset needs at least one token stream")
        self.streams: list[TokenStream] = [FlatTokens(s) if isinstance(s, TokenFile) else s for s in items]
        self.seq_len = seq_len
        counts = [max(0, (s.num_tokens - 1) // seq_len) for s in self.streams]
        self._starts = np.cumsum([0, *counts]).astype(np.int64)
        self.num_samples = int(self._starts[-1])
        if self.num_samples == 0:
            total = sum(s.num_tokens for s in self.streams)
            raise ValueError(
                f"{_name(self.streams[0])}{' and others' if len(self.streams) > 1 else ''} hold(s) {total} "
                f"tokens, too few for one sample of seq_len {seq_len} (needs {seq_len + 1} in one file)"
            )

    def __len__(self) -> int:
        return self.num_samples

    def read_windows(self, sample_ids: np.ndarray, out: np.ndarray) -> None:
        # the streams of all samples in one search; then one slice copy per sample (no index array
        # of n * (seq_len + 1) entries)
        bad = (sample_ids < 0) | (sample_ids >= self.num_samples)
        if bad.any():
            raise IndexError(f"sample {int(sample_ids[bad][0])} outside [0, {self.num_samples})")
        streams = np.searchsorted(self._starts, sample_ids, side="right") - 1
        starts = (sample_ids - self._starts[streams]) * self.seq_len
        for row, (k, start) in enumerate(zip(streams.tolist(), starts.tolist())):
            out[row] = self.streams[k].tokens(start, self.seq_len + 1)


def _name(stream: TokenStream) -> str:
    tf = getattr(stream, "token_file", None)
    return str(tf.path) if tf is not None else repr(stream)


def _has_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def is_prepared_set(path: str) -> bool:
    """A prefix, folder or glob of Megatron-format shards (`.idx` beside `.bin`) rather than flat
    token files."""
    if os.path.isfile(path + ".idx") or (path.endswith((".bin", ".idx")) and os.path.isfile(path[:-4] + ".idx")):
        return True
    pattern = os.path.join(path, "*") if os.path.isdir(path) else path
    matches = glob.glob(pattern) if _has_glob(pattern) else []
    return os.path.isfile(os.path.join(path, "manifest.json")) or any(
        m.endswith(".idx") or (m.endswith(".bin") and os.path.isfile(m[:-4] + ".idx")) for m in matches)


def open_source(path: str) -> OpenedSource:
    """One data source: a flat token file, a glob or folder of them (sorted), or a prepared set (a
    prefix, folder or glob of .idx/.bin shards, read by `oobleck_slurm.data.indexed`). Raises a
    BadInputError naming the path when nothing usable is there. A flat source's identity is each
    file's `flat_identity`; a prepared set's is its own index hash (`PreparedData.identity`)."""
    if is_prepared_set(path):
        try:
            indexed: Any = importlib.import_module("oobleck_slurm.data.indexed")
        except ImportError:
            raise TokenFileError(f"{path}: a prepared set (.idx/.bin shards), but this installation has no "
                                 "reader for it (oobleck_slurm.data.indexed)") from None
        data = indexed.open_prepared(path)
        if not len(data):
            raise TokenFileError(f"{path}: no shards in this prepared set")
        return OpenedSource(list(data), data.vocab_size, {"prepared_sha256": data.identity(),
                                                           "num_tokens": data.num_tokens, "shards": len(data)},
                            data.eos_id)
    if _has_glob(path) or os.path.isdir(path):
        pattern = os.path.join(path, "*.bin") if os.path.isdir(path) else path
        files = sorted(m for m in glob.glob(pattern) if not m.endswith(".json"))
        if not files:
            raise TokenFileError(f"{path}: matches no token file")
    else:
        files = [path]
    opened = [TokenFile(f) for f in files]
    # a flat file's sidecar records no eos; the byte tokenizer's is fixed (a NUL in the text ends a document)
    eos = BYTE_EOS if all(tf.meta.tokenizer == BYTE for tf in opened) else None
    return OpenedSource([FlatTokens(tf) for tf in opened], max(tf.meta.vocab_size for tf in opened),
                        {"files": [flat_identity(tf) for tf in opened]}, eos)
