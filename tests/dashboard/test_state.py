"""DashboardState: the reducer behind the panels and the report, on runs recorded from the real supervisor."""

from __future__ import annotations

from dash_helpers import recorded, render, state_of
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_slurm.dashboard.costs import time_split, useful_fraction
from oobleck_slurm.dashboard.state import DashboardState


def test_healthy_run():
    s = state_of("healthy")
    assert s.job_id.startswith("dash-healthy-") and (s.backend, s.recipe, s.total_steps, s.f) == ("local", "dash-healthy", 60, 1)
    assert s.steps_done == 60 and s.status == "completed" and s.exit_code == 0
    assert len(s.history) == 60 and s.loss < s.history[0].loss  # it learned
    assert s.step_time is not None and s.samples_per_s > 0
    assert {n.state for n in s.nodes.values()} == {"healthy"} and sorted(s.nodes) == ["node1", "node2", "node3", "node4"]
    assert s.generation == 0 and s.plan_reason == "initial" and len(s.pipelines) == 4
    assert all(p.stages[0].layers == (0, 10) and p.time is not None for p in s.pipelines)  # from pipeline_seconds
    assert s.recoveries == [] and s.bad_events == 0 and s.unknown_events == 0
    assert len(s.checkpoints) == 1 and s.checkpoints[0].step == 40


def test_failure_and_recovery():
    s = state_of("failure")
    assert s.nodes["node3"].state == "lost" and s.nodes["node3"].cause == "process_exit"
    assert s.generation == 1 and s.plan_reason == "failure" and len(s.pipelines) == 3
    assert all("node3" not in p.nodes for p in s.pipelines)
    (rec,) = s.recoveries
    assert (rec.trigger, rec.nodes, rec.cause, rec.generation) == ("failure", ["node3"], "process_exit", 0)
    assert list(rec.phases) == ["detection", "replan", "group_rebuild", "state_copy", "replay"]
    assert rec.done and rec.resumed_generation == 1 and rec.step is not None
    resumed = next(e for e in recorded("failure") if e["kind"] == "resumed")
    assert rec.seconds == resumed["total_seconds"] and resumed["step"] == rec.step  # the interrupted step is replayed
    # The band starts when the node died: the detection time before the failure was reported.
    detection = next(e for e in recorded("failure") if e["kind"] == "detection")
    assert abs(rec.t_start - (detection["t"] - detection["seconds"])) < 1e-6
    split = time_split(s)
    assert abs(sum(split.values()) - s.elapsed) < 1e-6
    assert abs(split["recovering"] - (rec.t_end - rec.t_start)) < 1e-6 and split["reconfiguring"] == 0
    assert 0.3 < useful_fraction(s) < 1


def test_status_is_recovering_until_resumed():
    s = DashboardState()
    seen = []
    for event in recorded("failure"):
        s.apply(event)
        if event["kind"] in ("failure", "state_copy", "resumed"):
            seen.append((event["kind"], s.status, s.current_recovery is not None))
    assert seen == [("failure", "recovering", True), ("state_copy", "recovering", True), ("resumed", "running", False)]


def test_failure_then_replacement_joins():
    s = DashboardState()
    r1 = []
    for event in recorded("join"):
        s.apply(event)
        r1.append(s.nodes["r1"].state if "r1" in s.nodes else None)
    assert "joining" in r1 and r1[-1] == "healthy"  # requested, joining, then in a pipeline
    assert s.nodes["node2"].state == "lost" and s.nodes["node2"].cause == "agent_lost"
    assert any("r1" in p.nodes for p in s.pipelines) and s.plan_reason == "join" and s.generation == 2
    failure, join = s.recoveries
    assert failure.trigger == "failure" and failure.nodes == ["node2"]
    # The join's `replan` phase comes before the plan that says "join".
    assert join.trigger == "join" and join.nodes == [] and "state_copy" in join.phases and join.state_bytes > 0
    split = time_split(s)
    assert split["recovering"] > 0 and split["reconfiguring"] > 0


def test_a_second_loss_during_recovery_is_the_same_recovery():
    s = DashboardState().apply_all([
        {"t": 0.0, "kind": "job_started", "nodes": ["a", "b", "c", "d"], "steps": 10},
        {"t": 1.0, "kind": "failure", "generation": 0, "nodes": ["a"], "cause": "process_exit", "step": 3, "recovery": 1},
        {"t": 1.0, "kind": "detection", "seconds": 0.5, "recovery": 1},
        {"t": 1.5, "kind": "failure", "generation": 0, "nodes": ["b"], "cause": "process exit during recovery", "step": None,
         "recovery": 1},
        {"t": 1.6, "kind": "replan", "seconds": 0.1, "recovery": 1},
        {"t": 2.0, "kind": "resumed", "step": 3, "total_seconds": 1.5, "generation": 1, "recovery": 1},
    ])
    (rec,) = s.recoveries
    assert rec.nodes == ["a", "b"] and rec.step == 3 and rec.t_start == 0.5 and rec.seconds == 1.5
    assert "b lost (process exit during recovery) during recovery" in [line.text for line in s.log]


