"""What a recovery owes the step it resumes at, through the production path (supervisor, agents,
workers; real gloo groups; SIGKILL): the checkpoint due at that step is completed, and the evaluation
due at that step is logged once, not again by the new generation."""

from __future__ import annotations

from collections import Counter

import pytest
from jobrun import assert_matches_reference, run_job, tiny_recipe
from reference import train_reference

from oobleck_slurm.engine.checkpoint import layer_file, read_layer_file

pytestmark = pytest.mark.slow
PAUSE_S = 8.0  # the paused rank's stall: well past the kill's detection, so the generation has failed when it wakes


def test_a_checkpoint_due_at_the_resume_step_is_completed_when_the_commit_split_before_it(tmp_path, templates_cache):
    # node1 (rank 0; its one-node pipeline is the first, so it writes every layer of a checkpoint) stalls
    # at step 1's commit point after posting its part: the others apply step 1 and start step 2, where
    # node3 dies. node1 wakes in a failed generation, with step 1 pending; the job resumes at step 2,
    # and node1 completes step 1 in the recovery (engine/recovery.py), so it never reaches the
    # checkpoint of step 2 in the old generation's loop.
    faults = [{"node": "node1", "step": 1, "at": "wait:last", "do": "pause", "seconds": PAUSE_S},
              {"node": "node3", "step": 2, "at": "start"}]
    run = run_job(tmp_path, tiny_recipe(checkpoint_interval=2), templates_cache, faults=faults)
    (replan,) = run.kind("replan")
    steps = replan["survivor_steps"]
    assert replan["resume_step"] == 2 and steps["node1:0"] == 1 and {steps["node2:0"], steps["node4:0"]} == {2}, steps
    assert_matches_reference(run)
    spec = run.spec()
    _, ref = train_reference(spec, 2)
    for key in spec.model.keys():
        path = layer_file(run.job.checkpoints, 2, key)
        assert path.exists(), f"the checkpoint of step 2 lacks {key}"
        params = {k[len("param."):]: v for k, v in read_layer_file(path, 2).items() if k.startswith("param.")}
        for name, p in params.items():
            err = float((p - ref[key][name]).abs().max() / ref[key][name].abs().max().clamp_min(1e-12))
            assert err <= 1e-5, f"{key}.{name}: relative error {err:.2e} against the reference after 2 steps"


def test_an_evaluation_done_before_a_failure_is_not_repeated_at_the_resume_step(tmp_path, templates_cache):
    # The evaluation after 2 steps is logged, then node2 dies as step 2 starts: the job resumes at
    # step 2, where an evaluation is due, but it was measured and logged already.
    recipe = tiny_recipe(steps=5)
    recipe["training"].update(eval_interval=2, eval_samples=5)
    run = run_job(tmp_path, recipe, templates_cache, faults=[{"node": "node2", "step": 2, "at": "start"}])
    assert run.kind("replan")[0]["resume_step"] == 2
    assert_matches_reference(run)
    assert Counter(e["step"] for e in run.kind("eval")) == {2: 1, 4: 1, 5: 1}, run.kind("eval")
