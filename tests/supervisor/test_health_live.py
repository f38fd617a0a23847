"""Faulty machines and stragglers found live (supervisor/health_monitor.py), in jobs started as `submit`
starts them: the agents sample and send their metrics, rank 0 publishes each step's compute times,
the supervisor judges. The `slow` drill (a node's workers duty-cycled with SIGSTOP/SIGCONT: it keeps
working, slower) is found and handled while training goes on, on the failure-free trajectory; the
`leak` drill (memory only) is found from the metrics; before the faults nothing is flagged."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from job_events import running_job, wait_for
from jobrun import JobRun, assert_matches_reference, run_job, tiny_recipe

from oobleck_slurm.detection import read_metrics
from oobleck_slurm.protocol.events import read_events
from oobleck_slurm.recipe.schema import DetectionConfig

pytestmark = pytest.mark.slow
HANDLED_WITHIN_S = 30.0
STRAGGLER_WINDOW = DetectionConfig().straggler_window  # the recipe's default
DETECTION_KINDS = ("faulty_node", "straggler")


def recipe_with(steps: int, drill: str | None = None, **detection: Any) -> dict[str, Any]:
    recipe = tiny_recipe(steps=steps)
    if drill:
        recipe["drills"] = [{"step": 30, "node": "node2", "how": drill}]
    if detection:
        recipe["detection"] = detection
    return recipe


def drill_time(run: JobRun, how: str) -> float:
    (fault,) = [e for e in run.kind("fault_injected") if e["how"] == how]
    assert fault["node"] == "node2"
    before = [e for e in run.events if e["kind"] in DETECTION_KINDS and e["t"] < fault["t"]]
    assert before == [], before  # nothing was flagged while the job was healthy
    return fault["t"]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The single-process reference on one thread: two threads on this shared 2-core machine spin
    against the jobs' own processes (measured: 5 s a step instead of 0.6 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_slow_node_is_evicted_within_seconds_and_training_stays_exact(tmp_path: Path, templates_cache: Path,
                                                                         one_thread: None) -> None:
    # The recipe's drill at step 30 (the path `submit` takes); the trajectory is checked to the end.
    run = run_job(tmp_path, recipe_with(70, "slow", stragglers="evict", evict=True), templates_cache, timeout=180)
    t_fault = drill_time(run, "slow")
    (lost,) = run.kind("node_lost")
    assert lost["node"] == "node2" and lost["cause"] in ("straggler", "faulty_metrics"), lost
    # The straggler verdict needs a window of slow steps (detection.straggler_window, 20): bounded in steps,
    # and in seconds only loosely (a loaded machine's steps took 0.3-1.9 s: 10.2 s for 21 steps was seen)
    steps_between = [e["step"] for e in run.kind("step") if t_fault < e["t"] <= lost["t"]]
    assert len(steps_between) <= STRAGGLER_WINDOW + 3, (steps_between, lost)
    assert lost["t"] - t_fault <= HANDLED_WITHIN_S, (lost, run.kind("straggler"), run.kind("faulty_node"))
    if lost["cause"] == "straggler":
        (decision,) = run.kind("straggler")
        assert decision["action"] == "evict" and set(decision["nodes"]) == {"node2"} and decision["nodes"]["node2"] >= 1.3
    assert run.kind("resumed") and run.losses()  # training went on without node2 ...
    assert_matches_reference(run)  # ... on the failure-free trajectory


LIVE_FT = "  checkpoint_interval: 0\n  replacement: none\n  heartbeat_lease: 12\n  collective_timeout: 10\n"


def kill_node(job: Path, node: str, how: str) -> float:
    """`kill-node JOB NODE --how HOW`, as a user runs it; returns when the supervisor noted the fault."""
    done = subprocess.run([sys.executable, "-m", "oobleck_slurm", "kill-node", str(job), node, "--how", how],
                          capture_output=True, text=True, timeout=60, cwd=job.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    return wait_for(job, "the fault", lambda ev: [e for e in ev if e["kind"] == "fault_injected" and e["how"] == how])[0]["t"]


def test_a_slow_node_is_rebalanced_and_a_leaking_node_evicted(tmp_path: Path, templates_cache: Path) -> None:
    """The defaults but `detection.evict: true`, in one live job: healthy for 40 steps, nobody is flagged; node2 slowed is
    then rebalanced (the decision made, handed to the coordinator, training going on); node3's memory
    leak is then found from its metrics and node3 evicted, while node2 is still slow."""
    nodes = {"node1", "node2", "node3", "node4"}
    # eviction on metrics is off by default (report only): this test asks for it
    with running_job(tmp_path, LIVE_FT, templates_cache, sections="detection:\n  evict: true\n") as job:
        wait_for(job, "training", lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] >= 40])
        wait_for(job, "every node scored", lambda ev: [e for e in ev if e["kind"] == "health" and set(e["scores"]) == nodes])
        # Healthy so far: nobody flagged or lost, every score low, and `detect` on the metrics the
        # supervisor judged (the job folder's metrics.csv, in the format `detect` reads) agrees.
        events = read_events(job / "events.jsonl")
        assert [e for e in events if e["kind"] in (*DETECTION_KINDS, "node_lost")] == []
        assert max(s for e in events if e["kind"] == "health" for s in e["scores"].values()) < 4.5
        trace = read_metrics(job / "metrics.csv")
        assert {n for _, sample in trace for n in sample} == nodes
        assert {m for _, sample in trace for values in sample.values() for m in values} == {"procs.cpu_pct", "procs.rss_gib"}
        done = subprocess.run([sys.executable, "-m", "oobleck_slurm", "detect", str(job), "--json"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and json.loads(done.stdout) == [], done.stdout + done.stderr
        t_fault = kill_node(job, "node2", "slow")
        decision = wait_for(job, "a rebalance", lambda ev: [
            e for e in ev if e["kind"] == "straggler" and e["action"] == "rebalance" and "node2" in e["nodes"]])[0]
        # Judged over the window (the threshold, 1.3x); its pipeline's share follows how slow it is now
        # (the recent samples, never under the release, 1.15x): on a busy machine that can be less.
        judged = float(re.search(r"computes ([\d.]+)x", decision["detail"]).group(1))  # type: ignore[union-attr]
        assert decision["t"] - t_fault <= HANDLED_WITHIN_S and judged >= 1.3 and decision["nodes"]["node2"] >= 1.15, decision
        steps = len(read_events(job / "events.jsonl", "step"))
        wait_for(job, "training after the decision", lambda ev: len([e for e in ev if e["kind"] == "step"]) > steps + 5)
        assert [e for e in read_events(job / "events.jsonl", "node_lost") if e["cause"] == "straggler"] == []

        t_fault = kill_node(job, "node3", "leak")
        flag = wait_for(job, "the flag", lambda ev: [e for e in ev if e["kind"] == "faulty_node"])[0]
        assert flag["node"] == "node3" and flag["action"] == "evict" and "procs.rss_gib" in flag["metrics"], flag
        assert flag["score"] >= 4.5 and flag["t"] - t_fault <= 30
        lost = wait_for(job, "the eviction", lambda ev: [e for e in ev if e["kind"] == "node_lost"])[0]
        assert (lost["node"], lost["cause"]) == ("node3", "faulty_metrics") and "procs.rss_gib" in lost["detail"]
        steps = len(read_events(job / "events.jsonl", "step"))
        wait_for(job, "training without node3", lambda ev: len([e for e in ev if e["kind"] == "step"]) > steps + 5)
