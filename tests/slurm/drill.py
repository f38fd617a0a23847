"""Fault drills on a job running in the local Slurm lab, shared by tests/slurm_e2e and
benchmarks/bench_detection.py: inject one kind of fault into a node, then measure detection (against
Slurm's own DOWN time, watched at the same time), resumption and the replacement's join.

Kinds: node (slurmd, stepds and tasks SIGKILLed: a dead machine), agent (the node agent kill -9ed),
worker (the worker kill -9ed), hang (the worker SIGSTOPped), down (`scontrol update state=down`),
freeze (every process of the node SIGSTOPped: a frozen machine that never closes a connection).
agent, worker and hang are injected by the node's own agent (relayed through the supervisor).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import psutil
from job_events import events_so_far  # tests/job_events.py

from oobleck_slurm.protocol.events import read_events
from oobleck_slurm.supervisor.client import notify_fault

KINDS = ("node", "agent", "worker", "hang", "down", "freeze")
RELAYED = ("agent", "worker", "hang")  # the agent injects these: Slurm never sees the node go
RECIPE = """extends: {repo}/recipes/lab-slurm.yaml
cluster:
  time: "00:15:00"
  sbatch:
    exclusive: ""
training:
  steps: 1000000
fault_tolerance:
  heartbeat_interval: 0.25
  heartbeat_lease: 2.5
  collective_timeout: 2.0
  step_timeout: 8
  reconfiguration_timeout: 60
  replacement: request
  checkpoint_interval: 0
"""
DOWN_WATCH_S = 40.0  # how long Slurm's DOWN is waited for (its own detection takes ~10-15 s here)


class DrillError(AssertionError):
    """An expected event did not come; the message holds the event log's and the logs' tails."""


def wait_event(job: Path, what: str, check: Callable[[list[dict]], Any], timeout: float = 90.0) -> Any:
    """Poll the job's events until `check(events)` is truthy; DrillError after `timeout` or the job's end."""
    deadline = time.monotonic() + timeout
    while True:
        events = events_so_far(job / "events.jsonl")
        found = check(events)
        if found:
            return found
        finished = [e for e in events if e["kind"] == "job_finished"]
        if finished or time.monotonic() > deadline:
            tail = "\n".join(str(e) for e in events[-15:] if e["kind"] != "node")
            logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in
                             sorted((job / "logs").glob("*")) if p.is_file())
            raise DrillError(f"{what}: not seen ({'job finished' if finished else f'{timeout}s'})\n{tail}\n{logs}")
        time.sleep(0.1)


class DownWatch(threading.Thread):
    """Slurm's own view: seconds from `start` until the node is DOWN (None if not within `limit`)."""

    def __init__(self, lab: Any, node: str, start: float, limit: float = DOWN_WATCH_S) -> None:
        super().__init__(daemon=True)
        self.lab, self.node, self.start_t, self.limit = lab, node, start, limit
        self.seconds: float | None = None

    def run(self) -> None:
        while time.time() - self.start_t < self.limit:
            with contextlib.suppress(Exception):
                if {"DOWN", "FAIL"} & self.lab.node_state(self.node):
                    self.seconds = time.time() - self.start_t
                    return
            time.sleep(0.1)


def inject(lab: Any, job: Path, node: str, kind: str) -> float:
    """Inject `kind` into `node`; returns the fault time (the supervisor is told it first)."""
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; kinds: {', '.join(KINDS)}")
    t = time.time()
    notify_fault(job, node, kind, t)  # relayed kinds: the node's agent injects it now
    if kind == "node":
        lab.kill_node(node)
    elif kind == "down":
        lab.set_down(node, "drill")
    elif kind == "freeze":
        for p in lab.node_processes(node):
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGSTOP)
    return t


@dataclass
class Drill:
    """One fault and what followed it, from the job's event log."""

    kind: str
    node: str
    t: float
    lost: dict
    failure: dict
    resumed: dict
    resumed_plan: dict
    joined: dict
    joined_plan: dict
    health: list[dict]
    slurm_down_s: float | None
    registered_t: float  # when the replacement's agent registered (its `joining` node event)

    def row(self) -> dict[str, Any]:
        return {"kind": self.kind, "node": self.node, "cause": self.lost["cause"],
                "detection_s": self.lost["detection_seconds"], "slurm_down_s": self.slurm_down_s,
                "resumed_s": self.resumed["t"] - self.t, "joined_s": self.joined["t"] - self.t,
                "recovery_s": self.resumed["total_seconds"], "registered_to_joined_s": self.joined_after_registration_s}

    @property
    def joined_after_registration_s(self) -> float:
        """The replacement's join: from its agent's registration to training with it (health check
        included; Slurm's start of the replacement job excluded)."""
        return self.joined["t"] - self.registered_t


def drill(lab: Any, job: Path, node: str, kind: str) -> Drill:
    """Inject `kind` into `node` of a running job with `replacement: request`; wait until the loss is
    detected, training resumed, and a replacement (a lab spare started here) joined."""
    lab.start_spare()  # a free node for the replacement job
    before = len(read_events(job / "events.jsonl"))

    def after(kind_: str) -> Callable[[list[dict]], list[dict]]:
        return lambda ev: [e for e in ev[before:] if e["kind"] == kind_]

    t = inject(lab, job, node, kind)
    down = DownWatch(lab, node, t)
    if kind not in RELAYED:
        down.start()
    lost = wait_event(job, f"{node} lost ({kind})", after("node_lost"))[0]
    resumed = wait_event(job, "resumed", after("resumed"))[0]
    joined = wait_event(job, "replacement joined", after("node_joined"), timeout=120)[0]
    events = read_events(job / "events.jsonl")
    plan_of = {e["generation"]: e for e in events if e["kind"] == "plan"}
    failure = [e for e in events[before:] if e["kind"] == "failure"][0]
    health = [e for e in events if e["kind"] == "health_check" and e["node"] == joined["node"]]
    registered = min(e["t"] for e in events if e["kind"] == "node" and e["node"] == joined["node"]
                     and e.get("state") == "joining")
    if kind not in RELAYED:
        down.join()
    if kind == "freeze":
        lab.kill_node(node)  # end the stopped processes: the lab is reset later
    return Drill(kind, node, t, lost, failure, resumed, plan_of[resumed["generation"]], joined,
                 plan_of[joined["generation"]], health, down.seconds, registered)
