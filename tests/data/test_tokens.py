"""Token files: prepare round trip, layout, sidecar validation, the shipped text."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from oobleck_slurm.data import (
    DEFAULT_TEXT,
    ByteTokenizer,
    TokenDataset,
    TokenFile,
    TokenFileError,
    TokenizerError,
    default_token_file,
    prepare,
)
from oobleck_slurm.data.prepare import sha256_file

HERE = Path(__file__).parent

TEXT = "Anne Elliot walked to Uppercross.\nCaf\u00e9 na\u00efve \u2014 \u00e9l\u00e8ve \U0001f600\n" * 50


@pytest.fixture(autouse=True)
def user_tokenizers_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))  # so that 'user_tokenizers:...' imports


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    p = tmp_path / "in.txt"
    p.write_text(TEXT, encoding="utf-8")
    return p


def test_byte_round_trip_with_tiny_chunks(text_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.bin"
    # 7-byte chunks split multi-byte UTF-8 characters: bytes must still round-trip exactly.
    meta = prepare(text_file, out, chunk_bytes=7)
    tf = TokenFile(out)
    assert tf.meta == meta
    assert meta.dtype == "uint16" and meta.vocab_size == 256 and meta.tokenizer == "byte"
    assert meta.source_sha256 == sha256_file(text_file)
    assert tf.tokens.dtype == np.uint16
    assert ByteTokenizer.decode(tf.tokens.tolist()) == TEXT
    assert out.stat().st_size == 2 * len(TEXT.encode("utf-8"))
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_user_tokenizer_uses_uint32_and_chunks_at_newlines(text_file: Path, tmp_path: Path) -> None:
    spec = "user_tokenizers:word_tokenizer"
    whole = tmp_path / "whole.bin"
    chunked = tmp_path / "chunked.bin"
    prepare(text_file, whole, spec)
    prepare(text_file, chunked, spec, chunk_bytes=16)
    a, b = TokenFile(whole), TokenFile(chunked)
    assert a.meta.dtype == "uint32" and a.meta.vocab_size == 70000
    # Each line is tokenized whole in both cases, so the ids agree.
    assert np.array_equal(a.tokens, b.tokens)
    from user_tokenizers import WordTokenizer

    lines = TEXT.splitlines(keepends=True)
    assert a.tokens.tolist() == [i for line in lines for i in WordTokenizer().encode(line)]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("bpe", "expected 'byte', a tokenizer.json"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("user_tokenizers:missing", "has no callable 'missing'"),
        ("user_tokenizers:not_a_tokenizer", "needs an encode"),
    ],
)
def test_bad_tokenizer_strings(text_file: Path, tmp_path: Path, spec: str, match: str) -> None:
    with pytest.raises(TokenizerError, match=match):
        prepare(text_file, tmp_path / "o.bin", spec)
    assert not (tmp_path / "o.bin").exists()


def test_out_of_vocab_ids_are_rejected_and_nothing_is_left(text_file: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"outside its vocabulary \[0, 10\)"):
        prepare(text_file, tmp_path / "o.bin", "user_tokenizers:out_of_range_tokenizer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_missing_input(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.txt does not exist"):
        prepare(tmp_path / "nope.txt", tmp_path / "o.bin")


def test_bad_files_give_clear_errors(text_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.bin"
    with pytest.raises(TokenFileError, match="does not exist"):
        TokenFile(out)
    prepare(text_file, out)
    side = tmp_path / "out.bin.json"
    good = side.read_text()

    side.unlink()
    with pytest.raises(TokenFileError, match="has no sidecar"):
        TokenFile(out)
    side.write_text("{not json")
    with pytest.raises(TokenFileError, match="not valid JSON"):
        TokenFile(out)
    raw = json.loads(good)
    side.write_text(json.dumps({**raw, "dtype": "int8"}))
    with pytest.raises(TokenFileError, match="dtype 'int8', expected one of uint16, uint32"):
        TokenFile(out)
    side.write_text(json.dumps({k: v for k, v in raw.items() if k != "vocab_size"}))
    with pytest.raises(TokenFileError, match="missing field.* vocab_size"):
        TokenFile(out)
    side.write_text(json.dumps({**raw, "vocab_size": 100000}))
    with pytest.raises(TokenFileError, match="uint16 cannot hold a vocabulary of 100000"):
        TokenFile(out)

    side.write_text(good)
    with open(out, "ab") as f:
        f.write(b"\x00")  # odd size: not a whole number of uint16 tokens
    with pytest.raises(TokenFileError, match="sidecar says .* tokens of uint16"):
        TokenFile(out)


def test_dataset_windows_are_shifted_and_non_overlapping(text_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.bin"
    prepare(text_file, out)
    tf = TokenFile(out)
    ds = TokenDataset(tf, seq_len=16)
    assert len(ds) == (len(tf) - 1) // 16
    x, y = ds.batch([0, 2, len(ds) - 1])
    assert x.shape == y.shape == (3, 16) and str(x.dtype) == "torch.int64"
    toks = tf.tokens.astype(np.int64)
    assert x[1].tolist() == toks[32:48].tolist()
    assert y[1].tolist() == toks[33:49].tolist()
    with pytest.raises(IndexError):
        ds.batch([len(ds)])
    with pytest.raises(ValueError, match="too few for one sample"):
        TokenDataset(tf, seq_len=len(tf))


def test_default_token_file_is_the_shipped_text_and_cached(tmp_path: Path) -> None:
    assert 100_000 <= DEFAULT_TEXT.stat().st_size <= 1_000_000
    tf = default_token_file(tmp_path)
    assert ByteTokenizer.decode(tf.tokens[:10].tolist()) == "Persuasion"
    assert len(tf) == DEFAULT_TEXT.stat().st_size
    mtime = tf.path.stat().st_mtime_ns
    assert default_token_file(tmp_path).path.stat().st_mtime_ns == mtime  # reused, not rewritten
    tf.path.write_bytes(b"\x00\x00")  # a broken cache is prepared again
    assert len(default_token_file(tmp_path)) == DEFAULT_TEXT.stat().st_size
