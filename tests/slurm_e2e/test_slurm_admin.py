"""Routine administration and a busy controller, on the lab, during training: a node set DRAIN (what
`scontrol reboot ASAP` and maintenance do to running nodes) loses no node; slurmctld stopped (SIGSTOP)
for 30 s loses no node, and the job and `submit`'s follow go on; the job's controller load in the steady
state, counted by slurmctld itself (sdiag), stays within 6 RPCs a minute."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_events import events_so_far
from test_slurm_requeue import REPO, START_TIMEOUT_S, assert_on_reference, submit_lab_job, wait_events

from oobleck_slurm.protocol.events import read_events

pytestmark = pytest.mark.slurm
# Message types that Slurm's daemons send slurmctld (registration, step and batch completion), and
# sdiag's own: the rest are clients' requests, the load a job puts on the controller.
DAEMON_RPCS = {"MESSAGE_NODE_REGISTRATION_STATUS", "MESSAGE_EPILOG_COMPLETE", "REQUEST_STEP_COMPLETE",
               "REQUEST_COMPLETE_BATCH_SCRIPT", "REQUEST_COMPLETE_PROLOG", "MESSAGE_COMPOSITE", "REQUEST_STATS_INFO"}


def client_rpcs() -> dict[str, int]:
    """slurmctld's count of each RPC type clients sent it since its start (sdiag)."""
    out = subprocess.run(["sdiag"], capture_output=True, text=True, timeout=30, check=True).stdout
    table = out.split("by message type", 1)[1].split("by user", 1)[0]
    counts = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s*(\w+)\s+\(\s*\d+\)\s+count:(\d+)", table, re.M)}
    return {k: v for k, v in counts.items() if k not in DAEMON_RPCS}


def assert_exact_and_whole(job: Path, steps: int) -> None:
    events = read_events(job / "events.jsonl")
    assert not [e for e in events if e["kind"] == "failure"], "no node was lost"
    assert [e["status"] for e in events if e["kind"] == "job_finished"] == ["completed"]
    trained = [e for e in events if e["kind"] == "step"]
    assert sorted({e["step"] for e in trained}) == list(range(steps))
    assert_on_reference(job, trained)


def test_a_drained_node_is_no_loss_and_its_state_is_reported(slurm_cluster, tmp_path: Path,
                                                              templates_cache: Path) -> None:
    lab = slurm_cluster
    steps = 400
    job = submit_lab_job(tmp_path, templates_cache, f"training:\n  steps: {steps}\n")
    try:
        wait_events(job, "steps", lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] >= 10],
                    START_TIMEOUT_S)
        lab.run("scontrol", "update", "nodename=node3", "state=drain", "reason=maintenance")
        reported = wait_events(job, "the drain reported", lambda ev: [e for e in ev if e["kind"] == "node"
                                                                      and "DRAIN" in str(e.get("slurm_state"))], 60)
        assert reported[0]["node"] == "node3"
        wait_events(job, "the end", lambda ev: [e for e in ev if e["kind"] == "job_finished"], 240)
        assert_exact_and_whole(job, steps)
    finally:
        lab.resume("node3")


def test_a_stopped_controller_loses_no_node_and_the_follow_goes_on(slurm_cluster, tmp_path: Path,
                                                                   templates_cache: Path) -> None:
    lab = slurm_cluster
    steps = 500
    recipe = tmp_path / "job.yaml"
    recipe.write_text(f"extends: {REPO / 'recipes' / 'lab-slurm.yaml'}\ntraining:\n  steps: {steps}\n")
    out = tmp_path / "follow.jsonl"  # a file, not a pipe: an unread pipe would block the follow once full
    with open(out, "w") as stdout:
        follow = subprocess.Popen([sys.executable, "-m", "oobleck_slurm", "submit", str(recipe), "--json",
                                   "--cache", str(templates_cache)], cwd=tmp_path, stdout=stdout,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    pid = int((lab.folder / "run" / "slurmctld.pid").read_text())
    stopped = False
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not list((tmp_path / "jobs").glob("*/events.jsonl")):
            assert follow.poll() is None and time.monotonic() < deadline, "submit did not start the job"
            time.sleep(0.2)
        (job,) = (tmp_path / "jobs").iterdir()
        wait_events(job, "steps", lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] >= 10],
                    START_TIMEOUT_S)
        os.kill(pid, signal.SIGSTOP)
        stopped, t_stop = True, time.monotonic()
        while time.monotonic() - t_stop < 30:
            assert follow.poll() is None, "submit's follow ended while slurmctld was stopped"
            time.sleep(0.5)
        steps_while_stopped = [e["step"] for e in events_so_far(job / "events.jsonl") if e["kind"] == "step"]
        os.kill(pid, signal.SIGCONT)
        stopped = False
        assert follow.wait(300) == 0, out.read_text()[-2000:]
        assert_exact_and_whole(job, steps)
        followed = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
        assert followed[-1]["kind"] == "job_finished", followed[-1]  # it followed to the end
        assert max(steps_while_stopped) > 10, "training went on while the controller was stopped"
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        if follow.poll() is None:
            os.killpg(follow.pid, signal.SIGKILL)


def test_a_job_in_its_steady_state_costs_at_most_6_controller_rpcs_a_minute(slurm_cluster, tmp_path: Path,
                                                                             templates_cache: Path) -> None:
    steps = 2000  # ~10 steps/s: well past the counted minute
    job = submit_lab_job(tmp_path, templates_cache, f"training:\n  steps: {steps}\n")
    slurm_id = None
    try:
        start = wait_events(job, "steps", lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] >= 20],
                            START_TIMEOUT_S)
        slurm_id = read_events(job / "events.jsonl", "job_started")[0]["slurm_job_id"]
        assert start
        # The measured window, just under a minute: the poll is every 20 s at the least, so any such
        # window holds at most 3 of them. This test asks Slurm nothing meanwhile.
        before = client_rpcs()
        time.sleep(59)
        after = client_rpcs()
        sent = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
        assert [e for e in read_events(job / "events.jsonl", "step") if e["step"] > 20], "it trained meanwhile"
        print(f"controller RPCs in 59 s of the steady state: {sum(sent.values())} ({sent})")
        assert 1 <= sum(sent.values()) <= 6, sent  # it polls, and gently
    finally:
        if slurm_id:
            subprocess.run(["scancel", slurm_id], timeout=30, check=False)
