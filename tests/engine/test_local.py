"""The mapping of a planner plan to worker ranks. (The embedded default through the production path,
its loss falling on the shipped text: tests/cli/test_submit.py.)"""

from pathlib import Path

import pytest

from oobleck_slurm.engine.from_planner import exec_plan
from oobleck_slurm.engine.from_recipe import job_from_recipe
from oobleck_slurm.engine.layout import PlanError
from oobleck_slurm.planning import instantiate
from oobleck_slurm.planning.pregenerate import pregenerate
from oobleck_slurm.recipe import load_recipe


def test_planner_plan_maps_to_ranks(tmp_path):
    # local-tiny: the embedded default's memory budget per device is sized for its measured CPU profile
    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "local-tiny.yaml")
    profile, templates = pregenerate(recipe, tmp_path / "templates_cache", estimate_gpu="A100-40")
    plan = instantiate(templates, recipe.cluster.nodes, recipe.fault_tolerance.f,
                       recipe.training.global_microbatches, microbatch_size=recipe.training.microbatch_size)
    ep = exec_plan(plan, list(range(recipe.cluster.nodes)))
    assert ep.num_microbatches == recipe.training.global_microbatches
    assert ep.num_layers == recipe.model.resolve().n_layer + 2
    assert len(ep.pipelines) >= recipe.fault_tolerance.f + 1
    with pytest.raises(PlanError, match="not among the job's nodes"):
        exec_plan(plan, [10, 11, 12, 13])
    job = job_from_recipe(recipe, tmp_path / "tokens.bin")
    assert job.train.global_batch_size == recipe.training.global_batch_size
    assert job.backend == "gloo"


def test_stages_of_several_devices_map_to_consecutive_ranks_of_their_node():
    from oobleck_slurm.planning.instantiate import PipelinePlan, Plan
    from oobleck_slurm.planning.templates import PipelineTemplate, StageTemplate

    def stage(start: int, stop: int, first: int, devices: int, keep: bool = False) -> StageTemplate:
        return StageTemplate(start, stop, first, devices, 1.0, 1.0, keep)

    wide = PipelineTemplate(1, 4, 4, (stage(0, 6, 0, 4, keep=True),), 1.0)  # one kept stage on the node's 4 workers
    mixed = PipelineTemplate(1, 4, 4, (stage(0, 3, 0, 2), stage(3, 5, 2, 1), stage(5, 6, 3, 1)), 1.0)
    plan = Plan((PipelinePlan(wide, ("b",), 4, 0), PipelinePlan(mixed, ("a",), 4, 4)), (), 8, 2, 0.0)
    ep = exec_plan(plan, ["a", "b"], 4)
    assert [(p.ranks, p.widths) for p in ep.pipelines] == [((4,), (4,)), ((0, 2, 3), (2, 1, 1))]
    assert [p.keep for p in ep.pipelines] == [(True,), (False, False, False)]  # the planner's stage modes
    assert ep.holder_stages(0) == ((4, 5, 6, 7), (0, 1))
    overflow = PipelineTemplate(1, 4, 4, (stage(0, 6, 2, 4),), 1.0)
    with pytest.raises(PlanError, match="does not fit a node of 4 devices"):
        exec_plan(Plan((PipelinePlan(overflow, ("a",), 8, 0),), (), 8, 2, 0.0), ["a"], 4)
