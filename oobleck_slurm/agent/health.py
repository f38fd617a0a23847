"""The node agent's part in detection (agent/main.py runs it): metrics sent to the supervisor, and
the drills that make a node slow or leak memory while it keeps working.

Metrics: every `interval` seconds the agent samples its node (detection/metrics.py: psutil, NVML) and
the job's processes on it (its own and its workers': `procs.cpu_pct`, `procs.rss_gib`), and sends
what it gathered about once a second, one control message per batch:

    {"type": "metrics", "node": <Slurm node>, "samples": [[t, metric, value], ...]}

The supervisor says what to sample in supervisor.json (`metrics`: interval, machine, gpus; absent
when `detection.enabled` is false). `machine: false` when the nodes are virtual nodes of one machine
(supervisor/main.py `nodes_share_a_machine`): its counters would compare the machine with itself; the
per-process metrics still tell the virtual nodes apart.

Drills (`kill-node --how slow|leak`, recipe `drills:`), until the node's workers are stopped:
    slow    the node keeps working, slower: its workers, and a health check it runs (a spare slowed
            before it joins fails its pre-flight check: docs/detection.md), are stopped with SIGSTOP
            for SLOW_STOP_S out of every SLOW_STOP_S + SLOW_RUN_S (a duty cycle: compute takes ~3x as
            long); on a node that runs nothing yet it waits until it does. The heartbeat
            reads the workers' states between two pauses: a slow node is slow, not stopped (a worker
            stopped for longer than the lease is a hang, and is named `hung`)
    leak    a metric-only fault: the agent allocates LEAK_MB_PER_S more memory every second, up to
            LEAK_CAP_MB (training is unaffected; the node's memory and its processes' RSS grow)
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from oobleck_slurm.detection.metrics import MetricsSampler, ProcessMetrics
from oobleck_slurm.protocol.messages import Metrics

METRICS_MESSAGE = "metrics"
SEND_EVERY_S = 1.0  # a batch at most this often: one small message per node per second
MAX_BATCH = 10_000  # values kept while sending fails (a slow supervisor): the oldest are dropped
SLOW_STOP_S = 0.06
SLOW_RUN_S = 0.03
LEAK_MB_PER_S = 32
LEAK_CAP_MB = 2048
DRILLS = ("slow", "leak")


def metrics_message(node: str, samples: list[tuple[float, str, float]]) -> Metrics:
    """The control message that carries a batch of samples (the one place it is built)."""
    return Metrics(node=node, samples=tuple((t, m, v) for t, m, v in samples))


class MetricsReporter:
    """Samples every `interval` s and sends batches with `send` (a thread; `stop()` ends it)."""

    def __init__(self, node: str, settings: dict[str, Any], send: Callable[[Metrics], None],
                 pids: Callable[[], list[int]]) -> None:
        self.node, self.send, self.pids = node, send, pids
        self.interval = float(settings.get("interval", 1.0))
        self.machine = MetricsSampler(gpus=bool(settings.get("gpus", False))) if settings.get("machine", True) else None
        self.processes = ProcessMetrics()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agent-metrics", daemon=True)

    def start(self) -> MetricsReporter:
        self._thread.start()
        return self

    def sample(self) -> dict[str, float]:
        values = self.machine.sample() if self.machine is not None else {}
        values.update(self.processes.sample([os.getpid(), *self.pids()]))
        return values

    def _run(self) -> None:
        batch: list[tuple[float, str, float]] = []
        next_send = time.time() + SEND_EVERY_S
        next_sample = time.time()
        while not self._stop.wait(max(0.0, next_sample - time.time())):
            t = time.time()
            next_sample += self.interval
            if next_sample <= t:  # woken late (a stalled machine): no burst of catch-up samples
                next_sample = t + self.interval
            batch += [(t, m, v) for m, v in self.sample().items() if math.isfinite(v)]
            del batch[:-MAX_BATCH]
            if t >= next_send:
                next_send = t + SEND_EVERY_S
                try:
                    self.send(metrics_message(self.node, batch))
                except OSError:
                    return  # the supervisor is gone: the agent is ending too
                batch = []

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if self.machine is not None:
            self.machine.close()


class NodeDrills:
    """The `slow` and `leak` drills of one node; `pids()` gives its workers' process ids."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self.pids = pids
        self._running = threading.Lock()  # held while the slow drill has the workers stopped
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._leaked: list[bytes] = []

    def start(self, how: str) -> None:
        if how not in DRILLS:
            raise ValueError(f"unknown drill {how!r}; known: {', '.join(DRILLS)}")
        self._stop.clear()
        thread = threading.Thread(target=self._slow if how == "slow" else self._leak, name=f"drill-{how}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def stop(self) -> None:
        """End every drill (the workers are running again, the leaked memory is freed)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        self._threads = []
        self._leaked = []

    @contextlib.contextmanager
    def workers_running(self) -> Iterator[None]:
        """Within this block, the slow drill leaves the workers running (their states are read here)."""
        with self._running:
            yield

    def _signal(self, sig: signal.Signals) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _slow(self) -> None:
        while not self._stop.is_set():
            if not self.pids():  # a node not running yet (a spare): slowed once it runs something
                self._stop.wait(SLOW_RUN_S)
                continue
            with self._running:
                self._signal(signal.SIGSTOP)
                self._stop.wait(SLOW_STOP_S)
                self._signal(signal.SIGCONT)
            self._stop.wait(SLOW_RUN_S)

    def _leak(self) -> None:
        chunk_mb, period = 8, 8 / LEAK_MB_PER_S
        while not self._stop.wait(period):
            if len(self._leaked) * chunk_mb < LEAK_CAP_MB:
                self._leaked.append(b"\x01" * (chunk_mb << 20))  # written, so resident: RSS grows

