"""Fast tests of the failure simulator (pure: no processes)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from recorded_run import simulate_recorded

from oobleck_slurm.cli import main
from oobleck_slurm.planning import LayerProfile, Link, Profile, generate_templates
from oobleck_slurm.planning.reconfigure import RecoveryImpossible, reconfigure
from oobleck_slurm.simulate import (
    DEFAULT_CALIBRATION,
    CheckpointRestart,
    OobleckSystem,
    RestartCosts,
    TraceError,
    fit_calibration,
    fixed_interval_trace,
    job_events,
    parse_duration,
    random_failure_trace,
    read_trace_csv,
    scenario_from,
    simulate,
)
from oobleck_slurm.simulate.traces import TraceEvent, build_trace

LOGS = Path(__file__).resolve().parent.parent / "dashboard" / "logs"


def uniform_profile(layers: int = 8, memory_layers: float = 100.0, per_node: int = 1) -> Profile:
    """Equal layers; a device holds `memory_layers` layers' state (so small values force n0 > 1)."""
    layer = LayerProfile("l", 0.01, 0.02, 1000, 1000, 2000, 100, 100)
    link = Link(1e-5, 1e9)
    mem = int(memory_layers * layer.state_bytes / 0.9) + 1000
    return Profile((layer,) * layers, "test", mem, per_node, 1, "fp32", "adamw",
                   {"intra_node": link, "inter_node": link, "allreduce_intra": link, "allreduce_inter": link},
                   source="test", key=f"test-{layers}-{memory_layers}")


