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


# Centre recipes and the data-sheet GPU that `plan --estimate` uses for each (planning/gpus.py).
CENTRE_GPUS = {
    "cscs-alps-gh200.yaml": "GH200", "isambard-ai.yaml": "GH200", "juwels-booster.yaml": "A100-40",
    "jureca-dc-gpu.yaml": "A100-40", "perlmutter-gpu.yaml": "A100-40", "olcf-frontier.yaml": "MI250X",
    "lumi-g.yaml": "MI250X",
    "leonardo-booster.yaml": "A100-40",  # its A100s have 64 GB; A100-40 is the closest known below
}
CENTRES = sorted((REPO / "recipes" / "centres").glob("*.yaml"))


def test_every_centre_recipe_has_a_gpu_to_plan_with() -> None:
    from oobleck_slurm.planning.gpus import GPUS

    assert {p.name for p in CENTRES} == set(CENTRE_GPUS)
    assert set(CENTRE_GPUS.values()) <= set(GPUS)


@pytest.mark.parametrize("path", CENTRES, ids=[p.name for p in CENTRES])
def test_centre_recipe_cites_its_sources(path: Path) -> None:
    """Every hardware value carries a comment: a URL with what it says, or that it is unconfirmed."""
    lines = path.read_text().splitlines()
    assert any("https://" in line for line in lines if line.lstrip().startswith("#")), "no source URL"
    for i, line in enumerate(lines):
        key = line.strip().split(":", 1)[0]
        if key in ("partition", "gpus_per_node", "cpus_per_node", "qos", "constraint") and not line.lstrip().startswith("#"):
            commented = "#" in line or lines[i - 1].lstrip().startswith("#")
            assert commented, f"{path.name}:{i + 1}: {key} has no comment saying where it comes from"


@pytest.mark.parametrize("path", CENTRES, ids=[p.name for p in CENTRES])
def test_centre_recipe_validates_and_plans(path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from oobleck_slurm.cli import main

    # A centre recipe is a base, not a job: alone it names no data, which a Slurm job must.
    assert main(["validate", str(path)]) == 2 and "a Slurm job needs training data" in capsys.readouterr().err
    # A job on the centre, as a user writes it: plan it with the centre GPU's data-sheet figures.
    job = tmp_path / "job.yaml"
    job.write_text(f"extends: {path}\nname: centre-job\ncluster:\n  nodes: 4\n  account: test\nmodel:\n  size: 350m\n"
                   "training:\n  global_batch_size: 64\n  microbatch_size: 2\nfault_tolerance:\n  f: 1\n"
                   "data:\n  sources:\n    - {path: /scratch/prepared, weight: 1.0}\n")
    assert main(["validate", str(job), "--json"]) == 0, capsys.readouterr().err
    values = json.loads(capsys.readouterr().out)
    assert values["cluster"]["backend"] == "slurm" and values["cluster"]["gpus_per_node"] >= 1
    code = main(["plan", str(job), "--estimate", CENTRE_GPUS[path.name], "--cache", str(tmp_path / "cache"), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    plan = json.loads(out.out)
    assert plan["profile"]["devices_per_node"] == values["cluster"]["gpus_per_node"]
    assert len(plan["plan"]["pipelines"]) >= 2
