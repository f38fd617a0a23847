"""`status`'s summary of a job's event log (pure): what it says of a job that has ended."""

from __future__ import annotations

from oobleck_slurm.commands.status import summarize


def test_a_finished_job_lists_no_worker_as_running() -> None:
    events = [
        {"t": 1.0, "kind": "job_started", "backend": "local"},
        {"t": 2.0, "kind": "node", "node": "node1", "state": "healthy", "workers": ["running", "sleeping"]},
        {"t": 2.0, "kind": "node", "node": "node2", "state": "lost", "cause": "process_exit"},
        {"t": 3.0, "kind": "job_finished", "status": "completed", "exit_code": 0},
    ]
    s = summarize(events)
    assert s["state"] == "completed"
    assert s["nodes"]["node1"] == {"state": "ended"}  # not the last sample's running workers
    assert s["nodes"]["node2"]["state"] == "lost"
