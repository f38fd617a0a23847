"""A job trains a user's model through `model.factory` (tests/factory_model.py, with kwargs; it
declares its own layers), the way `submit` runs it: the workers import the factory from PYTHONPATH, and
the per-step losses and final parameters equal the single-process reference built by the same factory
(fp64). The final checkpoint keeps the persistent buffer. Recipe-level checks: tests/recipe/test_model_factory.py."""

from pathlib import Path

import pytest
from factory_model import factory_pythonpath
from jobrun import assert_matches_reference, run_job, tiny_recipe

from oobleck_slurm.engine.checkpoint import layer_file, read_layer_file

pytestmark = pytest.mark.slow


def test_a_job_trains_a_factory_model_with_kwargs(tmp_path: Path, templates_cache: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", factory_pythonpath())  # the job's processes inherit it
    recipe = tiny_recipe(nodes=2, workers=2, steps=3)
    recipe["model"] = {"factory": "factory_model:make_layers",
                       "kwargs": {"depth": 7, "width": 32, "vocab": 256, "seq": 32, "hidden": 48, "scale": 0.5},
                       "seq_len": 32, "vocab_size": 256}
    run = run_job(tmp_path, recipe, templates_cache, timeout=180, estimate=None)  # a factory is profiled, not estimated
    spec = run.spec()
    assert spec.model.config.kwargs["hidden"] == 48  # type: ignore[attr-defined]
    assert spec.model.keys() == ["embed", *(f"block.{i}" for i in range(7)), "head"]  # 9 layers, the factory's names
    assert_matches_reference(run)
    assert any(len(p["stages"]) > 1 for p in run.first("plan")["pipelines"])  # activations crossed stages
    embed = read_layer_file(layer_file(run.job.checkpoints, spec.train.steps, spec.model.keys()[0]), spec.train.steps)
    assert "buffer.pos" in embed and embed["param.tok.weight"].shape == (256, 32)
