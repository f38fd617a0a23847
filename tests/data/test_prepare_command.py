"""The `prepare` command: output and exit codes (parsed through its own add_parser)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from oobleck_slurm.commands import prepare as command
from oobleck_slurm.data import DEFAULT_TEXT, TokenFile

HERE = Path(__file__).parent


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    return command.run(parser.parse_args(["prepare", *argv]))


def test_prepare_writes_tokens_and_reports_the_count(tmp_path: Path, capsys) -> None:
    out = tmp_path / "sub" / "tokens.bin"
    assert run(str(DEFAULT_TEXT), str(out)) == 0
    assert len(TokenFile(out)) == DEFAULT_TEXT.stat().st_size
    assert f"{DEFAULT_TEXT.stat().st_size:,}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.txt", "o.bin"], "text file missing.txt does not exist"),
        ([str(DEFAULT_TEXT), "o.bin", "--tokenizer", "gpt2"], "expected 'byte', a tokenizer.json"),
        ([str(DEFAULT_TEXT), "o.bin", "--tokenizer", "user_tokenizers:failing_factory"],
         "failing_factory() raised FileNotFoundError: vocab.json not found"),
    ],
)
def test_bad_input_exits_2_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, args: list[str], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(HERE))
    assert run(*args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "o.bin").exists()


# ---- a corpus into a folder of Megatron shards ----

import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from oobleck_slurm.data.indexed import open_prepared  # noqa: E402
from oobleck_slurm.data.prepare import prepare_corpus  # noqa: E402

from . import llama3_bpe  # noqa: E402

REPO = HERE.parents[1]


def corpus(folder: Path, docs: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "a.jsonl", "w", encoding="utf-8") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": llama3_bpe.english(rng, rng.randrange(20, 200))}) + "\n")
    return folder


def test_a_corpus_is_prepared_into_shards_and_a_manifest(tmp_path: Path, capsys) -> None:
    src = corpus(tmp_path / "in", 300)
    assert run(str(src), str(tmp_path / "out"), "--workers", "1") == 0
    out = capsys.readouterr().out
    data = open_prepared(tmp_path / "out", verify=True)
    assert data.num_documents == 300 and f"{data.num_tokens:,} tokens" in out and "1 shards" in out
    assert run(str(src), str(tmp_path / "out")) == 0  # again: nothing to do
    assert "0 shard(s) prepared, 1 already complete" in capsys.readouterr().out


def test_the_same_output_whatever_the_workers_and_tasks(tmp_path: Path) -> None:
    src = str(corpus(tmp_path / "in", 400))
    one = prepare_corpus([src], tmp_path / "one", shard_bytes=8000, workers=1).manifest
    two = prepare_corpus([src], tmp_path / "two", shard_bytes=8000, workers=2).manifest
    first = prepare_corpus([src], tmp_path / "tasks", shard_bytes=8000, shard_of="0/2", workers=1)
    assert first.manifest is None and first.mine == (first.shards + 1) // 2  # task 1's shards are missing
    last = prepare_corpus([src], tmp_path / "tasks", shard_bytes=8000, env={"SLURM_PROCID": "1",
                                                                           "SLURM_STEP_NUM_TASKS": "2"})
    assert one is not None and two is not None and last.manifest is not None and one["num_documents"] == 400
    assert len(one["shards"]) > 4
    assert one["content_hash"] == two["content_hash"] == last.manifest["content_hash"]


def test_a_folder_of_other_inputs_is_not_reused(tmp_path: Path, capsys) -> None:
    src = corpus(tmp_path / "in", 20)
    assert run(str(src), str(tmp_path / "out")) == 0
    corpus(tmp_path / "in", 25)  # the input changed
    assert run(str(src), str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "holds a preparation with other inputs" in err and "Traceback" not in err


def test_bad_corpus_input_exits_2_naming_the_file_and_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "fine"}\n{"txt": "oops"}\n', encoding="utf-8")
    assert run(str(tmp_path / "in"), str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'in' / 'a.jsonl'}: line 2: no key 'text'" in " ".join(err.split()) and "Traceback" not in err


@pytest.mark.slow
def test_a_run_killed_half_way_redoes_only_its_unfinished_shards(tmp_path: Path) -> None:
    """A real process is killed with SIGKILL once some shards are done; the rerun keeps those and the
    result equals an uninterrupted run's."""
    pytest.importorskip("tokenizers")
    spec = str(llama3_bpe.build(tmp_path / "tok" / "tokenizer.json"))
    src = str(corpus(tmp_path / "in", 3000))
    code = (f"from oobleck_slurm.data.prepare import prepare_corpus; "
            f"prepare_corpus([{src!r}], {str(tmp_path / 'out')!r}, {spec!r}, shard_bytes=20000, workers=1)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while len(list((tmp_path / "out").glob("*.idx"))) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "finished or stalled before the kill"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert not (tmp_path / "out" / "manifest.json").exists()
    kept = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("*.idx")}
    redone: list[str] = []
    result = prepare_corpus([src], tmp_path / "out", spec, shard_bytes=20000, workers=1,
                            on_shard=lambda name, counts: counts is not None and redone.append(name))
    assert result.skipped == len(kept) and result.done == result.shards - len(kept) == len(redone) > 0
    assert not set(redone) & {n[: -len(".idx")] for n in kept}
    assert all((tmp_path / "out" / n).stat().st_mtime_ns == t for n, t in kept.items())  # not rewritten
    assert not list((tmp_path / "out").glob(".*.tmp"))
    fresh = prepare_corpus([src], tmp_path / "fresh", spec, shard_bytes=20000, workers=1)
    assert result.manifest is not None and fresh.manifest is not None
    assert result.manifest["content_hash"] == fresh.manifest["content_hash"]


PEAK_RSS = ("import resource, sys; from oobleck_slurm.data.prepare import DocumentEncoder, prepare_corpus; "
            "enc = DocumentEncoder(sys.argv[1]); {} "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")


@pytest.mark.slow
def test_one_huge_cjk_document_is_prepared_in_bounded_memory(tmp_path: Path) -> None:
    """6 MB of CJK text without a single space or newline, as one jsonl document: the peak RSS of the
    preparing process stays within 150 MB of a process that only imports and loads the tokenizer (the
    flat path held such text in one piece: 835 MB for this input)."""
    pytest.importorskip("tokenizers")
    spec = str(llama3_bpe.build(tmp_path / "tok" / "tokenizer.json"))
    rng = random.Random(0)
    doc = "".join(rng.choice(llama3_bpe.CJK) for _ in range(2_000_000))
    (tmp_path / "cjk.jsonl").write_text(json.dumps({"text": doc}, ensure_ascii=False) + "\n", encoding="utf-8")
    del doc
    work = f"prepare_corpus([{str(tmp_path / 'cjk.jsonl')!r}], {str(tmp_path / 'out')!r}, sys.argv[1], workers=1);"

    def peak_kb(code: str) -> int:
        out = subprocess.run([sys.executable, "-c", code, spec], cwd=REPO, capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    base, peak = peak_kb(PEAK_RSS.format("")), peak_kb(PEAK_RSS.format(work))
    assert open_prepared(tmp_path / "out").num_documents == 1
    assert peak - base < 150 * 1024, (base, peak)
