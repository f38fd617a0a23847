"""Supervisor failover on the real local Slurm lab (docs/failover.md, "Under Slurm").

With `cluster.supervisor.failover` the primary and the standby supervisor each run as the batch step of
their own one-node job, and every training node is its own one-node `--exclusive` job whose batch step
is its agent. `kill-node JOB supervisor --how node` SIGKILLs every process of the job on the primary's
node (its job then ends); the standby's job claims epoch 2 from the lapsed lease, the agents and workers
follow it, and training goes on from the replicas in memory to the end with the failure-free losses.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_events import dump_stacks, events_so_far

from oobleck_slurm.cluster.slurm import parse_scontrol_records
from oobleck_slurm.protocol.events import read_events

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]
# Enough steps that the takeover comes mid-training. The kill follows step 5 by a CLI call (~2 s). A
# killed supervisor's workers stall at once (its connections close), but a frozen one's train on until
# its lease lapses (2.5 s: about 30 steps here).
STEPS = 80
RECIPE = """extends: {repo}/recipes/lab-slurm.yaml
cluster:
  time: "00:15:00"
  supervisor:
    failover: true
training:
  steps: {steps}
  precision: fp64
fault_tolerance:
  heartbeat_interval: 0.25
  heartbeat_lease: 2.5
  collective_timeout: 2.0
  step_timeout: 30
  reconfiguration_timeout: 60
  replacement: none
  checkpoint_interval: 0
"""


def cli(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "oobleck_slurm", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def wait_for(job: Path, what: str, check, timeout: float):
    """Poll the job's events until `check(events)` is truthy; fail with the tail of the log after `timeout`."""
    deadline = time.monotonic() + timeout
    while not (found := check(events_so_far(job / "events.jsonl"))):
        if time.monotonic() > deadline:
            tail = "\n".join(str(e) for e in read_events(job / "events.jsonl")[-20:] if e["kind"] != "node")
            logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                             for p in sorted((job / "submitit").glob("*.err")) + sorted((job / "logs").glob("*"))
                             if p.is_file())
            pytest.fail(f"{what}: not seen after {timeout}s\n{tail}\n{logs}\n{dump_stacks(job)}")
        time.sleep(0.1)
    return found


def submit(tmp_path: Path, cache: Path) -> Path:
    """`submit --detach` of the failover recipe, as a user runs it; the job folder. The session's templates
    cache: the lab's profile is measured once (its link measurement and layer timings cost seconds of CPU)."""
    recipe = tmp_path / "failover.yaml"
    recipe.write_text(RECIPE.format(repo=REPO, steps=STEPS))
    done = cli(tmp_path, "submit", str(recipe), "--detach", "--cache", str(cache))
    assert done.returncode == 0, done.stdout + done.stderr
    (job,) = (tmp_path / "jobs").iterdir()
    return job


def node_job_states(lab, node_jobs: list[str]) -> list[str]:
    """Each training node job's final state in accounting, once the agents told to shut down ended them."""
    deadline = time.monotonic() + 60
    while lab.run("squeue", "-h", "-j", ",".join(node_jobs), "-o", "%i").split():
        assert time.monotonic() < deadline, "the training node jobs did not end after the job"
        time.sleep(0.2)

    def sacct_states() -> list[str]:
        return [lab.run("sacct", "-n", "-X", "-P", "-j", j, "-o", "State").split()[0] for j in node_jobs]

    # Accounting lags squeue: under load sacct still said RUNNING for a job squeue no longer listed.
    while {"PENDING", "RUNNING", "COMPLETING"} & set(states := sacct_states()):
        assert time.monotonic() < deadline, f"sacct never recorded the node jobs' ends: {states}"
        time.sleep(0.2)
    return states


def job_node(lab, job_id: str) -> str:
    """The node a running one-node job runs on."""
    return parse_scontrol_records(lab.run("scontrol", "show", "job", "-o", job_id))[0]["NodeList"]


