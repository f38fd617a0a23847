"""Checkpoints that move between jobs (engine/resume.py), retention, and failed writes, on real local
jobs (supervisor, agents and workers as processes: tests/jobrun.py).

One old job (5 nodes, f 1, 6 steps, a checkpoint every 3) is trained once for the module. A new job
started from its step 3 on 3 nodes with f 0, or on 6 nodes with f 2, must train steps 3-5 to the old job's losses and end with
its final parameters and optimizer state: so the step, learning-rate position, optimizer state, data
cursor and the parameters at load all carried over (a mismatch in any one changes the losses). A new
job with a doubled global batch goes on from the old job's consumed-samples cursor; it also meets a
file where its step 7 folder should go (a write that fails for real), and keeps 2 checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from exec_plans import make_plan
from jobrun import JobRun, assert_tensors_match, run_job, start_and_wait, tiny_recipe

from oobleck_slurm.cluster.jobdir import JobDir
from oobleck_slurm.commands.status import summarize
from oobleck_slurm.dashboard.narrate import Narrator
from oobleck_slurm.engine.checkpoint import (
    DATA_FILE,
    CheckpointError,
    CheckpointWriter,
    DataChangedError,
    latest_complete,
    layer_file,
    prune,
    read_data_record,
    read_layer_file,
    save_layer,
    step_dir,
)
from oobleck_slurm.engine.elastic_process import ElasticWorker
from oobleck_slurm.exit_codes import EXIT_BAD_INPUT
from oobleck_slurm.recipe import load_recipe
from oobleck_slurm.submission import prepare_job

JOB_TIMEOUT_S = 300.0
GBS = 16


def _recipe(**changes: Any) -> dict[str, Any]:
    nodes, f, steps = changes.pop("nodes", 4), changes.pop("f", 1), changes.pop("steps", 6)
    recipe = tiny_recipe(nodes=nodes, f=f, steps=steps, **changes.pop("fault_tolerance", {}))
    for section, values in changes.items():
        recipe[section] = {**recipe.get(section, {}), **values}
    return recipe


@pytest.fixture(scope="module")
def old_job(tmp_path_factory: pytest.TempPathFactory, templates_cache: Path) -> JobRun:
    run = run_job(tmp_path_factory.mktemp("old"), _recipe(nodes=5, fault_tolerance={"checkpoint_interval": 3}),
                  templates_cache, timeout=JOB_TIMEOUT_S)
    assert latest_complete(run.job.checkpoints, run.spec().model.keys()) == 6
    assert (step_dir(run.job.checkpoints, 3) / DATA_FILE).is_file()
    return run


def _digest(folder: Path) -> dict[str, str]:
    """Every file under `folder`, by relative name, with a hash of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _prepare(tmp_path: Path, recipe: dict[str, Any], cache: Path, resume_from: Path | None) -> JobDir:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return prepare_job(load_recipe(path), cache_dir=cache, estimate_gpu="A100-40", job_root=tmp_path / "jobs",
                       resume_from=resume_from)


def _states(job: JobDir, step: int, kind: str) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for path in sorted(step_dir(job.checkpoints, step).glob("*.safetensors")):
        tensors = read_layer_file(path, step)
        out[path.stem] = {k[len(kind) + 1:]: v for k, v in tensors.items() if k.startswith(f"{kind}.")}
    return out


@pytest.mark.parametrize(("nodes", "f"), [(3, 0), (6, 2)])
def test_a_new_job_goes_on_from_another_jobs_checkpoint_on_other_nodes_and_f(
        tmp_path: Path, templates_cache: Path, old_job: JobRun, nodes: int, f: int) -> None:
    before = _digest(old_job.job.checkpoints)
    job = _prepare(tmp_path, _recipe(nodes=nodes, f=f), templates_cache, step_dir(old_job.job.checkpoints, 3))
    assert job.meta()["resumed_from"] == {"path": str(step_dir(old_job.job.checkpoints, 3)), "step": 3,
                                          "how": "linked"}  # one filesystem: hard links, no bytes copied
    new = start_and_wait(job, JOB_TIMEOUT_S)
    assert new.exit_code == 0, new.log_tails()

    started = new.first("job_started")
    assert started is not None and started["requeued"] is False  # a new job: its drills would run
    assert started["resumed_from"] == str(step_dir(old_job.job.checkpoints, 3))
    plans = new.kind("plan")
    assert plans[0]["ranks"] == nodes and old_job.first("plan")["ranks"] == 5  # type: ignore[index]
    assert len(plans[0]["pipelines"]) >= f + 1
    old_losses, losses = old_job.losses(), new.losses()
    assert sorted(losses) == [3, 4, 5]  # it went on from the step: steps 0-2 not trained again
    for step in losses:  # same parameters at load, same data, same lr and optimizer state: same losses
        assert abs(losses[step] - old_losses[step]) <= 1e-5 * abs(old_losses[step]), (step, losses, old_losses)
    assert_tensors_match(_states(job, 6, "param"), _states(old_job.job, 6, "param"), 1e-5)
    assert_tensors_match(_states(job, 6, "state"), _states(old_job.job, 6, "state"), 1e-5)
    assert _digest(old_job.job.checkpoints) == before  # the old job's files are as they were


