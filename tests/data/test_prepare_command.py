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
