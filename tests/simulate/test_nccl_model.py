"""The NCCL communicator-rebuild model of the simulator at scale (simulate/nccl_model.py): pure, fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oobleck_slurm.cli import main
from oobleck_slurm.engine.comm import communicators_per_rank, plan_groups
from oobleck_slurm.engine.layout import ExecPlan, PipelineSpec
from oobleck_slurm.simulate import (
    ASSUMPTIONS,
    DEFAULT_CALIBRATION,
    DEFAULT_COMM_COSTS,
    CommCosts,
    build_seconds,
    group_shape,
    scale_calibration,
)
from oobleck_slurm.simulate.nccl_model import build_order


def test_one_communicator_costs_fixed_plus_per_rank() -> None:
    c = CommCosts(fixed_s=0.5, per_rank_s=0.01)
    assert c.communicator_s(2) == pytest.approx(0.52)
    assert c.communicator_s(1000) == pytest.approx(10.5)


def test_disjoint_groups_build_side_by_side_and_a_rank_builds_one_at_a_time() -> None:
    c = CommCosts(1.0, 0.0)
    assert build_seconds({"world": (0, 1, 2, 3)}, c) == pytest.approx(1.0)
    # after the world, two disjoint pairs at once
    assert build_seconds({"world": (0, 1, 2, 3), "a": (0, 1), "b": (2, 3)}, c) == pytest.approx(2.0)
    # a chain: b waits for rank 1, which builds a first
    assert build_seconds({"world": (0, 1, 2), "a": (0, 1), "b": (1, 2)}, c) == pytest.approx(3.0)


def test_the_world_is_built_first_then_by_name() -> None:
    assert build_order({"p2p/0-1": (0, 1), "world": (0, 1), "layers/0-1": (0, 1)}) == \
        ["world", "layers/0-1", "p2p/0-1"]


def test_group_shape_counts_what_the_engine_builds() -> None:
    """Two pipelines whose stages split the layers differently: the layer held by different stage
    ranks gets its own group, as the engine's `communicators_per_rank` counts."""
    plan = ExecPlan(6, 8, (PipelineSpec((0, 1), (0, 3, 6), 0, 4), PipelineSpec((2, 3), (0, 2, 6), 4, 4)))
    groups = plan_groups(plan, 4)
    shape = group_shape(groups)
    assert shape.per_rank_max == max(communicators_per_rank(plan, 4))
    assert shape.per_rank_min == min(communicators_per_rank(plan, 4))
    assert shape.groups == len(groups) and shape.largest == 4


def test_a_large_world_dominates_and_cost_grows_with_every_assumption() -> None:
    world = 4096
    groups = {"world": tuple(range(world))}
    for p in range(world // 8):  # pipelines of 8 ranks, one edge group per neighbour pair
        ranks = tuple(range(8 * p, 8 * p + 8))
        groups[f"pipe/{p}"] = ranks
        for a, b in zip(ranks, ranks[1:]):
            groups[f"p2p/{a}-{b}"] = (a, b)
    for s in range(8):  # each stage's data-parallel group across the pipelines
        groups[f"layers/{s}"] = tuple(range(s, world, 8))
    base = build_seconds(groups, DEFAULT_COMM_COSTS)
    assert base > DEFAULT_COMM_COSTS.communicator_s(world)
    assert build_seconds(groups, CommCosts(DEFAULT_COMM_COSTS.fixed_s, 3 * DEFAULT_COMM_COSTS.per_rank_s)) > base
    assert build_seconds(groups, CommCosts(3 * DEFAULT_COMM_COSTS.fixed_s, DEFAULT_COMM_COSTS.per_rank_s)) > base
    # the tiny CPU job's rebuild is far below the model at this scale
    assert base > 100 * DEFAULT_CALIBRATION.rebuild_s


def test_scale_calibration_charges_the_model_the_lease_and_the_replan() -> None:
    cal = scale_calibration(DEFAULT_CALIBRATION, 20.0)
    named = {a.name: a.value for a in ASSUMPTIONS}
    assert (cal.rebuild_s, cal.detection_s, cal.replan_s) == (20.0, named["detection_s"], named["replan_s"])
    assert cal.agreement_s == DEFAULT_CALIBRATION.agreement_s
    assert cal.recovery_s(0.0, 1.0, 0.0) > DEFAULT_CALIBRATION.recovery_s(0.0, 1.0, 0.0) + 20.0
    assert all(a.source for a in ASSUMPTIONS)


def test_cli_nccl_model_charges_a_rebuild_and_the_lease(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from oobleck_slurm.recipe import DEFAULT_RECIPE

    recipe = tmp_path / "roomy.yaml"
    recipe.write_text(f"extends: {DEFAULT_RECIPE}\ncluster:\n  memory_per_device: 10MB\n")
    common = ["simulate", str(recipe), "--estimate", "V100", "--cache", str(tmp_path / "cache"), "--mtbf", "10m",
              "--nodes", "8", "--min-nodes", "4", "--systems", "oobleck", "--json"]
    assert main(common) == 0
    tiny = json.loads(capsys.readouterr().out)
    assert main([*common, "--nccl-model"]) == 0
    modelled = json.loads(capsys.readouterr().out)
    cal = modelled["calibration"]
    assert cal["rebuild_s"] > DEFAULT_CALIBRATION.rebuild_s and cal["detection_s"] == 3.0  # the default lease
    assert "NCCL rebuild model" in cal["source"]
    assert modelled["oobleck"]["useful_fraction"] < tiny["oobleck"]["useful_fraction"]


def test_the_cli_knows_the_default_calibrations_source() -> None:
    from oobleck_slurm.commands.simulate import DEFAULT_SOURCE

    assert DEFAULT_SOURCE == DEFAULT_CALIBRATION.source
