"""Inputs of `prepare`: discovery (files, folders, globs), the shard plan, every format (jsonl, parquet,
text, .gz, .zst), errors naming the file and line, bounded pieces and their effect on tokenization, and
the Slurm task share."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pytest

from oobleck_slurm.data.corpus import CorpusError, InputFile, Unit, atoms, discover, plan_shards, read_unit
from oobleck_slurm.data.indexed import open_prepared
from oobleck_slurm.data.prepare import (
    BYTE_EOS,
    DocumentEncoder,
    PrepareError,
    encode_documents,
    prepare_corpus,
    split_document,
    task_share,
)

from . import llama3_bpe  # noqa: E402

HERE = Path(__file__).parent


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def docs_of(f: InputFile, unit: Unit) -> list[str]:
    return ["".join(d) for d in read_unit(f, unit)]


def test_discovery_searches_folders_expands_globs_and_lists_each_file_once(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / ".hidden").mkdir()
    for name in ("a/1.jsonl", "a/b/2.txt", "a/b/3.jsonl.zst", "a/notes.csv", "a/.hidden/x.txt", "a/.y.jsonl"):
        (tmp_path / name).write_text("", encoding="utf-8")
    found = discover([str(tmp_path / "a"), str(tmp_path / "a" / "*.jsonl"), str(tmp_path / "a" / "notes.csv")])
    assert [Path(f.path).relative_to(tmp_path).as_posix() for f in found] == [
        "a/1.jsonl", "a/b/2.txt", "a/b/3.jsonl.zst", "a/notes.csv"]
    assert [(f.kind, f.compression) for f in found] == [("jsonl", None), ("text", None), ("jsonl", "zst"),
                                                        ("text", None)]  # named explicitly: read as text
    with pytest.raises(CorpusError, match="no such file"):
        discover([str(tmp_path / "missing")])
    with pytest.raises(CorpusError, match="matches no file"):
        discover([str(tmp_path / "*.parquet")])


def test_the_plan_packs_units_in_order_and_cuts_a_large_jsonl() -> None:
    big = InputFile("/big.jsonl", 250, 0, "jsonl", None)
    small = InputFile("/s.txt", 30, 0, "text", None)
    zst = InputFile("/z.jsonl.zst", 500, 0, "jsonl", "zst")
    pieces = atoms(big, 0, 100) + atoms(small, 1, 100) + atoms(zst, 2, 100)
    assert plan_shards(pieces, 100) == [[Unit(0, 0, 100)], [Unit(0, 100, 200)], [Unit(0, 200, 250), Unit(1, 0, 30)],
                                        [Unit(2, 0, 500)]]  # a compressed stream is never cut
    assert plan_shards(pieces, 10_000) == [[Unit(0, 0, 250), Unit(1, 0, 30), Unit(2, 0, 500)]]


@pytest.mark.parametrize("shard_bytes", [1, 7, 64, 1000])
def test_byte_ranges_of_a_jsonl_give_every_line_once(tmp_path: Path, shard_bytes: int) -> None:
    rng = random.Random(shard_bytes)
    texts = ["x" * rng.randrange(0, 40) + f"#{i}" for i in range(60)]
    path = write_jsonl(tmp_path / "a.jsonl", texts)
    f = discover([str(path)])[0]
    got = [d for unit, _ in atoms(f, 0, shard_bytes) for d in docs_of(f, unit)]
    assert got == texts


def test_every_format_gives_the_same_documents(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = ["first document", "", "second \u6771\u4eac", "third\nwith lines"]
    raw = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    (tmp_path / "a.jsonl").write_bytes(raw + b"\n")  # a blank line is skipped
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    pq.write_table(pa.table({"text": texts + [None], "n": list(range(5))}), tmp_path / "d.parquet", row_group_size=2)
    expected = [t for t in texts if t]  # empty documents are skipped
    for f in discover([str(tmp_path)]):
        if f.kind == "parquet":
            units = [u for u, _ in atoms(f, 0, 1, [1, 1, 1])]
            assert [d for u in units for d in docs_of(f, u)] == expected
        else:
            assert docs_of(f, Unit(0, 0, f.size)) == expected, f.path
    (tmp_path / "e.txt.gz").write_bytes(gzip.compress("one whole file\n\nis one document".encode()))
    f = discover([str(tmp_path / "e.txt.gz")])[0]
    assert docs_of(f, Unit(0, 0, f.size)) == ["one whole file\n\nis one document"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"text": "ok"', "line 3: not valid JSON"),
        ('{"body": "no text key"}', "line 3: no key 'text', expected an object with a string 'text' (--text-key) (keys: body)"),
        ('{"text": 12}', "line 3: 'text' is a int, expected a string"),
        ('["text"]', "line 3: a JSON list"),
    ],
)
def test_a_bad_jsonl_line_is_named_by_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n' + line + "\n", encoding="utf-8")
    f = discover([str(path)])[0]
    with pytest.raises(CorpusError) as e:
        docs_of(f, Unit(0, 0, f.size))
    assert f"{path}: {message}" in str(e.value)
    # Also from a unit that starts mid-file (the line number is counted when the error is reported).
    with pytest.raises(CorpusError, match=f"{path}: line 3"):
        docs_of(f, Unit(0, 20, f.size))


def test_a_bad_input_stops_the_run_without_losing_finished_shards(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", ["good " * 50] * 20)
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n{"text": broken}\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=r"b.jsonl: line 2: not valid JSON"):
        prepare_corpus([str(tmp_path)], tmp_path / "out", shard_bytes=4096, workers=1)
    assert (tmp_path / "out" / "shard-00000.idx").is_file()  # a.jsonl's shard is kept
    assert not list((tmp_path / "out").glob(".*tmp"))  # no temporary file left behind


def test_corrupt_compressed_input_is_named(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:-20])
    f = discover([str(tmp_path / "a.jsonl.gz")])[0]
    with pytest.raises(CorpusError, match="a.jsonl.gz: cannot read"):
        docs_of(f, Unit(0, 0, f.size))


@pytest.mark.parametrize("max_chars", [2, 5, 64, 1000])
def test_pieces_are_bounded_and_join_back(max_chars: int) -> None:
    rng = random.Random(max_chars)
    alphabet = "ab \n\u6771\u4eac.7"
    text = "".join(rng.choice(alphabet) for _ in range(3000))
    chunks = [text[i : i + 97] for i in range(0, len(text), 97)]
    pieces = list(split_document(iter(chunks), max_chars))
    assert "".join(pieces) == text and all(0 < len(p) <= max_chars for p in pieces)


def test_cuts_prefer_word_gaps_then_line_ends_then_whitespace() -> None:
    assert list(split_document(iter(["aaaa bbbb cccc"]), 10)) == ["aaaa bbbb", " cccc"]
    assert list(split_document(iter(["12345\n6789012345"]), 10)) == ["12345\n", "6789012345"]
    assert list(split_document(iter(["12345 7890123"]), 10)) == ["12345", " 7890123"]
    assert list(split_document(iter(["123 4567890123"]), 10)) == ["123 456789", "0123"]  # only the 2nd half
    assert list(split_document(iter(["\u6771" * 25]), 10)) == ["\u6771" * 10, "\u6771" * 10, "\u6771" * 5]


def test_a_cut_inside_cjk_text_changes_few_tokens(tmp_path: Path) -> None:
    """The documented effect of the last-resort cut: the text round-trips, and the token count differs
    from the whole document's by at most 2 per cut (BPE cannot merge across it). Word-gap and
    line-end cuts are exact."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    spec = str(llama3_bpe.build(tmp_path / "tokenizer.json"))
    whole_tok = Tokenizer.from_file(spec)
    enc = DocumentEncoder(spec)
    rng = random.Random(3)
    cases = {"cjk": llama3_bpe.cjk(rng, 50_000), "cjk-lines": llama3_bpe.cjk(rng, 50_000, 80),
             "english": llama3_bpe.english(rng, 10_000)}
    for name, doc in cases.items():
        cuts = len(list(split_document(iter([doc]), 2048))) - 1
        got = np.concatenate([ids for ids, _ in encode_documents(iter([iter([doc])]), enc, name, 2048)]).tolist()
        whole = whole_tok.encode(doc).ids + [enc.info.eos_id]
        assert cuts > 10
        assert whole_tok.decode(got, skip_special_tokens=True) == doc
        if name == "cjk":
            assert got != whole and abs(len(got) - len(whole)) <= 2 * cuts
        else:
            assert got == whole, name


