"""A worker that hangs inside a step while it stays runnable (a deadlock, not SIGSTOP): its agent sees
a live process, every peer waits for it in the step's all-reduce, and only per-rank progress
(`node/{id}/step`) names it. Real supervisor, agents and workers on the local backend."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from oobleck_slurm.cluster.jobdir import create_job_dir
from oobleck_slurm.events import read_events
from oobleck_slurm.recipe import load_recipe
from oobleck_slurm.supervisor.main import FAULTS_FILE

from job_events import wait_for  # noqa: E402 - tests/supervisor helper

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEP_TIMEOUT_S = 4.0
HANG_STEP = 4


def test_hung_running_worker_is_named_and_evicted(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"extends: {REPO / 'recipes' / 'local-tiny.yaml'}\ntraining:\n  steps: 100000\n"
                      f"fault_tolerance:\n  checkpoint_interval: 0\n  step_timeout: {STEP_TIMEOUT_S}\n"
                      "  reconfiguration_timeout: 60\n  replacement: none\n")
    job = create_job_dir(load_recipe(recipe), tmp_path / "jobs").path
    (job / FAULTS_FILE).write_text(json.dumps([{"node": "node3", "step": HANG_STEP, "at": "start", "do": "hang"}]))
    sup = subprocess.Popen([sys.executable, "-m", "oobleck_slurm.supervisor.main", str(job), "--backend", "local"],
                           cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        lost = wait_for(job, "node3 lost", lambda ev: [e for e in ev if e["kind"] == "node_lost"], 90)
        assert [(e["node"], e["cause"]) for e in lost] == [("node3", "hung")], lost
        assert "behind" not in lost[0]["detail"] and f"collective of step {HANG_STEP - 1}, its peers of step {HANG_STEP}" in lost[0]["detail"]
        detection = read_events(job / "events.jsonl", "detection")[0]
        assert STEP_TIMEOUT_S <= detection["seconds"] < STEP_TIMEOUT_S + 2.0, detection
        resumed = wait_for(job, "resumed", lambda ev: [e for e in ev if e["kind"] == "resumed"], 60)[0]
        assert resumed["step"] == HANG_STEP  # the stalled step is replayed by the survivors
        wait_for(job, "steps after", lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] > HANG_STEP + 2])
        plan = read_events(job / "events.jsonl", "plan")[-1]
        assert sorted(n for p in plan["pipelines"] for n in p["nodes"]) == ["node1", "node2", "node4"]
    finally:
        children = psutil.Process(sup.pid).children(recursive=True)
        sup.terminate()
        sup.wait(30)
        psutil.wait_procs(children, timeout=10)  # agents see the supervisor gone and end their workers
