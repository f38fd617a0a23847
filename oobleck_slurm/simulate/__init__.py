"""Failure simulator: a whole training run under a failure trace, for Oobleck and two baselines.

    from oobleck_slurm.simulate import fixed_interval_trace, scenario_from, simulate
    scenario = scenario_from(profile, templates, f=1, global_microbatches=1024, microbatch_size=8)
    results = simulate(scenario, fixed_interval_trace(30, 15, 600))
    results["oobleck"].useful_fraction

Oobleck's recoveries call the real `planning.reconfigure` and `instantiate` on the real templates and
are charged with a recovery-cost model fitted from measured recoveries (`calibration`). The baselines
(`baselines`: checkpoint-restart, redundant computation) run on the same trace and cost model.
Pure: no processes; the only I/O is `loader` (trace CSV files, job event logs).
"""

from oobleck_slurm.simulate.baselines import CheckpointRestart, Redundancy, RestartCosts, default_restart_costs
from oobleck_slurm.simulate.calibration import DEFAULT_CALIBRATION, Calibration, fit_calibration
from oobleck_slurm.simulate.core import CATEGORIES, SystemResult
from oobleck_slurm.simulate.loader import job_events, read_trace_csv
from oobleck_slurm.simulate.nccl_model import (
    ASSUMPTIONS,
    DEFAULT_COMM_COSTS,
    CommCosts,
    build_seconds,
    group_shape,
    scale_calibration,
)
from oobleck_slurm.simulate.oobleck import OobleckSystem
from oobleck_slurm.simulate.run import SYSTEMS, simulate
from oobleck_slurm.simulate.scenario import Scenario, scenario_from
from oobleck_slurm.simulate.traces import (
    Trace,
    TraceError,
    TraceEvent,
    fixed_interval_trace,
    parse_duration,
    random_failure_trace,
)

__all__ = [
    "ASSUMPTIONS", "CATEGORIES", "CommCosts", "DEFAULT_COMM_COSTS", "build_seconds", "group_shape",
    "scale_calibration", "Calibration", "CheckpointRestart", "DEFAULT_CALIBRATION", "OobleckSystem", "Redundancy",
    "RestartCosts", "SYSTEMS", "Scenario", "SystemResult", "Trace", "TraceError", "TraceEvent",
    "default_restart_costs", "fit_calibration", "fixed_interval_trace", "job_events", "parse_duration",
    "random_failure_trace", "read_trace_csv", "scenario_from", "simulate",
]
