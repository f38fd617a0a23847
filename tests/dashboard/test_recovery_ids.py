"""Recoveries reduced by the coordinator's recovery id: one per membership change, opened by its first event,
closed by `resumed` / `run_complete` / `checkpoint_fallback`, interrupted when a later change supersedes it.
Nothing is guessed from event order: no trigger rewritten, no recovery dropped."""

from __future__ import annotations

from oobleck_slurm.dashboard.costs import time_split
from oobleck_slurm.dashboard.state import DashboardState

START = [{"t": 0.0, "kind": "job_started", "nodes": ["a", "b", "c", "d"], "steps": 10},
         {"t": 0.5, "kind": "plan", "generation": 0, "reason": "initial",
          "pipelines": [{"id": 0, "nodes": ["a", "b"]}, {"id": 1, "nodes": ["c", "d"]}]},
         {"t": 1.0, "kind": "step", "step": 0, "loss": 3.0, "samples_per_s": 10.0}]


def change(rec: int, t: float, kind: str, phase: str, **fields) -> dict:
    return {"t": t, "kind": kind, "recovery": rec, "phase": phase, **fields}


def recovery_of_a_failure(rec: int, t: float, nodes: list[str], step: int | None = 3, **first) -> list[dict]:
    """A whole recovery from the loss of `nodes` (generation rec - 1 fails, rec resumes)."""
    return [
        change(rec, t, "failure", "collecting", generation=rec - 1, nodes=nodes, cause="process_exit", step=step,
               **first),
        change(rec, t, "detection", "collecting", generation=rec - 1, seconds=0.25),
        change(rec, t + 0.1, "replan", "rebuilding", generation=rec, seconds=0.01),
        change(rec, t + 0.1, "plan", "rebuilding", generation=rec, reason="failure", pipelines=[{"nodes": ["a"]}]),
        change(rec, t + 0.3, "group_rebuild", "rebuilding", generation=rec, seconds=0.1),
        change(rec, t + 0.4, "state_copy", "rebuilding", generation=rec, seconds=0.1, bytes=2048),
        change(rec, t + 0.6, "replay", "replaying", generation=rec, seconds=0.2, step=3),
        change(rec, t + 0.6, "resumed", "running", generation=rec, step=3, total_seconds=0.85),
    ]


def test_one_failure_is_one_recovery_with_its_phases():
    s = DashboardState().apply_all(START + recovery_of_a_failure(1, 2.0, ["b"]))
    (rec,) = s.recoveries
    assert (rec.id, rec.trigger, rec.nodes, rec.cause, rec.step, rec.generation) == (1, "failure", ["b"],
                                                                                   "process_exit", 3, 0)
    assert list(rec.phases) == ["detection", "replan", "group_rebuild", "state_copy", "replay"]
    assert rec.t_start == 2.0 - 0.25 and rec.done and rec.outcome == "resumed" and rec.seconds == 0.85
    assert rec.state_bytes == 2048 and rec.resumed_generation == 1 and rec.phase == "running"
    assert s.status == "running" and s.current_recovery is None and s.nodes["b"].state == "lost"


def test_two_failures_at_once_are_one_recovery():
    events = recovery_of_a_failure(1, 2.0, ["b", "d"])
    # the same change can also name its nodes in two `failure` events (a second loss while collecting)
    second = [*events[:2], change(1, 2.05, "failure", "collecting", generation=0, nodes=["c"], cause="heartbeat",
                                  step=None), *events[2:]]
    for log in (events, second):
        s = DashboardState().apply_all(START + log)
        (rec,) = s.recoveries
        assert rec.trigger == "failure" and rec.done and rec.cause == "process_exit"
        assert rec.nodes == (["b", "d"] if log is events else ["b", "d", "c"])
    assert "c lost (heartbeat) during recovery" in [line.text for line in s.log]


def test_a_change_that_supersedes_an_unfinished_one_marks_it_interrupted():
    first = recovery_of_a_failure(1, 2.0, ["b"])[:5]  # up to the group rebuild of generation 1
    second = recovery_of_a_failure(2, 2.4, ["c"], step=None, supersedes=1)
    s = DashboardState()
    statuses = []
    for event in START + first + second:
        s.apply(event)
        statuses.append(s.status)
    old, new = s.recoveries
    assert (old.id, old.trigger, old.nodes, old.outcome, old.t_end) == (1, "failure", ["b"], "interrupted", 2.4)
    assert old.interrupted and old.done and "state_copy" not in old.phases
    assert (new.id, new.trigger, new.nodes, new.outcome) == (2, "failure", ["c"], "resumed")
    assert new.t_start == 2.4 - 0.25 and not new.interrupted
    assert statuses[len(START):].count("running") == 1 and s.status == "running"  # recovering until the resume
    # the throughput bands do not overlap: the interrupted one ends where the next one's first event is
    assert time_split(s)["recovering"] > 0


