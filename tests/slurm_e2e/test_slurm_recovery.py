"""End to end on the real local Slurm lab: `submit` a 4-node job, then kill a node (slurmd, stepds,
tasks), down one with scontrol, freeze one with SIGSTOP. Each time the supervisor must detect the
loss before Slurm marks the node DOWN, training must go on from the same step on 3 nodes, and a
replacement (a one-node --exclusive job) must be health-checked and join: 4 nodes again.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from oobleck_slurm.events import read_events
from oobleck_slurm.supervisor.client import notify_fault
from oobleck_slurm.supervisor.server import connect

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]


def cli(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "oobleck_slurm", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def wait_event(job: Path, what: str, check, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        events = read_events(job / "events.jsonl")
        found = check(events)
        if found:
            return found
        finished = [e for e in events if e["kind"] == "job_finished"]
        if finished or time.monotonic() > deadline:
            tail = "\n".join(str(e) for e in events[-15:] if e["kind"] not in ("node",))
            logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in
                             sorted((job / "logs").glob("*")) if p.is_file())
            pytest.fail(f"{what}: not seen ({'job finished' if finished else f'{timeout}s'})\n{tail}\n{logs}")
        time.sleep(0.2)


class DownWatch(threading.Thread):
    """Slurm's own view: seconds from `start` until the node is DOWN (None if not within `limit`)."""

    def __init__(self, lab, node: str, start: float, limit: float = 40.0) -> None:
        super().__init__(daemon=True)
        self.lab, self.node, self.start_t, self.limit, self.seconds = lab, node, start, limit, None

    def run(self) -> None:
        while time.time() - self.start_t < self.limit:
            with contextlib.suppress(Exception):
                if {"DOWN", "FAIL"} & self.lab.node_state(self.node):
                    self.seconds = time.time() - self.start_t
                    return
            time.sleep(0.1)


def recover(lab, job: Path, node: str, how: str, inject) -> dict:
    """Inject a fault into `node`, wait for detection, resume on 3 nodes, and the replacement's join."""
    lab.start_spare()  # a free node for the replacement job
    before = len(read_events(job / "events.jsonl"))
    t = time.time()
    notify_fault(job, node, how, t)
    inject()
    down = DownWatch(lab, node, t)
    down.start()
    lost = wait_event(job, f"{node} lost", lambda ev: [e for e in ev[before:] if e["kind"] == "node_lost"])[0]
    resumed = wait_event(job, "resumed", lambda ev: [e for e in ev[before:] if e["kind"] == "resumed"])[0]
    plan = [e for e in read_events(job / "events.jsonl", "plan") if e["generation"] == resumed["generation"]][0]
    assert sum(len(p["nodes"]) for p in plan["pipelines"]) == 3
    failure = [e for e in read_events(job / "events.jsonl", "failure")][-1]
    assert failure["cause"] == lost["cause"]
    assert resumed["step"] == failure["step"] or resumed["step"] == failure["step"] - 1  # same step (replayed)
    joined = wait_event(job, "replacement joined", lambda ev: [e for e in ev[before:] if e["kind"] == "node_joined"],
                        timeout=120)[0]
    health = [e for e in read_events(job / "events.jsonl", "health_check") if e["node"] == joined["node"]]
    assert health and health[-1]["ok"]
    plan = [e for e in read_events(job / "events.jsonl", "plan") if e["generation"] == joined["generation"]][0]
    assert sum(len(p["nodes"]) for p in plan["pipelines"]) == 4
    down.join()
    print(f"{how} {node}: detected by {lost['cause']} after {lost['detection_seconds']:.3f}s; "
          f"Slurm DOWN after {down.seconds}s; resumed in {resumed['total_seconds']:.2f}s at step {resumed['step']}; "
          f"joined {joined['node']} {joined['t'] - t:.1f}s after the fault")
    if down.seconds is not None and how != "down":  # an admin's DOWN is immediate: Slurm is the signal
        assert lost["detection_seconds"] < down.seconds
    return lost


def test_kill_down_freeze_each_recovers_and_refills(slurm_cluster, tmp_path: Path) -> None:
    lab = slurm_cluster
    recipe = tmp_path / "lab.yaml"
    recipe.write_text(f"""extends: {REPO / 'recipes' / 'lab-slurm.yaml'}
cluster:
  time: "00:10:00"
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
""")
    done = cli(tmp_path, "submit", str(recipe), "--detach")
    assert done.returncode == 0, done.stdout + done.stderr
    (job,) = (tmp_path / "jobs").iterdir()
    try:
        start = wait_event(job, "job_started", lambda ev: [e for e in ev if e["kind"] == "job_started"], 60)[0]
        wait_event(job, "first steps", lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] >= 3], 120)
        batch, others = start["nodes"][0], start["nodes"][1:]

        # An unauthenticated peer changes nothing: refused and logged, the job goes on.
        with pytest.raises(Exception):
            ch = connect("127.0.0.1", int(job.joinpath("meta.json").read_text().split('"port": ')[1].split(",")[0]
                                          .split("}")[0]), b"x" * 32, {"role": "intruder"})
            ch.send({"type": "fault", "node": others[0], "how": "agent", "t": 0})
            ch.recv()
        wait_event(job, "refused", lambda ev: [e for e in ev if e["kind"] == "refused"], 10)
        assert not read_events(job / "events.jsonl", "node_lost")

        lost = recover(lab, job, others[0], "node", lambda: lab.kill_node(others[0]))
        assert lost["cause"] in ("agent_lost", "srun_exit", "heartbeat")

        recover(lab, job, others[1], "down", lambda: lab.set_down(others[1], "drill"))

        frozen = lab.node_processes(others[2])

        def freeze() -> None:
            for p in frozen:
                with contextlib.suppress(psutil.Error):
                    p.send_signal(signal.SIGSTOP)

        lost = recover(lab, job, others[2], "freeze", freeze)
        assert lost["cause"] == "heartbeat"
        lab.kill_node(others[2])

        status = cli(tmp_path, "status", str(job))
        assert status.returncode == 0, status.stderr
        assert "recoveries" in status.stdout and "running" in status.stdout
        events = cli(tmp_path, "events", str(job))
        for kind in ("node_lost", "detection", "replan", "group_rebuild", "state_copy", "replay", "resumed",
                     "replacement_requested", "health_check", "node_joined"):
            assert kind in events.stdout, kind
        print(events.stdout)
    finally:
        cancel = cli(tmp_path, "cancel", str(job))
        print(cancel.stdout, cancel.stderr)
