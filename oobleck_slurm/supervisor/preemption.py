"""A preemption or time-limit notice, between the thread that receives it and the coordinator.

Slurm sends the notice as SIGUSR2 (submitit's `--signal=USR2@90`, or `scancel --signal=USR2 JOB`).
Without `B:` it reaches the job's steps, not the batch script: the node agents receive it and relay a
`preempt` message; the supervisor then signals itself so that submitit's handler (which requeues)
runs in its main thread. That handler calls `SupervisorJob.checkpoint`, which sets `requested` and
waits for the coordinator: at its next loop it stops every worker at a step boundary, has them write
an on-demand checkpoint of that step, and sets `step` and `finished`. How long that may take is the
job's `checkpoint_timeout` (timeouts.py: 60 s, submitit signals 90 s ahead).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Preemption:
    requested: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    step: int | None = None  # the checkpointed step, once finished (None: no checkpoint was written)
    signal: str | None = None  # the notice's: SIGUSR2 (time limit: the job requeues itself) or SIGTERM

    def notice(self, signal_name: str) -> None:
        """An agent relayed Slurm's notice: checkpoint at the next step boundary."""
        self.signal = signal_name
        self.requested.set()
