"""The flat binary token file (nanoGPT/Megatron style) and its JSON sidecar.

`<name>.bin` holds the token ids back to back, little-endian: uint16 when every id fits (vocabulary
of at most 65536 ids, 0..65535), else uint32. `<name>.bin.json` records the dtype, vocabulary size,
tokenizer, token count and the sha256 of the source text (and, for a Hugging Face tokenizer.json, the
sha256 of that file), so that a reader never guesses the dtype and a cache can tell whether it is stale. The tokens are read through `numpy.memmap`: opening a
many-GB file costs nothing and every worker process shares the page cache.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from oobleck_slurm.errors import BadInputError

FORMAT_VERSION = 1
_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_OPTIONAL = {"tokenizer_sha256": str}  # sidecar fields that may be absent (then None)


class TokenFileError(BadInputError, ValueError):
    """A token file or its sidecar is missing, malformed or inconsistent."""


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest dtype name that holds every id of a vocabulary of `vocab_size` tokens."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_size <= 65536:  # ids 0 .. vocab_size-1 <= 65535
        return "uint16"
    if vocab_size <= 2**32:
        return "uint32"
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32 token ids")


@dataclass(frozen=True)
class TokenFileMeta:
    """What the sidecar records about a token file."""

    dtype: str
    vocab_size: int
    tokenizer: str
    num_tokens: int
    source_sha256: str
    format_version: int = FORMAT_VERSION
    # sha256 of the tokenizer.json a Hugging Face tokenizer was read from; None (and absent from the
    # sidecar, which older readers then still accept) for the byte tokenizer and factories.
    tokenizer_sha256: str | None = None


def sidecar_path(path: str | os.PathLike[str]) -> Path:
    """`<file>.json` next to the token file."""
    p = Path(path)
    return p.with_name(p.name + ".json")


def meta_to_json(meta: TokenFileMeta) -> str:
    raw = {k: v for k, v in asdict(meta).items() if not (k in _OPTIONAL and v is None)}
    return json.dumps(raw, indent=2, sort_keys=True) + "\n"


def meta_from_json(text: str, where: str) -> TokenFileMeta:
    """Parse and validate a sidecar's text; `where` names it in error messages."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenFileError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise TokenFileError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    expected = {
        "dtype": str,
        "vocab_size": int,
        "tokenizer": str,
        "num_tokens": int,
        "source_sha256": str,
        "format_version": int,
    }
    missing = sorted(set(expected) - set(raw))
    if missing:
        raise TokenFileError(f"{where}: missing field(s) {', '.join(missing)}")
    unknown = sorted(set(raw) - set(expected) - set(_OPTIONAL))
    if unknown:
        raise TokenFileError(f"{where}: unknown field(s) {', '.join(unknown)}")
    for key, typ in expected.items():
        if not isinstance(raw[key], typ) or isinstance(raw[key], bool):
            raise TokenFileError(
                f"{where}: field {key!r} should be {typ.__name__}, got {raw[key]!r}"
            )
    for key, typ in _OPTIONAL.items():
        if raw.get(key) is not None and not isinstance(raw[key], typ):
            raise TokenFileError(
                f"{where}: field {key!r} should be {typ.__name__} or null, got {raw[key]!r}"
            )
    if raw["format_version"] != FORMAT_VERSION:
        raise TokenFileError(
            f"{where}: format_version {raw['format_version']}, this reader knows {FORMAT_VERSION}"
        )
    if raw["dtype"] not in _DTYPES:
        raise TokenFileError(
            f"{where}: dtype {raw['dtype']!r}, expected one of {', '.join(_DTYPES)}"
        )
    if raw["vocab_size"] < 1 or raw["num_tokens"] < 0:
        raise TokenFileError(
            f"{where}: vocab_size must be >= 1 and num_tokens >= 0, got "
            f"{raw['vocab_size']} and {raw['num_tokens']}"
        )
    if _DTYPES[raw["dtype"]].itemsize < _DTYPES[dtype_for_vocab(raw["vocab_size"])].itemsize:
        raise TokenFileError(
            f"{where}: dtype {raw['dtype']} cannot hold a vocabulary of {raw['vocab_size']}"
        )
    return TokenFileMeta(**raw)


class TokenFile:
    """A read-only token file: `tokens` is a memmap of `meta.num_tokens` ids."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        side = sidecar_path(self.path)
        if not self.path.is_file():
            raise TokenFileError(
                f"token file {self.path} does not exist (make one with "
                f"`python -m oobleck_slurm prepare TEXT {self.path}`)"
            )
        if not side.is_file():
            raise TokenFileError(
                f"token file {self.path} has no sidecar {side}: it records the dtype, "
                "so the file cannot be read safely without it"
            )
        self.meta = meta_from_json(side.read_text(encoding="utf-8"), str(side))
        dtype = _DTYPES[self.meta.dtype]
        size = self.path.stat().st_size
        expected = self.meta.num_tokens * dtype.itemsize
        if size != expected:
            raise TokenFileError(
                f"token file {self.path} is {size} bytes, but its sidecar says "
                f"{self.meta.num_tokens} tokens of {self.meta.dtype} = {expected} bytes "
                "(truncated, or the sidecar belongs to another file)"
            )
        # np.memmap cannot map an empty file; an empty token array is still a valid file.
        self.tokens: np.ndarray = (
            np.memmap(self.path, dtype=dtype, mode="r", shape=(self.meta.num_tokens,))
            if self.meta.num_tokens
            else np.empty(0, dtype=dtype)
        )

    def __len__(self) -> int:
        return self.meta.num_tokens

    def __repr__(self) -> str:
        return f"TokenFile({str(self.path)!r}, {self.meta.num_tokens} {self.meta.dtype} tokens)"
