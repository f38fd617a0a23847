"""How agents get onto nodes, and how a replacement node is asked for: Slurm or local processes.

    SrunLauncher    one `srun --no-kill --kill-on-bad-exit=0 -N1 -n1 -w NODE` step per node inside the
                    allocation (a step per node, so that srun's exit names the node whose task ended),
                    replacements as one-node `--exclusive` jobs submitted through submitit, like the
                    allocation, whose batch step is an agent (`ReplacementAgent`)
    LocalLauncher   agents as local processes named node1, node2, ... (the embedded default)

The supervisor above them is the same. Every Slurm command is run by cluster/slurm.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from oobleck_slurm.cluster import slurm
from oobleck_slurm.cluster.jobdir import JobDir
from oobleck_slurm.cluster.slurm import NodeHealth, SlurmError
from oobleck_slurm.exit_codes import EXIT_OK
from oobleck_slurm.recipe import ClusterConfig

AGENT_MODULE = "oobleck_slurm.supervisor.agent"


class AgentLauncher(Protocol):
    def launch(self, node: str) -> subprocess.Popen: ...  # the process whose exit means "the node's task ended"
    def request(self, token: str) -> str | None: ...  # ask for one more node; a handle (job id) or None
    def node_states(self, nodes: Sequence[str]) -> dict[str, NodeHealth] | None: ...  # None: no such view
    def close(self) -> None: ...  # cancel outstanding requests


def agent_argv(job_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", AGENT_MODULE, str(job_dir), *extra]


@dataclass(frozen=True)
class ReplacementAgent:
    """What submitit runs in a replacement job's batch step: an agent that registers with `token`
    (the id the coordinator already knows the node by)."""

    job_dir: str
    token: str

    def __call__(self) -> int:
        from oobleck_slurm.supervisor import agent

        # submitit's handlers only log SIGTERM and SIGCONT: an agent ends on scancel's SIGTERM, as one
        # started by srun does (its workers die with it).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCONT, signal.SIG_DFL)
        code = agent.main([self.job_dir, "--replacement", self.token])
        if code != EXIT_OK:
            raise SystemExit(code)  # submitit lets SystemExit through: Slurm records this exit code
        return code


class SrunLauncher:
    def __init__(self, job_dir: Path, cluster: ClusterConfig, job_name: str) -> None:
        self.job, self.cluster, self.job_name = JobDir.at(job_dir), cluster, job_name
        self.requested: dict[str, str] = {}  # token -> Slurm job id

    def launch(self, node: str) -> subprocess.Popen:
        return slurm.start_step(node, agent_argv(self.job.path), self.cluster.cpus_per_node,
                                self.cluster.gpus_per_node, self.job.agent_log(node))

    def request(self, token: str) -> str | None:
        try:
            job_id = slurm.submit(self.job.submitit, slurm.replacement_parameters(self.cluster, self.job_name, token),
                                  ReplacementAgent(str(self.job.path), token))
        except SlurmError as err:
            print(f"supervisor: replacement request failed: {err}", file=sys.stderr)
            return None
        self.requested[token] = job_id
        return job_id

    def node_states(self, nodes: Sequence[str]) -> dict[str, NodeHealth] | None:
        return slurm.query_nodes(list(nodes)) if nodes else {}

    def close(self) -> None:
        try:
            slurm.cancel_jobs(list(self.requested.values()))
        except SlurmError as err:
            print(f"supervisor: scancel of replacement jobs failed: {err}", file=sys.stderr)


class LocalLauncher:
    """Virtual nodes: each agent is a local process; a replacement is one more."""

    def __init__(self, job_dir: Path) -> None:
        self.job = JobDir.at(job_dir)
        self.procs: list[subprocess.Popen] = []

    def launch(self, node: str, *extra: str) -> subprocess.Popen:
        with open(self.job.agent_log(node), "ab") as out:  # the child keeps its own descriptor
            proc = subprocess.Popen(agent_argv(self.job.path, "--node", node, *extra), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
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