def test_a_join_is_its_plans_reason_and_closes_with_resumed():
    join = [change(2, 5.0, "replan", "rebuilding", generation=2, seconds=0.5, rules=["join"]),
            change(2, 5.0, "plan", "rebuilding", generation=2, reason="join",
                   pipelines=[{"nodes": ["a", "b"]}, {"nodes": ["c", "r1"]}]),
            change(2, 5.5, "state_copy", "rebuilding", generation=2, seconds=0.4, bytes=10),
            change(2, 5.6, "resumed", "running", generation=2, step=5, total_seconds=1.1),
            change(2, 5.7, "node_joined", "running", generation=2, node="r1", seconds=1.2)]
    s = DashboardState().apply_all(START + recovery_of_a_failure(1, 2.0, ["d"]) + join)
    failure, rec = s.recoveries
    assert failure.trigger == "failure" and rec.trigger == "join" and rec.nodes == [] and rec.t_start == 4.5
    assert rec.done and rec.outcome == "resumed" and s.nodes["r1"].state == "healthy"
    assert s.current_recovery is None  # node_joined after `resumed` belongs to the closed change, reopens nothing


def test_a_failure_outside_any_change_opens_no_recovery():
    """A joining node lost before it was used: no id, nothing stopped. Nothing to drop afterwards either."""
    joining_lost = [{"t": 5.0, "kind": "failure", "generation": 1, "nodes": ["r1"], "cause": "joining node lost",
                     "step": 4},
                    {"t": 5.2, "kind": "step", "step": 4, "loss": 2.0, "samples_per_s": 10.0}]
    s = DashboardState().apply_all(START + recovery_of_a_failure(1, 2.0, ["d"]) + joining_lost)
    assert [r.nodes for r in s.recoveries] == [["d"]] and s.status == "running" and s.nodes["r1"].state == "lost"


def test_a_reform_that_names_a_hung_member_is_a_failure_of_the_same_change():
    events = [change(1, 2.0, "collective_error", "running", generation=0, nodes=["b:0"], step=2, errors={}),
              change(1, 4.5, "reform", "collecting", generation=0, cause="collective_error", step=3),
              change(1, 10.0, "node_lost", "collecting", node="b", cause="hung", detection_seconds=8.0),
              change(1, 10.0, "failure", "collecting", generation=0, nodes=["b"], cause="hung", step=None),
              change(1, 10.1, "resumed", "running", generation=1, step=3, total_seconds=8.2)]
    s = DashboardState().apply_all(START + events)
    (rec,) = s.recoveries
    assert (rec.trigger, rec.nodes, rec.step, rec.t_start, rec.outcome) == ("failure", ["b"], 3, 2.0, "resumed")
    s = DashboardState().apply_all(START + events[:2] + [events[-1]])
    assert [(r.trigger, r.done) for r in s.recoveries] == [("reform", True)]


def test_a_fallback_closes_its_change_and_the_restart_is_its_own():
    events = [*recovery_of_a_failure(1, 2.0, ["a", "c"])[:2],
              change(1, 2.1, "checkpoint_fallback", "collecting", generation=1, reason="layer 0 lost every replica"),
              change(2, 2.5, "plan", "restarting", generation=2, reason="failure", pipelines=[{"nodes": ["b"]}]),
              change(2, 4.0, "group_rebuild", "restarting", generation=2, seconds=0.1),
              change(2, 4.5, "resumed", "running", generation=2, step=2, total_seconds=2.5)]
    s = DashboardState()
    s.apply_all(START + events[:3])
    (failure,) = s.recoveries
    assert failure.outcome == "fallback" and failure.fallback == "layer 0 lost every replica" and failure.t_end == 2.1
    assert s.status == "recovering" and s.fallback_reason == failure.fallback
    s.apply_all(events[3:])
    assert [(r.trigger, r.outcome) for r in s.recoveries] == [("failure", "fallback"), ("restart", "resumed")]
    assert s.status == "running" and time_split(s)["recovering"] == (2.1 - 1.75) + (4.5 - 2.5)


def test_run_complete_closes_the_change():
    events = [change(1, 2.0, "failure", "collecting", generation=0, nodes=["b"], cause="process_exit", step=9),
              change(1, 2.1, "run_complete", "done", generation=0, note="process_exit as the run ended",
                     finished=["a"])]
    (rec,) = DashboardState().apply_all(START + events).recoveries
    assert rec.outcome == "run_complete" and rec.t_end == 2.1
