"""`prepare` with a Hugging Face tokenizer.json (or a folder holding one): the ids of the whole text
encoded in one go, computed in pieces; the sidecar records the tokenizer's path and sha256 so that a
changed tokenizer is prepared again; bad tokenizer files are reported by path, without a traceback.
The tokenizers are trained here, on a few lines, with the `tokenizers` library (the `hf` extra)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

from oobleck_slurm.commands import prepare as command  # noqa: E402
from oobleck_slurm.data import (  # noqa: E402
    DEFAULT_TEXT,
    TokenFile,
    TokenizerError,
    default_token_file,
    load_tokenizer,
    prepare,
    prepared,
)
from oobleck_slurm.data.hf_tokenizer import HFTokenizer  # noqa: E402

LINES = [
    "Anne Elliot walked to Uppercross.\n",
    "\n",
    "  An indented line, with   three spaces.\n",
    "\n",
    "Caf\u00e9 na\u00efve \u2014 \u00e9l\u00e8ve \U0001f600 <|endoftext|> more   \n",
    "\t\n",
    "It's 12345 items, don't stop!\r\n",
    "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who,\n",
    "for his own amusement, never took up any book but the Baronetage.\n",
]
TEXT = "".join(LINES) * 30 + "the last line has no newline"
SPECIALS = ["<|endoftext|>", "<s>", "</s>", "[UNK]", "[CLS]", "[SEP]"]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def build(kind: str) -> Tokenizer:
    """A tokenizer of the given family, trained on LINES."""
    byte_level = trainers.BpeTrainer(vocab_size=400, show_progress=False, special_tokens=SPECIALS,
                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    if kind == "wordlevel":  # whitespace words, no post-processor
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(show_progress=False, special_tokens=SPECIALS)
    elif kind == "gpt2":  # byte-level BPE: no special tokens added
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = byte_level
    elif kind == "llama3":  # tiktoken-style split regex, and a post-processor that adds BOS
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        trainer = byte_level
    elif kind == "roberta":  # a prefix space, and <s> ... </s> around a sequence
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 1))
        trainer = byte_level
    elif kind == "bert":  # normalizer, WordPiece, [CLS] ... [SEP] around a sequence
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer()
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.post_processor = processors.BertProcessing(("[SEP]", 5), ("[CLS]", 4))
        trainer = trainers.WordPieceTrainer(vocab_size=300, show_progress=False, special_tokens=SPECIALS)
    elif kind == "metaspace":  # sentencepiece-style unigram: '▁' before the first word
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        trainer = trainers.UnigramTrainer(vocab_size=300, show_progress=False, special_tokens=SPECIALS,
                                          unk_token="[UNK]")
    else:
        raise ValueError(kind)
    tok.train_from_iterator(LINES, trainer)
    return tok


def save(tok: Tokenizer, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    p = tmp_path / "in.txt"
    p.write_bytes(TEXT.encode("utf-8"))  # bytes: keep the \r\n as it is
    return p


@pytest.fixture
def pieces_seen(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Every batch of pieces `prepare` encodes."""
    seen: list[list[str]] = []
    original = HFTokenizer.encode_pieces

    def spy(self: HFTokenizer, pieces: list[str]) -> list[list[int]]:
        seen.append(list(pieces))
        return original(self, pieces)

    monkeypatch.setattr(HFTokenizer, "encode_pieces", spy)
    return seen


@pytest.mark.parametrize("kind", ["wordlevel", "gpt2", "llama3", "roberta", "bert", "metaspace"])
@pytest.mark.parametrize(("chunk_bytes", "piece_chars"), [(1 << 20, 1 << 20), (64, 40), (7, 1), (1 << 20, 25)])
def test_ids_are_the_whole_text_encoded_in_one_go(
    text_file: Path, tmp_path: Path, pieces_seen: list[list[str]], kind: str, chunk_bytes: int, piece_chars: int
) -> None:
    path = save(build(kind), tmp_path / kind)
    reference = Tokenizer.from_file(str(path))
    out = tmp_path / "out.bin"
    meta = prepare(text_file, out, str(path), chunk_bytes=chunk_bytes, piece_chars=piece_chars)
    tf = TokenFile(out)
    assert tf.meta == meta
    assert tf.tokens.tolist() == reference.encode(TEXT).ids
    assert meta.vocab_size == reference.get_vocab_size(with_added_tokens=True) and meta.dtype == "uint16"
    assert meta.tokenizer == str(path)
    assert meta.tokenizer_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    pieces = [p for batch in pieces_seen for p in batch]
    assert "".join(pieces) == TEXT
    if chunk_bytes < len(TEXT):  # streamed: read and encoded a few bytes at a time, never all of it
        assert len(pieces_seen) > 10 and max(len(p) for p in pieces) < len(TEXT) // 10
    if piece_chars < 100:  # encode_batch got several pieces at a time
        assert max(len(batch) for batch in pieces_seen) > 1