def scenario(nodes: int = 12, f: int = 1, memory_layers: float = 100.0, batch: int = 24):
    profile = uniform_profile(memory_layers=memory_layers)
    templates = generate_templates(profile, nodes, 1, num_microbatches=batch // (f + 1))
    return scenario_from(profile, templates, f=f, global_microbatches=batch, microbatch_size=1, checkpoint_interval=50)


def test_parse_duration() -> None:
    assert parse_duration("10m") == 600
    assert parse_duration("6h") == 21600
    assert parse_duration("30s") == 30
    assert parse_duration("1.5d") == 1.5 * 86400
    assert parse_duration("45") == 45
    for bad in ("10x", "", "-5m", "0s", "h"):
        with pytest.raises(TraceError):
            parse_duration(bad)


def test_trace_errors_name_file_and_line(tmp_path: Path) -> None:
    cases = {
        "time,event,node\n0,fail,node1\nabc,fail,node2\n": ":3: time 'abc'",
        "time,event,node\n5,fail,node1\n3,fail,node2\n": ":3: time 3 goes back",
        "time,event,node\n5,explode,node1\n": ":2: event 'explode'",
        "time,event\n5,fail\n": ":1: header",
        "time,event,node\n5,fail\n": ":2: expected 3 fields",
        "time,event,node\n1,join,n9\n2,join,n9\n": ":3: node 'n9' joins but is already present",
        "time,event,node\n1,fail,node1\n2,fail,node1\n": ":3: node 'node1' fails again",
    }
    for i, (text, expected) in enumerate(cases.items()):
        path = tmp_path / f"t{i}.csv"
        path.write_text(text)
        with pytest.raises(TraceError) as err:
            read_trace_csv(path, initial_nodes=4)
        assert f"{path}{expected}" in str(err.value), (str(err.value), expected)


def test_trace_csv_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("time,event,node\n# comment\n600,fail,node3\n900,join,new1\n1200,fail,node1\n")
    trace = read_trace_csv(path, initial_nodes=4, horizon_s=3600)
    assert set(trace.initial_nodes) == {"node1", "node2", "node3", "node4"}
    assert [(e.time, e.kind, e.node) for e in trace.events] == [
        (600, "fail", "node3"), (900, "join", "new1"), (1200, "fail", "node1")]


def test_fixed_interval_trace_is_the_artifact_shape() -> None:
    trace = fixed_interval_trace(30, 15, 600)
    assert len(trace.initial_nodes) == 30
    assert [e.time for e in trace.events] == [600 * (i + 1) for i in range(15)]
    assert all(e.kind == "fail" for e in trace.events)
    assert len({e.node for e in trace.events}) == 15
    assert trace.horizon_s == 600 * 16


def test_random_trace_rate() -> None:
    trace = random_failure_trace(200, 3600 * 100, 3600 * 50, replacement_delay_s=60, seed=3)
    fails = trace.failures
    # expected 200 * 50 / 100 = 100 failures (Poisson, sd 10)
    assert 60 < fails < 140
    assert sum(e.kind == "join" for e in trace.events) >= fails - 5


def test_fallback_exactly_when_reconfigure_raises() -> None:
    # memory for 5 of 8 layers per device: n0 = 2 nodes; 4 nodes = 2 pipelines of 2 nodes, f = 1
    sc = scenario(nodes=6, f=1, memory_layers=5)
    assert sc.n0 == 2
    system = OobleckSystem(sc, DEFAULT_CALIBRATION)
    pipes, spares, _, f = system.fresh_plan(["a", "b", "c", "d"])
    assert len(pipes) == 2 and f == 1
    plan = system._make_plan(pipes, spares)
    with pytest.raises(RecoveryImpossible) as err:
        reconfigure(plan, ["a"], [], sc.templates, 1, layer_bytes=sc.layer_bytes)
    assert err.value.kind == "too_few_pipelines"
    trace = build_trace(["a", "b", "c", "d"], [TraceEvent(100.0, "fail", "a")], 400.0)
    result = OobleckSystem(sc, DEFAULT_CALIBRATION).run(trace)
    assert result.fallbacks == 1 and result.seconds["fallback"] > 0 and result.seconds["lost"] > 0
    # with 6 nodes (3 pipelines) the same loss is recovered in memory: no fallback, nothing lost
    pipes6, spares6, _, _ = system.fresh_plan(list("abcdef"))
    reconfigure(system._make_plan(pipes6, spares6), ["a"], [], sc.templates, 1, layer_bytes=sc.layer_bytes)
    result6 = OobleckSystem(sc, DEFAULT_CALIBRATION).run(
        build_trace(list("abcdef"), [TraceEvent(100.0, "fail", "a")], 400.0))
    assert result6.fallbacks == 0 and result6.seconds["lost"] == 0 and result6.seconds["recovering"] > 0


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), mttf_h=st.floats(2, 50))
def test_shape_cache_matches_direct_calls(seed: int, mttf_h: float) -> None:
    sc = scenario(nodes=16, f=1, memory_layers=3)
    trace = random_failure_trace(12, mttf_h * 3600, 24 * 3600, replacement_delay_s=1800, seed=seed)
    cached = OobleckSystem(sc, DEFAULT_CALIBRATION, use_cache=True).run(trace)
    direct = OobleckSystem(sc, DEFAULT_CALIBRATION, use_cache=False).run(trace)
    assert cached.samples == direct.samples
    assert cached.fallbacks == direct.fallbacks
    for k, v in direct.seconds.items():
        assert math.isclose(cached.seconds[k], v, rel_tol=1e-3, abs_tol=1e-6), k


def test_useful_fraction_decreases_with_failure_rate() -> None:
    sc = scenario(nodes=30, f=1, memory_layers=3)
    fractions: dict[str, list[float]] = {"oobleck": [], "checkpoint": []}
    for interval in (6 * 3600, 3600, 600, 60):
        res = simulate(sc, fixed_interval_trace(24, 12, interval), ["oobleck", "checkpoint"],
                       checkpoint_costs=RestartCosts(20.0, 120.0, 100))
        for name in fractions:
            fractions[name].append(res[name].useful_fraction)
    for name, values in fractions.items():
        assert values == sorted(values, reverse=True), (name, values)
        assert values[0] > values[-1]
    assert all(o > c for o, c in zip(fractions["oobleck"], fractions["checkpoint"]))