@pytest.mark.parametrize("how", ["node", "freeze", "machine"])
def test_supervisor_lost_standby_job_takes_over(slurm_cluster, tmp_path: Path, templates_cache: Path, how: str) -> None:
    """`node`: `kill-node --how node`, every process of the job on the primary's node SIGKILLed (its job
    ends); `freeze`: the primary SIGSTOPped (its connections stay open; the new primary cancels its
    job); `machine`: the lab kills the whole node, its slurmd too (Slurm marks it DOWN later).

    `node` first loses a training node the same way: that ends only its own job, the others go on (3
    nodes) under the same supervisor, and after the takeover the 3 node jobs end COMPLETED with the job."""
    from reference import train_reference  # tests/reference.py

    from oobleck_slurm.engine.spec import JobSpec

    lab = slurm_cluster
    # 4 exclusive training nodes, the primary's and the standby's jobs, and the new standby after the
    # takeover (on neither supervisor's node): 7 nodes.
    for _ in range(3):
        lab.start_spare()
    job = submit(tmp_path, templates_cache)
    try:
        started = wait_for(job, "job_started", lambda ev: [e for e in ev if e["kind"] == "job_started"], 180)[0]
        # The standby's job, submitted once the primary runs, then running; then step 5: the kill follows
        # step 5 at once, well before the last step.
        deadline = time.monotonic() + 60
        while len((meta := json.loads((job / "meta.json").read_text())).get("supervisor_jobs", [])) < 2:
            assert time.monotonic() < deadline, f"no standby job in meta.json: {meta}"
            time.sleep(0.2)
        primary_job, standby_job = meta["supervisor_jobs"][:2]
        primary_node = meta["supervisor"]["host"]
        assert started["supervisor_node"] == primary_node
        assert primary_node not in started["nodes"]  # the training nodes are jobs of their own
        while lab.run("squeue", "-h", "-j", standby_job, "-o", "%T").strip() != "RUNNING":
            assert time.monotonic() < deadline, f"the standby's job {standby_job} does not run"
            time.sleep(0.2)
        standby_node = job_node(lab, standby_job)
        assert standby_node != primary_node
        wait_for(job, "step 5", lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] >= 5], 240)
        node_jobs = json.loads((job / "meta.json").read_text())["node_jobs"]
        assert len(node_jobs) == 4
        victim = None
        if how == "node":  # a training node's loss first: recovered by the primary, no takeover
            victim = started["nodes"][1]
            kill = cli(tmp_path, "kill-node", str(job), victim, "--how", "node")
            assert kill.returncode == 0, kill.stdout + kill.stderr
            lost = wait_for(job, "node_lost", lambda ev: [e for e in ev if e["kind"] == "node_lost"], 60)
            wait_for(job, "resumed after the node's loss",
                     lambda ev: [e for e in ev if e["kind"] == "resumed" and e["t"] > lost[0]["t"]], 120)
            assert not read_events(job / "events.jsonl", "takeover")

        if how == "machine":
            lab.kill_node(primary_node)
        else:
            kill = cli(tmp_path, "kill-node", str(job), "supervisor", "--how", how)
            assert kill.returncode == 0, kill.stdout + kill.stderr
        killed_at = time.time()  # both return once every process is SIGKILLed (or SIGSTOPped)
        takeover = wait_for(job, "takeover", lambda ev: [e for e in ev if e["kind"] == "takeover"], 60)[0]
        assert takeover["epoch"] == 2 and not takeover["lost"], takeover
        resumed = wait_for(job, "resumed after the takeover",
                           lambda ev: [e for e in ev if e["kind"] == "resumed" and e["t"] > takeover["t"]], 120)[0]
        finished = wait_for(job, "job_finished", lambda ev: [e for e in ev if e["kind"] == "job_finished"], 600)[0]
        assert finished["status"] == "completed", finished

        events = read_events(job / "events.jsonl")
        assert not [e for e in events if e["kind"] == "checkpoint_fallback"]
        assert [e["node"] for e in events if e["kind"] == "node_lost"] == ([victim] if victim else [])
        assert [e["epoch"] for e in events if e["kind"] == "takeover"] == [2]
        losses = {e["step"]: e["loss"] for e in events if e["kind"] == "step"}
        ref, _ = train_reference(JobSpec.from_json((job / "job.json").read_text()))
        assert sorted(losses) == list(range(STEPS))
        assert all(abs(losses[s] - r) <= 1e-5 * abs(r) for s, r in enumerate(ref)), (losses, ref)
        new_primary = json.loads((job / "meta.json").read_text())["supervisor"]["host"]
        assert new_primary == standby_node
        if victim:
            states = node_job_states(lab, node_jobs)
            print(f"training node {victim} killed: node jobs {dict(zip(node_jobs, states))}")
            assert states.count("COMPLETED") == 3, states
        print(f"{how}: supervisor {primary_node} (job {primary_job}) killed; standby {standby_node} (job {standby_job}) "
              f"took over: lease age {takeover['lease_age']:.2f}s, agents back {takeover['seconds']:.2f}s, "
              f"training resumed {resumed['t'] - killed_at:.2f}s after the kill at step {resumed['step']}; "
              f"primary's job: {lab.run('sacct', '-n', '-X', '-P', '-j', primary_job, '-o', 'State,ExitCode')}")
    finally:
        print(cli(tmp_path, "cancel", str(job)).stdout)
