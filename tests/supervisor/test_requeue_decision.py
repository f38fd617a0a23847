"""`SupervisorJob.checkpoint` (what submitit's USR2 handler calls): a job that is over or cannot go on
is not requeued; otherwise the folder is marked and the same callable comes back for submitit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import submitit

from oobleck_slurm.cluster.jobdir import CANCEL_MARKER, REQUEUE_MARKER
from oobleck_slurm.supervisor.main import SupervisorJob


def job_dir(tmp_path: Path, status: str | None) -> Path:
    (tmp_path / "meta.json").write_text(json.dumps({"status": status} if status else {}))
    return tmp_path


@pytest.mark.parametrize("status", ["unrecoverable", "completed", "cancelled"])
def test_not_requeued_when_over(tmp_path: Path, status: str) -> None:
    assert SupervisorJob(str(job_dir(tmp_path, status))).checkpoint() is None
    assert not (tmp_path / REQUEUE_MARKER).exists()


def test_not_requeued_when_cancel_marked(tmp_path: Path) -> None:
    (job_dir(tmp_path, None) / CANCEL_MARKER).write_text("x")
    assert SupervisorJob(str(tmp_path)).checkpoint() is None


def test_requeued_while_running(tmp_path: Path) -> None:
    again = SupervisorJob(str(job_dir(tmp_path, "running"))).checkpoint()
    assert isinstance(again, submitit.helpers.DelayedSubmission)
    assert isinstance(again.function, SupervisorJob) and again.function.job_dir == str(tmp_path)
    assert (tmp_path / REQUEUE_MARKER).exists()
