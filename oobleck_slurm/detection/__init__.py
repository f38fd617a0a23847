"""Failure detection as pure logic: the supervisor feeds observations, these decide.

    lease       heartbeat leases: a member not heard from within its lease is lost
    progress    step progress: a worker whose step does not advance within the step timeout is hung
    minder      Minder-style faulty-machine detection from monitoring metrics (peers, over time)
    straggler   MegaScale-style straggler detection from compute-only segment timings
    health      what to do about a flagged machine or a straggler: evict, report, rebalance
    metrics     the per-node metrics sampler (psutil, NVML), the job's processes' CPU and memory,
                and the job folder's metrics.csv store

Apart from `metrics` (which reads the machine's counters and files), nothing here reads clocks,
sockets or files: callers pass `now`/`t` and the observations.
"""

from oobleck_slurm.detection.lease import LeaseTable
from oobleck_slurm.detection.metrics import (
    HEADER,
    MetricsFileError,
    MetricsSampler,
    MetricsWriter,
    ProcessMetrics,
    bucket,
    metrics_files,
    read_metrics,
)
from oobleck_slurm.detection.minder import DetectorConfig, Flag, MinderDetector, detect
from oobleck_slurm.detection.progress import ProgressWatch
from oobleck_slurm.detection.straggler import Straggler, StragglerWatch, find_stragglers

__all__ = [
    "HEADER", "DetectorConfig", "Flag", "LeaseTable", "MetricsFileError", "MetricsSampler", "MetricsWriter",
    "MinderDetector", "ProcessMetrics", "ProgressWatch", "Straggler", "StragglerWatch", "bucket", "detect",
    "find_stragglers", "metrics_files", "read_metrics",
]
