"""The W&B logger (dashboard/wandb_logger.py) against wandb's offline mode (no network): the files it
writes are read back (wandb_files.py) and compared with the job's events."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("wandb")
from wandb_files import history, offline_runs  # noqa: E402

from oobleck_slurm.dashboard.wandb_logger import RUN_ID_FILE, STEP_METRIC, WandbExporter  # noqa: E402
from oobleck_slurm.protocol.events import read_events  # noqa: E402

LOGS = Path(__file__).parent / "logs"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_two_supervisors_of_one_job_log_one_run_with_every_step_once(tmp_path: Path) -> None:
    # a requeue or a takeover: a second supervisor follows the log on from where the first stopped
    lines = (LOGS / "failure.jsonl").read_text().splitlines(keepends=True)
    events = tmp_path / "events.jsonl"
    half = len(lines) // 2
    events.write_text("".join(lines[:half]))
    first = WandbExporter(events, tmp_path / "wandb", project="t", mode="offline", config={"name": "t"})
    assert first.export() == half
    first.close()
    with events.open("a") as f:
        f.write("".join(lines[half:]))
    second = WandbExporter(events, tmp_path / "wandb", project="t", mode="offline")
    assert second.run_id == first.run_id == (tmp_path / "wandb" / RUN_ID_FILE).read_text()
    assert second.export() == len(lines) - half
    second.close()

    runs = offline_runs(tmp_path / "wandb")
    assert len(runs) == 2 and all(p.name == f"run-{first.run_id}.wandb" for p in runs)  # one run, resumed
    logged = [row for p in runs for row in history(p) if "train/loss" in row]
    steps = read_events(events, "step")
    assert [row[STEP_METRIC] for row in logged] == [e["step"] for e in steps]  # each once, replays included
    assert [row["train/loss"] for row in logged] == pytest.approx([e["loss"] for e in steps])
    resumed = [row for p in runs for row in history(p) if "recovery/seconds" in row]
    assert [row[STEP_METRIC] for row in resumed] == [e["step"] for e in read_events(events, "resumed")]


def test_a_recipe_asking_for_wandb_without_the_package_is_refused(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from oobleck_slurm.recipe import RecipeError, load_recipe

    path = tmp_path / "r.yaml"
    path.write_text("logging: {wandb: {project: p, mode: offline}}\n")
    assert load_recipe(path).logging.wandb is not None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(RecipeError, match=r"logging\.wandb.*not installed"):
        load_recipe(path)


@pytest.mark.slow
def test_a_job_keeps_one_run_across_a_supervisor_takeover(tmp_path: Path, templates_cache: Path) -> None:
    from job_events import wait_for
    from jobrun import run_job, tiny_recipe

    def kill_once_logging(job) -> None:  # noqa: ANN001 - a JobDir
        # W&B starts in the supervisor's metrics thread: once it logged, its supervisor is killed (kill -9)
        wait_for(job.path, "W&B logging", lambda ev: [e for e in ev if e["kind"] == "metrics_logger"])
        wait_for(job.path, "W&B logged steps", lambda ev: offline_runs(job.wandb) and history(offline_runs(job.wandb)[0]))
        subprocess.run([sys.executable, "-m", "oobleck_slurm", "kill-node", str(job.path), "supervisor"],
                       cwd=REPO, check=True, capture_output=True, timeout=60)

    recipe = tiny_recipe(steps=60)
    # a peak for the CPU (no table entry): MFU is reported as for a GPU
    recipe["logging"] = {"wandb": {"project": "t", "mode": "offline"}, "peak_tflops": 0.01}
    run = run_job(tmp_path, recipe, templates_cache, alongside=kill_once_logging)
    assert run.kind("takeover")
    started = [e for e in run.kind("metrics_logger") if e["logger"] == "wandb"]
    assert len(started) == 2 and started[0]["run_id"] == started[1]["run_id"] and "error" not in started[1]
    runs = offline_runs(run.job.wandb)
    assert len(runs) == 2 and all(p.name == f"run-{started[0]['run_id']}.wandb" for p in runs)
    first, second = ({row[STEP_METRIC] for row in history(p) if "train/loss" in row} for p in runs)
    assert first and second  # each supervisor logged
    logged = {row[STEP_METRIC]: row for p in runs for row in history(p) if "train/loss" in row}
    steps = {e["step"]: e for e in run.kind("step")}
    # the killed supervisor's last records may be logged again by its successor, never left out
    assert set(logged) == set(steps) == set(range(60))
    for step, e in steps.items():
        assert e["devices"] == 4 and e["tokens_per_s"] == pytest.approx(16 * 64 / e["seconds"])
        assert e["mfu"] == pytest.approx(e["tflops_per_device"] / 0.01)
        assert logged[step]["train/tokens_per_s_per_device"] == pytest.approx(e["tokens_per_s_per_device"])
        assert logged[step]["train/mfu"] == pytest.approx(e["mfu"])
