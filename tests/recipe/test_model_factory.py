"""`model.factory`: a user's model with its kwargs and the GPT-interface shape keys beside it, carried
into the JobSpec and called as f(seed, start, stop, **kwargs); a factory that does not fit the
shape (layer count, activations, return type, import, kwargs) is refused naming the file, line and
key, by `validate` and `submit` before anything starts (and by the builder a worker uses). The model
is tests/factory_model.py; a job that trains it: tests/engine/test_factory_job.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from oobleck_slurm.commands import validate as validate_command
from oobleck_slurm.commands.common import model_factory_issues
from oobleck_slurm.engine.checkpoint import layer_payload, load_layer
from oobleck_slurm.engine.from_recipe import job_from_recipe
from oobleck_slurm.engine.layer_optim import make_layer_optimizer
from oobleck_slurm.engine.spec import FactoryError, JobSpec
from oobleck_slurm.recipe import load_recipe

KWARGS = "{depth: 3, width: 32, vocab: 256, seq: 16, scale: 0.25}"
SHAPE = "  n_layer: 3\n  d_model: 32\n  n_head: 4\n  seq_len: 16\n  vocab_size: 256\n"


def write(tmp_path: Path, factory: str = "factory_model:make_layers", kwargs: str = KWARGS, shape: str = SHAPE) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(f"model:\n  factory: {factory}\n  kwargs: {kwargs}\n{shape}")
    return path


def test_factory_kwargs_and_shape_keys_reach_the_jobspec_and_the_factory(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path))
    assert model_factory_issues(recipe) == []
    job = JobSpec.from_json(job_from_recipe(recipe, tmp_path / "tokens.bin").to_json())  # as workers read it
    m = job.model
    assert m.factory == "factory_model:make_layers"
    assert m.kwargs == {"depth": 3, "width": 32, "vocab": 256, "seq": 16, "scale": 0.25}
    assert (m.gpt.n_layer, m.gpt.d_model, m.gpt.n_head, m.gpt.seq_len, m.gpt.vocab_size) == (3, 32, 4, 16, 256)
    assert m.num_layers == 5 and len(m.keys()) == 5
    block = m.builder()(0, 2, 3)[0]  # what a worker builds for layer 2
    assert float(block.scale) == 0.25 and block.up.in_features == 32
    x = torch.randint(0, 256, (2, 16))
    for layer in m.builder()(0, 0, 5):
        x = layer(x)
    assert x.shape == (2, 16, 256)


def test_validate_command_passes_a_factory_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert validate_command.run(argparse.Namespace(recipe=write(tmp_path), json=False)) == 0
    assert "factory_model:make_layers, 5 layers" in capsys.readouterr().out


@pytest.mark.parametrize(("factory", "kwargs", "shape", "key", "words"), [
    # the factory's model has 5 layers, the recipe says n_layer 5 (7 layers)
    ("factory_model:make_layers", KWARGS, SHAPE.replace("n_layer: 3", "n_layer: 5"), "model.n_layer",
     "returned 5 layer(s) for layers [0, 7); the recipe's shape has 7 layers (model.n_layer 5"),
    # ... and n_layer 2 (4 layers): layer 4 exists
    ("factory_model:make_layers", KWARGS, SHAPE.replace("n_layer: 3", "n_layer: 2"), "model.n_layer",
     "gave 1 layer(s) for layers [4, 5), past the recipe's 4 layers"),
    ("factory_model:make_layers", KWARGS, SHAPE.replace("d_model: 32", "d_model: 64"), "model.d_model",
     "layer 0 of 5 must output hidden states (B, T, model.d_model) = (1, 16, 64)"),
    ("factory_model:make_layers", KWARGS, SHAPE.replace("vocab_size: 256", "vocab_size: 300"), "model.vocab_size",
     "layer 4 of 5 must output logits (B, T, model.vocab_size) = (1, 16, 300)"),
    ("factory_model:shaped_wrong", KWARGS, SHAPE, "model.factory", "layer 1 of 5 must output hidden states"),
    ("factory_model:not_modules", KWARGS, SHAPE, "model.factory", "must return a list of torch.nn.Module, got dict"),
    ("factory_model:make_layers", "{depth: 3, width: 32, vocab: 256, seq: 16, colour: red}", SHAPE, "model.kwargs",
     "unexpected keyword argument 'colour'"),
    ("no_such_module_x:make_layers", KWARGS, SHAPE, "model.factory", "cannot be loaded: No module named"),
    ("factory_model:no_such_function", KWARGS, SHAPE, "model.factory", "cannot be loaded"),
], ids=["too-few-layers", "too-many-layers", "d-model", "vocab", "layer-changes-shape", "not-modules",
        "bad-kwarg", "no-module", "no-function"])
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


def test_a_worker_building_a_layer_the_factory_lacks_gets_a_clear_error(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path, shape=SHAPE.replace("n_layer: 3", "n_layer: 5")))
    build = job_from_recipe(recipe, tmp_path / "tokens.bin").model.builder()
    build(0, 4, 5)  # within the factory's model
    with pytest.raises(FactoryError, match=r"returned 0 layer\(s\) for layers \[6, 7\).*set model.n_layer"):
        build(0, 6, 7)


def test_checkpoints_keep_persistent_buffers(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path))
    job = job_from_recipe(recipe, tmp_path / "tokens.bin")
    embed, block = job.model.builder()(0, 0, 2)
    for layer, key in ((embed, "embed"), (block, "block")):
        opt = make_layer_optimizer(layer, job.optim)
        payload = layer_payload(layer, opt, 3)
        (tmp_path / "step3").mkdir(exist_ok=True)
        torch.save(payload, tmp_path / "step3" / f"{key}.pt")
    assert "buffer.pos" in torch.load(tmp_path / "step3" / "embed.pt", weights_only=True)
    assert not any(k.startswith("buffer.") for k in torch.load(tmp_path / "step3" / "block.pt", weights_only=True))
    fresh = job.model.builder()(1, 0, 1)[0]  # another seed: other positions
    assert not torch.equal(fresh.pos, embed.pos)
    load_layer(tmp_path, 3, "embed", fresh, make_layer_optimizer(fresh, job.optim))
    assert torch.equal(fresh.pos, embed.pos) and torch.equal(fresh.tok.weight, embed.tok.weight)


def test_kwargs_stay_plain_json(tmp_path: Path) -> None:
    path = write(tmp_path, kwargs="{depth: 3, width: 32, vocab: 256, seq: 16, extra: {a: [1, {b: 2}]}}")
    spec = job_from_recipe(load_recipe(path), tmp_path / "t.bin")
    assert json.loads(spec.to_json())["model"]["kwargs"]["extra"] == {"a": [1, {"b": 2}]}
    assert JobSpec.from_json(spec.to_json()) == spec