def test_special_tokens_only_from_the_post_processor_once_around_the_file(text_file: Path, tmp_path: Path) -> None:
    plain = build("gpt2")  # no post-processor: nothing but the text's own tokens
    prepare(text_file, tmp_path / "plain.bin", str(save(plain, tmp_path / "plain")), chunk_bytes=64, piece_chars=40)
    ids = TokenFile(tmp_path / "plain.bin").tokens.tolist()
    assert ids == plain.encode(TEXT, add_special_tokens=False).ids
    eot = plain.token_to_id("<|endoftext|>")  # written in the text: kept as the text's own token, 30 times
    assert ids.count(eot) == 30 and plain.token_to_id("<s>") not in ids

    bert = build("bert")  # [CLS] text [SEP]: once for the whole file, not once per piece
    prepare(text_file, tmp_path / "bert.bin", str(save(bert, tmp_path / "bert")), chunk_bytes=64, piece_chars=40)
    ids = TokenFile(tmp_path / "bert.bin").tokens.tolist()
    cls, sep = bert.token_to_id("[CLS]"), bert.token_to_id("[SEP]")
    assert ids[0] == cls and ids[-1] == sep and ids.count(cls) == 1 and ids.count(sep) == 1
    assert ids[1:-1] == bert.encode(TEXT, add_special_tokens=False).ids


@pytest.mark.parametrize("content", ["", "   \n\n", "\U0001f600\U0001f600"])
def test_a_text_without_tokens_of_its_own_gets_the_special_tokens(tmp_path: Path, content: str) -> None:
    tok = build("roberta")
    path = save(tok, tmp_path / "tok")
    (tmp_path / "in.txt").write_text(content, encoding="utf-8")
    prepare(tmp_path / "in.txt", tmp_path / "o.bin", str(path), chunk_bytes=3, piece_chars=1)
    assert TokenFile(tmp_path / "o.bin").tokens.tolist() == tok.encode(content).ids


def test_a_folder_names_its_tokenizer_json(text_file: Path, tmp_path: Path) -> None:
    tok = build("wordlevel")
    path = save(tok, tmp_path / "model")
    assert isinstance(load_tokenizer(str(tmp_path / "model")), HFTokenizer)
    meta = prepare(text_file, tmp_path / "o.bin", str(tmp_path / "model"))
    assert meta.tokenizer == str(tmp_path / "model")
    assert meta.tokenizer_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert TokenFile(tmp_path / "o.bin").tokens.tolist() == tok.encode(TEXT).ids


def test_a_large_vocabulary_uses_uint32(text_file: Path, tmp_path: Path) -> None:
    tok = build("wordlevel")
    tok.add_tokens([f"extra{i}" for i in range(70000)])  # added tokens count in the vocabulary size
    path = save(tok, tmp_path / "big")
    meta = prepare(text_file, tmp_path / "o.bin", str(path))
    assert meta.vocab_size == tok.get_vocab_size(with_added_tokens=True) > 65536
    assert meta.dtype == "uint32"
    assert TokenFile(tmp_path / "o.bin").tokens.tolist() == tok.encode(TEXT).ids


def test_truncation_and_padding_in_the_file_are_ignored(text_file: Path, tmp_path: Path) -> None:
    tok = build("wordlevel")
    reference = tok.encode(TEXT).ids
    tok.enable_truncation(max_length=8)
    tok.enable_padding(length=16, pad_id=0, pad_token="[UNK]")
    prepare(text_file, tmp_path / "o.bin", str(save(tok, tmp_path / "tok")), chunk_bytes=64, piece_chars=40)
    assert TokenFile(tmp_path / "o.bin").tokens.tolist() == reference


def test_a_changed_tokenizer_is_prepared_again(text_file: Path, tmp_path: Path) -> None:
    path = save(build("wordlevel"), tmp_path / "tok")
    out = tmp_path / "cache" / "in.bin"
    first = prepared(text_file, out, str(path))
    mtime = out.stat().st_mtime_ns
    assert prepared(text_file, out, str(path)).path.stat().st_mtime_ns == mtime  # current: reused
    other = build("gpt2")
    save(other, tmp_path / "tok")  # same path, other tokenizer
    again = prepared(text_file, out, str(path))
    assert again.meta.tokenizer_sha256 != first.meta.tokenizer_sha256
    assert again.tokens.tolist() == other.encode(TEXT).ids
    # The shipped text's cache follows the same rule.
    tf = default_token_file(tmp_path / "cache", str(path))
    assert tf.meta.tokenizer == str(path) and tf.tokens.tolist() == other.encode(DEFAULT_TEXT.read_text()).ids


