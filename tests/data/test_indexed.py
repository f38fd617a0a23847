"""Megatron's indexed format: a dataset packed here with struct from the documented layout is read by
`IndexedDataset`; what `prepare` writes is read back by a reader written here from the same layout;
broken files give errors naming the file; `open_prepared` opens folders, prefixes, globs and flat
token files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from oobleck_slurm.data import prepare as flat_prepare
from oobleck_slurm.data.indexed import IndexedDataset, IndexedDatasetError, IndexedWriter, open_prepared
from oobleck_slurm.data.prepare import BYTE_EOS, prepare_corpus

# The layout (Megatron-LM's MMapIndexedDataset, version 1), written out here independently of indexed.py.
CODES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 8: "<u2"}


def pack(prefix: Path, code: int, docs: list[list[list[int]]]) -> None:
    """Write PREFIX.bin/.idx: `docs` is a list of documents, each a list of sequences of token ids."""
    dt = np.dtype(CODES[code])
    lengths, pointers, doc_idx, pos = [], [], [0], 0
    with open(f"{prefix}.bin", "wb") as b:
        for doc in docs:
            for seq in doc:
                b.write(np.asarray(seq, dtype=dt).tobytes())
                lengths.append(len(seq))
                pointers.append(pos)
                pos += len(seq) * dt.itemsize
            doc_idx.append(len(lengths))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def unpack(prefix: Path) -> list[list[int]]:
    """The documents of PREFIX.bin/.idx (each its sequences concatenated), read from the layout."""
    raw = Path(f"{prefix}.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    (code,) = struct.unpack_from("<B", raw, 17)
    n_seq, n_doc = struct.unpack_from("<QQ", raw, 18)
    off = 34
    lengths = struct.unpack_from(f"<{n_seq}i", raw, off)
    pointers = struct.unpack_from(f"<{n_seq}q", raw, off + 4 * n_seq)
    doc_idx = struct.unpack_from(f"<{n_doc}q", raw, off + 12 * n_seq)
    assert version == 1 and len(raw) == off + 12 * n_seq + 8 * n_doc
    dt = np.dtype(CODES[code])
    data = Path(f"{prefix}.bin").read_bytes()
    seqs = [np.frombuffer(data, dtype=dt, count=n, offset=p).tolist() for n, p in zip(lengths, pointers)]
    return [sum(seqs[a:b], []) for a, b in zip(doc_idx[:-1], doc_idx[1:])]


DOCS = [[[5, 6, 7]], [[1], [2, 3]], [[60000, 9]]]  # the second document spans two sequences


def test_a_dataset_packed_from_the_layout_is_read(tmp_path: Path) -> None:
    pack(tmp_path / "m", 8, DOCS)
    ds = IndexedDataset(tmp_path / "m")
    ds.verify()
    assert (ds.dtype, ds.num_tokens, ds.num_documents, ds.num_sequences) == (np.dtype("<u2"), 8, 3, 4)
    assert ds.document_boundaries().tolist() == [0, 3, 6, 8]
    assert ds.document_lengths().tolist() == [3, 3, 2]
    assert ds.tokens(2, 4).tolist() == [7, 1, 2, 3]
    assert [ds.document(d).tolist() for d in range(3)] == [[5, 6, 7], [1, 2, 3], [60000, 9]]
    with pytest.raises(IndexError):
        ds.tokens(7, 2)
    for spec in (tmp_path / "m", f"{tmp_path}/m.bin", f"{tmp_path}/m.idx", f"{tmp_path}/*.idx", tmp_path):
        opened = open_prepared(spec)
        assert len(opened) == 1 and opened.num_tokens == 8 and opened.identity() == open_prepared(spec).identity()


@pytest.mark.parametrize("code", [1, 3, 4, 5])
def test_every_integer_dtype_code_is_read(tmp_path: Path, code: int) -> None:
    pack(tmp_path / "m", code, [[[1, 2]], [[3]]])
    assert IndexedDataset(tmp_path / "m").tokens(0, 3).tolist() == [1, 2, 3]


def test_the_writer_matches_the_layout_and_splits_an_overlong_document(tmp_path: Path) -> None:
    with open(tmp_path / "w.bin", "wb") as b:
        w = IndexedWriter(b, np.dtype("<u2"), max_sequence_tokens=4)
        w.add(np.array([1, 2, 3]))
        w.add(np.array([4, 5, 6]))  # the document goes on past 4 tokens: a second sequence
        w.end_document()
        w.end_document()  # an empty document is not recorded
        w.add(np.array([7]))
        idx = w.index_bytes()
    (tmp_path / "w.idx").write_bytes(idx)
    assert unpack(tmp_path / "w") == [[1, 2, 3, 4, 5, 6], [7]]
    ds = IndexedDataset(tmp_path / "w")
    assert ds.num_sequences == 3 and ds.document_lengths().tolist() == [6, 1]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.with_suffix(".idx").write_bytes(b"MMIDIDX"), "shorter than the 34-byte header"),
        (lambda p: p.with_suffix(".idx").write_bytes(b"XXXXXXXXX" + p.with_suffix(".idx").read_bytes()[9:]),
         "not a Megatron index"),
        (lambda p: p.with_suffix(".idx").write_bytes(p.with_suffix(".idx").read_bytes()[:-8]), "truncated"),
        (lambda p: p.with_suffix(".bin").write_bytes(p.with_suffix(".bin").read_bytes()[:-2]), "truncated"),
        (lambda p: p.with_suffix(".bin").unlink(), "does not exist"),
    ],
)
def test_a_broken_dataset_names_its_file(tmp_path: Path, damage, message: str) -> None:
    pack(tmp_path / "m", 8, DOCS)
    damage(tmp_path / "m.bin")
    with pytest.raises(IndexedDatasetError, match=message) as e:
        IndexedDataset(tmp_path / "m")
    assert str(tmp_path / "m") in str(e.value)


def test_prepare_output_is_read_back_from_the_layout(tmp_path: Path) -> None:
    texts = [f"document {i}: " + "abc " * i for i in range(50)] + ["Caf\u00e9 \u6771\u4eac"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts), encoding="utf-8")
    prepare_corpus([str(tmp_path / "in.jsonl")], tmp_path / "out", text_key="body", workers=1)
    docs = unpack(tmp_path / "out" / "shard-00000")
    assert docs == [list(t.encode()) + [BYTE_EOS] for t in texts]
    opened = open_prepared(tmp_path / "out", verify=True)
    assert (opened.vocab_size, opened.eos_id, opened.tokenizer) == (256, BYTE_EOS, "byte")
    assert opened.identity() == opened.manifest["content_hash"]  # type: ignore[index]


def test_a_changed_shard_is_refused_by_the_manifest(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("some text", encoding="utf-8")
    prepare_corpus([str(tmp_path / "a.txt")], tmp_path / "out")
    with open(tmp_path / "out" / "shard-00000.bin", "ab") as f:  # a token more, and its .idx to match
        f.write(b"x")
    (tmp_path / "out" / "shard-00000.idx").write_bytes(
        (tmp_path / "out" / "shard-00000.idx").read_bytes()[:34] + struct.pack("<i", 11)
        + (tmp_path / "out" / "shard-00000.idx").read_bytes()[38:])
    with pytest.raises(IndexedDatasetError, match="the manifest says"):
        open_prepared(tmp_path / "out")


def test_an_unfinished_folder_says_to_rerun(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("some text", encoding="utf-8")
    prepare_corpus([str(tmp_path / "a.txt")], tmp_path / "out")
    (tmp_path / "out" / "manifest.json").unlink()
    (tmp_path / "out" / "shard-00000.idx").unlink()
    with pytest.raises(IndexedDatasetError, match="not finished"):
        open_prepared(tmp_path / "out")


def test_a_flat_token_file_opens_as_one_document(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("flat text", encoding="utf-8")
    flat_prepare(tmp_path / "a.txt", tmp_path / "a.bin")
    opened = open_prepared(tmp_path / "a.bin")
    assert opened.num_documents == 1 and bytes(opened[0].tokens(0, 9).tolist()) == b"flat text"
    assert opened.vocab_size == 256 and len(opened.identity()) == 64


def test_nothing_to_open_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(IndexedDatasetError, match="matches no .bin or .idx"):
        open_prepared(tmp_path / "*.idx")
    with pytest.raises(IndexedDatasetError, match="neither a prepared folder"):
        open_prepared(tmp_path / "nothing")
