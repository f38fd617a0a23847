"""A worker that runs out of device memory is a named failure, not a silent node loss: the worker
records what it was doing and the device's figures (an `out_of_memory` event, and a store record for
the coordinator), the `failure` event's cause is `out_of_memory`, and the coordinator does not run the
same plan again: an out-of-memory in a step (or an evaluation, a checkpoint, an adopt from a checkpoint)
says the plan does not fit, and the job stops, unrecoverable (a requeue would fail the same way); one
while layers are copied in memory (the old and new state together) restarts from the last checkpoint.

Jobs run as `submit` runs them, on the local backend; the CPU has no out-of-memory error, so a fault
hook raises torch.OutOfMemoryError where the CUDA allocator would (engine/faults.py, "do": "oom"):
everything after it is the real path."""

from __future__ import annotations

import pytest
from jobrun import assert_matches_reference, run_job, tiny_recipe

from oobleck_slurm.exit_codes import EXIT_UNRECOVERABLE

pytestmark = pytest.mark.slow


def test_out_of_memory_in_a_step_is_named_and_stops_the_job(tmp_path, templates_cache):
    run = run_job(tmp_path, tiny_recipe(steps=5), templates_cache,
                  faults=[{"node": "node2", "step": 2, "do": "oom"}], expect_exit=None)
    (oom,) = run.kind("out_of_memory")
    assert (oom["node"], oom["worker"], oom["phase"], oom["step"], oom["generation"]) == ("node2", 0, "step", 2, 0)
    assert "emulated out of memory" in oom["error"]
    (failure,) = run.kind("failure")
    assert failure["nodes"] == ["node2"] and failure["cause"] == "out_of_memory"
    assert len(run.kind("plan")) == 1  # no second plan: the first one does not fit
    assert run.exit_code == EXIT_UNRECOVERABLE, run.log_tails()
    (finished,) = run.kind("job_finished")
    assert "ran out of device memory" in finished["error"] and "node2" in finished["error"]
    assert max(e["step"] for e in run.kind("step")) == 1


def test_out_of_memory_while_copying_layers_restarts_from_the_checkpoint(tmp_path, templates_cache):
    # node3 is killed in step 2; in the recovery node1 runs out of memory as it adopts the new plan from
    # its peers' memory: the job goes on from the checkpoint of step 2 on the two nodes left, exactly
    recipe = tiny_recipe(steps=4, checkpoint_interval=1)
    faults = [{"node": "node3", "step": 2, "at": "wait:last"},
              {"node": "node1", "generation": 1, "at": "adopt", "do": "oom"}]
    run = run_job(tmp_path, recipe, templates_cache, faults=faults)
    (oom,) = run.kind("out_of_memory")
    assert (oom["node"], oom["phase"], oom["generation"]) == ("node1", "adopt:memory", 1)
    assert [(f["nodes"], f["cause"]) for f in run.kind("failure")] == [(["node3"], "process_exit"),
                                                                      (["node1"], "out_of_memory")]
    (fallback,) = run.kind("checkpoint_fallback")
    assert "node1:0 (adopt:memory) ran out of device memory while copying layers" in fallback["reason"]
    assert_matches_reference(run)
