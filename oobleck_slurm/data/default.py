"""The text shipped with the package, and its token file prepared on first use into a cache."""

from __future__ import annotations

import os
from pathlib import Path

from oobleck_slurm.data.prepare import prepare, sha256_file
from oobleck_slurm.data.tokenizers import BYTE
from oobleck_slurm.data.tokens import TokenFile, TokenFileError

# Jane Austen, "Persuasion" (1818), public domain; provenance in README.md next to it.
DEFAULT_TEXT = Path(__file__).with_name("persuasion.txt")


def default_token_file(cache_dir: str | os.PathLike[str], tokenizer: str = BYTE) -> TokenFile:
    """The shipped text as a token file in `cache_dir`, prepared now if missing or stale.

    Safe to call from many processes at once: `prepare` writes atomically, so the worst case is
    that several of them prepare the same (identical) file.
    """
    safe_tok = tokenizer.replace(":", "_").replace("/", "_")
    out = Path(cache_dir) / f"{DEFAULT_TEXT.stem}.{safe_tok}.bin"
    try:
        tf = TokenFile(out)
        if tf.meta.source_sha256 == sha256_file(DEFAULT_TEXT) and tf.meta.tokenizer == tokenizer:
            return tf
    except TokenFileError:
        pass  # missing or broken: prepare it again
    prepare(DEFAULT_TEXT, out, tokenizer)
    return TokenFile(out)
