"""The supervisor's lease and epochs (cluster/lease.py): one claimant wins an epoch, the highest
epoch is the current one, and a lease lapses by age or, on one machine, by its process's death."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from oobleck_slurm.cluster.jobdir import JobDir
from oobleck_slurm.cluster.lease import LeaseRecord, claim_epoch, current_epoch, primary_gone, read_lease, renew


def test_one_claimant_wins_each_epoch(tmp_path: Path) -> None:
    job = JobDir(tmp_path, "j")
    assert current_epoch(job) == 0
    with ThreadPoolExecutor(8) as pool:
        wins = list(pool.map(lambda _: claim_epoch(job, 1), range(8)))
    assert wins.count(True) == 1
    assert claim_epoch(job, 2) and current_epoch(job) == 2


def test_a_lease_reads_back_and_lapses_by_age(tmp_path: Path) -> None:
    job = JobDir(tmp_path, "j")
    assert read_lease(job) is None and not primary_gone(None, 3.0, time.time(), True)
    renew(job, 4)
    lease = read_lease(job)
    assert lease is not None and (lease.epoch, lease.pid) == (4, os.getpid())
    assert not primary_gone(lease, 3.0, lease.t + 1.0, same_machine=True)
    assert primary_gone(lease, 3.0, lease.t + 3.5, same_machine=False)


def test_a_dead_primary_on_this_machine_is_seen_at_once(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = LeaseRecord(epoch=1, pid=int(done.stdout), host=socket.gethostname(), t=time.time())
    assert primary_gone(dead, 3.0, dead.t, same_machine=True)
    assert not primary_gone(dead, 3.0, dead.t, same_machine=False)  # across machines only the age counts
