"""`model.factory`: a user's model with its kwargs, called as f(seed, start, stop, **kwargs); it declares
its own layers (f(seed, 0, None) gives all of them, by name), and `seq_len`/`vocab_size` beside it give
the data's shape. A factory that does not fit a job (return type, activations, import, kwargs, range,
shape keys that do not apply) is refused naming the file, line and key, by `validate` and `submit`
before anything starts (and by the builder a worker uses). The model is tests/factory_model.py; a job
that trains it: tests/engine/test_factory_job.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from oobleck_slurm.commands import validate as validate_command
from oobleck_slurm.commands.common import model_factory_issues
from oobleck_slurm.engine.checkpoint import CheckpointWriter, layer_payload, load_layer
from oobleck_slurm.engine.from_recipe import job_from_recipe
from oobleck_slurm.engine.layer_optim import make_layer_optimizer
from oobleck_slurm.engine.spec import JobSpec
from oobleck_slurm.models import FactoryError
from oobleck_slurm.recipe import load_recipe
from oobleck_slurm.recipe.errors import RecipeError

KWARGS = "{depth: 3, width: 32, vocab: 256, seq: 16, scale: 0.25}"
SHAPE = "  seq_len: 16\n  vocab_size: 256\n"


def write(tmp_path: Path, factory: str = "factory_model:make_layers", kwargs: str = KWARGS, shape: str = SHAPE) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(f"model:\n  factory: {factory}\n  kwargs: {kwargs}\n{shape}")
    return path


def test_kwargs_reach_the_factory_and_its_declared_layers_the_jobspec(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path))
    assert model_factory_issues(recipe) == []
    job = JobSpec.from_json(job_from_recipe(recipe, tmp_path / "tokens.bin").to_json())  # as workers read it
    m = job.model
    assert m.config.factory == "factory_model:make_layers"  # type: ignore[attr-defined]
    assert m.config.kwargs == {"depth": 3, "width": 32, "vocab": 256, "seq": 16, "scale": 0.25}  # type: ignore[attr-defined]
    assert m.keys() == ["embed", "block.0", "block.1", "block.2", "head"]  # the names the factory gave
    assert m.config.boundary_shape(1) == (16, 32) and (m.seq_len, m.vocab_size) == (16, 256)
    block = m.build(0, 2, 3)[0]  # what a worker builds for layer 2
    assert float(block.scale) == 0.25 and block.up.in_features == 32
    x = torch.randint(0, 256, (2, 16))
    for layer in m.build(0, 0, 5):
        x = layer(x)
    assert x.shape == (2, 16, 256)


def test_validate_passes_a_factory_with_nine_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, kwargs="{depth: 7, width: 32, vocab: 256, seq: 16}")
    assert validate_command.run(argparse.Namespace(recipe=path, json=False)) == 0
    assert "factory_model:make_layers: 9 layers" in capsys.readouterr().out
    assert job_from_recipe(load_recipe(path), tmp_path / "t.bin").model.num_layers == 9


@pytest.mark.parametrize(("factory", "kwargs", "shape", "key", "words"), [
    ("factory_model:make_layers", KWARGS, SHAPE.replace("vocab_size: 256", "vocab_size: 300"), "model.vocab_size",
     "the last layer (head) must return logits (B, model.seq_len, model.vocab_size) = (1, 16, 300)"),
    ("factory_model:make_layers", KWARGS.replace("seq: 16", "seq: 8"), SHAPE, "model.factory",
     "layer 0 (embed) cannot take token ids of shape (1, model.seq_len)"),
    ("factory_model:shaped_wrong", KWARGS, SHAPE, "model.factory", "layer 2 (layer.02) cannot take the output of layer 1"),
    ("factory_model:not_modules", KWARGS, SHAPE, "model.factory", "must return a list (or a dict by name) of "
     "torch.nn.Module, got a dict of int"),
    ("factory_model:make_layers", "{depth: 3, width: 32, vocab: 256, seq: 16, colour: red}", SHAPE, "model.kwargs",
     "unexpected keyword argument 'colour'"),
    ("no_such_module_x:make_layers", KWARGS, SHAPE, "model.factory", "cannot be loaded: No module named"),
    ("factory_model:no_such_function", KWARGS, SHAPE, "model.factory", "cannot be loaded"),
], ids=["vocab", "seq-len", "layer-changes-shape", "not-modules", "bad-kwarg", "no-module", "no-function"])
def test_a_factory_that_does_not_fit_is_refused_naming_file_line_and_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], factory: str, kwargs: str, shape: str, key: str,
        words: str) -> None:
    path = write(tmp_path, factory, kwargs, shape)
    issues = model_factory_issues(load_recipe(path))
    assert len(issues) == 1, issues
    issue = issues[0]
    assert (issue.file, issue.key) == (str(path), key)
    assert issue.line is not None and words in issue.message, issue.message
    # `validate` (and `submit`, the same check) reports it and exits 2
    assert validate_command.run(argparse.Namespace(recipe=path, json=False)) == 2
    assert f"{path}:{issue.line}: {key}: " in capsys.readouterr().err


def test_shape_keys_that_a_factory_declares_itself_are_refused(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path, shape=SHAPE + "  n_layer: 3\n  d_model: 32\n"))
    keys = sorted(issue.key for issue in err.value.issues)
    assert keys == ["model.d_model", "model.n_layer"]
    assert "model.factory takes the model's shape from the factory: remove model.n_layer" in str(err.value)


def test_a_worker_building_a_range_the_factory_does_not_honour_gets_a_clear_error(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path, factory="factory_model:ignores_the_range"))
    model = job_from_recipe(recipe, tmp_path / "tokens.bin").model
    assert model.num_layers == 5  # f(seed, 0, None): all five
    with pytest.raises(FactoryError, match=r"returned 5 layer\(s\) for layers \[2, 3\)"):
        model.build(0, 2, 3)


def test_buffers_travel_with_checkpoints(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path))
    job = job_from_recipe(recipe, tmp_path / "tokens.bin")
    embed, block = job.model.build(0, 0, 2)
    writer = CheckpointWriter(tmp_path)
    for layer, key in ((embed, "embed"), (block, "block.0")):
        payload = layer_payload(layer, make_layer_optimizer(layer, job.optim), 3)
        assert ("buffer.pos" in payload) == (key == "embed")  # the block's buffer is not persistent
        writer.submit(3, key, payload)
    writer.flush()
    fresh = job.model.build(1, 0, 1)[0]  # another seed: other positions
    assert not torch.equal(fresh.pos, embed.pos)
    load_layer(tmp_path, 3, "embed", fresh, make_layer_optimizer(fresh, job.optim))
    assert torch.equal(fresh.pos, embed.pos) and torch.equal(fresh.tok.weight, embed.tok.weight)


def test_kwargs_stay_plain_json(tmp_path: Path) -> None:
    path = write(tmp_path, kwargs="{depth: 3, width: 32, vocab: 256, seq: 16, notes: {a: [1, {b: 2}]}}")
    spec = job_from_recipe(load_recipe(path), tmp_path / "t.bin")
    assert json.loads(spec.to_json())["model"]["config"]["kwargs"]["notes"] == {"a": [1, {"b": 2}]}
    assert JobSpec.from_json(spec.to_json()) == spec


def test_the_shipped_example_validates_and_declares_nine_layers(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    example = Path(__file__).resolve().parents[2] / "recipes" / "examples"
    monkeypatch.syspath_prepend(str(example))  # what PYTHONPATH=recipes/examples does for the job
    path = example / "my-model.yaml"
    assert validate_command.run(argparse.Namespace(recipe=path, json=False)) == 0
    assert "my_model:build: 9 layers" in capsys.readouterr().out
    model = job_from_recipe(load_recipe(path), path.parent / "unused.bin").model
    assert model.keys() == ["embed", *(f"block{i}" for i in range(1, 8)), "head"]
    x = torch.randint(0, 256, (2, 64))
    for part in (model.build(3, 0, 4), model.build(3, 4, 9)):  # two stages give the full model's logits
        for layer in part:
            x = layer(x)
    assert x.shape == (2, 64, 256) and torch.isfinite(x).all()
