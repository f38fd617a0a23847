"""`cancel` of a local job stops its processes and records it: a `job_finished` event with status
cancelled, the status in meta.json, and `status` says cancelled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from oobleck_slurm.cli import main
from oobleck_slurm.cluster.jobdir import create_job_dir
from oobleck_slurm.commands.cancel import _group_alive
from oobleck_slurm.protocol.events import EventLog, events_path, read_events
from oobleck_slurm.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0  # profiling, templates and process start on a loaded two-core machine


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.2)


def status_of(capsys: pytest.CaptureFixture[str], job: Path) -> dict:
    assert main(["status", str(job), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def fake_job(tmp_path: Path) -> tuple[Path, subprocess.Popen]:
    """A job folder whose 'supervisor' is a sleeping process in its own session, named after the
    folder as the real one is (so that cancel knows it for this job's)."""
    job = create_job_dir(load_recipe(), tmp_path / "jobs")
    proc = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(120)", str(job.path)],
                            start_new_session=True)
    job.update_meta(pid=proc.pid)
    with EventLog(events_path(job.path)) as log:
        log.emit("job_started", job_id=job.job_id, backend="local")
    return job.path, proc


def test_cancel_records_a_running_local_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job, proc = fake_job(tmp_path)
    assert status_of(capsys, job)["state"] == "running"
    assert main(["cancel", str(job)]) == 0
    assert "recorded as cancelled" in capsys.readouterr().out
    assert proc.wait(timeout=10) != 0
    (finished,) = read_events(events_path(job), "job_finished")
    assert finished["status"] == "cancelled" and finished["recorded_by"] == "cancel"
    assert json.loads((job / "meta.json").read_text())["status"] == "cancelled"
    assert (job / "cancelled").is_file()
    assert status_of(capsys, job)["state"] == "cancelled"


def test_cancel_of_a_job_that_is_gone_records_it_without_signalling(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    job, proc = fake_job(tmp_path)
    proc.kill()
    proc.wait()
    assert main(["cancel", str(job)]) == 0
    assert "was not running" in capsys.readouterr().out
    (finished,) = read_events(events_path(job), "job_finished")
    assert finished["status"] == "cancelled" and "ended unrecorded" in finished["error"]


def test_cancel_never_signals_a_reused_pid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """meta.json's pid names another program now (the job ended long ago): it is left alone."""
    job = create_job_dir(load_recipe(), tmp_path / "jobs")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        job.update_meta(pid=other.pid)
        assert main(["cancel", str(job.path)]) == 0
        assert other.poll() is None, "cancel signalled a process that is not the job's"
        assert read_events(events_path(job.path), "job_finished")[0]["status"] == "cancelled"
    finally:
        other.kill()
        other.wait()


def test_cancel_of_a_finished_job_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job, proc = fake_job(tmp_path)
    with EventLog(events_path(job)) as log:
        log.emit("job_finished", status="completed", exit_code=0)
    try:
        assert main(["cancel", str(job)]) == 0
        assert "already finished (completed)" in capsys.readouterr().out
        assert proc.poll() is None
        assert [e["status"] for e in read_events(events_path(job), "job_finished")] == ["completed"]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_cancel_a_real_local_job(tmp_path: Path, templates_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "long.yaml"
    recipe.write_text(f"extends: {REPO / 'recipes' / 'local-tiny.yaml'}\ntraining:\n  steps: 100000\n")
    submitted = subprocess.run(
        [sys.executable, "-m", "oobleck_slurm", "submit", str(recipe), "--detach", "--no-dashboard",
         "--job-root", str(tmp_path / "jobs"), "--cache", str(templates_cache)], cwd=tmp_path, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    (job,) = (tmp_path / "jobs").iterdir()
    pid = json.loads((job / "meta.json").read_text())["pid"]
    try:
        wait_for(lambda: bool(read_events(events_path(job), "step")), START_TIMEOUT_S, "the first step")
        assert status_of(capsys, job)["state"] == "running"
        assert main(["cancel", str(job)]) == 0
        capsys.readouterr()
        wait_for(lambda: not _group_alive(pid), 30, "the job's processes to end")
        finished = read_events(events_path(job), "job_finished")
        assert [e["status"] for e in finished] == ["cancelled"], finished
        assert json.loads((job / "meta.json").read_text())["status"] == "cancelled"
        assert status_of(capsys, job)["state"] == "cancelled"
    finally:
        for proc in psutil.process_iter():  # never leave a training job behind, whatever failed
            try:
                if os.getpgid(proc.pid) == pid:
                    proc.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
