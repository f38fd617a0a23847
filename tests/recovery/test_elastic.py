"""Checkpoint-free recovery through the production path (supervisor, agents, workers; real gloo
groups; SIGKILL): after each failure the trajectory (every step's loss, the final checkpoint's
parameters) equals the failure-free single-process reference within 1e-5 relative (fp64, see
tests/engine/test_exact.py), and each step's loss is reported once per generation that ran it."""

from __future__ import annotations

import pytest
from jobrun import assert_matches_reference, run_job, tiny_recipe

pytestmark = pytest.mark.slow
RECOVERY_EVENTS = ["failure", "detection", "replan", "plan", "group_rebuild", "state_copy", "replay", "resumed"]
# Two pipelines of 2 nodes (a kill -9 of one of a node's several workers: tests/cli/test_submit.py)
TWO_NODE_PIPELINES = {"nodes": 4, "workers": 1, "f": 0, "memory": "14MB"}


def kinds(run):
    return [e["kind"] for e in run.events if e["kind"] in RECOVERY_EVENTS]


@pytest.mark.parametrize("optimizer, at", [("adamw", "wait:last"), ("came", "optimizer")])
def test_kill_mid_step_keeps_the_trajectory(tmp_path, templates_cache, optimizer, at):
    faults = [{"node": "node2", "step": 2, "at": at}]
    run = run_job(tmp_path, tiny_recipe(optimizer=optimizer), templates_cache, faults=faults)
    assert_matches_reference(run)
    assert kinds(run)[:1 + len(RECOVERY_EVENTS)] == ["plan"] + RECOVERY_EVENTS  # every phase once, in order
    assert run.kind("failure")[0]["nodes"] == ["node2"]
    resumed = run.kind("resumed")[0]
    assert resumed["generation"] == 1 and resumed["step"] in (2, 3) and resumed["total_seconds"] < 30
    assert {e["generation"] for e in run.kind("step") if e["step"] < 2} == {0}
    # the durable supervisor state (what a supervisor taking over resumes from) is the last generation's
    from oobleck_slurm.protocol.records import read_state

    state, last = read_state(run.job.supervisor_state), run.kind("plan")[-1]
    assert state is not None and state.generation == last["generation"] and state.recovery is None
    assert set(state.members) == {n for p in last["pipelines"] for n in p["nodes"]} | set(last["spares"])
    assert "node2" not in state.members and state.trained


def test_a_split_commit_is_completed_alone_beside_survivors_that_applied_it(tmp_path, templates_cache):
    """The commit point split deterministically (engine/faults.py): node1 is held at step 2's commit
    wait until the generation fails, so it holds step 2 pending; node2 dies at the start of step 3
    once node3 and node4 have reached step 3 (so they applied step 2, and so did node2). Every
    survivor goes on at step 3: node1 completes step 2 alone, and node2's layers are copied from
    node4, which applied it (their only surviving holder), to the spare that joins node1's pipeline.
    The final optimizer state is the reference's, not only the parameters."""
    faults = [{"node": "node1", "step": 2, "at": "wait:last", "do": "hold"},
              {"node": "node2", "step": 3, "at": "start", "after": ["node3", "node4"]}]
    recipe = tiny_recipe(**{**TWO_NODE_PIPELINES, "nodes": 5})  # pipelines (node1, node2), (node3, node4), node5 spare
    run = run_job(tmp_path, recipe, templates_cache, faults=faults)
    first = run.kind("plan")[0]
    assert [p["nodes"] for p in first["pipelines"]] == [["node1", "node2"], ["node3", "node4"]], first
    assert run.kind("failure")[0]["nodes"] == ["node2"]
    replan = run.kind("replan")[0]
    assert replan["survivor_steps"] == {"node1:0": 2, "node3:0": 3, "node4:0": 3}, replan
    assert replan["resume_step"] == 3 and replan["transfers"] > 0
    after = run.kind("plan")[1]
    assert ["node1", "node5"] in [sorted(p["nodes"]) for p in after["pipelines"]], after
    assert run.kind("state_copy")[0]["bytes"] > 0
    assert_matches_reference(run, optimizer_state=True)


