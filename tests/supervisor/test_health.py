"""The join health check: the real `python -m oobleck_slurm.supervisor.health` process all-reduces with
the supervisor's side (`health_peer`) over a real TCPStore; without a peer it fails with a message."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys

import torch.distributed as dist

from oobleck_slurm.supervisor.health import health_peer


def check_process(port: int, prefix: str, timeout_s: float) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "oobleck_slurm.supervisor.health", "127.0.0.1", str(port),
                             prefix, str(timeout_s)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_node_that_can_all_reduce_passes() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
    node = check_process(store.port, "health/node1/1", 60.0)
    assert health_peer(store, "health/node1/1", 60.0)
    out, _ = node.communicate(timeout=60)
    assert node.returncode == 0 and out.strip() == "ok", out


def test_a_node_without_its_peer_fails_with_the_reason() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
    node = check_process(store.port, "health/node2/1", 2.0)
    out, _ = node.communicate(timeout=60)
    assert node.returncode == 1 and "health check failed: " in out, out  # after c10d's own warnings
