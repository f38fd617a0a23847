"""DashboardState: the reducer behind the panels and the report, tested on recorded runs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_slurm.dashboard.costs import time_split, useful_fraction
from oobleck_slurm.dashboard.state import DashboardState

from dash_helpers import recorded, render, state_of


def test_healthy_run():
    s = state_of("healthy")
    assert (s.job_id, s.backend, s.recipe, s.total_steps, s.f) == ("healthy", "local", "local-mini", 40, 1)
    assert s.step == 40 and s.status == "completed" and s.exit_code == 0
    assert len(s.history) == 40 and s.loss < s.history[0].loss  # it learned
    assert {n.state for n in s.nodes.values()} == {"healthy"} and len(s.nodes) == 4
    assert [(p.id, len(p.stages), p.microbatches) for p in s.pipelines] == [(0, 2, 4), (1, 2, 4)]
    assert s.pipelines[0].stages[1].layers == (5, 10) and s.pipelines[1].time is not None
    assert s.recoveries == [] and s.bad_events == 0 and s.unknown_events == 0
    assert useful_fraction(s) > 0.85


def test_failure_and_recovery():
    s = state_of("failure")
    assert s.nodes["node-2"].state == "lost" and s.nodes["node-2"].slurm_state == "DOWN"
    assert s.generation == 2 and s.plan_reason == "failure"
    assert all("node-2" not in p.nodes for p in s.pipelines)
    (rec,) = s.recoveries
    assert (rec.trigger, rec.nodes, rec.cause, rec.step, rec.generation) == ("failure", ["node-2"], "heartbeat", 25, 1)
    assert list(rec.phases) == ["detection", "replan", "group_rebuild", "state_copy", "replay"]
    assert rec.phases["detection"] == 3.0 and rec.state_bytes == 48 * 2**20
    assert rec.done and rec.seconds == 6.43 and rec.resumed_generation == 2
    # The band starts when the node died (detection time before the failure was reported).
    failure_t = next(e["t"] for e in recorded("failure") if e["kind"] == "failure")
    assert abs(rec.t_start - (failure_t - 3.0)) < 1e-6
    split = time_split(s)
    assert abs(sum(split.values()) - s.elapsed) < 1e-6
    assert 6.0 < split["recovering"] < 7.0 and split["reconfiguring"] == 0


def test_status_is_recovering_until_resumed():
    s = DashboardState()
    for event in recorded("failure"):
        s.apply(event)
        if event["kind"] == "failure":
            assert s.status == "recovering" and s.current_recovery is not None
        if event["kind"] == "resumed":
            assert s.status == "running" and s.current_recovery is None
            break


def test_join_grows_the_job():
    s = DashboardState()
    states = []
    for event in recorded("join"):
        s.apply(event)
        states.append(s.nodes.get("node-4").state if "node-4" in s.nodes else None)
    assert "spare" in states and "joining" in states  # spare, then requested, then in a pipeline
    assert s.nodes["node-4"].state == "healthy"
    assert any("node-4" in p.nodes for p in s.pipelines) and s.plan_reason == "join"
    (rec,) = s.recoveries
    assert rec.trigger == "join" and set(rec.phases) == {"group_rebuild", "state_copy"} and rec.seconds == 1.7
    assert time_split(s)["recovering"] == 0 and time_split(s)["reconfiguring"] > 1.5


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
                          "node_joined", "health_check", "checkpoint", "checkpoint_fallback", "slurm_job", "odd"])
_fields = st.sampled_from(["nodes", "node", "pipelines", "stages", "step", "loss", "seconds", "state", "generation",
                           "steps", "ok", "bytes", "total_seconds", "samples_per_s", "status", "layers"])


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(_kinds, st.dictionaries(_fields, _json, max_size=4)), max_size=12))
def test_reducer_and_rendering_never_raise(events):
    s = DashboardState()
    for i, (kind, fields) in enumerate(events):
        s.apply({**fields, "t": float(i), "kind": kind})
    assert s.events_seen == len(events)
    assert "╭─ events" in render(s, 100, 30)
