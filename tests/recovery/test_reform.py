"""Collective failures with no node lost, with real worker processes and gloo timeouts.

A rank that stalls for longer than the collective timeout (a transient pause) makes its peers'
collectives fail: nothing died, so the same members re-form under a new generation and the
trajectory stays exact. A rank that hangs inside a step after its first collective (every rank
reached the same step, so per-rank steps cannot name it) does not leave the aborted generation:
it is named hung and recovered from like a dead node."""

from __future__ import annotations

import re

import pytest
from jobrun import assert_matches_reference, run_job, tiny_recipe

from oobleck_slurm.dashboard.state import DashboardState

pytestmark = pytest.mark.slow
COLLECTIVE_S = 2.0
ERROR_GRACE_S = 2.5  # the heartbeat lease: a loss is named first, within it
LEAVE_S = 6.0  # the step timeout: how long a member may take to leave an aborted generation
PAUSE_S = 4.5  # > COLLECTIVE_S: the peers' collectives time out; < ERROR_GRACE_S + LEAVE_S: it leaves in time
FAST = {"collective_timeout": COLLECTIVE_S, "heartbeat_lease": ERROR_GRACE_S, "step_timeout": LEAVE_S}
SLOW_S = 1.5 * COLLECTIVE_S  # a slow stage's extra compute every step: longer than the collective timeout


def test_a_slow_stage_is_waited_for_not_reformed(tmp_path, templates_cache):
    """A wait includes its peers' compute (a stage's first gradient waits for the stages after it, a
    slow stage holds up its pipeline, the first step connects NCCL's paths): a step's waits are bounded
    by the collective timeout beyond the generation's longest step, and a generation's first step by
    the step timeout (comm.py Generation.wait_timeout). With a fixed collective timeout, the slow
    stage's peers timed out at every step, re-formed, and timed out again in the new generation."""
    faults = [{"node": "node2", "step": 0, "at": "start", "do": "slow", "seconds": SLOW_S}]
    run = run_job(tmp_path, tiny_recipe(**FAST), templates_cache, faults=faults)
    assert_matches_reference(run)
    assert not run.kind("collective_error") and not run.kind("reform"), run.kind("collective_error")
    steps = [e for e in run.kind("step")]
    # node2 was slow every step: rank 0's step outlasted the collective timeout every time (it times its
    # step from its own start, which load may delay behind node2's: 2.97 s of node2's 3 s was seen)
    assert len(steps) == 5 and all(e["seconds"] > COLLECTIVE_S for e in steps), [e["seconds"] for e in steps]


def test_collective_timeout_without_a_loss_reforms_the_same_members(tmp_path, templates_cache):
    faults = [{"node": "node2", "step": 2, "at": "wait:2", "do": "pause", "seconds": PAUSE_S}]
    run = run_job(tmp_path, tiny_recipe(**FAST), templates_cache, faults=faults)
    assert_matches_reference(run)
    errors = run.kind("collective_error")
    assert errors and errors[0]["generation"] == 0 and errors[0]["nodes"], errors
    assert all("Error" in text for text in errors[0]["errors"].values()), errors
    reform = run.kind("reform")
    # (a loaded machine may time out another collective, earlier or later: that re-forms again, the same way)
    assert any(e["step"] == 2 for e in reform), reform
    assert {e["cause"] for e in reform} == {"collective_error"}
    assert not run.kind("failure") and not run.kind("node_lost")
    plans = run.kind("plan")
    assert [p["reason"] for p in plans] == ["initial"] + ["reform"] * len(reform)
    assert all(p["pipelines"] == plans[0]["pipelines"] for p in plans)  # the same members, the same stages
    assert {(tuple(e["rules"]), e["transfers"]) for e in run.kind("replan")} == {(("re-form",), 0)}
    # Resumed at 2 (replayed), or at 3: the paused rank finished step 2's last collective with the
    # others' contributions after they had stopped waiting, and they completed the step in the
    # recovery (engine/recovery.py); step 2 is logged once either way (assert_matches_reference).
    assert any(e["step"] in (2, 3) for e in run.kind("resumed"))
    assert {n for p in plans[-1]["pipelines"] for n in p["nodes"]} == {f"node{i}" for i in range(1, 5)}
    board = DashboardState().apply_all(run.events)  # the dashboard reads the real log
    assert [(r.trigger, r.done) for r in board.recoveries] == [("reform", True)] * len(reform)
    assert any(r.step == 2 for r in board.recoveries)
    assert {n.state for n in board.nodes.values()} == {"healthy"} and board.unknown_events == 0
    assert any(line.kind == "collective_error" for line in board.log)


def test_rank_hung_after_its_first_collective_is_named_and_evicted(tmp_path, templates_cache):
    faults = [{"node": "node2", "step": 2, "at": "wait:2", "do": "hang"}]
    run = run_job(tmp_path, tiny_recipe(optimizer="came", **FAST), templates_cache, faults=faults)
    assert_matches_reference(run)
    assert [e["nodes"] for e in run.kind("collective_error")][:1] and run.kind("reform")
    kinds = [e["kind"] for e in run.events]
    assert kinds.index("collective_error") < kinds.index("reform") < kinds.index("node_lost")
    lost = run.kind("node_lost")
    assert [(e["node"], e["cause"]) for e in lost] == [("node2", "hung")], lost
    assert re.match(r"did not leave generation \d+ within", lost[0]["detail"])  # 0, or 1 after a spurious re-form
    # named after its peers' collectives failed, the grace and the leave timeout; not before
    assert COLLECTIVE_S + ERROR_GRACE_S + LEAVE_S <= lost[0]["detection_seconds"] < COLLECTIVE_S + ERROR_GRACE_S + LEAVE_S + 5
    final = run.kind("plan")[-1]
    assert final["reason"] == "failure"
    assert sorted(n for p in final["pipelines"] for n in p["nodes"]) == ["node1", "node3", "node4"]
    board = DashboardState().apply_all(run.events)
    # the re-form named node2 (a loaded machine may add spurious re-forms before it)
    assert [(r.trigger, r.nodes) for r in board.recoveries][-1] == ("failure", ["node2"])
    assert {r.trigger for r in board.recoveries[:-1]} <= {"reform"}
    assert board.nodes["node2"].state == "lost" and board.nodes["node2"].cause == "hung"
