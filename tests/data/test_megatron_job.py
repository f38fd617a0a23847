"""A job trains end to end on a Megatron-LM tokenized set (`.bin`/`.idx`, MMapIndexedDataset version 1)
written by this test from the layout itself (tests/data/test_indexed.py `pack`), not by our writer:
what a team that brings an existing Megatron set does, `data.path: PREFIX` in the recipe."""

from __future__ import annotations

import math

import numpy as np
import pytest
from jobrun import run_job, tiny_recipe

from .test_indexed import pack

pytestmark = pytest.mark.slow


def test_a_megatron_set_trains_through_a_kill(tmp_path, templates_cache):
    rng = np.random.default_rng(0)
    # 200 documents of 40-160 tokens (uint16 ids below the tiny GPT's vocabulary of 256), one sequence each
    docs = [[rng.integers(0, 256, int(rng.integers(40, 160))).tolist()] for _ in range(200)]
    prefix = tmp_path / "megatron" / "corpus_text_document"
    prefix.parent.mkdir()
    pack(prefix, 8, docs)
    recipe = tiny_recipe(nodes=4, steps=5, f=1)
    recipe["data"] = {"path": str(prefix)}
    run = run_job(tmp_path, recipe, templates_cache,
                  faults=[{"node": "node2", "step": 2, "at": "wait:2", "do": "kill"}])
    losses = run.losses()
    assert sorted(losses) == [0, 1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values()), losses
    assert [e["node"] for e in run.kind("node_lost")] == ["node2"] and run.kind("resumed")
    assert not run.kind("checkpoint_fallback")  # recovered in memory, on the same samples
