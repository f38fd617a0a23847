"""What every tokenizer is: the `Tokenizer` protocol and `TokenizerError`.

Its own module so that the tokenizers (`tokenizers.ByteTokenizer`, `hf_tokenizer.HFTokenizer`) and the
loader that picks one from a tokenizer string (`tokenizers.load_tokenizer`) all depend on it, and not
on each other in a circle.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from oobleck_slurm.errors import BadInputError


class TokenizerError(BadInputError, ValueError):
    """A tokenizer string cannot be resolved, or what it names is not a usable tokenizer."""


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
