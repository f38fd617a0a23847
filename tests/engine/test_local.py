"""The local backend end to end: recipe -> planner plan -> worker processes on the shipped text."""

import dataclasses

import pytest

from oobleck_slurm.engine.from_planner import exec_plan
from oobleck_slurm.engine.layout import PlanError
from oobleck_slurm.engine.local import job_from_recipe, local_plan, train_local
from oobleck_slurm.events import events_path, read_events
from oobleck_slurm.recipe import load_recipe

pytestmark = pytest.mark.slow


def default_recipe(steps: int):
    r = load_recipe()  # tiny GPT, shipped text, 4 local virtual nodes, f=1
    return dataclasses.replace(r, training=dataclasses.replace(r.training, steps=steps))


def test_loss_falls_on_the_shipped_text(tmp_path):
    recipe = default_recipe(40)
    run = train_local(recipe, tmp_path / "job", cache_dir=tmp_path / "templates_cache")
    losses = [s["loss"] for s in run.steps]
    assert len(losses) == 40
    assert losses[0] > 5.0  # ~ln(256) at init, byte-level
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    kinds = [e["kind"] for e in read_events(events_path(tmp_path / "job"))]
    assert kinds[0] == "plan" and kinds[-1] == "done" and kinds.count("step") == 40


def test_planner_plan_maps_to_ranks(tmp_path):
    recipe = default_recipe(1)
    plan = local_plan(recipe, tmp_path / "templates_cache")
    ep = exec_plan(plan, list(range(recipe.cluster.nodes)))
    assert ep.num_microbatches == recipe.training.global_microbatches
    assert ep.num_layers == recipe.model.resolve().n_layer + 2
    assert len(ep.pipelines) >= recipe.fault_tolerance.f + 1
    with pytest.raises(PlanError, match="not among the job's nodes"):
        exec_plan(plan, [10, 11, 12, 13])
    job = job_from_recipe(recipe, tmp_path / "tokens.bin")
    assert job.train.global_batch_size == recipe.training.global_batch_size
    assert job.backend == "gloo"