def test_prepared_tokens_are_encode_plus_eos_per_document(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    spec = str(llama3_bpe.build(tmp_path / "tok" / "tokenizer.json"))
    rng = random.Random(5)
    texts = [llama3_bpe.english(rng, rng.randrange(1, 300)) for _ in range(40)]
    write_jsonl(tmp_path / "a.jsonl", texts)
    prepare_corpus([str(tmp_path / "a.jsonl")], tmp_path / "out", spec, shard_bytes=2000, workers=1)
    data = open_prepared(tmp_path / "out")
    tok = Tokenizer.from_file(spec)
    eos = tok.token_to_id("<|end_of_text|>")
    assert data.eos_id == eos and len(data) > 3
    got = [s.tokens(int(b[d]), int(b[d + 1] - b[d])).tolist()
           for s in data for b in [s.document_boundaries()] for d in range(s.num_documents)]
    assert got == [tok.encode(t).ids + [eos] for t in texts]  # encode() includes Llama 3's BOS


def test_the_eos_is_found_or_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    assert DocumentEncoder("byte").info.eos_id == BYTE_EOS
    assert DocumentEncoder("byte", "10").info.eos_id == 10
    with pytest.raises(PrepareError, match="has no integer eos_token_id or eos_id: give --eos ID"):
        DocumentEncoder("user_tokenizers:word_tokenizer")
    assert DocumentEncoder("user_tokenizers:word_tokenizer", "7").info.eos_id == 7
    with pytest.raises(PrepareError, match="outside its vocabulary"):
        DocumentEncoder("byte", "256")


def test_the_task_share_comes_from_the_argument_or_slurm() -> None:
    assert task_share(None, {}) == (0, 1)
    assert task_share("3/8", {"SLURM_ARRAY_TASK_ID": "1"}) == (3, 8)
    array = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_MAX": "7",
             "SLURM_ARRAY_TASK_COUNT": "4"}
    assert task_share(None, array) == (1, 4)
    assert task_share(None, {"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "3"}) == (2, 3)
    assert task_share(None, {**array, "SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "3"}) == (5, 12)
    assert task_share(None, {"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) == (0, 1)  # a batch script's own shell
    for bad in ("3", "8/8", "a/b", "-1/2"):
        with pytest.raises(PrepareError, match="--shard-of"):
            task_share(bad, {})
    with pytest.raises(PrepareError, match="give --shard-of"):
        task_share(None, {**array, "SLURM_ARRAY_TASK_MAX": "10"})
