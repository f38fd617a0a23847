"""The node that runs the batch step dies as a machine (tests/slurm/lab.py `kill_node`: its slurmd, stepds
and tasks at once; or every process of it SIGSTOPped and never resumed, as a powered-off machine that
closes no connection). Measured on Slurm 22.05 (docs/slurm.md, "The batch host"): slurmctld removes the
node from the `--no-kill` job and ends the steps launched from it, and the job stays RUNNING on the other
nodes with nothing in it until its time limit. With no standby, the agents that see the supervisor lost
(its connection closed, or its lease older than the step timeout) requeue the job off the dead node: the
next run resumes from the newest complete checkpoint on the reference's trajectory, and no node of the
allocation is left idle."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_slurm_requeue import (
    REQUEUE_TIMEOUT_S,
    START_TIMEOUT_S,
    assert_on_reference,
    slurm_job,
    submit_lab_job,
    wait_events,
    written,
)

from oobleck_slurm.protocol.events import read_events

pytestmark = pytest.mark.slurm
STEPS = 160  # ~10 steps/s on the lab


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_the_batch_host_dies_and_the_job_requeues_from_its_newest_checkpoint(slurm_cluster, tmp_path: Path,
                                                                            templates_cache: Path, how: str) -> None:
    lab = slurm_cluster
    job = submit_lab_job(tmp_path, templates_cache, f"""training:
  steps: {STEPS}
fault_tolerance:
  checkpoint_interval: 50
  step_timeout: 15
  replacement: none
""")
    slurm_id = None
    frozen: list = []
    try:
        start = wait_events(job, "job_started", lambda ev: [e for e in ev if e["kind"] == "job_started"],
                            START_TIMEOUT_S)[0]
        slurm_id, batch_host = start["slurm_job_id"], start["supervisor_node"]
        wait_events(job, "a checkpoint and steps past it", lambda ev: [e for e in ev if e["kind"] == "step"
                                                                       and e["step"] >= 55]
                    if any(written(e) for e in ev) else [], START_TIMEOUT_S)
        spare = lab.start_spare()  # the repaired capacity the requeued run starts on
        t_kill = time.time()
        if how == "kill":
            lab.kill_node(batch_host)
        else:
            frozen = lab.node_processes(batch_host)
            for proc in frozen:
                proc.send_signal(signal.SIGSTOP)
        again = wait_events(job, "requeued run", lambda ev: [e for e in ev if e["kind"] == "job_started"
                                                             and e["requeued"]], REQUEUE_TIMEOUT_S + 60)[0]
        record = slurm_job(slurm_id)
        assert int(record["Restarts"]) >= 1, record
        assert batch_host not in lab.run("scontrol", "show", "hostnames", record["NodeList"]).split()
        assert again["supervisor_node"] != batch_host and spare in again["nodes"] + again["spares"]
        finished = wait_events(job, "end of the requeued run", lambda ev: [e for e in ev if e["kind"] == "job_finished"
                                                                           and e["t"] > again["t"]], 240)[0]
        assert finished["status"] == "completed", finished
        events = read_events(job / "events.jsonl")
        newest = max(e["step"] for e in events if written(e) and e["t"] < again["t"])
        resumed = [e for e in events if e["kind"] == "step" and e["t"] > again["t"]]
        assert [e["step"] for e in resumed] == list(range(newest, STEPS))
        assert_on_reference(job, resumed)
        print(f"{how}: batch host lost -> requeued run started {again['t'] - t_kill:.1f} s later, "
              f"resumed at step {newest}")
    finally:
        if frozen:
            lab.kill_node(batch_host)  # the frozen machine is powered off for good: reset brings it back
        if slurm_id:
            subprocess.run(["scancel", slurm_id], timeout=30, check=False)
