"""Preemption drill on the real local Slurm lab: Slurm's SIGUSR2 to the job's steps (what submitit's
`--signal=USR2@90` sends before the time limit) -> the agents relay it, submitit's handler in the
supervisor asks the workers for an on-demand checkpoint, and `scontrol requeue` runs the same job again.
The requeued run (same Slurm job id, restart count 1) resumes at the checkpointed step and each step's
loss equals the failure-free single-process reference's."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_events import events_so_far
from reference import train_reference  # tests/reference.py
from wandb_files import history, offline_runs  # tests/wandb_files.py

from oobleck_slurm.cluster.slurm import parse_scontrol_records
from oobleck_slurm.dashboard.wandb_logger import STEP_METRIC
from oobleck_slurm.engine.spec import JobSpec
from oobleck_slurm.protocol.events import read_events

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]
STEPS = 30
START_TIMEOUT_S = 120.0  # submit -> training runs (the lab has 2 cores; torch imports take seconds)
REQUEUE_TIMEOUT_S = 120.0  # notice -> the requeued run started (teardown, cred_expire=10 s, scheduling)
LOSS_RTOL = 1e-5  # fp32; the engine matches the reference to ~1e-7 (docs/recovery.md)


def wait_events(job: Path, what: str, check, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while not (found := check(events_so_far(job / "events.jsonl"))):
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                             for p in sorted((job / "logs").glob("*")) if p.is_file())
            tail = [e for e in read_events(job / "events.jsonl") if e["kind"] not in ("node", "step")][-12:]
            pytest.fail(f"{what}: not seen within {timeout}s\n{tail}\n{logs}")
        time.sleep(0.2)
    return found


def assert_on_reference(job: Path, steps: list[dict]) -> None:
    """Every `step` event's loss equals the failure-free single-process reference's at its step."""
    ref, _ = train_reference(JobSpec.from_json((job / "job.json").read_text()))
    for e in steps:
        assert e["loss"] == pytest.approx(ref[e["step"]], rel=LOSS_RTOL), e["step"]


def slurm_job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    return parse_scontrol_records(out)[0]


def test_preemption_checkpoints_requeues_and_resumes_the_same_trajectory(slurm_cluster, tmp_path: Path,
                                                                       templates_cache: Path) -> None:
    recipe = tmp_path / "requeue.yaml"
    recipe.write_text(f"""extends: {REPO / 'recipes' / 'lab-slurm.yaml'}
cluster:
  time: "00:10:00"
training:
  steps: {STEPS}
fault_tolerance:
  checkpoint_interval: 0
  replacement: none
logging:
  wandb: {{project: lab, mode: offline}}
