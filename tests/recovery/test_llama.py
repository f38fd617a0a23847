"""The llama family through the production path, as the GPT is tested: a kill -9 mid-step, recovery
from the replicas in memory, and every step's loss and the final parameters equal to the
single-process reference (fp64, 1e-5)."""

from __future__ import annotations

import pytest
from jobrun import assert_matches_reference, run_job, tiny_recipe

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_a_llama_survives_a_kill_with_the_reference_trajectory(tmp_path, templates_cache, recompute):
    # recompute: activations rebuilt in the backward change no number (the same kernels run again)
    # pipelines of 2 or 3 nodes (recomputed activations: a smaller budget for the same shape)
    recipe = tiny_recipe(nodes=5, steps=5, memory="8MB" if recompute else "12MB")
    recipe["model"] = {"family": "llama", "size": "tiny"}
    recipe["training"]["recompute"] = recompute
    run = run_job(tmp_path, recipe, templates_cache, faults=[{"node": "node2", "step": 2, "at": "wait:last"}])
    assert run.spec().model.config.family == "llama" and run.spec().train.recompute == recompute
    assert run.kind("failure")[0]["nodes"] == ["node2"] and run.kind("resumed")
    assert any(len(p["stages"]) > 1 for p in run.first("plan")["pipelines"])  # hidden states crossed stages
    assert_matches_reference(run)