def test_checkpoint_restart_loses_exactly_the_work_since_its_checkpoint() -> None:
    sc = scenario(nodes=8, f=1)
    costs = RestartCosts(checkpoint_s=7.0, restart_s=50.0, interval_steps=10)
    system = CheckpointRestart(sc, costs, sc.templates)
    step = system.plans.best(8)[0]
    cycle = 10 * step + 7.0
    t_fail = 2 * cycle + 3.5 * step  # two checkpoints done, then 3 whole steps and half of one
    trace = build_trace([f"n{i}" for i in range(8)], [TraceEvent(t_fail, "fail", "n0")], t_fail + 10.0)
    res = system.run(trace)
    assert math.isclose(res.seconds["lost"], 3.5 * step, rel_tol=1e-9)
    assert math.isclose(res.seconds["recovering"], 10.0, rel_tol=1e-9)  # the restart is cut by the horizon
    assert math.isclose(res.seconds["checkpointing"], 14.0, rel_tol=1e-9)
    assert res.steps == 20 and res.samples == 20 * sc.batch_samples


def test_default_calibration_matches_recorded_logs() -> None:
    fitted = fit_calibration([job_events(LOGS / f"{n}.jsonl") for n in ("failure", "join", "healthy")])
    for name in ("detection_s", "agreement_s", "replan_s", "rebuild_s", "copy_overhead_s", "replay_factor",
                 "checkpoint_steps"):
        assert math.isclose(getattr(fitted, name), getattr(DEFAULT_CALIBRATION, name), rel_tol=0.05), name
    assert fitted.copy_Bps and 1e7 < fitted.copy_Bps < 2e7  # 20 MB in 1.38 s on the 2-core machine


@pytest.mark.parametrize("name", ["failure", "join", "healthy"])
def test_recorded_schedule_agrees_with_its_measurement(name: str) -> None:
    measured, simulated = simulate_recorded(job_events(LOGS / f"{name}.jsonl"))
    assert abs(simulated.useful_fraction - measured.useful_fraction) <= 0.10 * measured.useful_fraction
    if name != "healthy":
        assert simulated.failures == 1 and simulated.seconds["recovering"] > 0


def test_cli_bad_trace_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("time,event,node\n10,fail,node1\nsoon,fail,node2\n")
    assert main(["simulate", "--trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:3:" in err and "Traceback" not in err
    assert main(["simulate", "--mttf-node", "2h"]) == 2
    assert "--hours" in capsys.readouterr().err
    assert main(["simulate", "--mtbf", "10m", "--systems", "oobleck,magic"]) == 2
    assert "magic" in capsys.readouterr().err


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The embedded default with the room Bamboo-style redundancy needs on the V100 estimate: its 9MB budget
    # is sized for the default's measured CPU profile, in which no stage holds its successor's state too.
    from oobleck_slurm.recipe import DEFAULT_RECIPE

    recipe = tmp_path / "roomy.yaml"
    recipe.write_text(f"extends: {DEFAULT_RECIPE}\ncluster:\n  memory_per_device: 10MB\n")
    code = main(["simulate", str(recipe), "--estimate", "V100", "--cache", str(tmp_path / "cache"), "--mtbf", "10m",
                 "--nodes", "8", "--min-nodes", "4", "--json", "--out", str(tmp_path / "out")])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    for system in ("oobleck", "checkpoint", "redundancy"):
        assert 0 < data[system]["useful_fraction"] <= 1 and data[system]["samples"] > 0
    assert data["oobleck"]["useful_fraction"] > data["checkpoint"]["useful_fraction"]
    assert (tmp_path / "out" / "samples.png").stat().st_size > 1000
    assert (tmp_path / "out" / "breakdown.png").stat().st_size > 1000
