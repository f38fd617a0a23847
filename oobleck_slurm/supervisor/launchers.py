"""How agents get onto nodes, and how a replacement node is asked for: Slurm or local processes.

    SrunLauncher    one `srun --no-kill --kill-on-bad-exit=0 -N1 -n1 -w NODE` step per node inside the
                    allocation (a step per node, so that srun's exit names the node whose task ended),
                    replacements as one-node `sbatch --exclusive` jobs whose batch script is an agent
    LocalLauncher   agents as local processes named node1, node2, ... (the embedded default)

The supervisor above them is the same.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from oobleck_slurm.cluster.slurm import NodeHealth, SlurmError, query_nodes, run_slurm, slurm_time_minutes
from oobleck_slurm.recipe import ClusterConfig

AGENT_MODULE = "oobleck_slurm.supervisor.agent"


class AgentLauncher(Protocol):
    def launch(self, node: str) -> subprocess.Popen: ...  # the process whose exit means "the node's task ended"
    def request(self, token: str) -> str | None: ...  # ask for one more node; a handle (job id) or None
    def node_states(self, nodes: Sequence[str]) -> dict[str, NodeHealth] | None: ...  # None: no such view
    def close(self) -> None: ...  # cancel outstanding requests


def agent_argv(job_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", AGENT_MODULE, str(job_dir), *extra]


def srun_argv(job_dir: Path, node: str, cpus: int, gpus: int = 0) -> list[str]:
    """The step that runs one node's agent. `--no-kill --kill-on-bad-exit=0`: the loss of another
    node or task must not end this one (measured: `--kill-on-bad-exit=0` alone is not enough);
    `--overlap`: the agent shares the node's CPUs with nothing else of ours but the batch step.
    With GPUs the step takes all of the node's (`--gpus-per-node`) with no per-task binding
    (`--gpu-bind=none`): the agent starts one worker per GPU and pins each itself before CUDA
    initialises, and every worker sees its peers' GPUs for NCCL's peer access (nccl-notes.md, 4.3)."""
    gpu_args = [f"--gpus-per-node={gpus}", "--gpu-bind=none"] if gpus else []
    return ["srun", "--no-kill", "--kill-on-bad-exit=0", "--overlap", "-N1", "-n1", f"--nodelist={node}",
            f"--cpus-per-task={cpus}", *gpu_args, "--job-name=oobleck-agent", *agent_argv(job_dir)]


def replacement_script(job_dir: Path, token: str, setup: Sequence[str]) -> str:
    lines = ["#!/bin/bash", *setup, f"cd {shlex.quote(os.getcwd())}",
             "exec " + shlex.join(agent_argv(job_dir, "--replacement", token))]
    return "\n".join(lines) + "\n"


def replacement_sbatch_args(cluster: ClusterConfig, job_name: str, token: str, output: Path) -> list[str]:
    """A one-node `--exclusive` job whose batch script is an agent that joins the running job."""
    args = ["sbatch", "--parsable", "--exclusive", "-N1", "-n1", f"--cpus-per-task={cluster.cpus_per_node}",
            f"--time={slurm_time_minutes(cluster.time)}", f"--job-name={job_name}-{token}", f"--output={output}"]
    for flag, value in (("partition", cluster.partition), ("account", cluster.account), ("qos", cluster.qos),
                        ("constraint", cluster.constraint), ("mem", cluster.mem)):
        if value:
            args.append(f"--{flag}={value}")
    if cluster.gpus_per_node:
        args.append(f"--gpus-per-node={cluster.gpus_per_node}")
    return args


def expand_nodelist(nodelist: str) -> list[str]:
    """`node[1-4]` -> node1..node4, as Slurm expands it."""
    return run_slurm(["scontrol", "show", "hostnames", nodelist]).split()


class SrunLauncher:
    def __init__(self, job_dir: Path, cluster: ClusterConfig, job_name: str) -> None:
        self.job_dir, self.cluster, self.job_name = job_dir, cluster, job_name
        self.requested: dict[str, str] = {}  # token -> Slurm job id

    def launch(self, node: str) -> subprocess.Popen:
        out = open(self.job_dir / "logs" / f"agent-{node}.log", "ab")  # noqa: SIM115 - the child owns it
        try:
            return subprocess.Popen(srun_argv(self.job_dir, node, self.cluster.cpus_per_node,
                                              self.cluster.gpus_per_node), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            out.close()

    def request(self, token: str) -> str | None:
        script = self.job_dir / f"replacement-{token}.sh"
        script.write_text(replacement_script(self.job_dir, token, self.cluster.setup))
        output = self.job_dir / "logs" / f"replacement-{token}-%j.log"
        try:
            job_id = run_slurm(replacement_sbatch_args(self.cluster, self.job_name, token, output)
                               + [str(script)]).strip().split(";")[0]
        except SlurmError as err:
            print(f"supervisor: replacement request failed: {err}", file=sys.stderr)
            return None
        self.requested[token] = job_id
        return job_id

    def node_states(self, nodes: Sequence[str]) -> dict[str, NodeHealth] | None:
        return query_nodes(list(nodes)) if nodes else {}

    def close(self) -> None:
        if self.requested:
            try:
                run_slurm(["scancel", *self.requested.values()])
            except SlurmError as err:
                print(f"supervisor: scancel of replacement jobs failed: {err}", file=sys.stderr)


class LocalLauncher:
    """Virtual nodes: each agent is a local process; a replacement is one more."""

    def __init__(self, job_dir: Path) -> None:
        self.job_dir = job_dir
        self.procs: list[subprocess.Popen] = []

    def launch(self, node: str, *extra: str) -> subprocess.Popen:
        out = open(self.job_dir / "logs" / f"agent-{node}.log", "ab")  # noqa: SIM115 - the child owns it
        try:
            proc = subprocess.Popen(agent_argv(self.job_dir, "--node", node, *extra), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            out.close()
        self.procs.append(proc)
        return proc

    def request(self, token: str) -> str | None:
        proc = self.launch(f"{token}-host", "--replacement", token)
        return f"pid{proc.pid}"

    def node_states(self, nodes: Sequence[str]) -> dict[str, NodeHealth] | None:
        return None

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
