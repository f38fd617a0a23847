"""The event log's contract: every event the package writes is in the schema, every kind of the schema is
reduced by the dashboard or deliberately ignored, and the README's tables are the schema's.

A new kind or field fails here until it is added to oobleck_slurm/protocol/event_schema.py (and the
dashboard decides whether to reduce it); a schema change fails until the README is regenerated."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest
from planning_helpers import make_profile

import oobleck_slurm
from oobleck_slurm.dashboard.state import IGNORED_KINDS, REDUCED_KINDS
from oobleck_slurm.protocol import event_schema
from oobleck_slurm.protocol.event_schema import EVENT_TYPES, check_event

PACKAGE = Path(oobleck_slurm.__file__).resolve().parent


def emit_calls() -> list[tuple[str, ast.Call]]:
    """Every `<x>.emit(...)` call in the package, with where it is (`path:line`)."""
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "emit":
                calls.append((f"{path.relative_to(PACKAGE.parent)}:{node.lineno}", node))
    return calls


# Call sites that pass fields as `**builder(...)`: the builder's name -> its check below.
DYNAMIC_FIELDS = {"plan_event": "plan", "event": "step"}
# Builders of fields that several kinds share: the builder's name -> the fields it may write.
SHARED_FIELDS = {"_recovery_fields": ("recovery", "phase", "supersedes")}


def test_the_scan_sees_the_writers():
    """Guards the scan itself: it finds the supervisor's, the agents' backend's and the engine's events."""
    where = {w.split(":")[0] for w, _ in emit_calls()}
    assert {"oobleck_slurm/supervisor/coordinator.py", "oobleck_slurm/supervisor/agent_nodes.py",
            "oobleck_slurm/supervisor/main.py", "oobleck_slurm/engine/elastic_process.py"} <= where, where


def test_every_emit_in_the_package_writes_a_kind_and_fields_of_the_schema():
    problems = []
    for where, call in emit_calls():
        if not call.args or not isinstance(call.args[0], ast.Constant) or not isinstance(call.args[0].value, str):
            problems.append(f"{where}: the kind is not a string literal (the contract cannot check it)")
            continue
        kind = call.args[0].value
        if kind not in EVENT_TYPES:
            problems.append(f"{where}: kind {kind!r} is not in the event schema")
            continue
        names = {f.name: f for f in fields(EVENT_TYPES[kind])}
        passed = [k.arg for k in call.keywords if k.arg is not None]
        problems += [f"{where}: {kind!r} has no field {name!r}" for name in passed if name not in names]
        spread = [k.value for k in call.keywords if k.arg is None]
        for value in spread:
            builder = value.func if isinstance(value, ast.Call) else None
            name = builder.attr if isinstance(builder, ast.Attribute) else builder.id if isinstance(builder, ast.Name) \
                else None
            if name in SHARED_FIELDS:
                problems += [f"{where}: {kind!r} has no field {f!r} (from {name})" for f in SHARED_FIELDS[name]
                             if f not in names]
                continue
            if DYNAMIC_FIELDS.get(name) != kind:
                problems.append(f"{where}: {kind!r} gets fields from `**{ast.unparse(value)}`, which this test does "
                                f"not check: call a builder checked here (DYNAMIC_FIELDS) or pass keywords")
        if not [v for v in spread if not (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute)
                                          and v.func.attr in SHARED_FIELDS)]:
            required = event_schema.required_fields(kind)
            problems += [f"{where}: {kind!r} lacks required field {name!r}" for name in required if name not in passed]
    assert not problems, "\n".join(problems)


def test_the_plan_event_builder_writes_plan_fields():
    from oobleck_slurm.planning import generate_templates, instantiate
    from oobleck_slurm.supervisor.coordinator import plan_event, str_nodes

    templates = generate_templates(make_profile([0.01] * 4, devices_per_node=2), 2, num_microbatches=4)
    plan = str_nodes(instantiate(templates, ["a", "b", "c"], 1, 8))
    members = [str(n) for p in plan.pipelines for n in p.nodes] + [str(n) for n in plan.spare_nodes]
    fields_written = plan_event(plan, 3, "failure", members, 2)
    check_event("plan", fields_written)
    typed = event_schema.read_event({"t": 1.0, "kind": "plan", **fields_written})
    assert typed is not None and typed.generation == 3 and typed.pipelines[0].stages[0].layers is not None


def test_the_step_event_builder_writes_step_fields():
    from oobleck_slurm.protocol.records import StepResult

    result = StepResult(step=4, loss=2.5, grad_norm=1.0, lr=1e-3, seconds=0.5, pipeline_seconds=[0.4, 0.45],
                        compute_seconds=[0.3, 0.3], peak_memory=[0.0, 0.0])
    fields_written = result.event(generation=1, global_batch_size=8)
    check_event("step", fields_written)
    typed = event_schema.read_event({"t": 1.0, "kind": "step", **fields_written})
    assert typed is not None and (typed.step, typed.samples_per_s, typed.pipeline_seconds) == (4, 16.0, [0.4, 0.45])


@pytest.mark.parametrize("log", sorted((Path(__file__).resolve().parents[1] / "dashboard" / "logs").glob("*.jsonl")),
                         ids=lambda p: p.stem)
def test_recorded_runs_wrote_only_schema_events(log):
    """Logs written by real runs (tests/dashboard/record_logs.py) hold only what the schema knows."""
    from oobleck_slurm.protocol.events import read_events

    for record in read_events(log):
        fields_written = {k: v for k, v in record.items() if k not in ("t", "kind")}
        check_event(record["kind"], fields_written)
        assert event_schema.read_event(record) is not None, record


def test_every_kind_is_reduced_by_the_dashboard_or_deliberately_ignored():
    kinds = set(EVENT_TYPES)
    undecided = kinds - REDUCED_KINDS - IGNORED_KINDS
    assert not undecided, (f"the dashboard neither reduces nor ignores {sorted(undecided)}: add a handler in "
                           "oobleck_slurm/dashboard/state.py, or the kind to IGNORED_KINDS there")
    assert not REDUCED_KINDS & IGNORED_KINDS, REDUCED_KINDS & IGNORED_KINDS
    assert REDUCED_KINDS | IGNORED_KINDS <= kinds, (REDUCED_KINDS | IGNORED_KINDS) - kinds


def test_the_readme_tables_are_the_schemas():
    readme = event_schema.README.read_text()
    expected = event_schema.replace_tables(readme, event_schema.render_tables())
    assert readme == expected, (f"{event_schema.README} is out of date with the event schema; regenerate it "
                                f"with:\n\n    {event_schema.UPDATE_COMMAND}\n")


def test_kinds_and_class_names_agree():
    """One type per kind: the registry has no duplicate, and a kind's class is its name in CamelCase."""
    types = [cls for group in event_schema.SECTIONS.values() for cls in group]
    assert len(types) == len(EVENT_TYPES)
    for kind, cls in EVENT_TYPES.items():
        assert cls.__name__ == "".join(part.title() for part in kind.split("_")), (kind, cls.__name__)
        assert cls.__doc__ and cls.__doc__.strip(), f"{cls.__name__} says when it is written"
