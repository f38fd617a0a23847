"""User tokenizer factories for the tests, loaded by name as 'user_tokenizers:<factory>'."""

from __future__ import annotations


class WordTokenizer:
    """One id per whitespace-separated word: ord(first char) + 256 * len(word), capped."""

    vocab_size = 70000  # > 65535: forces uint32 token files

    def encode(self, text: str) -> list[int]:
        return [min(ord(w[0]) + 256 * len(w), 69999) for w in text.split()]


def word_tokenizer() -> WordTokenizer:
    return WordTokenizer()


def out_of_range_tokenizer() -> WordTokenizer:
    tok = WordTokenizer()
    tok.vocab_size = 10
    return tok


def not_a_tokenizer() -> object:
    return object()


def failing_factory() -> WordTokenizer:
    raise FileNotFoundError("vocab.json not found")
