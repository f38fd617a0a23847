"""training.loss_spike in jobs run as `submit` runs them (local backend, real worker processes): a spike
forced on the loss of one step (engine/faults.py "spike") is skipped and said so in the step event,
also after a node is lost and the plan changes (the survivors and the re-planned generation carry the
policy's state); `max_consecutive` spikes in a row stop the job, unrecoverable, with the reason, the
steps and the newest complete checkpoint, rather than a recovery that would replay into them."""

from __future__ import annotations

import pytest
from jobrun import assert_tensors_match, run_job, tiny_recipe

from oobleck_slurm.exit_codes import EXIT_UNRECOVERABLE

pytestmark = pytest.mark.slow

POLICY = {"sigma": 3.0, "window": 4, "warmup": 3, "max_consecutive": 2}
NODES = 4


def spikes(*steps: int, nodes: int = NODES) -> list[dict]:
    # every node's worker: whichever holds a last stage, the step's loss jumps
    return [{"node": f"node{n}", "step": s, "do": "spike", "factor": 1000.0} for n in range(1, nodes + 1) for s in steps]


def recipe(steps: int, nodes: int = NODES, **kwargs) -> dict:
    r = tiny_recipe(nodes=nodes, steps=steps, **kwargs)
    r["training"]["loss_spike"] = POLICY
    return r


def test_a_spike_is_skipped_before_and_after_a_node_is_lost(tmp_path, templates_cache):
    # node4 is killed in step 6, between the two spikes: the re-planned generation judges step 8 as the
    # first one did step 5
    faults = [*spikes(5, 8), {"node": "node4", "step": 6, "at": "wait:last"}]
    run = run_job(tmp_path, recipe(10), templates_cache, faults=faults)
    assert [f["nodes"] for f in run.kind("failure")] == [["node4"]] and len(run.kind("plan")) == 2
    last = {e["step"]: e for e in run.kind("step")}  # a replayed step's last event
    assert sorted(last) == list(range(10))
    assert {s for s, e in last.items() if e.get("skipped")} == {5, 8}
    assert all(last[s]["skip_reason"] == "loss_spike" and last[s]["loss"] > last[s]["loss_threshold"] for s in (5, 8))
    assert all("loss_threshold" in last[s] for s in range(POLICY["warmup"], 10))  # judged from the warmup on
    assert not run.kind("loss_spike_stop")


def test_max_consecutive_spikes_stop_the_job_with_the_reason_and_the_checkpoint(tmp_path, templates_cache):
    run = run_job(tmp_path, recipe(10, checkpoint_interval=2), templates_cache, faults=spikes(5, 6),
                  expect_exit=EXIT_UNRECOVERABLE)
    (stop,) = run.kind("loss_spike_stop")
    assert (stop["step"], stop["spikes"], stop["checkpoint"]) == (6, [5, 6], 6)
    (finished,) = run.kind("job_finished")
    assert "2 loss spikes in a row (steps 5, 6" in finished["error"]
    assert "newest complete checkpoint is step 6" in finished["error"]
    assert len(run.kind("plan")) == 1  # no recovery was tried
    assert max(e["step"] for e in run.kind("step")) == 6


def test_a_spike_step_completed_alone_in_a_recovery_is_skipped_there_too(tmp_path, templates_cache):
    """The commit point of the spike step 4 split (as tests/recovery/test_elastic.py splits one): node1
    is held at its last wait until the generation fails, so it holds step 4 pending, loss included;
    node2 dies as step 5 starts, after node3 and node4 applied step 4. node1 completes step 4 alone and
    skips it as they did, and the spare node5, which joins node1's pipeline, receives the policy's
    state: the run, a second spike included, ends where an uninterrupted run with the same spikes does."""
    shape = {"nodes": 5, "workers": 1, "f": 0, "memory": "14MB"}  # pipelines (node1, node2), (node3, node4), node5 spare
    kill = [{"node": "node1", "step": 4, "at": "wait:last", "do": "hold"},
            {"node": "node2", "step": 5, "at": "start", "after": ["node3", "node4"]}]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run = run_job(tmp_path / "a", recipe(9, **shape), templates_cache, faults=[*spikes(4, 7, nodes=5), *kill])
    replan = run.kind("replan")[0]
    assert replan["survivor_steps"] == {"node1:0": 4, "node3:0": 5, "node4:0": 5}, replan
    ref = run_job(tmp_path / "b", recipe(9, **shape), templates_cache, faults=spikes(4, 7, nodes=5))
    last = {e["step"]: e for e in run.kind("step")}
    assert {s for s, e in last.items() if e.get("skipped")} == {4, 7}
    ref_losses = ref.losses()
    for step, e in sorted(last.items()):
        assert abs(e["loss"] - ref_losses[step]) <= 1e-9 * abs(ref_losses[step]), (step, e["loss"], ref_losses[step])
    assert_tensors_match(run.final_params("state"), ref.final_params("state"), 1e-9)
    assert_tensors_match(run.final_params(), ref.final_params(), 1e-9)
