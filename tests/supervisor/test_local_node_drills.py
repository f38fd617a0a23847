"""`kill-node --how node` and `--how freeze` on the local backend (the embedded default's): a virtual
node's processes are its agent and its workers, known to the supervisor; a crashed node is found by
its agent's connection, a frozen one (every process SIGSTOPped, no FIN ever sent) by its lease."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from job_events import assert_trained_on_the_reference, running_job, wait_for

from oobleck_slurm.protocol.events import read_events

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
LEASE_S = 2.5
HEARTBEAT_S = 0.5  # fault_tolerance.heartbeat_interval (the default)


def test_node_and_freeze_drills_on_virtual_nodes(tmp_path: Path, templates_cache: Path) -> None:
    with running_job(tmp_path, f"  checkpoint_interval: 0\n  replacement: none\n  heartbeat_lease: {LEASE_S}\n"
                               "  step_timeout: 30\n  reconfiguration_timeout: 60\n", templates_cache, precision="fp64") as job:
        wait_for(job, "steps", lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] >= 2])
        for node, how, causes in [("node2", "node", {"agent_lost", "process_exit", "srun_exit"}), ("node3", "freeze", {"heartbeat"})]:
            done = subprocess.run([sys.executable, "-m", "oobleck_slurm", "kill-node", str(job), node, "--how", how],
                                  capture_output=True, text=True, timeout=60, cwd=tmp_path)
            assert done.returncode == 0, done.stdout + done.stderr
            lost = wait_for(job, f"{node} lost", lambda ev, node=node: [
                e for e in ev if e["kind"] == "node_lost" and e["node"] == node])[0]
            assert lost["cause"] in causes, lost
            if how == "freeze":  # no connection closes: only the lease can tell (counted from the last
                # heartbeat, up to one heartbeat interval before the freeze)
                assert LEASE_S - HEARTBEAT_S - 0.1 <= lost["detection_seconds"] < LEASE_S + 10, lost
            steps = len(read_events(job / "events.jsonl", "step"))
            wait_for(job, f"training after {node}", lambda ev, steps=steps: len(
                [e for e in ev if e["kind"] == "step"]) > steps + 2)
        final = read_events(job / "events.jsonl", "plan")[-1]
        assert sorted(n for p in final["pipelines"] for n in p["nodes"]) == ["node1", "node4"]
    # (once the job is stopped: the reference would otherwise share the cores with it)
    assert_trained_on_the_reference(job)  # through every drill, on the failure-free trajectory
