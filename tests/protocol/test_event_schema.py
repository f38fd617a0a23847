"""The event schema: what `emit` refuses (with the kind and the field named), and what `read_event` makes of
records of this and other versions (typed, tolerant, never raising)."""

from __future__ import annotations

import math
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_slurm.protocol import event_schema as ev
from oobleck_slurm.protocol.events import EventLog, read_events


def sample(hint: Any, choices: tuple[str, ...] | None = None) -> Any:
    """A JSON value of the field type `hint` (the first choice when the field has choices)."""
    if choices:
        return choices[0]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return sample(inner[0])
    if origin is list:
        return [sample(args[0]), None] if type(None) in typing.get_args(args[0]) else [sample(args[0])]
    if origin is dict:
        return {"k": sample(args[1])}
    if origin is tuple:
        return [0, 3]
    if is_dataclass(hint):
        return {f.name: sample(typing.get_type_hints(hint)[f.name], f.metadata.get("choices")) for f in fields(hint)}
    return {int: 3, float: 1.5, str: "x", bool: True, Any: {"any": 1}}[hint]


def full_event(kind: str) -> dict[str, Any]:
    cls = ev.EVENT_TYPES[kind]
    hints = typing.get_type_hints(cls)
    return {f.name: sample(hints[f.name], f.metadata.get("choices")) for f in fields(cls) if f.name != "t"}


@pytest.mark.parametrize("kind", sorted(ev.EVENT_TYPES))
def test_every_field_of_every_kind_is_written_and_read_back(tmp_path, kind):
    values = full_event(kind)
    with EventLog(tmp_path / "events.jsonl") as log:
        log.emit(kind, t=12.5, **values)
    (record,) = read_events(tmp_path / "events.jsonl")
    event = ev.read_event(record)
    assert type(event) is ev.EVENT_TYPES[kind] and event.t == 12.5 and event.kind == kind
    assert {name: plain(getattr(event, name)) for name in values} == values


def plain(value: Any) -> Any:
    """A typed value as JSON has it: nested records as objects, tuples as lists."""
    if is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return {k: plain(v) for k, v in value.items()} if isinstance(value, dict) else value


@pytest.mark.parametrize("kind", sorted(ev.EVENT_TYPES))
def test_only_the_required_fields_are_enough(kind):
    values = full_event(kind)
    required = {k: values[k] for k in ev.required_fields(kind)}
    ev.check_event(kind, required)
    event = ev.read_event({"t": 1.0, "kind": kind, **required})
    assert event is not None and all(getattr(event, k) is None for k in values if k not in required)


def test_an_unknown_kind_is_refused_naming_it(tmp_path):
    with EventLog(tmp_path / "events.jsonl") as log, pytest.raises(ValueError, match="'recovery_started' is not in"):
        log.emit("recovery_started", generation=1)
    with pytest.raises(ValueError, match="kind '' is not in"):
        ev.check_event("", {})
    assert read_events(tmp_path / "events.jsonl") == []  # nothing written


def test_an_unknown_field_is_refused_naming_the_kind_and_the_field(tmp_path):
    with EventLog(tmp_path / "events.jsonl") as log, \
            pytest.raises(ValueError, match=r"event 'step': unknown field 'step_time' \(its fields: .*seconds"):
        log.emit("step", step=3, step_time=0.5)
    assert read_events(tmp_path / "events.jsonl") == []


@pytest.mark.parametrize("values", [{"cause": "hung"}, {"node": None, "cause": "hung"}])
def test_a_missing_required_field_is_refused_naming_the_kind_and_the_field(values):
    with pytest.raises(ValueError, match="event 'node_lost': required field 'node' is missing"):
        ev.check_event("node_lost", values)


def test_a_value_outside_a_fields_choices_is_refused():
    with pytest.raises(ValueError, match="event 'failure': field 'phase' is 'recovering', not one of running"):
        ev.check_event("failure", {"nodes": ["a"], "recovery": 1, "phase": "recovering"})
    ev.check_event("failure", {"nodes": ["a"], "recovery": 1, "phase": "collecting", "supersedes": None})


def test_reading_records_of_other_versions():
    assert ev.read_event({"t": 1.0, "kind": "telemetry_v2", "x": 1}) is None  # a kind from a newer version
    assert ev.read_event(["t", "kind"]) is None and ev.read_event({"kind": "step", "step": 1}) is None  # no time
    step = ev.read_event({"t": 1, "kind": "step", "step": 2.0, "loss": "nan?", "lr": True, "newer_field": [1],
                          "seconds": math.nan, "pipeline_seconds": [0.5, "x", None, 0.7]})
    assert step == ev.Step(t=1.0, step=2, pipeline_seconds=[0.5, None, None, 0.7])  # positions kept
    assert ev.read_event({"t": 1.0, "kind": "step", "loss": 2.0}) is None  # its required `step` is missing
    assert ev.read_event({"t": 1.0, "kind": "node", "node": ["a"]}) is None  # required, of the wrong type
    node = ev.read_event({"t": 1.0, "kind": "node", "node": 7, "state": "sleepy", "workers": ["running", 3, {}]})
    assert node == ev.Node(t=1.0, node="7", workers=["running", "3"])  # not a state of NODE_STATES: None
    failure = ev.read_event({"t": 1.0, "kind": "failure", "nodes": "a", "recovery": 4, "phase": "nope"})
    assert failure is None  # `nodes` must be a list
    failure = ev.read_event({"t": 1.0, "kind": "failure", "nodes": ["a"], "recovery": 4, "phase": "nope"})
    assert failure == ev.Failure(t=1.0, nodes=["a"], recovery=4)


def test_a_plans_pipelines_read_as_typed_records():
    plan = ev.read_event({"t": 1.0, "kind": "plan", "generation": 2, "pipelines": [
        {"id": 0, "nodes": ["a", "b"], "microbatches": 3,
         "stages": [{"layers": [0, 3], "node": "a", "rank": 0}, {"layers": "3-6", "node": "b"}, "junk"]},
        "junk", {"stages": None}]})
    assert plan is not None and plan.generation == 2 and len(plan.pipelines) == 2
    first = plan.pipelines[0]
    assert first.nodes == ["a", "b"] and first.microbatches == 3
    assert first.stages == [ev.PlanStage(layers=(0, 3), node="a", rank=0), ev.PlanStage(node="b")]
    assert plan.pipelines[1] == ev.PlanPipeline()


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)
_names = st.sampled_from(sorted({f.name for cls in ev.EVENT_TYPES.values() for f in fields(cls)} | {"odd"}))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(ev.EVENT_TYPES) + ["odd"]), st.dictionaries(_names, _json, max_size=6))
def test_reading_never_raises(kind, values):
    event = ev.read_event({**values, "kind": kind})
    assert event is None or type(event) is ev.EVENT_TYPES[kind]