def test_a_changed_global_batch_goes_on_from_the_cursor_through_a_failed_write_keeping_two(
        tmp_path: Path, templates_cache: Path, old_job: JobRun) -> None:
    before = _digest(old_job.job.checkpoints)
    recipe = _recipe(nodes=2, f=0, steps=9, training={"global_batch_size": 2 * GBS},
                     fault_tolerance={"checkpoint_interval": 1, "keep_checkpoints": 2})
    job = _prepare(tmp_path, recipe, templates_cache, old_job.job.path)  # the job folder: its newest, step 6
    assert job.meta()["resumed_from"]["step"] == 6
    # A real failing write: a file where the step 7 folder should go (its mkdir fails, whoever runs it).
    job.checkpoints.joinpath("step7").write_text("in the way")
    new = start_and_wait(job, JOB_TIMEOUT_S)
    assert new.exit_code == 0, new.log_tails()  # a checkpoint is last-resort: the run went on

    assert sorted(new.losses()) == [6, 7, 8]
    failed = [e for e in new.kind("checkpoint") if e.get("ok") is False]
    assert failed and {e["step"] for e in failed} == {7}, failed
    assert all(e["worker"] and "step7" in e["detail"] and e["failures"] == 1 for e in failed), failed
    # Said where people look: the narration `submit` prints, and `status`.
    narrator = Narrator()
    said = [line for e in new.events for line in narrator.lines(e)]
    assert any("checkpoint of step 7 NOT written" in line for line in said), said
    assert any("starting from another job's checkpoint" in line for line in said), said
    assert [f["step"] for f in summarize(new.events)["checkpoint_failures"]] == [7] * len(failed)
    keys = new.spec().model.keys()
    # The next interval wrote a checkpoint again; retention kept the 2 newest complete ones.
    assert latest_complete(job.checkpoints, keys) == 9
    kept = sorted(int(d.name[4:]) for d in job.checkpoints.glob("step*") if d.is_dir())
    assert kept == [8, 9], kept
    assert any(e.get("pruned") == [6] for e in new.kind("checkpoint")), new.kind("checkpoint")
    # The stream went on from the old job's cursor with the new batch: no sample skipped or repeated.
    cursor = read_data_record(old_job.job.checkpoints, 6)["consumed_samples"]  # type: ignore[index]
    assert cursor == 6 * GBS
    assert read_data_record(job.checkpoints, 8)["consumed_samples"] == cursor + 2 * 2 * GBS  # type: ignore[index]
    assert read_data_record(job.checkpoints, 9)["consumed_samples"] == cursor + 3 * 2 * GBS  # type: ignore[index]
    # Its pruned copy was the new job's own link: the old job's checkpoint is whole.
    assert _digest(old_job.job.checkpoints) == before
    assert latest_complete(old_job.job.checkpoints, keys) == 6


def test_bad_checkpoints_to_start_from_are_refused_by_name_leaving_no_job(
        tmp_path: Path, templates_cache: Path, old_job: JobRun) -> None:
    before = _digest(old_job.job.checkpoints)
    old = old_job.job.checkpoints
    keys = old_job.spec().model.keys()

    def refused(error: type[Exception], match: str, path: Path, **changes: Any) -> None:
        with pytest.raises(error, match=match):
            _prepare(tmp_path, _recipe(**changes), templates_cache, path)
        assert not list((tmp_path / "jobs").glob("*")), "a refused job left its folder"

    refused(CheckpointError, "does not exist", tmp_path / "nowhere")
    refused(CheckpointError, "holds no step<S> checkpoint folder", tmp_path)
    incomplete = tmp_path / "incomplete" / "step3"
    incomplete.mkdir(parents=True)
    for p in step_dir(old, 3).iterdir():
        if p.name != f"{keys[2]}.safetensors":
            (incomplete / p.name).write_bytes(p.read_bytes())
    refused(CheckpointError, rf"incomplete checkpoint: 1 of {len(keys)} layer files missing \({keys[2]}", incomplete)
    refused(CheckpointError, "no such file|incomplete checkpoint", incomplete.parent)
    refused(CheckpointError, r"param\.\S+ is \(.*\) in the checkpoint, \(.*\) in the recipe's model",
            step_dir(old, 3), model={"d_model": 32})
    refused(CheckpointError, "that the recipe's model .* does not have: a checkpoint of another model",
            step_dir(old, 3), model={"n_layer": 2})
    refused(DataChangedError, "data.seed was 0, is 1", step_dir(old, 3), training={"seed": 1})
    refused(CheckpointError, "nothing is left to train", step_dir(old, 6))
    assert _digest(old) == before


