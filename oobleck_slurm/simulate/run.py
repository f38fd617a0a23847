"""`simulate`: run every requested system on one trace and return their results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from oobleck_slurm.simulate.baselines import CheckpointRestart, Redundancy, RestartCosts, default_restart_costs
from oobleck_slurm.simulate.calibration import DEFAULT_CALIBRATION, Calibration
from oobleck_slurm.simulate.core import SystemResult
from oobleck_slurm.simulate.oobleck import OobleckSystem
from oobleck_slurm.simulate.scenario import Scenario
from oobleck_slurm.simulate.traces import Trace

SYSTEMS = ("oobleck", "checkpoint", "redundancy")


def simulate(scenario: Scenario, trace: Trace, systems: Sequence[str] = SYSTEMS, *,
             calibration: Calibration = DEFAULT_CALIBRATION, checkpoint_costs: RestartCosts | None = None,
             redundancy_costs: RestartCosts | None = None, use_cache: bool = True) -> dict[str, SystemResult]:
    """Each system's run over `trace`. Oobleck's fallback restart costs the checkpoint baseline's
    restart (the same relaunch from the same storage) unless the calibration sets its own."""
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    ckpt = checkpoint_costs or default_restart_costs(scenario)
    red = redundancy_costs or ckpt
    out: dict[str, SystemResult] = {}
    for name in systems:
        if name == "oobleck":
            cal = calibration
            if calibration.source == DEFAULT_CALIBRATION.source or calibration.restart_s == DEFAULT_CALIBRATION.restart_s:
                cal = replace(calibration, restart_s=ckpt.restart_s)
            out[name] = OobleckSystem(scenario, cal, use_cache=use_cache).run(trace)
        elif name == "checkpoint":
            out[name] = CheckpointRestart(scenario, ckpt, scenario.templates).run(trace)
        else:
            out[name] = Redundancy(scenario, red).run(trace)
    return out
