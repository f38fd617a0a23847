"""Closing the loop: a recorded run's measured useful share, and the simulation of its own schedule.

`measured_run` reads a job's event log with the simulator's definitions: the window is from the
start of the first step to the end of the last; useful = the final duration of every committed step
(a replayed step counts once, with its replay); the kill schedule is each failure's time minus its
detection delay, and each join's time is the start of its reconfiguration.

`simulate_recorded` rebuilds the run's model from the log (its layers, nodes, f and batch split from
the first `plan` event), on a synthetic profile of equal layers whose one free constant, the step
time, is set from the measured steps before the first failure; fits the recovery model from the same
log; and simulates the measured schedule. The two useful shares should agree.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from oobleck_slurm.planning import LayerProfile, Link, Profile, generate_templates
from oobleck_slurm.simulate.calibration import Calibration, fit_calibration
from oobleck_slurm.simulate.core import SystemResult
from oobleck_slurm.simulate.oobleck import OobleckSystem
from oobleck_slurm.simulate.scenario import scenario_from
from oobleck_slurm.simulate.traces import TraceError, TraceEvent, build_trace


@dataclass(frozen=True)
class MeasuredRun:
    start: float  # unix time of the first step's start
    wall_s: float
    useful_s: float
    steps: int
    nodes: tuple[str, ...]
    f: int
    events: tuple[TraceEvent, ...]  # relative to start
    step_s_before_failure: float
    checkpoint_interval: int

    @property
    def useful_fraction(self) -> float:
        return self.useful_s / self.wall_s if self.wall_s > 0 else 0.0


def measured_run(records: list[dict[str, Any]]) -> MeasuredRun:
    steps = [r for r in records if r["kind"] == "step" and isinstance(r.get("seconds"), (int, float))]
    started = next((r for r in records if r["kind"] == "job_started"), None)
    if not steps or started is None:
        raise TraceError("the event log has no job_started or no step events")
    start = steps[0]["t"] - steps[0]["seconds"]
    end = steps[-1]["t"]
    last: dict[int, float] = {}
    for r in steps:
        last[int(r["step"])] = float(r["seconds"])
    detections = {int(r.get("generation", -1)): float(r["seconds"]) for r in records if r["kind"] == "detection"}
    events: list[TraceEvent] = []
    for r in records:
        if r["kind"] == "failure":
            at = r["t"] - detections.get(int(r.get("generation", -1)), 0.0)
            events += [TraceEvent(at - start, "fail", str(n)) for n in r.get("nodes", [])]
        elif r["kind"] == "node_joined":
            events.append(TraceEvent(r["t"] - float(r.get("seconds") or 0.0) - start, "join", str(r["node"])))
    first_fail = min((e.time + start for e in events if e.kind == "fail"), default=end)
    before = [float(r["seconds"]) for r in steps if r["t"] <= first_fail and r["step"] > 0]
    ckpts = sorted(int(r["step"]) for r in records if r["kind"] == "checkpoint")
    return MeasuredRun(start, end - start, sum(last.values()), len(last), tuple(map(str, started["nodes"])),
                       int(started.get("f", 1)), tuple(sorted(events)),
                       statistics.median(before) if before else statistics.median(last.values()),
                       ckpts[0] if ckpts else 0)


def _synthetic_profile(num_layers: int, layer_bytes: float, devices_per_node: int) -> Profile:
    layer = LayerProfile("layer", 0.5, 1.0, int(layer_bytes / 3), int(layer_bytes / 3), int(layer_bytes * 2 / 3),
                         1024, 1024)
    link = Link(1e-4, 1e9)
    return Profile((layer,) * num_layers, "recorded", 1 << 40, devices_per_node, 1, "fp32", "adamw",
                   {"intra_node": link, "inter_node": link, "allreduce_intra": link, "allreduce_inter": link},
                   source="synthetic", key="recorded")


def simulate_recorded(records: list[dict[str, Any]], calibration: Calibration | None = None
                      ) -> tuple[MeasuredRun, SystemResult]:
    """The measured run and Oobleck's simulation of its schedule (see the module docstring)."""
    run = measured_run(records)
    plan = next((r for r in records if r["kind"] == "plan"), None)
    if plan is None:
        raise TraceError("the event log has no plan event")
    stages = [s for p in plan["pipelines"] for s in p["stages"]]
    num_layers = max(int(s["layers"][1]) for s in stages)
    microbatches = sum(int(p["microbatches"]) for p in plan["pipelines"])
    per_node = max(sum(1 for s in p["stages"] if s["node"] == p["nodes"][0]) for p in plan["pipelines"])
    copies = [r for r in records if r["kind"] == "state_copy" and r.get("bytes")]
    replan = [r for r in records if r["kind"] == "replan" and r.get("transfers")]
    layer_bytes = (copies[0]["bytes"] / replan[0]["transfers"]) if copies and replan else 1e6
    cal = calibration or fit_calibration([records], source="the recorded log itself")
    profile = _synthetic_profile(num_layers, layer_bytes, per_node)
    templates = generate_templates(profile, len(run.nodes), 1, num_microbatches=max(1, microbatches // (run.f + 1)))
    scenario = scenario_from(profile, templates, f=run.f, global_microbatches=microbatches, microbatch_size=1,
                             checkpoint_interval=run.checkpoint_interval, name="recorded")
    system = OobleckSystem(scenario, cal)
    start = system.fresh_plan(run.nodes)
    if start is None:
        raise TraceError("no plan fits the recorded nodes")
    scale = run.step_s_before_failure / start[2]
    # The free constant: compute per layer scaled so the initial plan's step equals the measured one.
    layer = profile.layers[0]
    scaled = LayerProfile(layer.name, layer.forward_s * scale, layer.backward_s * scale, layer.param_bytes,
                          layer.grad_bytes, layer.optimizer_bytes, layer.output_bytes, layer.activation_bytes)
    profile = Profile((scaled,) * num_layers, profile.device_name, profile.device_memory_bytes, per_node, 1, "fp32",
                      "adamw", profile.links, source="synthetic", key="recorded-scaled")
    templates = generate_templates(profile, len(run.nodes), 1, num_microbatches=max(1, microbatches // (run.f + 1)))
    scenario = scenario_from(profile, templates, f=run.f, global_microbatches=microbatches, microbatch_size=1,
                             checkpoint_interval=run.checkpoint_interval, name="recorded")
    trace = build_trace(run.nodes, run.events, run.wall_s, "recorded schedule")
    return run, OobleckSystem(scenario, cal).run(trace)
