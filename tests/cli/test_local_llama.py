"""`submit recipes/local-llama.yaml`: the shipped Llama recipe, its scripted drill (node2's worker killed
at step 40) and a replacement joining, run in fp64 and shortened to 60 steps: every step's loss, the
validation losses and the final parameters equal the single-process reference (1e-5 relative)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from oobleck_slurm.protocol.events import read_events

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_the_local_llama_recipe_recovers_with_the_reference_trajectory(tmp_path: Path) -> None:
    from jobrun import JobRun, assert_matches_reference

    from oobleck_slurm.cluster.jobdir import JobDir

    recipe = tmp_path / "llama.yaml"
    recipe.write_text(f"extends: {REPO}/recipes/local-llama.yaml\ntraining: {{steps: 60, precision: fp64}}\n"
                      "cluster: {memory_per_device: 20MB}\n")  # fp64: more bytes, the same 3 + 2 nodes
    done = subprocess.run([sys.executable, "-m", "oobleck_slurm", "submit", str(recipe)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "eval after 25 steps: loss" in done.stdout and "eval after 50 steps: loss" in done.stdout
    (job_dir,) = (tmp_path / "jobs").iterdir()
    events = read_events(job_dir / "events.jsonl")
    run = JobRun(JobDir.at(job_dir), 0, events, 0.0)
    assert run.spec().model.config.family == "llama"
    assert [e["nodes"] for e in run.kind("failure")] == [["node2"]]
    assert [e["node"] for e in run.kind("node_joined")] == ["r1"]
    assert sorted({len(p["nodes"]) for p in run.first("plan")["pipelines"]}) == [2, 3]
    assert_matches_reference(run)  # the eval losses after 25 and 50 steps too
