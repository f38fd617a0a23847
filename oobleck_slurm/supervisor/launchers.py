"""How agents get onto nodes, and how a replacement node is asked for: Slurm or local processes.

    SrunLauncher    one `srun --no-kill --kill-on-bad-exit=0 -N1 -n1 -w NODE` step per node inside the
                    allocation (a step per node, so that srun's exit names the node whose task ended),
                    replacements as one-node `--exclusive` jobs submitted through submitit, like the
                    allocation, whose batch step is an agent (`ReplacementAgent`)
    NodeJobLauncher under supervisor failover (docs/failover.md, "Under Slurm"): no allocation; every
                    training node is its own one-node `--exclusive` job whose batch step is its agent,
                    exactly like a replacement, so that no node's loss (the supervisor's included)
                    ends the others; replacements as with SrunLauncher
    LocalLauncher   agents as local processes named node1, node2, ... (the embedded default), forked
                    from one warm server of the job

The supervisor above them is the same. Every Slurm command is run by cluster/slurm.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from oobleck_slurm.agent.warm import WarmProcess, WarmServer
from oobleck_slurm.cluster import slurm
from oobleck_slurm.cluster.jobdir import JobDir
from oobleck_slurm.cluster.slurm import NodeHealth, SlurmError
from oobleck_slurm.errors import InfrastructureError, JobTimeoutError
from oobleck_slurm.exit_codes import EXIT_OK
from oobleck_slurm.recipe import ClusterConfig

AGENT_MODULE = "oobleck_slurm.agent.main"


class AgentLauncher(Protocol):
    # The process whose exit means "the node's task ended"; None when the agent is its own job's batch
    # step (NodeJobLauncher): its loss is then seen by its connection, heartbeats and Slurm's node state.
    def launch(self, node: str) -> subprocess.Popen | WarmProcess | None: ...
    def request(self, token: str) -> str | None: ...  # ask for one more node; a handle (job id) or None
    def lost(self, node: str) -> None: ...  # a Slurm node the job lost: later requests (and a requeue) avoid it
    def node_states(self, nodes: Sequence[str]) -> dict[str, NodeHealth] | None: ...  # None: no such view
    def close(self) -> None: ...  # cancel outstanding requests


def agent_argv(job_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", AGENT_MODULE, str(job_dir), *extra]


@dataclass(frozen=True)
class ReplacementAgent:
    """What submitit runs in a replacement job's batch step: an agent that registers with `token`
    (the id the coordinator already knows the node by); with no token, a training node's own job
    under supervisor failover, whose agent registers under its Slurm node name."""

    job_dir: str
    token: str | None = None

    def __call__(self) -> int:
        from oobleck_slurm.agent import main as agent

        # submitit's handlers only log SIGTERM and SIGCONT: an agent ends on scancel's SIGTERM, as one
        # started by srun does (its workers die with it).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCONT, signal.SIG_DFL)
        code = agent.main([self.job_dir, *(["--replacement", self.token] if self.token else [])])
        if code != EXIT_OK:
            raise SystemExit(code)  # submitit lets SystemExit through: Slurm records this exit code
        return code


class SrunLauncher:
    def __init__(self, job_dir: Path, cluster: ClusterConfig, job_name: str) -> None:
        self.job, self.cluster, self.job_name = JobDir.at(job_dir), cluster, job_name
        self.requested: dict[str, str] = {}  # token -> Slurm job id
        # Nodes this job lost, in this run or one before a requeue (meta.json): replacements exclude them.
        self.evicted: list[str] = list(self.job.meta().get("evicted_nodes", []))

    def launch(self, node: str) -> subprocess.Popen | None:
        return slurm.start_step(node, agent_argv(self.job.path), self.cluster.cpus_per_node,
                                self.cluster.gpus_per_node, self.job.agent_log(node), self.cluster.network)

    def lost(self, node: str) -> None:
        if node in self.evicted:
            return
        self.evicted.append(node)
        try:
            self.job.update_meta(evicted_nodes=self.evicted)
        except OSError as err:  # the in-memory list still serves this run's requests
            print(f"supervisor: could not record evicted node {node}: {err}", file=sys.stderr)

    def request(self, token: str) -> str | None:
        try:
            job_id = slurm.submit(self.job.submitit, slurm.replacement_parameters(self.cluster, self.job_name, token,
                                                                                  self.evicted),
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


# Queue states in which a submitted job may still start (squeue's %T).
WAITING_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "RESIZING"})


def queue_or_none(job_ids: Sequence[str]) -> dict[str, tuple[str, str]] | None:
    """squeue's view of `job_ids`, or None when slurmctld did not answer (after its retries)."""
    try:
        return slurm.queued_jobs(job_ids)
    except slurm.SlurmUnavailable as err:
        print(f"supervisor: {err}; still waiting for the node jobs", file=sys.stderr)
        return None


