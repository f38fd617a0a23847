"""A worker that hangs inside a step while it stays runnable (a deadlock, not SIGSTOP): its agent sees
a live process. Hung before its first collective of the step, per-rank progress (`worker/{id}/step`)
names it. (Hung after it, every rank at the same step, the re-form names it: tests/recovery/test_reform.py.)
Real supervisor, agents and workers on the local backend."""

from __future__ import annotations

from pathlib import Path

import pytest
from job_events import running_job, wait_for

from oobleck_slurm.protocol.events import read_events

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEP_TIMEOUT_S = 4.0
COLLECTIVE_S = 1.0
LEASE_S = 2.0  # the grace before unexplained collective errors re-form the members
HANG_STEP = 4


def supervised_job(tmp_path: Path, at: str, cache: Path):  # noqa: ANN201 - a context manager
    """A local-backend job whose node3 hangs at `at` of step HANG_STEP, under a real supervisor."""
    return running_job(tmp_path, f"  checkpoint_interval: 0\n  step_timeout: {STEP_TIMEOUT_S}\n"
                                 f"  collective_timeout: {COLLECTIVE_S}\n  heartbeat_lease: {LEASE_S}\n"
                                 "  reconfiguration_timeout: 60\n  replacement: none\n", cache,
                       [{"node": "node3", "step": HANG_STEP, "at": at, "do": "hang"}])


def assert_recovers_without(job: Path, node: str) -> None:
    def after_loss(ev: list[dict]) -> list[dict]:  # a loaded machine may re-form (and resume) before the loss
        lost = [i for i, e in enumerate(ev) if e["kind"] == "node_lost"]
        return [e for e in ev[lost[0]:] if e["kind"] == "resumed"] if lost else []

    resumed = wait_for(job, "resumed after the loss", after_loss, 180)[0]
    assert resumed["step"] == HANG_STEP  # the stalled step is replayed by the survivors
    wait_for(job, "steps after", lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] > HANG_STEP + 2])
    plan = read_events(job / "events.jsonl", "plan")[-1]
    assert sorted(n for p in plan["pipelines"] for n in p["nodes"]) == sorted({"node1", "node2", "node3", "node4"} - {node})


def test_hung_running_worker_is_named_and_evicted(tmp_path: Path, templates_cache: Path) -> None:
    with supervised_job(tmp_path, "start", templates_cache) as job:
        lost = wait_for(job, "node3 lost", lambda ev: [e for e in ev if e["kind"] == "node_lost"], 180)
        assert [(e["node"], e["cause"]) for e in lost] == [("node3", "hung")], lost
        assert "behind" not in lost[0]["detail"] and f"collective of step {HANG_STEP - 1}, its peers of step {HANG_STEP}" in lost[0]["detail"]
        detection = wait_for(job, "detection", lambda ev: [e for e in ev if e["kind"] == "detection"])[0]  # after node_lost
        assert STEP_TIMEOUT_S <= detection["seconds"] < STEP_TIMEOUT_S + 10.0, detection  # slack: a busy machine
        assert_recovers_without(job, "node3")
