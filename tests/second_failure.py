"""The two-at-once drill on a live local job (issue 15): two nodes killed 1-76 ms apart, so the second
loss strikes while the first recovery collects reports or builds the next generation's groups.
Shared by tests/recovery/test_second_failure.py (a few rounds) and benchmarks/bench_second_failure.py
(20 rounds, a table).

A round passes when both losses are detected and training resumes on the survivors well within the
reconfiguration timeout (a stall would sit until that timeout), with no checkpoint fallback and no
healthy node evicted; then the two replacements join before the next round.
"""

from __future__ import annotations

import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from job_events import events_so_far

from oobleck_slurm.commands.kill_node import local_node_processes
from oobleck_slurm.supervisor.client import live_status

# fault_tolerance: lines for the drill's job (6 nodes, f=2): replacements requested, a long
# reconfiguration timeout, so that a stall cannot hide behind an eviction.
FAULT_TOLERANCE = ("  f: 2\n  checkpoint_interval: 0\n  replacement: request\n  heartbeat_lease: 3\n"
                   "  step_timeout: 60\n  reconfiguration_timeout: 120\n")
NODES = 6
RESUME_TIMEOUT_S = 45.0  # far below the reconfiguration timeout: a stall shows as a timeout here
JOIN_TIMEOUT_S = 150.0


@dataclass
class Round:
    nodes: tuple[str, str]
    gap_ms: float
    ok: bool
    resumed_s: float | None  # from the first kill to training resumed without both nodes
    recoveries: int  # recoveries it took (2 when the second loss interrupted the first)
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _events(job: Path) -> list[dict[str, Any]]:
    return events_so_far(job / "events.jsonl")


def _members(events: list[dict[str, Any]]) -> list[str]:
    plan = [e for e in events if e["kind"] == "plan"][-1]
    return [n for p in plan["pipelines"] for n in p["nodes"]] + list(plan.get("spares", []))


def wait_until(job: Path, check: Any, timeout: float) -> Any:
    """Poll the job's events until `check(events)` is truthy; None after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check(_events(job))
        if found:
            return found
        time.sleep(0.05)
    return None


def wait_full(job: Path, nodes: int = NODES, timeout: float = JOIN_TIMEOUT_S) -> bool:
    """Until `nodes` members train: the latest plan has them all and a step ran after it."""
    def full(ev: list[dict[str, Any]]) -> bool:
        plans = [i for i, e in enumerate(ev) if e["kind"] == "plan"]
        return bool(plans) and len(_members(ev)) >= nodes and any(e["kind"] == "step" for e in ev[plans[-1]:])
    return bool(wait_until(job, full, timeout))


def kill_two(job: Path, rng: random.Random) -> Round:
    """Kill two members' agents and workers `gap` (1-76 ms) apart; wait for the resume."""
    seen = _events(job)
    before = len(seen)  # the events from here on are this round's
    a, b = rng.sample(sorted(_members(seen)), 2)
    status = live_status(job)
    procs = [local_node_processes(status.agent_pids.get(status.node_of.get(n, n))) for n in (a, b)]
    if not all(procs):
        return Round((a, b), 0.0, False, None, 0, f"no live processes for {a} or {b}: {status}")
    gap = rng.uniform(0.001, 0.076)
    t0 = time.time()
    for i, node_procs in enumerate(procs):
        if i:
            time.sleep(gap)
        for p in node_procs:
            try:
                p.send_signal(signal.SIGKILL)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def resumed(ev: list[dict[str, Any]]) -> dict[str, Any] | None:
        new = ev[before:]
        lost = {n for e in new if e["kind"] == "failure" for n in e.get("nodes", [])}
        if not {a, b} <= lost:
            return None
        last_loss = max(i for i, e in enumerate(new) if e["kind"] == "failure")
        return next((e for e in new[last_loss:] if e["kind"] == "resumed"), None)

    found = wait_until(job, resumed, RESUME_TIMEOUT_S)
    new = _events(job)[before:]
    bad = [e for e in new if e["kind"] in ("checkpoint_fallback", "done")
           or (e["kind"] == "failure" and set(e.get("nodes", [])) - {a, b})]
    recoveries = len({e.get("recovery") for e in new if e["kind"] == "replan"})
    if found is None or bad:
        detail = f"bad events {bad}" if bad else f"no resume within {RESUME_TIMEOUT_S:g} s: {new[-12:]}"
        return Round((a, b), gap * 1e3, False, None, recoveries, detail)
    return Round((a, b), gap * 1e3, True, found["t"] - t0, recoveries)
