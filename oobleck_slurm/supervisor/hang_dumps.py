"""On a hang verdict, every worker's stacks and flight recorder saved before the hung node is stopped.

Both verdicts go through `HangDumps.collect`: the node backend's (a worker stopped, or behind its
peers' step: supervisor/membership.py) and the coordinator's (a member that did not leave an aborted
generation within the step timeout: coordinator.py `_lose_hung`). The request goes through the job
folder (engine/requests.py): each worker's watcher thread dumps, also when its training thread is stuck
in a collective; a SIGSTOPped worker cannot, and is reported `missing` after `hang_dump_wait`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from oobleck_slurm.cluster.jobdir import DUMPS_DIR
from oobleck_slurm.engine.requests import request_dumps
from oobleck_slurm.protocol import keys
from oobleck_slurm.protocol.events import EventLog


class HangDumps:
    def __init__(self, job_dir: Path, log: EventLog, workers_per_node: int, wait: float) -> None:
        self.job_dir, self.log, self.workers_per_node, self.wait = job_dir, log, workers_per_node, wait

    def collect(self, hung: Sequence[str], members: Sequence[str], stopped: Sequence[str] = ()) -> None:
        """Ask every worker of `members` (the hung nodes among them) for its dumps; a `hang_dump` event
        says which came within the wait. The workers of `stopped` nodes (SIGSTOPped: they cannot answer)
        are not waited for."""
        workers = [w for n in members if n not in stopped for w in keys.node_workers(n, self.workers_per_node)]
        t0 = time.time()
        ident, done, missing = request_dumps(self.job_dir, f"hung: {', '.join(hung)}", workers, self.wait)
        missing += [w for n in stopped for w in keys.node_workers(n, self.workers_per_node)]
        self.log.emit("hang_dump", nodes=list(hung), folder=str(self.job_dir / DUMPS_DIR / str(ident)), dumped=done,
                      missing=missing, seconds=time.time() - t0)
