"""A Hugging Face `tokenizer.json`, read with the `tokenizers` library (the `hf` extra).

The library is imported only when such a tokenizer is loaded: the rest of the package never needs it.

What `prepare` writes with one is the ids of the whole text encoded in one go, `Tokenizer.encode(text)
.ids`, computed in pieces (see `prepare`): the pieces are encoded without the post-processor, and the
special tokens the post-processor adds to a single sequence (BOS/EOS, [CLS]/[SEP]: whatever its
template says; GPT-2-style byte-level tokenizers add none) are written once, before the first and after
the last token of the file. Nothing else is added. Truncation and padding settings in the file are
ignored: a token file keeps every token.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from oobleck_slurm.data.tokenizer_base import TokenizerError

if TYPE_CHECKING:
    import tokenizers

TOKENIZER_JSON = "tokenizer.json"


def tokenizer_json(spec: str) -> Path:
    """The tokenizer.json file a spec names (the file itself, or `<folder>/tokenizer.json`)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        inner = path / TOKENIZER_JSON
        if not inner.is_file():
            raise TokenizerError(f"tokenizer {spec!r}: folder {path} has no {TOKENIZER_JSON}")
        return inner
    if not path.exists():
        raise TokenizerError(f"tokenizer {spec!r}: file {path} does not exist")
    return path


def _read(spec: str) -> tuple[Path, bytes]:
    path = tokenizer_json(spec)
    try:
        return path, path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"tokenizer {spec!r}: cannot read {path} ({e.strerror or e})") from None


def tokenizer_sha256(spec: str) -> str:
    """The hex sha256 of the tokenizer.json a spec names (what the token file's sidecar records)."""
    return hashlib.sha256(_read(spec)[1]).hexdigest()


class HFTokenizer:
    """A loaded tokenizer.json: `encode`, `vocab_size` (added tokens included), and what `prepare` uses
    to encode a large text in pieces (`encode_pieces`, `special_tokens`)."""

    def __init__(self, spec: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise TokenizerError(
                f"tokenizer {spec!r}: reading a tokenizer.json needs the 'tokenizers' library "
                f"(pip install 'oobleck-slurm[hf]'): {e}"
            ) from None
        self.spec = spec
        self.path, raw = _read(spec)
        # The digest is of exactly the bytes loaded (from_file would read the file a second time).
        self.sha256 = hashlib.sha256(raw).hexdigest()
        try:
            tok = Tokenizer.from_str(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise TokenizerError(f"tokenizer {spec!r}: {self.path} is not UTF-8 text ({e.reason})") from None
        except Exception as e:  # the library raises a bare Exception for malformed JSON or a bad model
            raise TokenizerError(
                f"tokenizer {spec!r}: {self.path} is not a valid tokenizer.json ({e})"
            ) from None
        tok.no_truncation()
        tok.no_padding()
        self._tok: tokenizers.Tokenizer = tok
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        if self.vocab_size < 1:
            raise TokenizerError(f"tokenizer {spec!r}: {self.path} has an empty vocabulary")

    def encode(self, text: str) -> list[int]:
        """The ids of `text` as one sequence, with the post-processor's special tokens (if any)."""
        return self._tok.encode(text).ids

    def encode_pieces(self, pieces: list[str]) -> list[list[int]]:
        """The ids of each piece, without the post-processor's special tokens (encoded in parallel)."""
        try:
            encodings = self._tok.encode_batch(pieces, add_special_tokens=False)
        except Exception as e:  # the library raises a bare Exception: make it bad input, not a crash
            raise ValueError(f"tokenizer {self.spec!r}: encode_batch raised {type(e).__name__}: {e}") from e
        return [e.ids for e in encodings]

    def special_tokens(self, piece: str) -> tuple[list[int], list[int]] | None:
        """(before, after): the ids the post-processor puts around a single sequence, found from how it
        wraps `piece`; None when `piece` has no tokens of its own (then where they go is ambiguous)."""
        plain = self._tok.encode(piece, add_special_tokens=False)
        if not plain.ids:
            return None
        wrapped = self._tok.post_process(plain)
        mask = wrapped.special_tokens_mask
        first = mask.index(0)
        last = len(mask) - 1 - mask[::-1].index(0)
        return wrapped.ids[:first], wrapped.ids[last + 1 :]

    def specials_alone(self) -> list[int]:
        """What the post-processor makes of an empty sequence: every special token it adds, in order."""
        return self._tok.encode("").ids

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"
