"""Good recipes: defaults, extends, typed immutable values, shipped recipes, the validate command."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from oobleck_slurm.recipe import DEFAULT_RECIPE, load_recipe

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "recipes").rglob("*.yaml"))


def test_default_recipe_is_local_and_valid() -> None:
    recipe = load_recipe()
    assert recipe.cluster.backend == "local"
    assert recipe.source == str(DEFAULT_RECIPE)
    assert recipe.training.global_batch_size % recipe.training.microbatch_size == 0


def test_recipe_is_immutable() -> None:
    recipe = load_recipe()
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.cluster.nodes = 9  # type: ignore[misc]
    with pytest.raises(TypeError):
        recipe.cluster.sbatch["x"] = "y"  # type: ignore[index]


def test_extends_merges_sections_key_by_key(tmp_path: Path) -> None:
    (tmp_path / "centre.yaml").write_text(
        "cluster:\n  backend: slurm\n  partition: gpu\n  nodes: 8\n  sbatch:\n    mail-type: END\n"
    )
    (tmp_path / "job.yaml").write_text(
        "extends: centre.yaml\ncluster:\n  nodes: 4\n  sbatch:\n    exclusive: true\ntraining:\n  optimizer:\n    lr: 3e-4\n"
    )
    recipe = load_recipe(tmp_path / "job.yaml")
    assert recipe.name == "job"
    assert (recipe.cluster.backend, recipe.cluster.partition, recipe.cluster.nodes) == ("slurm", "gpu", 4)
    assert dict(recipe.cluster.sbatch) == {"mail-type": "END", "exclusive": ""}
    assert recipe.training.optimizer.lr == pytest.approx(3e-4)  # YAML 1.1 reads 3e-4 as text


def test_data_paths_resolve_relative_to_the_recipe(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "corpus.txt").write_text("hello")
    (tmp_path / "job.yaml").write_text("data:\n  text: data/corpus.txt\n")
    recipe = load_recipe(tmp_path / "job.yaml")
    assert recipe.data.text == str(tmp_path / "data" / "corpus.txt")


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(REPO)) for p in SHIPPED])
def test_shipped_recipes_are_valid(path: Path) -> None:
    recipe = load_recipe(path)
    assert recipe.cluster.nodes >= recipe.fault_tolerance.f + 1


def test_shipped_recipes_exist() -> None:
    assert any("centres" in str(p) for p in SHIPPED) and len(SHIPPED) >= 4


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "oobleck_slurm", *args], capture_output=True, text=True, timeout=120)


def test_validate_command_prints_errors_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  microbatch_size: four\n")
    result = run_cli("validate", str(bad))
    assert result.returncode == 2
    assert f"{bad}:2: training.microbatch_size: expected an integer" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_validate_command_prints_resolved_recipe() -> None:
    result = run_cli("validate", "--json")
    assert result.returncode == 0, result.stderr
    values = json.loads(result.stdout)
    assert values["cluster"]["backend"] == "local"
    assert values["fault_tolerance"]["collective_timeout"] < values["fault_tolerance"]["heartbeat_lease"]


def test_help_lists_commands() -> None:
    result = run_cli("--help")
    assert result.returncode == 0 and "validate" in result.stdout
