"""Closing the loop (slow): a scripted kill schedule run locally through the public CLI, and the
simulation of the same schedule, agree on the useful-time share within 10%.

Only the stable CLI is used: `submit RECIPE --detach --no-dashboard --job-root DIR`, then
`kill-node JOB NODE --how worker` when chosen conditions hold in events.jsonl (a step reached, a
`resumed` event), never fixed sleeps.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from recorded_run import simulate_recorded

from oobleck_slurm.protocol.events import read_events
from oobleck_slurm.simulate import job_events

REPO = Path(__file__).resolve().parents[2]


def cli(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "oobleck_slurm", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def wait_for(log: Path, condition, what: str, timeout: float = 240.0):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = read_events(log)
        found = condition(records)
        if found:
            return found
        if any(r["kind"] == "job_finished" for r in records) and what != "job_finished":
            pytest.fail(f"job finished before {what}: {[r['kind'] for r in records][-10:]}")
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


@pytest.mark.slow
def test_kill_schedule_run_and_its_simulation_agree(tmp_path: Path, templates_cache: Path) -> None:
    recipe = tmp_path / "loop.yaml"
    recipe.write_text(f"extends: {REPO / 'recipes' / 'local-tiny.yaml'}\ntraining:\n  steps: 120\n"
                      f"fault_tolerance:\n  f: 1\n  replacement: none\n  checkpoint_interval: 40\n")
    result = cli(tmp_path, "submit", str(recipe), "--detach", "--no-dashboard", "--job-root", str(tmp_path / "jobs"),
                 "--cache", str(templates_cache))
    assert result.returncode == 0, result.stdout + result.stderr
    (job,) = (tmp_path / "jobs").iterdir()
    log = job / "events.jsonl"
    # the schedule: kill node2's worker at step 30, then node3's worker at step 70 after the first recovery
    for node, at_step in (("node2", 30), ("node3", 70)):
        wait_for(log, lambda rs, s=at_step: any(r["kind"] == "step" and r["step"] >= s for r in rs), f"step {at_step}")
        killed = cli(tmp_path, "kill-node", str(job), node, "--how", "worker")
        assert killed.returncode == 0, killed.stdout + killed.stderr
        wait_for(log, lambda rs, n=node: any(r["kind"] == "failure" and n in r.get("nodes", []) for r in rs)
                 and any(r["kind"] == "resumed" and r["t"] > max(x["t"] for x in rs if x["kind"] == "failure")
                         for r in rs), f"resumed after {node}")
    finished = wait_for(log, lambda rs: [r for r in rs if r["kind"] == "job_finished"], "job_finished")
    assert finished[0]["status"] == "completed", finished
    measured, simulated = simulate_recorded(job_events(job))
    assert simulated.failures == 2
    assert abs(simulated.useful_fraction - measured.useful_fraction) <= 0.10 * measured.useful_fraction, (
        measured.useful_fraction, simulated.useful_fraction, simulated.seconds)
