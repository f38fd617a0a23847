"""The agent's part in detection (agent/health.py) on real processes: the metrics it sends,
the `slow` drill's duty cycle (the node keeps working, slower, and never looks stopped between two
pauses) and the `leak` drill's growing memory."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from oobleck_slurm.agent.health import LEAK_MB_PER_S, SLOW_RUN_S, SLOW_STOP_S, MetricsReporter, NodeDrills
from oobleck_slurm.protocol.messages import Metrics, parse
from oobleck_slurm.supervisor.health_monitor import parse_metrics

BUSY = "while True: pass"


@pytest.fixture
def busy_worker() -> Iterator[subprocess.Popen]:
    """A process that computes all the time, like a training worker."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    yield proc
    proc.kill()
    proc.wait()


def wait_until(check, timeout: float = 20.0):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
    return found


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def test_metrics_are_sent_in_batches_the_supervisor_accepts(busy_worker: subprocess.Popen) -> None:
    sent: list[Metrics] = []
    reporter = MetricsReporter("nodeA", {"interval": 0.1, "machine": False}, sent.append, lambda: [busy_worker.pid])
    reporter.start()
    try:
        wait_until(lambda: len(sent) >= 2)
    finally:
        reporter.stop()
    assert {type(parse(m.to_dict())) for m in sent} == {Metrics} and {m.node for m in sent} == {"nodeA"}
    samples = [s for m in sent for s in parse_metrics(m.samples)]
    assert {metric for _, metric, _ in samples} == {"procs.cpu_pct", "procs.rss_gib"}  # no machine counters
    assert max(v for _, metric, v in samples if metric == "procs.cpu_pct") > 20  # the busy worker counts
    assert all(v > 0.005 for _, metric, v in samples if metric == "procs.rss_gib")
    assert len({t for t, _, _ in samples}) >= 5  # several samples per batch (0.1 s apart, sent every second)


def test_machine_metrics_are_sent_when_asked() -> None:
    reporter = MetricsReporter("nodeA", {"interval": 1.0, "machine": True, "gpus": False}, lambda m: None, lambda: [])
    try:
        values = reporter.sample()
    finally:
        reporter.stop()
    assert {"cpu.util", "mem.used_gib", "procs.cpu_pct", "procs.rss_gib"} <= set(values)


def test_the_slow_drill_slows_the_workers_without_stopping_them_for_good(busy_worker: subprocess.Popen) -> None:
    # How much of the time the worker is held stopped, sampled: unlike its CPU share, this does not
    # depend on what else the machine runs (a busy CI machine gave a free worker a third of a core).
    def stopped_share(seconds: float) -> float:
        states = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            states.append(psutil.Process(busy_worker.pid).status() == psutil.STATUS_STOPPED)
            time.sleep(0.005)
        return sum(states) / len(states)

    drills = NodeDrills(lambda: [busy_worker.pid])
    assert stopped_share(0.5) == 0.0
    drills.start("slow")
    try:
        share = stopped_share(2.0)
        for _ in range(20):  # what the heartbeat sees: never a stopped worker
            with drills.workers_running():
                assert psutil.Process(busy_worker.pid).status() != psutil.STATUS_STOPPED
    finally:
        drills.stop()
    stop_share = SLOW_STOP_S / (SLOW_RUN_S + SLOW_STOP_S)  # two thirds of every cycle
    assert stop_share - 0.25 < share < stop_share + 0.25, share  # slowed, but not stopped for good
    time.sleep(0.1)
    assert psutil.Process(busy_worker.pid).status() != psutil.STATUS_STOPPED  # running again after the drill


LEAKER = """
import sys
from oobleck_slurm.agent.health import NodeDrills
drills = NodeDrills(lambda: [])
print("ready", flush=True)
sys.stdin.readline()
drills.start("leak")
sys.stdin.readline()
drills.stop()
print("stopped", flush=True)
sys.stdin.readline()
"""


def test_the_leak_drill_grows_memory_until_stopped() -> None:
    # An agent-like process of its own, so that nothing else changes the memory that is measured.
    proc = subprocess.Popen([sys.executable, "-c", LEAKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        rss = psutil.Process(proc.pid).memory_info
        before = rss().rss
        proc.stdin.write("leak\n")
        proc.stdin.flush()
        wait_until(lambda: rss().rss - before >= 2 * LEAK_MB_PER_S * 2**20, timeout=20)  # it keeps growing
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "stopped"
        assert rss().rss - before < LEAK_MB_PER_S * 2**20  # given back
    finally:
        proc.kill()
        proc.wait()


def test_an_unknown_drill_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown drill 'fast'"):
        NodeDrills(lambda: []).start("fast")