def test_a_loss_before_the_first_step_starts_over_from_the_seed(tmp_path, templates_cache):
    # node2 dies as step 0 starts: nothing trained yet, so every layer is the seed's, even where its
    # replicas were on node2 or not built yet (found on a loaded machine: a lease lapsing at start-up)
    run = run_job(tmp_path, tiny_recipe(), templates_cache, faults=[{"node": "node2", "step": 0, "at": "start"}])
    assert_matches_reference(run)
    assert run.kind("failure")[0]["nodes"] == ["node2"] and not run.kind("checkpoint_fallback")
    assert run.kind("replan")[0]["resume_step"] == 0


def test_two_simultaneous_failures_f2(tmp_path, templates_cache):
    faults = [{"node": "node2", "step": 2, "at": "wait:2"}, {"node": "node5", "step": 2, "at": "wait:2"}]
    run = run_job(tmp_path, tiny_recipe(nodes=6, f=2), templates_cache, faults=faults)
    assert_matches_reference(run)
    assert sorted(n for e in run.kind("failure") for n in e["nodes"]) == ["node2", "node5"]
    final = run.kind("plan")[-1]
    assert len(final["pipelines"]) >= 3 and not {"node2", "node5"} & {n for p in final["pipelines"] for n in p["nodes"]}


def test_failure_during_recovery(tmp_path, templates_cache):
    # node2 dies in step 2; node3 dies while the survivors rebuild (groups up, copies pending).
    faults = [{"node": "node2", "step": 2, "at": "wait:3"}, {"node": "node3", "step": 2, "at": "adopt"}]
    run = run_job(tmp_path, tiny_recipe(optimizer="came"), templates_cache, faults=faults)
    assert_matches_reference(run)
    failures = run.kind("failure")
    assert [e["nodes"] for e in failures] == [["node2"], ["node3"]]
    first = run.events.index(failures[0])
    recovery_gen = next(e["generation"] for e in run.events[first:] if e["kind"] == "plan")
    assert failures[1]["generation"] == recovery_gen  # the second failure struck the recovery generation
    assert run.kind("resumed")[-1]["generation"] == recovery_gen + 1


def test_replacement_joins_and_receives_layers_from_replicas(tmp_path, templates_cache):
    """After the loss one pipeline and a spare node remain; the replacement and the spare form a new
    pipeline whose layers (parameters and optimizer state) are copied from the surviving replica."""
    faults = [{"node": "node1", "step": 2, "at": "wait:3"}]
    recipe = tiny_recipe(steps=40, replacement="request", **TWO_NODE_PIPELINES)  # the join comes by step ~5
    run = run_job(tmp_path, recipe, templates_cache, faults=faults)
    assert_matches_reference(run)
    joined = run.kind("node_joined")
    assert [e["node"] for e in joined] == ["r1"], "the replacement did not join before the end"
    # A straggler rebalance may follow the join on a loaded machine; it moves microbatches, not nodes.
    join = [e for e in run.kind("plan") if e["reason"] == "join"][-1]
    assert "r1" in {n for p in join["pipelines"] for n in p["nodes"]}
    assert run.kind("plan")[-1]["reason"] in ("join", "rebalance")
    copies = [e for e in run.kind("state_copy") if e["generation"] == join["generation"]]
    assert copies and copies[0]["bytes"] > 0


def test_every_replica_lost_falls_back_to_the_checkpoint(tmp_path, templates_cache):
    # The first node of each pipeline holds the first layers, on both pipelines: killing both loses them.
    faults = [{"node": "node1", "step": 3, "at": "wait:2"}, {"node": "node3", "step": 3, "at": "wait:2"}]
    run = run_job(tmp_path, tiny_recipe(checkpoint_interval=2, **TWO_NODE_PIPELINES), templates_cache, faults=faults,
                  expect_exit=None)
    fallback = run.kind("checkpoint_fallback")
    assert len(fallback) == 1 and "lost every replica" in fallback[0]["reason"], run.log_tails()
    assert any(e["step"] == 2 for e in run.kind("checkpoint"))
    assert run.exit_code == 0, run.log_tails()
    assert_matches_reference(run)


def test_every_replica_lost_without_checkpoint_says_why(tmp_path, templates_cache):
    faults = [{"node": "node1", "step": 1, "at": "wait:2"}, {"node": "node3", "step": 1, "at": "wait:2"}]
    run = run_job(tmp_path, tiny_recipe(steps=3, **TWO_NODE_PIPELINES), templates_cache, faults=faults, expect_exit=3)
    finished = run.kind("job_finished")[-1]
    assert finished["status"] == "unrecoverable"
    assert "lost every replica" in finished["error"] and "no complete checkpoint" in finished["error"]
