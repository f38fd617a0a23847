"""The same supervisor and agents as under Slurm, on the local backend (virtual nodes as processes):
real agents, real workers, real SIGKILL/SIGSTOP through `kill-node`, a replacement that is
health-checked and joins, and an unauthenticated peer that changes nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from job_events import assert_trained_on_the_reference, running_job, wait_for

from oobleck_slurm.protocol.events import read_events
from oobleck_slurm.protocol.wire import ProtocolError, connect
from oobleck_slurm.supervisor.client import live_status

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_local_agents_detect_worker_agent_and_hang_and_refill(tmp_path: Path, templates_cache: Path) -> None:
    # step timeout 10 s: a survivor slowed by a busy machine (two test sessions on 2 cores) must not be
    # taken for hung while it leaves a generation; the stopped worker is named by the lease (3 s) anyway
    with running_job(tmp_path, "  checkpoint_interval: 0\n  step_timeout: 10\n  reconfiguration_timeout: 60\n",
                     templates_cache, nodes=5, precision="fp64") as job:
        wait_for(job, "steps", lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] >= 2])
        port = live_status(job)  # authenticated status works
        assert port.members == ("node1", "node2", "node3", "node4", "node5")
        supervisor = (job / "supervisor.json").read_text()
        address = __import__("json").loads(supervisor)
        with pytest.raises((EOFError, OSError, ProtocolError)):  # refused: no authenticated reply
            ch = connect(address["host"], address["port"], b"\0" * 32, {"role": "intruder"})
            ch.send({"type": "fault", "node": "node2", "how": "agent", "t": 0})
            ch.recv()
        wait_for(job, "refused", lambda ev: [e for e in ev if e["kind"] == "refused"], 30)
        # The hang first, on a calm machine: its detection time is asserted. The next drills do not wait
        # for the previous replacement (5 nodes: f=1's 2 pipelines survive the 3 losses): losses while
        # replacements join are part of the test.
        # A killed agent shows twice at once, as its closed connection and as its process's exit (the
        # local backend's srun step): whichever the supervisor reads first names it.
        for node, how, causes in [("node4", "hang", ("hung",)), ("node2", "worker", ("process_exit",)),
                                  ("node3", "agent", ("agent_lost", "srun_exit"))]:
            done = subprocess.run([sys.executable, "-m", "oobleck_slurm", "kill-node", str(job), node, "--how", how],
                                  capture_output=True, text=True, timeout=60, cwd=tmp_path)
            assert done.returncode == 0, done.stdout + done.stderr
            lost = wait_for(job, f"{node} lost", lambda ev, node=node: [e for e in ev if e["kind"] == "node_lost"
                                                                          and e["node"] == node])[0]
            assert lost["cause"] in causes, lost
            # a stopped worker: named after the heartbeat lease (3 s), not the step timeout (10 s)
            assert lost["detection_seconds"] < (4.5 if how == "hang" else 1.0)
            assert how != "hang" or "has been stopped" in lost["detail"]
        wait_for(job, "3 joins", lambda ev: len([e for e in ev if e["kind"] == "node_joined"]) >= 3, 180)
        final = read_events(job / "events.jsonl", "plan")[-1]
        members = [n for p in final["pipelines"] for n in p["nodes"]] + final["spares"]  # 8 microbatches: 4 pipelines may beat 5
        losses = [(e["node"], e["cause"], e.get("detail")) for e in read_events(job / "events.jsonl", "node_lost")]
        assert sorted(members) == ["node1", "node5", "r1", "r2", "r3"], losses
        assert all(e["ok"] for e in read_events(job / "events.jsonl", "health_check"))
    # (once the job is stopped: the reference would otherwise share the cores with it)
    assert_trained_on_the_reference(job)  # through every drill, on the failure-free trajectory