def test_a_failure_that_stops_nothing_is_not_a_recovery():
    s = DashboardState().apply_all([
        {"t": 0.0, "kind": "job_started", "nodes": ["a", "b"], "steps": 10},
        {"t": 1.0, "kind": "failure", "nodes": ["r1"], "cause": "joining node lost: join_failed", "step": 4},
        {"t": 1.2, "kind": "step", "step": 4, "loss": 2.0, "samples_per_s": 10.0},
    ])
    assert s.recoveries == [] and s.status == "running" and s.nodes["r1"].state == "lost"


def test_slurm_fields_suspect_and_spares():
    s = DashboardState().apply_all([
        {"t": 0.0, "kind": "job_started", "backend": "slurm", "nodes": ["g1", "g2", "g3"], "spares": ["g3"],
         "slurm_job_id": "4242", "steps": 10},
        {"t": 1.0, "kind": "slurm_job", "slurm_job_id": "4242", "state": "RUNNING"},
        {"t": 2.0, "kind": "node", "node": "g2", "state": "suspect", "heartbeat_age": 2.5, "cpu": 3.0, "gpu": 0.0,
         "slurm_state": "DRAIN"},
        {"t": 3.0, "kind": "checkpoint", "step": None, "ok": False, "detail": "no checkpoint directory"},
    ])
    assert s.slurm_state == "RUNNING" and s.nodes["g3"].state == "spare"
    g2 = s.nodes["g2"]
    assert (g2.state, g2.heartbeat_age, g2.gpu, g2.slurm_state) == ("suspect", 2.5, 0.0, "DRAIN")
    assert s.checkpoints == [] and "FAILED: no checkpoint directory" in s.log[-1].text
    screen = render(s, 100, 30)
    assert "slurm 4242 RUNNING" in screen and "▲ g2 suspect DRAIN" in screen and "hb 2.5s cpu 3% gpu 0%" in screen
    assert "○ g3 spare" in screen


def test_unknown_kinds_and_bad_fields_are_tolerated():
    s = DashboardState()
    s.apply({"t": 1.0, "kind": "job_started", "job_id": "x", "nodes": ["a", "b"], "steps": "many"})
    s.apply({"t": 2.0, "kind": "telemetry_v2", "whatever": 1})
    s.apply({"t": 3.0, "kind": "step", "step": 1, "loss": "nan?", "samples_per_s": 10.0})
    s.apply({"t": 4.0, "kind": "plan", "pipelines": [{"stages": [{"layers": "0-3", "node": "a"}]}, "junk"]})
    s.apply({"t": 5.0, "kind": "node"})  # no node name: counted, not shown
    s.apply({"kind": "step"})  # no time
    s.apply(["not", "a", "dict"])
    assert s.total_steps is None and s.step == 1 and s.loss is None and s.samples_per_s == 10.0
    assert s.pipelines[0].stages[0].layers is None and s.pipelines[0].nodes == ["a"]
    assert s.nodes["b"].state == "spare"  # in the job, in no pipeline
    assert (s.unknown_events, s.bad_events) == (1, 3)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_kinds = st.sampled_from(["job_started", "job_finished", "plan", "step", "node", "failure", "detection", "replan",
                          "group_rebuild", "state_copy", "replay", "resumed", "replacement_requested",
                          "node_joined", "health_check", "checkpoint", "checkpoint_fallback", "slurm_job",
                          "node_lost", "agents_ready", "done", "fault_injected", "refused", "odd"])
_fields = st.sampled_from(["nodes", "node", "pipelines", "stages", "step", "loss", "seconds", "state", "generation",
                           "steps", "ok", "bytes", "total_seconds", "samples_per_s", "status", "layers", "spares",
                           "pipeline_seconds", "cause", "detail"])


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(_kinds, st.dictionaries(_fields, _json, max_size=4)), max_size=12))
def test_reducer_and_rendering_never_raise(events):
    s = DashboardState()
    for i, (kind, fields) in enumerate(events):
        s.apply({**fields, "t": float(i), "kind": kind})
    assert s.events_seen == len(events)
    assert "╭─ events" in render(s, 100, 30)


def test_eval_losses_are_kept_by_step_once_and_shown():
    s = DashboardState().apply_all(recorded("healthy"))
    t = s.t_last or 0.0
    s.apply_all([{"t": t + 1, "kind": "eval", "step": 2, "loss": 5.25, "samples": 8, "generation": 0},
                 {"t": t + 2, "kind": "eval", "step": 4, "loss": 5.0, "samples": 8, "generation": 0},
                 # a recovery repeats the evaluation after 4 steps: one point, at its first time
                 {"t": t + 3, "kind": "eval", "step": 4, "loss": 5.0, "samples": 8, "generation": 1}])
    assert s.evals == {2: (t + 1, 5.25), 4: (t + 2, 5.0)} and s.eval_loss == 5.0
    assert "eval 5.0000" in render(s, 140, 40)
