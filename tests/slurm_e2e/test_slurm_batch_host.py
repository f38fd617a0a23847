"""The node that runs the batch step dies as a machine (tests/slurm/lab.py `kill_node`: its slurmd, stepds
and tasks at once; or every process of it SIGSTOPped and never resumed, as a powered-off machine that
closes no connection). Measured on Slurm 22.05 (docs/slurm.md, "The batch host"): slurmctld removes the
node from the `--no-kill` job, the steps launched from it live on on the other nodes, and the job stays
RUNNING there until its time limit. The standby supervisor, a step on another node of the allocation,
takes over from the replicas in memory (no checkpoint loaded, the reference's trajectory) and ends the
allocation when training is done. With no standby (`cluster.supervisor.standby: false`), the agents that
see the supervisor lost requeue the job off the dead node: the next run resumes from the newest complete
checkpoint. Either way no node of the allocation is left idle."""

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


def lose_batch_host(lab, batch_host: str, how: str) -> list:
    """The machine dies (`kill`) or stops answering for good (`freeze`); returns the frozen processes."""
    if how == "kill":
        lab.kill_node(batch_host)
        return []
    frozen = lab.node_processes(batch_host)
    for proc in frozen:
        proc.send_signal(signal.SIGSTOP)
    return frozen


def job_left_queue(slurm_id: str, timeout: float) -> str:
    """Wait until Slurm ended the job; its final state (sacct's view once squeue drops it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = subprocess.run(["squeue", "-h", "-j", slurm_id, "-o", "%T"], capture_output=True, text=True,
                               timeout=30).stdout.strip()
        if state in ("", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL"):
            return state or "gone"
        time.sleep(1)
    raise AssertionError(f"job {slurm_id} still in the queue {timeout:g} s after training ended: {state}")


def training_job(tmp_path: Path, templates_cache: Path, cluster: str = "", fault_tolerance: str = "") -> Path:
    """A lab job of STEPS steps, a checkpoint every 50, no replacement (the survivors go on)."""
    return submit_lab_job(tmp_path, templates_cache, f"""training:
  steps: {STEPS}
{cluster}fault_tolerance:
  checkpoint_interval: 50
  replacement: none
{fault_tolerance}""")


def started(job: Path) -> tuple[str, str]:
    """Once the job runs: its Slurm id and its batch host."""
    start = wait_events(job, "job_started", lambda ev: [e for e in ev if e["kind"] == "job_started"],
                        START_TIMEOUT_S)[0]
    return start["slurm_job_id"], start["supervisor_node"]


def past_a_checkpoint(job: Path) -> None:
    wait_events(job, "a checkpoint and steps past it", lambda ev: [e for e in ev if e["kind"] == "step"
                                                                   and e["step"] >= 55]
                if any(written(e) for e in ev) else [], START_TIMEOUT_S)


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_the_batch_host_dies_and_the_standby_step_takes_over_in_memory(slurm_cluster, tmp_path: Path,
                                                                      templates_cache: Path, how: str) -> None:
    lab = slurm_cluster
    job = training_job(tmp_path, templates_cache)
    slurm_id = None
    frozen: list = []
    try:
        slurm_id, batch_host = started(job)
        past_a_checkpoint(job)
        t_kill = time.time()
        frozen = lose_batch_host(lab, batch_host, how)
        takeover = wait_events(job, "takeover", lambda ev: [e for e in ev if e["kind"] == "takeover"], 120)[0]
        resumed = wait_events(job, "resumed after the takeover", lambda ev: [
            e for e in ev if e["kind"] == "resumed" and e["t"] > takeover["t"]], 120)[0]
        finished = wait_events(job, "end of training", lambda ev: [e for e in ev if e["kind"] == "job_finished"
                                                                   and e["t"] > takeover["t"]], 240)[0]
        assert finished["status"] == "completed", finished
        # The new primary ends the allocation its lost batch script would have ended.
        job_left_queue(slurm_id, 60)
        events = read_events(job / "events.jsonl")
        assert takeover["epoch"] == 2, takeover
        assert [e["node"] for e in events if e["kind"] == "node_lost"] == [batch_host]
        assert not [e for e in events if e["kind"] == "checkpoint_fallback"]
        assert not [e for e in events if e["kind"] == "job_started" and e["t"] > t_kill]  # no requeue
        steps = [e for e in events if e["kind"] == "step"]
        after = [e for e in steps if e["t"] > takeover["t"]]
        assert after and after[-1]["step"] == STEPS - 1
        assert {e["step"] for e in steps} == set(range(STEPS))
        assert_on_reference(job, after)
        print(f"{how}: batch host lost at step {resumed['step']} -> training resumed in memory "
              f"{resumed['t'] - t_kill:.1f} s after the loss (lease age {takeover['lease_age']:.2f} s)")
    finally:
        if frozen:
            lab.kill_node(batch_host)  # the frozen machine is powered off for good: reset brings it back
        if slurm_id:
            subprocess.run(["scancel", slurm_id], timeout=30, check=False)


def test_after_a_takeover_the_time_limit_notice_checkpoints_and_the_job_requeues_itself(
        slurm_cluster, tmp_path: Path, templates_cache: Path) -> None:
    """submitit's handler, which requeues after the time limit's USR2, died with the batch step: the new
    primary checkpoints on the notice the agents relay, then requeues the job itself, off the lost node."""
    lab = slurm_cluster
    job = training_job(tmp_path, templates_cache)
    slurm_id = None
    try:
        slurm_id, batch_host = started(job)
        wait_events(job, "steps", lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] >= 20], START_TIMEOUT_S)
        spare = lab.start_spare()  # the requeued run needs four nodes without the dead one
        lose_batch_host(lab, batch_host, "kill")
        takeover = wait_events(job, "takeover", lambda ev: [e for e in ev if e["kind"] == "takeover"], 120)[0]
        wait_events(job, "resumed after the takeover", lambda ev: [
            e for e in ev if e["kind"] == "resumed" and e["t"] > takeover["t"]], 120)
        # The time limit's notice as Slurm sends it with submitit's `--signal=USR2@…`: to the steps only.
        subprocess.run(["scancel", "--signal=USR2", slurm_id], timeout=30, check=True)
        stopped = wait_events(job, "the run stopped by the notice", lambda ev: [
            e for e in ev if e["kind"] == "job_finished" and e["t"] > takeover["t"]], 120)[0]
        assert stopped["status"] == "preempted" and stopped["checkpoint_step"] is not None, stopped
        again = wait_events(job, "requeued run", lambda ev: [e for e in ev if e["kind"] == "job_started"
                                                             and e["requeued"]], REQUEUE_TIMEOUT_S + 60)[0]
        assert batch_host not in again["nodes"] + again["spares"] and spare in again["nodes"] + again["spares"]
        finished = wait_events(job, "end of the requeued run", lambda ev: [
            e for e in ev if e["kind"] == "job_finished" and e["t"] > again["t"]], 240)[0]
        assert finished["status"] == "completed", finished
        events = read_events(job / "events.jsonl")
        resumed = [e for e in events if e["kind"] == "step" and e["t"] > again["t"]]
        assert [e["step"] for e in resumed] == list(range(stopped["checkpoint_step"], STEPS))
        assert_on_reference(job, resumed)
        print(f"takeover, then the notice: checkpoint of step {stopped['checkpoint_step']}, requeued run "
              f"started {again['t'] - stopped['t']:.1f} s after, exact")
    finally:
        if slurm_id:
            subprocess.run(["scancel", slurm_id], timeout=30, check=False)


@pytest.mark.parametrize("how", ["kill"])
def test_without_a_standby_the_job_requeues_from_its_newest_checkpoint(slurm_cluster, tmp_path: Path,
                                                                      templates_cache: Path, how: str) -> None:
    lab = slurm_cluster
    job = training_job(tmp_path, templates_cache, cluster="cluster:\n  supervisor: {standby: false}\n",
                       fault_tolerance="  step_timeout: 15\n")
    slurm_id = None
    frozen: list = []
    try:
        slurm_id, batch_host = started(job)
        past_a_checkpoint(job)
        spare = lab.start_spare()  # the repaired capacity the requeued run starts on
        t_kill = time.time()
        frozen = lose_batch_host(lab, batch_host, how)
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