""")
    done = subprocess.run([sys.executable, "-m", "oobleck_slurm", "submit", str(recipe), "--detach",
                           "--cache", str(templates_cache)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (job,) = (tmp_path / "jobs").iterdir()
    slurm_id = None
    try:
        start = wait_events(job, "job_started", lambda ev: [e for e in ev if e["kind"] == "job_started"],
                            START_TIMEOUT_S)[0]
        slurm_id = start["slurm_job_id"]
        wait_events(job, "steps", lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] >= 4],
                    START_TIMEOUT_S)
        # Without --batch: every process of the job's steps (the agents, not the batch script).
        subprocess.run(["scancel", "--signal=USR2", slurm_id], check=True, timeout=30)
        ckpt = wait_events(job, "on-demand checkpoint", lambda ev: [e for e in ev if e["kind"] == "checkpoint"
                                                                    and e.get("on_demand")], 90)[0]
        assert ckpt["ok"] and ckpt["step"] >= 4
        again = wait_events(job, "requeued run", lambda ev: [e for e in ev if e["kind"] == "job_started"
                                                             and e["requeued"]], REQUEUE_TIMEOUT_S)[0]
        assert again["slurm_job_id"] == slurm_id
        finished = wait_events(job, "end of the requeued run", lambda ev: [e for e in ev if e["kind"] == "job_finished"
                                                                           and e["t"] > again["t"]], 180)[0]
        assert finished["status"] == "completed", finished
        record = slurm_job(slurm_id)
        assert record["Restarts"] == "1", record
        events = read_events(job / "events.jsonl")
        first_run = [e for e in events if e["t"] < again["t"]]
        assert [e["status"] for e in first_run if e["kind"] == "job_finished"] == ["preempted"]
        resumed = [e for e in events if e["kind"] == "step" and e["t"] > again["t"]]
        assert resumed[0]["step"] == ckpt["step"], "the requeued run starts at the checkpointed step, not 0"
        assert [e["step"] for e in resumed] == list(range(ckpt["step"], STEPS))
        assert_on_reference(job, resumed)
        # W&B (offline mode, no network): the requeued run's supervisor resumed the job's one run.
        runs = offline_runs(job / "wandb")
        assert len(runs) == 2 and len({p.name for p in runs}) == 1, runs  # run-<id>.wandb twice, one id
        logged = {row[STEP_METRIC] for p in runs for row in history(p) if "train/loss" in row}
        assert logged == set(range(STEPS)), sorted(set(range(STEPS)) - logged)
    finally:
        if slurm_id:
            subprocess.run(["scancel", slurm_id], timeout=30, check=False)


def submit_lab_job(tmp_path: Path, templates_cache: Path, extra: str) -> Path:
    recipe = tmp_path / "job.yaml"
    recipe.write_text(f"extends: {REPO / 'recipes' / 'lab-slurm.yaml'}\n{extra}")
    done = subprocess.run([sys.executable, "-m", "oobleck_slurm", "submit", str(recipe), "--detach",
                           "--cache", str(templates_cache)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (job,) = (tmp_path / "jobs").iterdir()
    return job


def complete_checkpoints(job: Path) -> list[int]:
    """Steps whose checkpoint the job logged as written, in order."""
    return [e["step"] for e in events_so_far(job / "events.jsonl") if written(e)]


def written(event: dict) -> bool:
    """A `checkpoint` event of a complete checkpoint (a periodic one has no `ok`; a failed one says False)."""
    return event["kind"] == "checkpoint" and event.get("step") is not None and event.get("ok", True)


@pytest.mark.parametrize("how", ["scontrol-requeue", "sigterm"])
def test_a_restart_slurm_starts_resumes_from_the_newest_complete_checkpoint(slurm_cluster, tmp_path: Path,
                                                                           templates_cache: Path, how: str) -> None:
    """Restarts that Slurm starts, not the project's notice path: `scontrol requeue` (Slurm sends
    SIGTERM to every step and the batch step, SIGKILL after KillWait, then requeues), and a preemption's
    SIGTERM with no USR2 before it (`scancel --signal=TERM --full`, then the requeue a `PreemptMode=REQUEUE`
    preemption makes). The requeued run's first step is the newest complete checkpoint's (the on-demand
    one of the SIGTERM, or the periodic one before it), never step 0, and every step's loss equals the
    failure-free reference's; the run completes; no checkpoint is written over with an earlier step."""
    steps = 160  # ~10 steps/s on the lab: the signal lands mid-run
    job = submit_lab_job(tmp_path, templates_cache, f"""training:
  steps: {steps}
fault_tolerance:
  checkpoint_interval: 50
  replacement: none
""")
    slurm_id = None
    try:
        start = wait_events(job, "job_started", lambda ev: [e for e in ev if e["kind"] == "job_started"],
                            START_TIMEOUT_S)[0]
        slurm_id = start["slurm_job_id"]
        assert start["requeued"] is False
        wait_events(job, "a periodic checkpoint and steps past it",
                    lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] >= 60] if complete_checkpoints(job)
                    else [], START_TIMEOUT_S)
        if how == "sigterm":
            subprocess.run(["scancel", "--signal=TERM", "--full", slurm_id], check=True, timeout=30)
            wait_events(job, "the first run's end", lambda ev: [e for e in ev if e["kind"] == "job_finished"], 90)
        subprocess.run(["scontrol", "requeue", slurm_id], check=True, timeout=30)
        again = wait_events(job, "requeued run", lambda ev: [e for e in ev if e["kind"] == "job_started"
                                                             and e["requeued"]], REQUEUE_TIMEOUT_S)[0]
        assert again["slurm_job_id"] == slurm_id
        finished = wait_events(job, "end of the requeued run", lambda ev: [e for e in ev if e["kind"] == "job_finished"
                                                                           and e["t"] > again["t"]], 240)[0]
        assert finished["status"] == "completed", finished
        events = read_events(job / "events.jsonl")
        before = [e for e in events if e["t"] < again["t"]]
        assert [e["status"] for e in before if e["kind"] == "job_finished"] in (["preempted"], []), before[-5:]
        newest = max(e["step"] for e in before if written(e))
        resumed = [e for e in events if e["kind"] == "step" and e["t"] > again["t"]]
        assert resumed[0]["step"] == newest, "the requeued run starts at the newest complete checkpoint"
        assert [e["step"] for e in resumed] == list(range(newest, steps))
        after = [e["step"] for e in events if written(e) and e["t"] > again["t"]]
        assert all(s > newest for s in after), f"a checkpoint of an earlier step was written again: {after}"
        assert_on_reference(job, resumed)
        assert int(slurm_job(slurm_id)["Restarts"]) >= 1
    finally:
        if slurm_id:
            subprocess.run(["scancel", slurm_id], timeout=30, check=False)


