"""The text shipped with the package, and its token file prepared on first use into a cache."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from oobleck_slurm.data.prepare import prepared
from oobleck_slurm.data.tokenizers import BYTE, is_hf_spec
from oobleck_slurm.data.tokens import TokenFile

# Jane Austen, "Persuasion" (1818), public domain; provenance in README.md next to it.
DEFAULT_TEXT = Path(__file__).with_name("persuasion.txt")


def default_token_file(cache_dir: str | os.PathLike[str], tokenizer: str = BYTE) -> TokenFile:
    """The shipped text as a token file in `cache_dir`, prepared now if missing or stale.

    Safe to call from many processes at once: `prepare` writes atomically, so the worst case is
    that several of them prepare the same (identical) file.
    """
    return prepared(DEFAULT_TEXT, cache_file(cache_dir, DEFAULT_TEXT, tokenizer), tokenizer)


def cache_file(cache_dir: str | os.PathLike[str], text: str | os.PathLike[str], tokenizer: str) -> Path:
    """Where the token file of `text` with `tokenizer` is cached: `<cache_dir>/<text stem>.<tag>.bin`,
    the tag being the tokenizer's name with ':' made '_', or for a tokenizer.json path a short hash of
    it (a path would make a long, nested name)."""
    tag = tokenizer.replace(":", "_")
    if "/" in tokenizer or is_hf_spec(tokenizer):
        tag = "tok-" + hashlib.sha256(tokenizer.encode()).hexdigest()[:12]
    return Path(cache_dir) / f"{Path(text).stem}.{tag}.bin"
