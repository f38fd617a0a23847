"""Failure detection as pure logic: the supervisor feeds observations, these decide.

    lease       heartbeat leases: a member not heard from within its lease is lost
    progress    step progress: a worker whose step does not advance within the step timeout is hung
    minder      Minder-style faulty-machine detection from monitoring metrics (peer distance over time)
    straggler   MegaScale-style straggler detection from compute-only segment timings

Nothing here reads clocks, sockets or files: callers pass `now` and the observations.
"""

from oobleck_slurm.detection.lease import LeaseTable
from oobleck_slurm.detection.minder import MinderDetector
from oobleck_slurm.detection.progress import ProgressWatch
from oobleck_slurm.detection.straggler import find_stragglers

__all__ = ["LeaseTable", "MinderDetector", "ProgressWatch", "find_stragglers"]
