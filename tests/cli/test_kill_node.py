"""`kill-node JOB supervisor --how process|freeze|node`: acts on the primary supervisor named by the
job folder's lease (a real process here, standing in for the supervisor), and refuses clearly what it
cannot do."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from oobleck_slurm.cli import main
from oobleck_slurm.cluster.jobdir import JobDir, create_job_dir
from oobleck_slurm.recipe import load_recipe


def job_with_primary(tmp_path: Path, backend: str = "local") -> tuple[JobDir, subprocess.Popen]:
    """A job folder whose lease names a live process on this machine as its primary supervisor."""
    job = create_job_dir(load_recipe(), tmp_path / "jobs")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    job.supervisor_lease.write_text(json.dumps({"epoch": 1, "pid": proc.pid, "host": socket.gethostname(),
                                                "t": time.time(), "done": False}))
    job.update_meta(backend=backend)
    return job, proc


def wait_status(proc: subprocess.Popen, status: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while psutil.Process(proc.pid).status() != status:
        assert time.monotonic() < deadline, f"pid {proc.pid} not {status} after {timeout}s"
        time.sleep(0.02)


@pytest.fixture
def primary(tmp_path: Path):
    job, proc = job_with_primary(tmp_path)
    yield job, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_freeze_stops_the_local_primary(primary, capsys: pytest.CaptureFixture[str]) -> None:
    job, proc = primary
    assert main(["kill-node", str(job.path), "supervisor", "--how", "freeze"]) == 0
    wait_status(proc, psutil.STATUS_STOPPED)
    assert f"pid {proc.pid}" in capsys.readouterr().out


def test_process_kills_the_local_primary(primary) -> None:
    job, proc = primary
    assert main(["kill-node", str(job.path), "supervisor", "--how", "process"]) == 0
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_node_is_refused_on_the_local_backend(primary, capsys: pytest.CaptureFixture[str]) -> None:
    job, proc = primary
    assert main(["kill-node", str(job.path), "supervisor", "--how", "node"]) != 0
    assert "no node of its own" in capsys.readouterr().err
    assert proc.poll() is None


def test_a_node_kind_of_fault_is_refused_for_the_supervisor(primary, capsys: pytest.CaptureFixture[str]) -> None:
    job, proc = primary
    assert main(["kill-node", str(job.path), "supervisor", "--how", "hang"]) != 0
    assert "process, node, freeze" in capsys.readouterr().err
    assert proc.poll() is None


def test_slurm_supervisor_without_a_standby_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job, proc = job_with_primary(tmp_path, backend="slurm")
    try:
        assert main(["kill-node", str(job.path), "supervisor", "--how", "process"]) != 0
        assert "cluster.supervisor.failover" in capsys.readouterr().err
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_no_live_lease_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = create_job_dir(load_recipe(), tmp_path / "jobs")
    job.update_meta(backend="local")
    assert main(["kill-node", str(job.path), "supervisor", "--how", "freeze"]) != 0
    assert "no running supervisor" in capsys.readouterr().err
