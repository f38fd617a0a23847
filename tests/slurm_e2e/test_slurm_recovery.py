"""End to end on the real local Slurm lab: `submit` a 4-node job, then kill a node (slurmd, stepds,
tasks), down one with scontrol, freeze one with SIGSTOP. Each time the supervisor must detect the
loss before Slurm marks the node DOWN, training must go on from the same step on 3 nodes, and a
replacement (a one-node --exclusive job) must be health-checked and join: 4 nodes again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from oobleck_slurm.protocol.events import read_events
from oobleck_slurm.protocol.wire import ProtocolError, connect

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]


def cli(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "oobleck_slurm", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def recover(drill_module, lab, job: Path, node: str, kind: str) -> dict:
    """Inject a fault into `node`, wait for detection, resume on 3 nodes, and the replacement's join."""
    d = drill_module.drill(lab, job, node, kind)
    # 3 survivors; 4 when the previous drill's replacement joined in the same recovery (a loaded machine)
    assert sum(len(p["nodes"]) for p in d.resumed_plan["pipelines"]) in (3, 4)
    assert d.failure["cause"] == d.lost["cause"]
    # The step in progress at the failure is replayed (or the one before it, by ranks that had already
    # stepped); on a loaded machine every survivor may have finished it before rank 0 published it, and
    # then training goes on with the next one: no step is skipped either way.
    assert d.failure["step"] - 1 <= d.resumed["step"] <= d.failure["step"] + 1
    assert d.health and d.health[-1]["ok"]
    assert sum(len(p["nodes"]) for p in d.joined_plan["pipelines"]) == 4
    print(f"{kind} {node}: detected by {d.lost['cause']} after {d.lost['detection_seconds']:.3f}s; "
          f"Slurm DOWN after {d.slurm_down_s}s; resumed in {d.resumed['total_seconds']:.2f}s at step "
          f"{d.resumed['step']}; joined {d.joined['node']} {d.joined['t'] - d.t:.1f}s after the fault, "
          f"{d.joined_after_registration_s:.1f}s after its agent registered (health check "
          f"{d.health[-1]['seconds']:.1f}s, join {d.joined['seconds']:.2f}s)")
    if d.slurm_down_s is not None and kind != "down":  # an admin's DOWN is immediate: Slurm is the signal
        assert d.lost["detection_seconds"] < d.slurm_down_s
    return d.lost


def test_kill_down_freeze_each_recovers_and_refills(slurm_cluster, slurm_drill, tmp_path: Path,
                                                   templates_cache: Path) -> None:
    lab = slurm_cluster
    recipe = tmp_path / "lab.yaml"
    recipe.write_text(slurm_drill.RECIPE.format(repo=REPO))

    done = cli(tmp_path, "submit", str(recipe), "--detach", "--cache", str(templates_cache))
    assert done.returncode == 0, done.stdout + done.stderr
    (job,) = (tmp_path / "jobs").iterdir()
    try:
        wait_event = slurm_drill.wait_event
        start = wait_event(job, "job_started", lambda ev: [e for e in ev if e["kind"] == "job_started"], 60)[0]
        wait_event(job, "first steps", lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] >= 3], 120)
        others = start["nodes"][1:]  # not the batch node: it runs the supervisor

        # An unauthenticated peer changes nothing: refused and logged, the job goes on.
        with pytest.raises((EOFError, OSError, ProtocolError)):  # refused: no authenticated reply
            port = json.loads((job / "meta.json").read_text())["supervisor"]["port"]
            ch = connect("127.0.0.1", port, b"x" * 32, {"role": "intruder"})
            ch.send({"type": "fault", "node": others[0], "how": "agent", "t": 0})
            ch.recv()
        wait_event(job, "refused", lambda ev: [e for e in ev if e["kind"] == "refused"], 10)
        assert not read_events(job / "events.jsonl", "node_lost")

        lost = recover(slurm_drill, lab, job, others[0], "node")
        assert lost["cause"] in ("agent_lost", "srun_exit", "heartbeat")
        recover(slurm_drill, lab, job, others[1], "down")
        lost = recover(slurm_drill, lab, job, others[2], "freeze")
        assert lost["cause"] == "heartbeat"

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


