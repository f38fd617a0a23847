"""Spare nodes and GPUs, on the lab. A job with a spare node in its allocation (`cluster.spare_nodes`,
`fault_tolerance.replacement: spare`, what the Slingshot and JURECA recipes rely on) loses a node as a
machine dies: the spare trains in its place, on the reference's trajectory. And the agents' GPU launch
line (`cluster/slurm.py` `srun_argv` with GPUs) run by Slurm on nodes that declare GPUs as generic
resources (tests/slurm/gres.conf.in: placeholder devices, no GPU): what each task receives from Slurm."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_slurm_requeue import START_TIMEOUT_S, assert_on_reference, submit_lab_job, wait_events

from oobleck_slurm.protocol.events import read_events

pytestmark = pytest.mark.slurm


def test_a_spare_node_of_the_allocation_trains_in_a_lost_nodes_place(slurm_cluster, tmp_path: Path,
                                                                      templates_cache: Path) -> None:
    lab = slurm_cluster
    steps = 300
    job = submit_lab_job(tmp_path, templates_cache, f"""cluster:
  nodes: 3
  spare_nodes: 1
training:
  steps: {steps}
fault_tolerance:
  replacement: spare
""")
    start = wait_events(job, "job_started", lambda ev: [e for e in ev if e["kind"] == "job_started"],
                        START_TIMEOUT_S)[0]
    assert len(start["nodes"]) == 3 and len(start["spares"]) == 1, start
    spare = start["spares"][0]
    victim = [n for n in start["nodes"] if n != start["supervisor_node"]][-1]
    wait_events(job, "steps", lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] >= 20], START_TIMEOUT_S)
    t_kill = time.time()
    lab.kill_node(victim)
    resumed = wait_events(job, "the spare training", lambda ev: [e for e in ev if e["kind"] == "plan"
                                                                 and spare in {n for p in e["pipelines"]
                                                                               for n in p["nodes"]}], 120)[0]
    wait_events(job, "the end", lambda ev: [e for e in ev if e["kind"] == "job_finished"], 300)
    events = read_events(job / "events.jsonl")
    assert [e["status"] for e in events if e["kind"] == "job_finished"] == ["completed"]
    assert [e["nodes"] for e in events if e["kind"] == "failure"] == [[victim]]
    assert victim not in {n for p in resumed["pipelines"] for n in p["nodes"]}
    assert not [e for e in events if e["kind"] == "checkpoint_fallback"]
    trained = [e for e in events if e["kind"] == "step"]
    assert sorted({e["step"] for e in trained}) == list(range(steps))
    assert_on_reference(job, trained)
    print(f"spare {spare} in the plan {resumed['t'] - t_kill:.2f} s after {victim} was killed")


DUMP = ("import json, os, sys; json.dump({k: v for k, v in os.environ.items() if k.startswith(('SLURM', 'CUDA'))}, "
        "open(sys.argv[1], 'w'))")


def test_the_gpu_launch_line_gives_each_agent_its_nodes_gpus(slurm_cluster, tmp_path: Path) -> None:
    """The batch step of a 2-node `--gpus-per-node=2` allocation starts one step per node with the
    agents' launch line (`slurm.start_step`, as `SrunLauncher` does); each task records the environment
    Slurm gave it."""
    lab = slurm_cluster
    script = tmp_path / "launch.py"
    script.write_text(f"""
import os, sys
from pathlib import Path
from oobleck_slurm.cluster import slurm
out = Path({str(tmp_path)!r})
nodes = slurm.expand_hostnames(os.environ["SLURM_JOB_NODELIST"])
steps = [slurm.start_step(n, [sys.executable, "-c", {DUMP!r}, str(out / f"{{n}}.json")], cpus=1, gpus=2,
                          output=out / f"{{n}}.log") for n in nodes]
sys.exit(max(p.wait() for p in steps))
""")
    done = subprocess.run(["sbatch", "--parsable", "--wait", "--no-kill", "-N2", "--gpus-per-node=2", "-c1",
                           "--time=5", f"--output={tmp_path / 'batch.log'}", "--wrap",
                           f"{sys.executable} {script}"], capture_output=True, text=True, timeout=180)
    logs = "\n".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert done.returncode == 0, done.stderr + logs
    job_id = done.stdout.strip().split(";")[0]
    seen = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("node*.json")}
    assert len(seen) == 2 and set(seen) <= set(lab.nodes), seen
    for node, env in seen.items():
        assert env["SLURMD_NODENAME"] == node
        assert env["SLURM_JOB_ID"] == job_id and env["SLURM_STEP_ID"] not in ("", "batch")
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1", env  # every GPU of the node: no per-task binding
        assert env["SLURM_GPUS_ON_NODE"] == "2", env
        assert env["SLURM_STEP_NUM_NODES"] == "1"
        assert env.get("SLURM_STEP_GPUS", "0,1").split(",") == ["0", "1"], env
    print("an agent step's Slurm environment:", {k: v for k, v in sorted(next(iter(seen.values())).items())
                                                 if "GPU" in k or "CUDA" in k})
