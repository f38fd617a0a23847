"""training.loss_spike in jobs run as `submit` runs them (local backend, real worker processes): a spike
forced on the loss of one step (engine/faults.py "spike") is skipped and said so in the step event,
also after a node is lost and the plan changes (the survivors and the re-planned generation carry the
policy's state); `max_consecutive` spikes in a row roll the job back to the newest checkpoint at or
before the first of them with the data skipped past the last (`on_consecutive: rollback`, the default:
the run then trains on what a job resumed from that checkpoint with its moved cursor does, and ends),
at most `max_rollbacks` times, or stop it (`stop`), unrecoverable, with the reason, the steps and the
newest complete checkpoint, rather than a recovery that would replay into them."""

from __future__ import annotations

import pytest
import yaml
from jobrun import assert_tensors_match, run_job, start_and_wait, tiny_recipe

from oobleck_slurm.engine.checkpoint import complete_steps, read_data_record, step_dir
from oobleck_slurm.exit_codes import EXIT_UNRECOVERABLE
from oobleck_slurm.recipe import load_recipe
from oobleck_slurm.submission import prepare_job

pytestmark = pytest.mark.slow

POLICY = {"sigma": 3.0, "window": 4, "warmup": 3, "max_consecutive": 2}
NODES = 4


def spikes(*steps: int, nodes: int = NODES) -> list[dict]:
    # every node's worker: whichever holds a last stage, the step's loss jumps
    return [{"node": f"node{n}", "step": s, "do": "spike", "factor": 1000.0} for n in range(1, nodes + 1) for s in steps]


def recipe(steps: int, nodes: int = NODES, policy: dict | None = None, **kwargs) -> dict:
    r = tiny_recipe(nodes=nodes, steps=steps, **kwargs)
    r["training"]["loss_spike"] = {**POLICY, **(policy or {})}
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
    run = run_job(tmp_path, recipe(10, policy={"on_consecutive": "stop"}, checkpoint_interval=2), templates_cache,
                  faults=spikes(5, 6), expect_exit=EXIT_UNRECOVERABLE)
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


GBS = 16  # tiny_recipe's global batch


def test_max_consecutive_spikes_roll_back_to_a_checkpoint_and_skip_their_data(tmp_path, templates_cache):
    """Spikes at steps 5 and 6 (checkpoints every 2 steps): every worker goes back to the checkpoint of
    step 4, whose cursor now points at step 7's samples, and the newer one (step 6) is deleted; the run
    ends at step 10, having read the samples of steps 7 to 12 in steps 4 to 9. Reference: a job resumed
    from that checkpoint (`--resume-from`, what a requeue does) trains the same steps, loss for loss and
    to the same final state, without any spike: so the rollback read those samples, and a resume goes
    on the same way."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run = run_job(tmp_path / "a", recipe(10, checkpoint_interval=2), templates_cache, faults=spikes(5, 6))
    (rollback,) = run.kind("loss_spike_rollback")
    assert (rollback["checkpoint"], rollback["data_step"], rollback["spikes"], rollback["skipped_samples"],
            rollback["rollback"], rollback["discarded"]) == (4, 7, [5, 6], 3 * GBS, 1, [6]), rollback
    (plan,) = [p for p in run.kind("plan") if p.get("reason") == "rollback"]
    assert plan["recovery"] == rollback["recovery"]
    steps = run.kind("step")
    after = steps[[i for i, e in enumerate(steps) if e["step"] == 6][0] + 1:]  # the steps run after the rollback
    assert [e["step"] for e in after] == list(range(4, 10)) and not any(e.get("skipped") for e in after)
    keys = run.spec().model.keys()
    record = read_data_record(run.job.checkpoints, 4)
    assert record is not None and record["consumed_samples"] == 7 * GBS
    assert record["rollbacks"] == [{"spikes": [5, 6], "data_step": 7, "skipped_samples": 3 * GBS}]
    assert read_data_record(run.job.checkpoints, 10)["consumed_samples"] == 13 * GBS
    assert complete_steps(run.job.checkpoints, keys) == [2, 4, 6, 8, 10]  # 6 and 8 of the new trajectory

    path = tmp_path / "b" / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(10, checkpoint_interval=2), sort_keys=False))
    job = prepare_job(load_recipe(path), cache_dir=templates_cache, estimate_gpu="A100-40",
                      job_root=tmp_path / "b" / "jobs", resume_from=step_dir(run.job.checkpoints, 4))
    ref = start_and_wait(job, 300.0)
    assert ref.exit_code == 0, ref.log_tails()
    ref_losses = ref.losses()
    assert sorted(ref_losses) == list(range(4, 10)) and not any(e.get("skipped") for e in ref.kind("step"))
    for e in after:
        assert abs(e["loss"] - ref_losses[e["step"]]) <= 1e-9 * abs(ref_losses[e["step"]]), (e, ref_losses)
    assert_tensors_match(run.final_params(), ref.final_params(), 1e-9)
    assert_tensors_match(run.final_params("state"), ref.final_params("state"), 1e-9)


def test_spikes_after_the_last_rollback_allowed_stop_the_job_naming_the_limit(tmp_path, templates_cache):
    """max_rollbacks 1: the rollback after the spikes of steps 5, 6 goes back to step 4 and reads on from
    step 7's samples; the samples of steps 9 and 10 (the job's stream) spike again, in steps 6 and 7:
    the job stops, unrecoverable, saying it rolled back already."""
    run = run_job(tmp_path, recipe(10, policy={"max_rollbacks": 1}, checkpoint_interval=2), templates_cache,
                  faults=spikes(5, 6, 9, 10), expect_exit=EXIT_UNRECOVERABLE)
    (rollback,) = run.kind("loss_spike_rollback")
    assert (rollback["checkpoint"], rollback["data_step"]) == (4, 7)
    assert [e["spikes"] for e in run.kind("loss_spike_stop")] == [[5, 6], [6, 7]]
    (finished,) = run.kind("job_finished")
    assert "rolled back 1 time(s) already" in finished["error"] and "max_rollbacks is 1" in finished["error"]


def test_without_a_checkpoint_before_the_spikes_the_rollback_stops_the_job_saying_so(tmp_path, templates_cache):
    """No checkpoint written (checkpoint_interval 0): nothing to roll back to, so the job stops,
    unrecoverable, with the workers' message and why no rollback; the workers waited for the decision
    (no node was lost) and no plan followed."""
    run = run_job(tmp_path, recipe(8), templates_cache, faults=spikes(5, 6), expect_exit=EXIT_UNRECOVERABLE)
    assert not run.kind("loss_spike_rollback") and not run.kind("failure") and len(run.kind("plan")) == 1
    (finished,) = run.kind("job_finished")
    assert "2 loss spikes in a row (steps 5, 6" in finished["error"]
    assert "no complete checkpoint exists at or before step 5" in finished["error"]