def test_a_time_limit_chain_completes_across_five_allocations(slurm_cluster, tmp_path: Path,
                                                             templates_cache: Path) -> None:
    """A 1-minute time limit with the notice 30 s before it (Slurm checks time limits every ~30 s, so
    the notice comes anywhere in the first half): each allocation trains until the notice, checkpoints
    and is requeued by submitit, past submitit's default of 3 timeouts (`cluster.requeues`, 1000 by
    default), until the run completes; every step's loss equals the reference's."""
    # 350 steps: 5-6 one-minute allocations on an idle lab machine (60-70 steps each). Each allocation's
    # start (4 agents importing torch on 2 cores, the pre-flight check) takes 10-15 s of the ~20 s before
    # the notice, so on a loaded machine many allocations train few steps or none: a CI run needed 40 for
    # 393 steps in 1226 s. The wait below allows for that.
    steps = 350
    job = submit_lab_job(tmp_path, templates_cache, f"""cluster:
  time: "00:01:00"
  signal_delay_s: 30
training:
  steps: {steps}
fault_tolerance:
  checkpoint_interval: 0
  replacement: none
""")
    slurm_id = None
    try:
        start = wait_events(job, "job_started", lambda ev: [e for e in ev if e["kind"] == "job_started"],
                            START_TIMEOUT_S)[0]
        slurm_id = start["slurm_job_id"]
        done = wait_events(job, "the completed run", lambda ev: [e for e in ev if e["kind"] == "job_finished"
                                                                 and e["status"] == "completed"], 2100)[0]
        events = read_events(job / "events.jsonl")
        runs = [e for e in events if e["kind"] == "job_started"]
        assert len(runs) >= 5, f"{len(runs)} allocations"
        assert [e["status"] for e in events if e["kind"] == "job_finished"][:-1] == ["preempted"] * (len(runs) - 1)
        assert int(slurm_job(slurm_id)["Restarts"]) == len(runs) - 1
        trained = [e for e in events if e["kind"] == "step"]
        assert sorted({e["step"] for e in trained}) == list(range(steps))
        assert_on_reference(job, trained)
        print(f"time-limit chain: {len(runs)} allocations, {done['t'] - start['t']:.0f} s")
    finally:
        if slurm_id:
            subprocess.run(["scancel", slurm_id], timeout=30, check=False)
