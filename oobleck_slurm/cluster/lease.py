"""The supervisor's lease and epochs: which supervisor process is the job's primary, through the job folder.

The primary holds epoch e (a fencing token: 1 for the first supervisor) and renews `supervisor.lease`
(its epoch, pid, host and the time) every heartbeat interval. A standby watches the lease; when it is
older than the heartbeat lease (or, on one machine, the primary's process is gone), the standby
claims epoch e + 1 by creating `epoch.<e+1>` exclusively (two claimants cannot both win) and becomes
the primary. A supervisor that finds a higher epoch than its own has been replaced and must exit:
agents and workers follow the highest epoch only.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass

from oobleck_slurm.cluster import durable
from oobleck_slurm.cluster.jobdir import JobDir

EPOCH_PREFIX = "epoch."


@dataclass(frozen=True)
class LeaseRecord:
    epoch: int
    pid: int
    host: str
    t: float
    done: bool = False  # the primary ended the job itself: nothing to take over


def current_epoch(job: JobDir) -> int:
    """The highest epoch claimed so far (0 before any supervisor started)."""
    found = [int(p.name[len(EPOCH_PREFIX):]) for p in job.path.glob(f"{EPOCH_PREFIX}*")
             if p.name[len(EPOCH_PREFIX):].isdigit()]
    return max(found, default=0)


def epoch_claimed(job: JobDir, epoch: int) -> bool:
    return (job.path / f"{EPOCH_PREFIX}{epoch}").exists()


def claim_epoch(job: JobDir, epoch: int) -> bool:
    """Claim `epoch` for this process; False when another process claimed it first."""
    try:
        fd = os.open(job.path / f"{EPOCH_PREFIX}{epoch}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "t": time.time()}))
        f.flush()
        os.fsync(f.fileno())
    durable.fsync_dir(job.path)  # the claim survives a crash: a rebooted folder never forgets an epoch
    return True


def renew(job: JobDir, epoch: int, done: bool = False) -> None:
    """Write this primary's lease (whole: a reader sees the old one or the new one); `done` when the
    job ended under it (its standby then leaves). Durable (cluster/durable.py): a standby on another
    node reads it through the shared file system."""
    durable.write_json(job.supervisor_lease, {"epoch": epoch, "pid": os.getpid(), "host": socket.gethostname(),
                                              "t": time.time(), "done": done})


def read_lease(job: JobDir, opener: durable.Opener = open) -> LeaseRecord | None:
    """The primary's lease, or None when there is none to judge: not written yet, or unreadable (empty,
    truncated, not a lease: only a crash of an older version or of the disk leaves one, and a live
    primary rewrites it within a heartbeat interval). A standby must never die on it, nor take over
    because of it; an open that NFS reports stale is retried (durable.read_text)."""
    try:
        data = json.loads(durable.read_text(job.supervisor_lease, opener))
        return LeaseRecord(int(data["epoch"]), int(data["pid"]), str(data["host"]), float(data["t"]),
                           bool(data.get("done", False)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # AttributeError: JSON, not an object
        return None


def primary_gone(lease: LeaseRecord | None, lease_s: float, now: float, same_machine: bool) -> bool:
    """Whether the primary holding `lease` has lost it: the lease is older than `lease_s`, or (when it
    runs on this machine) its process is gone, which a kill -9 shows at once."""
    if lease is None or lease.done:
        return False  # no primary has started yet, or the job is over
    if now - lease.t > lease_s:
        return True
    if same_machine and lease.host == socket.gethostname():
        try:
            os.kill(lease.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
    return False


class PublishedEpoch:
    """The supervisor epoch published in one of the job folder's address files (supervisor.json for
    agents, elastic.json for workers), re-read only when the file changed (a stat per look).

    A frozen supervisor keeps its connections open: its agents and workers see no error, so they learn
    that a standby took over only from a higher epoch here."""

    def __init__(self, path: os.PathLike[str] | str) -> None:
        self.path = os.fspath(path)
        self._seen: tuple[int, int] | None = None
        self._epoch = 0

    def read(self) -> int:
        """The published epoch (0 while the file is missing or unreadable)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return self._epoch
        if (st.st_mtime_ns, st.st_size) != self._seen:
            try:
                with open(self.path) as f:
                    self._epoch = int(json.load(f).get("epoch", 1))
                self._seen = (st.st_mtime_ns, st.st_size)
            except (OSError, ValueError, TypeError, AttributeError):
                pass  # being replaced (written whole and renamed): read it at the next look
        return self._epoch