TWO_WORKER_STEPS = 40  # the kill follows step 3 by a CLI call (~2 s) and is found by its exit at once
TWO_WORKERS = """extends: {repo}/recipes/lab-slurm.yaml
cluster:
  workers_per_node: 2
  cpus_per_node: 2
  time: "00:15:00"
training:
  steps: {steps}
  precision: fp64
fault_tolerance:
  heartbeat_lease: 10  # the kill is found by its exit; 8 fp64 workers on 2 busy cores can starve an agent 2.5 s
  collective_timeout: 2.0
  step_timeout: 30
  reconfiguration_timeout: 60
  replacement: none
  checkpoint_interval: 0
"""


def test_two_workers_per_node_on_slurm_survive_kill_9_of_one(slurm_cluster, tmp_path: Path,
                                                            templates_cache: Path) -> None:
    """The lab with 2 workers per node (8 ranks over 4 srun steps): kill -9 of one worker takes its
    node out, the other nodes' workers keep their processes, every step's loss equals the reference.

    `submit` runs attached, as a user runs it without --detach: it follows the Slurm job's event log to
    the supervisor's job_finished and exits with its code; with --json its stdout is the event stream,
    one JSON object a line, and what it says to people goes to stderr."""
    import time

    from reference import train_reference  # tests/reference.py

    from oobleck_slurm.engine.spec import JobSpec

    recipe = tmp_path / "lab2.yaml"
    recipe.write_text(TWO_WORKERS.format(repo=REPO, steps=TWO_WORKER_STEPS))
    out, err = tmp_path / "submit.out", tmp_path / "submit.err"
    with out.open("w") as stdout, err.open("w") as stderr:  # files: the stream may outgrow a pipe's buffer
        follower = subprocess.Popen([sys.executable, "-m", "oobleck_slurm", "submit", str(recipe), "--json",
                                     "--cache", str(templates_cache)],
                                    cwd=tmp_path, stdout=stdout, stderr=stderr, text=True)
    job = None
    try:
        deadline = time.monotonic() + 180
        while not (jobs := list((tmp_path / "jobs").glob("*"))):
            assert follower.poll() is None, err.read_text()
            assert time.monotonic() < deadline, "no job folder"
            time.sleep(0.2)
        (job,) = jobs
        events = job / "events.jsonl"
        while not [e for e in read_events(events, "step") if e["step"] >= 3]:
            assert time.monotonic() < deadline, "no step 3"
            time.sleep(0.2)
        plan = read_events(events, "plan")[0]
        assert plan["ranks"] == 8 and plan["workers_per_node"] == 2
        victim = read_events(events, "job_started")[0]["nodes"][1]  # not the batch node (the supervisor's)
        kill = cli(tmp_path, "kill-node", str(job), victim, "--how", "worker", "--worker", "1")
        assert kill.returncode == 0, kill.stdout + kill.stderr
        assert follower.wait(timeout=300) == 0, err.read_text()
        (finished,) = read_events(events, "job_finished")
        assert finished["status"] == "completed", finished
        lost = read_events(events, "node_lost")
        assert [(e["node"], e["cause"]) for e in lost] == [(victim, "process_exit")], lost
        losses = {e["step"]: e["loss"] for e in read_events(events, "step")}
        ref, _ = train_reference(JobSpec.from_json((job / "job.json").read_text()))
        assert sorted(losses) == list(range(TWO_WORKER_STEPS))
        assert all(abs(losses[s] - r) <= 1e-5 * abs(r) for s, r in enumerate(ref)), (losses, ref)

        said = err.read_text()
        slurm_job_id = json.loads((job / "meta.json").read_text())["slurm_job_id"]
        assert f"submitted (Slurm job {slurm_job_id})" in said.replace("\n", " ")
        streamed = [json.loads(line) for line in out.read_text().splitlines()]  # every line is JSON
        assert streamed == read_events(events)[: len(streamed)]  # the job's own events, in order
        assert [e["step"] for e in streamed if e["kind"] == "step"] == list(range(TWO_WORKER_STEPS))
        assert streamed[-1]["kind"] == "job_finished" and streamed[-1]["status"] == "completed"
        assert "summary: completed" in said
    finally:
        if follower.poll() is None:
            follower.kill()
        if job is not None:
            print(cli(tmp_path, "cancel", str(job)).stdout)
