"""The join health check: the real `python -m oobleck_slurm.agent.preflight` process all-reduces with
the supervisor's side (`health_peer`) over a real TCPStore, both signed with the job folder's secret;
without a peer, or with another job's secret, it fails with a message."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from oobleck_slurm.agent.preflight import health_peer
from oobleck_slurm.cluster.jobdir import create_secret
from oobleck_slurm.protocol.signed_store import SignedStore


def check_process(port: int, prefix: str, timeout_s: float, job_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "oobleck_slurm.agent.preflight", "127.0.0.1", str(port),
                             prefix, str(timeout_s), str(job_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def signed_server(job_dir: Path) -> SignedStore:
    """The supervisor's store, signed with `job_dir`'s (new) secret."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
    return SignedStore.with_secret(server, create_secret(job_dir))


def test_a_node_that_can_all_reduce_passes(tmp_path: Path) -> None:
    store = signed_server(tmp_path)
    node = check_process(store.port, "health/node1/1", 60.0, tmp_path)
    assert health_peer(store, "health/node1/1", 60.0)
    out, _ = node.communicate(timeout=60)
    assert node.returncode == 0 and out.strip() == "ok", out


def test_a_node_without_its_peer_fails_with_the_reason(tmp_path: Path) -> None:
    store = signed_server(tmp_path)
    node = check_process(store.port, "health/node2/1", 2.0, tmp_path)
    out, _ = node.communicate(timeout=60)
    assert node.returncode == 1 and "health check failed: " in out, out  # after c10d's own warnings


def test_a_node_with_another_jobs_secret_cannot_join_the_collective(tmp_path: Path) -> None:
    store = signed_server(tmp_path / "job")
    create_secret(tmp_path / "other")  # the check's side signs with another secret: it never meets its peer
    node = check_process(store.port, "health/node3/1", 3.0, tmp_path / "other")
    out, _ = node.communicate(timeout=60)
    assert node.returncode == 1 and "health check failed: " in out, out
