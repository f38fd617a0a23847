"""Tokenizers for `prepare`: the built-in byte tokenizer, a Hugging Face tokenizer.json, or a user's
through a factory string.

A tokenizer string is one of
    byte                      UTF-8 bytes, vocabulary 256
    path/to/tokenizer.json    a Hugging Face tokenizer file, or a folder holding one (a string that
    path/to/folder            ends in `.json` or names an existing file or folder): hf_tokenizer.py
    package.module:function   a factory: calling `function()` returns an object with
                              `encode(str) -> list[int]` and an integer `vocab_size`
That keeps any tokenizer library (tiktoken, sentencepiece, HF tokenizers) an optional dependency:
the `tokenizers` library is imported only to read a tokenizer.json (by `HFTokenizer`, when one is
loaded). The protocol and the error live in tokenizer_base.py.
"""

from __future__ import annotations

import importlib
import os

from oobleck_slurm.data.hf_tokenizer import HFTokenizer
from oobleck_slurm.data.tokenizer_base import Tokenizer, TokenizerError

BYTE = "byte"
BYTE_EOS = 0  # the byte tokenizer's end of document: NUL, so the vocabulary stays 256 (see docs/data.md)


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to download, exact round trip."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def is_hf_spec(spec: str) -> bool:
    """Whether a tokenizer string names a Hugging Face tokenizer.json: it ends in `.json`, or names an
    existing file or folder (a folder holding a tokenizer.json, as Hugging Face model folders do)."""
    return spec != BYTE and (spec.endswith(".json") or os.path.exists(os.path.expanduser(spec)))


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by `spec`: "byte", a tokenizer.json (or its folder), or
    "package.module:function" (a factory)."""
    if spec == BYTE:
        return ByteTokenizer()
    if is_hf_spec(spec):
        return HFTokenizer(spec)
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name or ":" in func_name:
        raise TokenizerError(
            f"tokenizer {spec!r}: expected 'byte', a tokenizer.json (or a folder holding one) "
            "or a factory 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TokenizerError(f"tokenizer {spec!r}: cannot import module {module_name!r} ({e})") from None
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise TokenizerError(
            f"tokenizer {spec!r}: module {module_name!r} has no callable {func_name!r}"
        )
    try:
        tok = factory()
    except Exception as e:  # a user's factory: report it as bad tokenizer input, not a traceback
        raise TokenizerError(f"tokenizer {spec!r}: {func_name}() raised {type(e).__name__}: {e}") from e
    vocab = getattr(tok, "vocab_size", None)
    if not callable(getattr(tok, "encode", None)) or not isinstance(vocab, int) or vocab < 1:
        raise TokenizerError(
            f"tokenizer {spec!r}: {func_name}() returned {type(tok).__name__}, which needs "
            "an encode(str) -> list[int] method and a positive integer vocab_size"
        )
    return tok
