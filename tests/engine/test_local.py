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