def test_old_and_byte_sidecars_have_no_tokenizer_digest(text_file: Path, tmp_path: Path) -> None:
    meta = prepare(text_file, tmp_path / "o.bin")
    side = tmp_path / "o.bin.json"
    assert meta.tokenizer_sha256 is None and "tokenizer_sha256" not in json.loads(side.read_text())
    raw = json.loads(side.read_text())
    side.write_text(json.dumps({**raw, "tokenizer_sha256": 7}))
    with pytest.raises(ValueError, match="'tokenizer_sha256' should be str or null"):
        TokenFile(tmp_path / "o.bin")


def bad_tokenizers(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """name -> (tokenizer string, what the error says), the files made in tmp_path."""
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "not_json.json").write_text("{not json")
    (tmp_path / "not_a_tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "Nope"}}))
    (tmp_path / "latin1.json").write_bytes(b'{"caf\xe9": 1}')
    (tmp_path / "a_dir.json").mkdir()
    return {
        "missing": (str(tmp_path / "missing.json"), f"file {tmp_path / 'missing.json'} does not exist"),
        "folder without": (str(tmp_path / "empty_folder"), f"folder {tmp_path / 'empty_folder'} has no tokenizer.json"),
        "not json": (str(tmp_path / "not_json.json"), f"{tmp_path / 'not_json.json'} is not a valid tokenizer.json"),
        "not a tokenizer": (str(tmp_path / "not_a_tokenizer.json"),
                            f"{tmp_path / 'not_a_tokenizer.json'} is not a valid tokenizer.json"),
        "not utf-8": (str(tmp_path / "latin1.json"), f"{tmp_path / 'latin1.json'} is not UTF-8 text"),
        "folder named .json": (str(tmp_path / "a_dir.json"), f"folder {tmp_path / 'a_dir.json'} has no tokenizer.json"),
    }


@pytest.mark.parametrize("case", ["missing", "folder without", "not json", "not a tokenizer", "not utf-8",
                                  "folder named .json"])
def test_bad_tokenizer_files(text_file: Path, tmp_path: Path, case: str) -> None:
    spec, message = bad_tokenizers(tmp_path)[case]
    with pytest.raises(TokenizerError) as err:
        prepare(text_file, tmp_path / "o.bin", spec)
    assert message in str(err.value)
    assert not (tmp_path / "o.bin").exists()


def test_an_unreadable_tokenizer_file(text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = save(build("wordlevel"), tmp_path / "tok")
    read_bytes = Path.read_bytes

    def refuse(self: Path) -> bytes:  # as chmod 0 would, for a user other than root
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(TokenizerError, match=f"cannot read {path} \\(Permission denied\\)"):
        prepare(text_file, tmp_path / "o.bin", str(path))
    assert not (tmp_path / "o.bin").exists()


def run_command(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    return command.run(parser.parse_args(["prepare", *argv]))


@pytest.mark.parametrize("case", ["missing", "folder without", "not json", "not a tokenizer"])
def test_the_command_reports_a_bad_tokenizer_file_without_a_traceback(
    text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    spec, message = bad_tokenizers(tmp_path)[case]
    assert run_command(str(text_file), str(tmp_path / "o.bin"), "--tokenizer", spec) == 2
    err = capsys.readouterr().err
    assert message in " ".join(err.split()) and "Traceback" not in err
    assert not (tmp_path / "o.bin").exists()


def test_the_command_prepares_with_a_tokenizer_json(
    text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tok = build("gpt2")
    path = save(tok, tmp_path / "tok")
    assert run_command(str(text_file), str(tmp_path / "o.bin"), "--tokenizer", str(path)) == 0
    count = len(tok.encode(TEXT).ids)
    assert f"{count:,}" in capsys.readouterr().out
    assert len(TokenFile(tmp_path / "o.bin")) == count


def test_the_package_imports_tokenizers_only_for_a_tokenizer_json(text_file: Path, tmp_path: Path) -> None:
    path = save(build("wordlevel"), tmp_path / "tok")
    code = (
        "import sys\n"
        "import oobleck_slurm.cli, oobleck_slurm.data, oobleck_slurm.engine.from_recipe\n"
        "from oobleck_slurm.data import prepare, load_tokenizer\n"
        f"prepare({str(text_file)!r}, {str(tmp_path / 'b.bin')!r})\n"
        "assert 'tokenizers' not in sys.modules, 'imported for the byte tokenizer'\n"
        f"prepare({str(text_file)!r}, {str(tmp_path / 'h.bin')!r}, {str(path)!r})\n"
        "assert 'tokenizers' in sys.modules\n"
    )
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path)
