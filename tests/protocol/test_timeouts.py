"""`JobTimeouts` (timeouts.py): every timeout and poll period of the job, built from the recipe
in one place, each recipe value under its own name, shipped whole to the workers (elastic.json)."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, fields
from pathlib import Path

import pytest

from oobleck_slurm.protocol.records import LaunchConfig, read_launch_config, write_launch_config
from oobleck_slurm.recipe import load_recipe
from oobleck_slurm.recipe.schema import FaultToleranceConfig
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS, RECIPE_FIELDS, JobTimeouts

REPO = Path(__file__).resolve().parents[2]

# Distinct values, nested as the recipe requires: a value mapped under another name would show.
RECIPE = ("fault_tolerance:\n  heartbeat_interval: 0.7\n  heartbeat_lease: 4.5\n  collective_timeout: 1.5\n"
          "  step_timeout: 45\n  reconfiguration_timeout: 95\n")


def nested(t: JobTimeouts) -> bool:
    """The nesting recipe/validate.py requires of a recipe's timeouts."""
    return (t.collective_timeout < t.heartbeat_lease < t.step_timeout < t.reconfiguration_timeout
            and t.heartbeat_interval < t.heartbeat_lease)


def test_from_recipe_keeps_every_recipe_value_under_its_own_name(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE)
    ft = load_recipe(path).fault_tolerance
    timeouts = JobTimeouts.from_recipe(ft)
    assert {name: getattr(timeouts, name) for name in RECIPE_FIELDS} == {
        "heartbeat_interval": 0.7, "heartbeat_lease": 4.5, "collective_timeout": 1.5, "step_timeout": 45.0,
        "reconfiguration_timeout": 95.0}
    # Everything else is the job's own default.
    others = [f.name for f in fields(JobTimeouts) if f.name not in RECIPE_FIELDS]
    assert {n: getattr(timeouts, n) for n in others} == {n: getattr(DEFAULT_TIMEOUTS, n) for n in others}


def test_every_timing_value_of_the_recipe_is_a_field_of_the_record() -> None:
    """fault_tolerance's float fields are exactly the record's recipe fields: none is left out, none is
    renamed (`heartbeat_lease` stays `heartbeat_lease`, not a grace; `step_timeout` not a leave timeout)."""
    shares = {"integrity_max_cost"}  # a float that is a share of a step's time, not a timing value
    timing = {f.name for f in fields(FaultToleranceConfig)
              if isinstance(getattr(FaultToleranceConfig(), f.name), float)} - shares
    assert timing == set(RECIPE_FIELDS)
    assert set(RECIPE_FIELDS) <= {f.name for f in fields(JobTimeouts)}


def test_the_defaults_are_the_recipes_defaults() -> None:
    assert JobTimeouts.from_recipe(FaultToleranceConfig()) == JobTimeouts() == DEFAULT_TIMEOUTS


@pytest.mark.parametrize("recipe", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_the_nesting_the_recipe_validates_holds_in_the_record(recipe: Path) -> None:
    assert nested(JobTimeouts.from_recipe(load_recipe(recipe).fault_tolerance))


def test_the_defaults_nest_and_the_polls_are_shorter_than_what_they_watch() -> None:
    t = DEFAULT_TIMEOUTS
    assert nested(t)
    assert t.checkpoint_timeout + t.teardown_timeout <= 90  # submitit's notice: --signal=USR2@90
    assert t.backend_poll < t.heartbeat_lease and t.agent_poll < t.heartbeat_interval
    assert t.coordinator_poll < t.collective_timeout and t.abort_poll < t.collective_timeout
    assert t.rank_step_poll < t.step_timeout and t.store_poll < t.heartbeat_lease
    assert t.nccl_poll < t.collective_timeout and t.warm_up_poll < t.connect_timeout
    assert t.run_timeout > t.reconfiguration_timeout


def test_every_field_is_a_positive_number_of_seconds() -> None:
    assert all(isinstance(getattr(DEFAULT_TIMEOUTS, f.name), float) and getattr(DEFAULT_TIMEOUTS, f.name) > 0
               for f in fields(JobTimeouts))
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="step_timeout must be a positive number of seconds"):
            JobTimeouts(step_timeout=bad)


def test_the_workers_rebuild_the_record_from_elastic_json(tmp_path: Path) -> None:
    timeouts = JobTimeouts(collective_timeout=1.25, run_timeout=7.0)
    write_launch_config(tmp_path / "elastic.json", LaunchConfig(host="h", port=1, timeouts=asdict(timeouts)))
    assert JobTimeouts(**read_launch_config(tmp_path / "elastic.json").timeouts) == timeouts


def test_td_is_the_named_timeout_as_a_timedelta() -> None:
    assert DEFAULT_TIMEOUTS.td("store_timeout") == dt.timedelta(seconds=DEFAULT_TIMEOUTS.store_timeout)
