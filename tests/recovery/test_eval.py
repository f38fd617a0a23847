"""The validation loss (`training.eval_interval`) through the production path: measured on the same
samples whatever the plan, so that a run with a kill -9 reports the failure-free reference's eval
losses (fp64, within 1e-5), each evaluation logged once, whether a recovery resumes at an evaluated
step or after it."""

from __future__ import annotations

from collections import Counter

import pytest
from jobrun import assert_matches_reference, run_job, tiny_recipe

pytestmark = pytest.mark.slow


def test_eval_losses_survive_a_kill_and_equal_the_reference(tmp_path, templates_cache):
    recipe = tiny_recipe(steps=5)
    # 5 validation samples held out of the shipped text: microbatches of 2, 2 and 1 over two pipelines
    recipe["training"].update(eval_interval=2, eval_samples=5)
    run = run_job(tmp_path, recipe, templates_cache, faults=[{"node": "node2", "step": 2, "at": "wait:last"}])
    assert run.kind("failure")[0]["nodes"] == ["node2"]
    assert_matches_reference(run)  # eval events included: after 2, 4 and 5 steps
    assert Counter(e["step"] for e in run.kind("eval")) == {2: 1, 4: 1, 5: 1}, run.kind("eval")
    assert all(e["samples"] == 5 for e in run.kind("eval"))
    assert len({e["generation"] for e in run.kind("eval")}) == 2  # before and after the recovery


def test_too_few_samples_for_the_held_out_validation_set_is_refused_before_any_node_starts(tmp_path, templates_cache):
    recipe = tiny_recipe(steps=2)
    recipe["training"].update(eval_interval=1, eval_samples=100000)
    run = run_job(tmp_path, recipe, templates_cache, expect_exit=2)
    (finished,) = run.kind("job_finished")
    assert "holding 100000 out for validation (training.eval_samples) leaves none to train on" in finished["error"]
    assert not run.kind("agents_ready")
