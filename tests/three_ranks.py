"""Three workers as threads of the test's process, on real gloo groups (engine/abort.py generations): one
3-stage pipeline, then a re-plan at step REPLAN_AT to a 1-stage pipeline (rank 0) and a 2-stage one
(ranks 1, 2), the layers copied from memory. For a 6-layer model (the tiny presets). Used by
tests/engine/test_prefetch.py (the middle rank reads nothing) and test_document_mask.py (it reads)."""

from __future__ import annotations

import datetime as dt
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from exec_plans import make_plan

from oobleck_slurm.engine.abort import AbortableGeneration
from oobleck_slurm.engine.spec import JobSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.timeouts import JobTimeouts

HANG_S = 30.0  # a take or a stop that has not returned by then hangs
TIMEOUTS = JobTimeouts(collective_timeout=60.0, step_timeout=300.0)  # nothing here should time out
FIRST = make_plan(6, [[0, 2, 4, 6]], [8])
SECOND = make_plan(6, [[0, 6], [0, 3, 6]], [3, 5])
MOVES = [(2, 1, 0), (3, 1, 0), (4, 2, 0), (5, 2, 0), (0, 0, 1), (1, 0, 1), (3, 1, 2)]
REPLAN_AT = 3


@dataclass
class ThreeRanks:
    losses: list[float] = field(default_factory=list)  # per step (rank 0's report)
    waits: list[float] = field(default_factory=list)  # data_s per step
    readers: dict[int, tuple[int, int, bool]] = field(default_factory=dict)  # per rank: the second plan's
    # reader's (hits, misses, thread ended)
    middle_reads: int = -1  # the takes of the first plan's middle rank (rank 1)


def train_three_ranks(job: JobSpec) -> ThreeRanks:
    """Train `job` (8 microbatches a step) through the two plans; what the ranks reported."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))
    out = ThreeRanks()
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=dt.timedelta(seconds=30))
            worker = Worker(job, r)
            worker.adopt(FIRST, AbortableGeneration(client, 0, r, 3, FIRST, TIMEOUTS))
            for step in range(job.train.steps):
                if step == REPLAN_AT:
                    if r == 1:
                        out.middle_reads = worker.reads.hits + worker.reads.misses
                    worker.adopt(SECOND, AbortableGeneration(client, 1, r, 3, SECOND, TIMEOUTS), "memory", MOVES)
                result = worker.train_step()
                if r == 0:
                    out.losses.append(result.loss)
                    out.waits.append(result.data_s)
            reads = worker.reads
            worker.stop_reads(HANG_S)
            out.readers[r] = (reads.hits, reads.misses, not reads.running)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return out
