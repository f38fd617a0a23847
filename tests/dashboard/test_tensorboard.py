"""The job's metrics as TensorBoard scalars (dashboard/tensorboard.py), read back with TensorBoard's own
reader from the files the exporter writes for a recorded run with a failure and its recovery."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from oobleck_slurm.dashboard.tensorboard import TensorBoardExporter, TensorBoardUnavailable  # noqa: E402
from oobleck_slurm.protocol.events import read_events  # noqa: E402

LOGS = Path(__file__).parent / "logs"


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_run_with_a_failure_reads_back_in_tensorboard(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    shutil.copy(LOGS / "failure.jsonl", events)
    exporter = TensorBoardExporter(events, tmp_path / "tb")
    assert exporter.export() == len(read_events(events))
    exporter.close()
    got = scalars(tmp_path / "tb")
    steps = read_events(events, "step")
    assert [s for s, _ in got["train/loss"]] == [e["step"] for e in steps]
    assert [v for _, v in got["train/loss"]] == pytest.approx([e["loss"] for e in steps])
    resumed = read_events(events, "resumed")
    assert got["recovery/seconds"] == [(e["step"], pytest.approx(e["total_seconds"])) for e in resumed]
    assert got["recovery/nodes_lost"] and got["cluster/pipelines"][0] == (0, len(read_events(events, "plan")[0]["pipelines"]))


def test_skipped_steps_are_a_series_per_reason_beside_the_spike_bar(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    steps = [{"kind": "step", "t": 1.0 + s, "step": s, "loss": 2.0, "loss_threshold": 3.0} for s in range(4)]
    steps[1].update(loss=9.0, skipped=True, skip_reason="loss_spike")
    steps[2].update(loss=float("nan"), skipped=True, skip_reason="non_finite")
    events.write_text("".join(json.dumps(e) + "\n" for e in steps))
    exporter = TensorBoardExporter(events, tmp_path / "tb")
    exporter.export()
    exporter.close()
    got = scalars(tmp_path / "tb")
    assert got["train/skipped/loss_spike"] == [(1, 1.0)] and got["train/skipped/non_finite"] == [(2, 1.0)]
    assert got["train/loss_threshold"] == [(s, 3.0) for s in range(4)]


def test_it_goes_on_where_it_stopped_and_never_writes_twice(tmp_path: Path) -> None:
    lines = (LOGS / "healthy.jsonl").read_text().splitlines(keepends=True)
    events = tmp_path / "events.jsonl"
    half = len(lines) // 2
    events.write_text("".join(lines[:half]) + lines[half][:10])  # a record being written
    first = TensorBoardExporter(events, tmp_path / "tb")
    assert first.export() == half
    first.close()
    with events.open("a") as f:  # the record completes, the run goes on
        f.write("".join([lines[half][10:], *lines[half + 1:]]))
    second = TensorBoardExporter(events, tmp_path / "tb")  # e.g. the supervisor that took over
    assert second.export() == len(lines) - half
    second.close()
    third = TensorBoardExporter(events, tmp_path / "tb")  # `report --tensorboard` again: nothing new
    assert third.export() == 0
    third.close()
    steps = [json.loads(line)["step"] for line in lines if '"kind":"step"' in line]
    assert [s for s, _ in scalars(tmp_path / "tb")["train/loss"]] == steps


def test_without_the_tensorboard_package_the_error_says_what_to_install(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(TensorBoardUnavailable, match="logging.tensorboard.*pip install"):
        TensorBoardExporter(tmp_path / "events.jsonl", tmp_path / "tb")


def test_report_tensorboard_writes_the_job_s_scalars_beside_it(job_dir, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from test_report import run_command

    from oobleck_slurm.commands import report as report_command

    job = job_dir("join")
    argv = ["report", str(job), "--out", str(tmp_path / "out"), "--tensorboard"]
    assert run_command(report_command, argv) == 0
    got = scalars(job / "tensorboard")
    assert len(got["train/loss"]) == len(read_events(job / "events.jsonl", "step"))
    assert run_command(report_command, argv) == 0  # again: nothing written twice
    assert len(scalars(job / "tensorboard")["train/loss"]) == len(got["train/loss"])


@pytest.mark.slow
def test_a_job_with_logging_tensorboard_writes_its_scalars_while_it_runs(tmp_path: Path, templates_cache: Path) -> None:
    from jobrun import run_job, tiny_recipe

    recipe = tiny_recipe(steps=6)
    recipe["logging"] = {"tensorboard": True}
    recipe["drills"] = [{"step": 3, "node": "node2", "how": "worker"}]
    run = run_job(tmp_path, recipe, templates_cache)
    got = scalars(run.job.tensorboard)
    assert [s for s, _ in got["train/loss"]] == [e["step"] for e in run.kind("step")]
    assert [s for s, _ in got["recovery/seconds"]] == [e["step"] for e in run.kind("resumed")]


def test_a_recipe_asking_for_tensorboard_without_the_package_is_refused(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from oobleck_slurm.recipe import RecipeError, load_recipe

    path = tmp_path / "r.yaml"
    path.write_text("logging: {tensorboard: true}\n")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(RecipeError, match=r"logging\.tensorboard.*not installed"):
        load_recipe(path)