def test_the_command_says_what_is_wrong_without_a_traceback(tmp_path: Path, templates_cache: Path,
                                                            old_job: JobRun) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(model={"d_model": 32}), sort_keys=False))  # --resume-from: the alias
    done = subprocess.run(
        [sys.executable, "-m", "oobleck_slurm", "submit", str(recipe), "--resume-from", str(old_job.job.path),
         "--detach", "--cache", str(templates_cache), "--estimate", "A100-40", "--job-root", str(tmp_path / "jobs")],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_BAD_INPUT, done.stderr
    assert "Traceback" not in done.stderr and "a checkpoint of another model" in done.stderr, done.stderr
    assert str(step_dir(old_job.job.checkpoints, 6)) in done.stderr
    assert not (tmp_path / "jobs").exists() or not list((tmp_path / "jobs").iterdir())


def test_the_recipe_key_names_the_checkpoint_relative_to_the_recipe(tmp_path: Path, templates_cache: Path,
                                                                    old_job: JobRun) -> None:
    link = tmp_path / "old"
    link.symlink_to(old_job.job.path)
    recipe = _recipe(steps=8, fault_tolerance={"resume_from": "old/checkpoints/step3"})
    job = _prepare(tmp_path, recipe, templates_cache, None)
    assert job.meta()["resumed_from"]["step"] == 3
    assert latest_complete(job.checkpoints, old_job.spec().model.keys()) == 3
    assert json.loads((step_dir(job.checkpoints, 3) / DATA_FILE).read_text())["consumed_samples"] == 3 * GBS


# ---- retention and the writer, without a job ----------------------------------------------------------

def _write(root: Path, step: int, keys: list[str]) -> None:
    for key in keys:
        save_layer(root, step, key, {"param.w": torch.full((2,), float(step))})


def test_retention_deletes_older_checkpoints_only_after_a_newer_one_is_complete(tmp_path: Path) -> None:
    keys = ["a", "b"]
    _write(tmp_path, 1, keys)
    _write(tmp_path, 2, keys)
    _write(tmp_path, 3, ["a"])  # being written (or failed): not complete
    assert prune(tmp_path, keys, 0) == []  # 0 keeps every one
    assert prune(tmp_path, keys, 1) == [1]  # step 2 is the newest complete: kept, and step 3 is newer
    assert prune(tmp_path, keys, 1) == []
    assert latest_complete(tmp_path, keys) == 2 and step_dir(tmp_path, 3).is_dir()
    _write(tmp_path, 4, ["a"])
    _write(tmp_path, 3, ["b"])  # step 3 complete: 2 goes; 4 is newer than it, still being written
    assert prune(tmp_path, keys, 1) == [2]
    _write(tmp_path, 5, keys)  # the half-written 4 is older than the newest complete: nothing completes it
    assert prune(tmp_path, keys, 2, protect={3}) == [4]
    assert sorted(int(d.name[4:]) for d in tmp_path.iterdir()) == [3, 5]
    assert prune(tmp_path, keys, 1, protect={3}) == []  # being loaded: stays
    assert prune(tmp_path, keys, 1) == [3]


def test_a_failed_write_is_reported_once_per_step_and_the_next_step_is_written(tmp_path: Path) -> None:
    reported: list[tuple[int, str]] = []
    step_dir(tmp_path, 2).parent.mkdir(exist_ok=True)
    step_dir(tmp_path, 2).write_text("a file where the step folder should go")
    writer = CheckpointWriter(tmp_path, on_error=lambda step, err: reported.append((step, type(err).__name__)))
    for step in (2, 3):
        for key in ("a", "b"):
            writer.submit(step, key, {"param.w": torch.zeros(2)})
    writer.flush([3])  # step 3 was written: no error for it
    assert reported == [(2, "FileExistsError")] and writer.failures == 1
    assert layer_file(tmp_path, 3, "b").is_file() and latest_complete(tmp_path, ["a", "b"]) == 3
    assert (2, "a") not in writer.submitted  # a recovery resuming at step 2 would write it again
    with pytest.raises(CheckpointError, match="step 2 .* failed: FileExistsError"):
        writer.flush([2])


def test_checkpoint_writes_are_spread_over_the_pipelines_one_writer_per_layer() -> None:
    plan = make_plan(6, [[0, 6], [0, 3, 6], [0, 2, 4, 6]], [2, 2, 2])  # ranks 0 | 1 2 | 3 4 5
    writes = {}
    for rank in range(6):
        p = plan.role(rank)
        assert p is not None
        worker = SimpleNamespace(plan=plan, rank=rank, layers=dict.fromkeys(p.layers))
        writes[rank] = ElasticWorker._writes(worker)  # type: ignore[arg-type]
    by_layer = sorted(i for layers in writes.values() for i in layers)
    assert by_layer == list(range(6))  # every layer once
    assert writes == {0: [0, 3], 1: [1], 2: [4], 3: [], 4: [2], 5: [5]}  # layer i by pipeline i mod 3
