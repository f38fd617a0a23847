"""A prepared set of many short documents for document-masking tests (docs/data.md, "Document masking"):
tests/engine/test_document_mask.py and tests/recovery/test_sharded_job.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from oobleck_slurm.data.prepare import prepare_corpus

WORDS = ["the", "data", "of", "a", "pipeline", "stage", "reads", "documents", "masked", "tokens"]


def documents_folder(tmp_path: Path, count: int = 300, seed: int = 0) -> str:
    """`prepare`'s folder (byte tokenizer: eos 0, recorded in its manifest) of `count` documents of 1 to
    30 words: several documents per window of the tiny models' 64 tokens, and documents across windows'
    starts."""
    rng = np.random.default_rng(seed)
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS, int(rng.integers(1, 31))))}) for _ in range(count)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    prepare_corpus([str(tmp_path / "docs.jsonl")], tmp_path / "docs", workers=1)
    return str(tmp_path / "docs")