def started_nodes(job_ids: Sequence[str], queue: dict[str, tuple[str, str]] | None) -> list[str] | None:
    """The node of each of `job_ids` (one-node jobs), in their order, once all run; None while one
    waits, or while squeue's answer is unknown (`queue` None: a slow controller ends no job);
    InfrastructureError when one ended or left the queue before it started (pure)."""
    if queue is None:
        return None
    nodes = []
    for job_id in job_ids:
        state, nodelist = queue.get(job_id, ("GONE", ""))
        if state == "RUNNING" and nodelist:
            nodes.append(nodelist)
        elif state not in WAITING_STATES:
            raise InfrastructureError(f"training node job {job_id} is {state} before it started; see its "
                                      f"output in the job folder's submitit/")
    return nodes if len(nodes) == len(job_ids) else None


class NodeJobLauncher(SrunLauncher):
    """Training nodes as one-node jobs whose batch step is their agent (see the module docstring)."""

    def __init__(self, job_dir: Path, cluster: ClusterConfig, job_name: str) -> None:
        super().__init__(job_dir, cluster, job_name)
        self.node_jobs: list[str] = []  # the node jobs this supervisor submitted (none after a takeover)

    def start_nodes(self, count: int, timeout: float, poll: float) -> list[str]:
        """Submit `count` node jobs and wait until each runs; their Slurm node names, in submission
        order (the coordinator's node ids). Their agents wait for the supervisor's address."""
        ids = [slurm.submit(self.job.submitit, slurm.node_job_parameters(self.cluster, self.job_name, i + 1),
                            ReplacementAgent(str(self.job.path))) for i in range(count)]
        self.node_jobs = ids
        self.job.update_meta(node_jobs=ids)  # `cancel` and `kill-node` find them there
        deadline = time.time() + timeout
        try:
            while (nodes := started_nodes(ids, queue_or_none(ids))) is None:
                if time.time() > deadline:
                    raise JobTimeoutError(f"training node jobs {ids} did not all start within {timeout:g} s "
                                          f"(node_jobs_timeout)")
                time.sleep(poll)  # slurm_poll: a transient wait, faster than the steady state's
        except Exception:
            slurm.cancel_jobs(ids)  # no agent of a job that cannot start waits for a supervisor
            raise
        return nodes

    def launch(self, node: str) -> subprocess.Popen | None:
        return None  # the agent is its node job's batch step: it registers by itself

    def close(self) -> None:
        super().close()
        try:  # agents told to shut down end their jobs; a node job still queued is cancelled
            slurm.cancel_jobs([j for j, (state, _) in slurm.queued_jobs(self.node_jobs).items()
                               if state in WAITING_STATES])
        except SlurmError as err:
            print(f"supervisor: scancel of queued node jobs failed: {err}", file=sys.stderr)


class LocalLauncher:
    """Virtual nodes: each agent is a local process; a replacement is one more. They share this
    machine, so they are forked from one warm server of the job (agent/warm.py), a fork of this
    supervisor that imports the engine once for every node's agent, warm server and workers (torch is
    in already: the supervisor runs the job's store); an agent starts cold
    if that server cannot fork it. Its agents outlive it (`detached`): they must outlive this
    supervisor, for its standby to take over."""

    def __init__(self, job_dir: Path) -> None:
        self.job = JobDir.at(job_dir)
        self.procs: list[subprocess.Popen | WarmProcess] = []
        # Its PR_SET_PDEATHSIG follows the thread that starts it: the main thread's, which lives as long
        # as this process (a supervisor that took over in another thread starts its agents cold).
        self.server = WarmServer(fork_here=True) if threading.current_thread() is threading.main_thread() else None

    def launch(self, node: str, *extra: str) -> subprocess.Popen | WarmProcess:
        argv = agent_argv(self.job.path, "--node", node, *extra)
        log = self.job.agent_log(node)
        proc: subprocess.Popen | WarmProcess | None = None
        if self.server is not None:
            try:
                proc = self.server.spawn(AGENT_MODULE, argv[3:], os.environ, str(log), detached=True)
            except OSError as err:
                print(f"supervisor: {err}; the agent of {node} starts cold", file=sys.stderr, flush=True)
        if proc is None:
            with open(log, "ab") as out:  # the child keeps its own descriptor
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def request(self, token: str) -> str | None:
        proc = self.launch(f"{token}-host", "--replacement", token)
        return f"pid{proc.pid}"

    def lost(self, node: str) -> None:
        pass  # virtual nodes: a replacement is a new process, never a machine to avoid

    def node_states(self, nodes: Sequence[str]) -> dict[str, NodeHealth] | None:
        return None

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if self.server is not None:
            self.server.close()
