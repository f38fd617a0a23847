"""The embedded default through the production path: recipe -> planner plan -> supervisor, agents and
workers on the shipped text; and the mapping of a planner plan to worker ranks."""

from pathlib import Path

import pytest
from jobrun import run_job

from oobleck_slurm.engine.from_planner import exec_plan
from oobleck_slurm.engine.from_recipe import job_from_recipe
from oobleck_slurm.engine.layout import PlanError
from oobleck_slurm.planning import instantiate
from oobleck_slurm.planning.pregenerate import pregenerate
from oobleck_slurm.recipe import load_recipe, recipe_to_dict


def default_recipe(steps: int) -> dict:
    tree = recipe_to_dict(load_recipe())  # tiny GPT, shipped text, 4 local virtual nodes, f=1
    tree["training"]["steps"] = steps
    tree["drills"] = []  # the default's scripted failure: tests/cli/test_submit.py
    tree["fault_tolerance"]["checkpoint_interval"] = 0
    return tree


@pytest.mark.slow
def test_loss_falls_on_the_shipped_text(tmp_path, templates_cache):
    run = run_job(tmp_path, default_recipe(40), templates_cache, estimate=None)  # the measured profile
    losses = [s["loss"] for s in run.kind("step")]
    assert len(losses) == 40
    assert losses[0] > 5.0  # ~ln(256) at init, byte-level
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert run.kind("job_finished")[-1]["status"] == "completed"


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
