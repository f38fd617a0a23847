"""`plan` and `profile` through the real CLI parser; errors are one clear line, no traceback."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from oobleck_slurm.commands import plan, profile, simulate, submit
from oobleck_slurm.planning import UnknownGPU, gpu_spec

JURECA = "recipes/gpt-1.3b-jureca.yaml"


def run(module, argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    module.add_parser(sub)
    args = parser.parse_args([module.__name__.rsplit(".", 1)[1], *argv])
    return module.run(args)


def test_plan_json_from_estimate(tmp_path, capsys):
    assert run(plan, [JURECA, "--estimate", "A100-40", "--json", "--cache", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    pipelines = out["plan"]["pipelines"]
    assert len(pipelines) >= 3  # f = 2
    assert sum(p["microbatches"] for p in pipelines) == 128
    assert out["templates_cache"] == "miss"
    assert run(plan, [JURECA, "--estimate", "A100-40", "--json", "--cache", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["templates_cache"] == "hit"


def test_plan_tables_and_impossible_requests(tmp_path, capsys):
    assert run(plan, [JURECA, "--estimate", "H100", "--cache", str(tmp_path), "--nodes", "4", "--failures", "1"]) == 0
    assert "samples/s" in capsys.readouterr().out
    assert run(plan, [JURECA, "--estimate", "H100", "--cache", str(tmp_path), "--nodes", "2", "--failures", "3"]) == 2
    err = capsys.readouterr().err
    assert "surviving f=3 failures needs 4 pipelines" in err and "at most f=1 with 2 nodes" in err
    assert run(plan, [JURECA, "--estimate", "B200", "--cache", str(tmp_path)]) == 2
    assert "unknown GPU 'B200'" in capsys.readouterr().err
    assert run(plan, [JURECA, "--cache", str(tmp_path)]) == 2  # GPUs in the recipe, none here
    assert "--estimate GPU" in capsys.readouterr().err


def test_profile_file_round_trip_through_commands(tmp_path, capsys):
    assert run(profile, [JURECA, "--estimate", "A100-40", "--json"]) == 0
    path = tmp_path / "prof.json"
    path.write_text(capsys.readouterr().out)
    assert run(plan, [JURECA, "--profile", str(path), "--json", "--cache", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["profile"]["source"] == "file"
    path.write_text("[]")
    assert run(plan, [JURECA, "--profile", str(path), "--cache", str(tmp_path)]) == 2
    assert f"{path}: expected a JSON object" in capsys.readouterr().err


@pytest.mark.slow
def test_measured_profile_and_plan_of_the_local_recipe(tmp_path, capsys):
    # Real per-layer runs and real gloo transfers between two processes (a few seconds).
    assert run(profile, ["recipes/local-tiny.yaml", "--json", "--cache", str(tmp_path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["source"] == "measured" and len(data["layers"]) == 6
    assert data["links"]["intra_node"]["bandwidth_Bps"] > 1e6
    assert run(plan, ["recipes/local-tiny.yaml", "--json", "--cache", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["profile"]["source"] == "cache hit" and len(out["plan"]["pipelines"]) >= 2


def test_an_unknown_gpu_is_one_typed_error_that_every_planning_command_reports(tmp_path, capsys):
    assert gpu_spec("h100").name == "H100"  # case-insensitive
    with pytest.raises(UnknownGPU, match="unknown GPU 'B200'; known: V100, "):
        gpu_spec("B200")
    for module in (plan, profile, simulate, submit):
        extra = {simulate: ["--mtbf", "1h", "--hours", "1"], submit: ["--job-root", str(tmp_path / "jobs")]}.get(module, [])
        assert run(module, [JURECA, "--estimate", "B200", "--cache", str(tmp_path), *extra]) == 2, module.__name__
        err = capsys.readouterr().err
        assert "unknown GPU 'B200'; known: V100" in err and "Traceback" not in err, module.__name__


@pytest.mark.parametrize(("recipe", "layers"), [("recipes/llama-3.1-8b-isambard.yaml", 34),
                                                ("recipes/llama-3.1-70b-isambard.yaml", 82)])
def test_llama_recipes_plan_on_h100s(tmp_path, capsys, recipe, layers):
    assert run(plan, [recipe, "--estimate", "H100", "--json", "--cache", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    pipelines = out["plan"]["pipelines"]
    assert len(pipelines) >= 3  # f = 2
    assert {p["template"]["stages"][-1]["stop"] for p in pipelines} == {layers}
    assert sum(p["microbatches"] for p in pipelines) == (256 if "8b" in recipe else 1024)


def test_a_70b_model_fits_only_with_recompute(tmp_path, capsys):
    recipe = tmp_path / "no-recompute.yaml"
    recipe.write_text(f"extends: {Path('recipes/llama-3.1-70b-isambard.yaml').resolve()}\ntraining: {{recompute: false}}\n")
    assert run(plan, [str(recipe), "--estimate", "H100", "--cache", str(tmp_path)]) == 2
    assert "fits on no node count" in capsys.readouterr().err
