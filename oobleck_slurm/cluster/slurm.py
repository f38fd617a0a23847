"""Slurm, in one module: every Slurm command this package runs (srun, sbatch through submitit, scontrol,
squeue, sacct, scancel) is run from here, and the parameters of the jobs it submits are built here.

Parsing and parameters are pure (`parse_scontrol_records`, `parse_squeue_jobs`, `node_health`,
`srun_argv`, `allocation_parameters`, `replacement_parameters`, `node_job_parameters`,
`supervisor_parameters`), so they are tested without Slurm; the functions
that call Slurm's clients name every timeout and raise `SlurmError` with the client's message.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oobleck_slurm.errors import InfrastructureError
from oobleck_slurm.recipe import ClusterConfig

SLURM_COMMAND_TIMEOUT_S = 10.0  # slurmctld answers in milliseconds; 10 s means it is unreachable
# Node states in which a node's processes cannot be trusted to run (scontrol's base state or flags).
BAD_NODE_STATES = frozenset({"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING",
                             "POWERED_DOWN", "POWERING_DOWN", "FUTURE", "UNKNOWN"})
AGENT_STEP_NAME = "oobleck-agent"


_KEY_VALUE = re.compile(r"(?:^| )([A-Za-z][\w/:]*)=(.*?)(?= [A-Za-z][\w/:]*=|$)")


class SlurmError(InfrastructureError):
    """A Slurm client command failed or could not be reached."""


# ---- what is submitted (pure) ---------------------------------------------------------------------

def _job_parameters(cluster: ClusterConfig, job_name: str, nodes: int, additional: dict[str, Any]) -> dict[str, Any]:
    """submitit `update_parameters` shared by the allocation and replacement jobs: one task per node,
    the batch step runs the Python callable itself (`use_srun=False`), the recipe's time, setup and
    placement options."""
    params: dict[str, Any] = {
        "name": job_name,
        "nodes": nodes,
        "tasks_per_node": 1,
        "cpus_per_task": cluster.cpus_per_node,
        "timeout_min": slurm_time_minutes(cluster.time),
        "slurm_use_srun": False,
        "slurm_additional_parameters": additional,
        "slurm_setup": list(cluster.setup),
    }
    optional = {
        "slurm_partition": cluster.partition, "slurm_account": cluster.account, "slurm_qos": cluster.qos,
        "slurm_constraint": cluster.constraint, "slurm_mem": cluster.mem,
        "gpus_per_node": cluster.gpus_per_node or None,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


def allocation_parameters(cluster: ClusterConfig, job_name: str) -> dict[str, Any]:
    """submitit `update_parameters` for the main allocation: one agent task per node, `--no-kill`.

    The supervisor runs in the batch step itself (`use_srun=False`) and starts the agents with its
    own `srun --kill-on-bad-exit=0`, so that losing a node ends neither the job nor the step.
    """
    additional: dict[str, Any] = {"no_kill": True}
    for key, value in cluster.sbatch.items():
        additional[key] = True if value == "" else value  # `exclusive: true` -> plain --exclusive
    return _job_parameters(cluster, job_name, cluster.nodes + cluster.spare_nodes, additional)


def replacement_parameters(cluster: ClusterConfig, job_name: str, token: str) -> dict[str, Any]:
    """submitit `update_parameters` for a replacement node: a one-node `--exclusive` job (it never
    shares a node with another job) named `<job>-<token>`, whose batch step runs an agent that joins
    the running job. submitit's USR2 notice reaches only steps, and this job has none: the
    replacement's own time limit ends it like a lost node, as the allocation's ends the job."""
    return _job_parameters(cluster, f"{job_name}-{token}", 1, {"exclusive": True})


def node_job_parameters(cluster: ClusterConfig, job_name: str, index: int) -> dict[str, Any]:
    """submitit `update_parameters` for a training node under supervisor failover: a one-node
    `--exclusive` job (two training nodes never share a machine, nor does a supervisor) named
    `<job>-train<index>`, whose batch step is the node's agent. Its loss ends only this job; the
    recipe's sbatch options apply as to the allocation."""
    additional: dict[str, Any] = {key: True if value == "" else value for key, value in cluster.sbatch.items()}
    additional["exclusive"] = True
    return _job_parameters(cluster, f"{job_name}-train{index}", 1, additional)


def supervisor_parameters(cluster: ClusterConfig, job_name: str, role: str,
                          exclude: Sequence[str] = ()) -> dict[str, Any]:
    """submitit `update_parameters` for a supervisor under failover (`role`: primary or standby): a
    small one-node job, not exclusive (supervisors may share a node with other jobs), with
    `cluster.supervisor`'s partition, CPUs and memory, and no GPU; `exclude` keeps a standby off the
    primary's node (one machine's loss must not take both)."""
    sup = cluster.supervisor
    params: dict[str, Any] = {
        "name": f"{job_name}-{role}",
        "nodes": 1,
        "tasks_per_node": 1,
        "cpus_per_task": sup.cpus,
        "timeout_min": slurm_time_minutes(cluster.time),
        "slurm_use_srun": False,
        "slurm_additional_parameters": {"exclude": ",".join(exclude)} if exclude else {},
        "slurm_setup": list(cluster.setup),
    }
    optional = {"slurm_partition": sup.partition or cluster.partition, "slurm_account": cluster.account,
                "slurm_qos": cluster.qos, "slurm_mem": sup.mem}
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


def parse_squeue_jobs(text: str) -> dict[str, tuple[str, str]]:
    """`squeue -h -o '%i %T %N'` lines -> job id -> (state, node list; "" while pending)."""
    jobs = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            jobs[parts[0]] = (parts[1], parts[2] if len(parts) > 2 else "")
    return jobs


def srun_argv(node: str, command: Sequence[str], cpus: int, gpus: int = 0) -> list[str]:
    """The step that runs `command` (a node's agent) on `node`. `--no-kill --kill-on-bad-exit=0`: the
    loss of another node or task must not end this one (measured: `--kill-on-bad-exit=0` alone is not
    enough); `--overlap`: the agent shares the node's CPUs with nothing else of ours but the batch step.
    With GPUs the step takes all of the node's (`--gpus-per-node`) with no per-task binding
    (`--gpu-bind=none`): the agent starts one worker per GPU and pins each itself before CUDA
    initialises, and every worker sees its peers' GPUs for NCCL's peer access (docs/nccl.md, "Slurm and GPUs")."""
    gpu_args = [f"--gpus-per-node={gpus}", "--gpu-bind=none"] if gpus else []
    return ["srun", "--no-kill", "--kill-on-bad-exit=0", "--overlap", "-N1", "-n1", f"--nodelist={node}",
            f"--cpus-per-task={cpus}", *gpu_args, f"--job-name={AGENT_STEP_NAME}", *command]


def slurm_time_minutes(text: str) -> int:
    """Minutes in a Slurm time limit ('90', 'H:M:S', 'D-H:M:S', ...), rounded up; the recipe validated it."""
    days, _, clock = text.rpartition("-") if "-" in text else ("0", "", text)
    parts = [int(p) for p in clock.split(":")]
    if "-" in text:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    else:  # M or M:S
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    total_seconds = ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    return max(1, -(-total_seconds // 60))


def parse_scontrol_records(text: str) -> list[dict[str, str]]:
    """`scontrol show ... -o` output (one record per line of Key=Value pairs) as dicts."""
    records = []
    for line in text.splitlines():
        if not line.strip():
            continue
        # Values are not quoted and may hold spaces (Reason=Not responding [slurm@...]), so a value
        # runs until the next ` Key=`.
        records.append({m.group(1): m.group(2) for m in _KEY_VALUE.finditer(line.strip())})
    return records


@dataclass(frozen=True)
class NodeHealth:
    name: str
    state: str  # scontrol's full State, e.g. "IDLE", "ALLOCATED+DRAIN", "DOWN*+NOT_RESPONDING"
    reason: str

    @property
    def usable(self) -> bool:
        flags = {part.rstrip("*~#!%$@^-") for part in self.state.replace("+", " ").split()}
        return not (flags & BAD_NODE_STATES) and not self.state.split("+")[0].endswith("*")


def node_health(records: list[dict[str, str]]) -> dict[str, NodeHealth]:
    return {r["NodeName"]: NodeHealth(r["NodeName"], r.get("State", "UNKNOWN"), r.get("Reason", ""))
            for r in records if "NodeName" in r}


# ---- Slurm's clients ------------------------------------------------------------------------------

def submit(folder: Path, parameters: Mapping[str, Any], function: Callable[[], Any]) -> str:
    """Submit `function` as a batch job through submitit (which runs sbatch, and keeps its files and
    the job's output in `folder`); returns the Slurm job id. SlurmError when sbatch refuses."""
    import submitit
    from submitit.core.utils import FailedJobError

    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    executor.update_parameters(**parameters)
    try:
        return str(executor.submit(function).job_id)
    except (FailedJobError, OSError) as err:
        raise SlurmError(str(err).strip() or f"sbatch failed: {type(err).__name__}") from None


def start_step(node: str, command: Sequence[str], cpus: int, gpus: int, output: Path) -> subprocess.Popen:
    """Start `command` as its own srun step on `node` (see `srun_argv`); its output goes to `output`.
    The step's exit is the evidence that the node's task ended."""
    with open(output, "ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(srun_argv(node, command, cpus, gpus), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


def queued_jobs(job_ids: Sequence[str]) -> dict[str, tuple[str, str]]:
    """The state and node list of those of `job_ids` still in the queue (see `parse_squeue_jobs`)."""
    if not job_ids:
        return {}
    return parse_squeue_jobs(_run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i %T %N"]))


def expand_hostnames(nodelist: str) -> list[str]:
    """`node[1-4]` -> node1..node4, as Slurm expands it."""
    return _run(["scontrol", "show", "hostnames", nodelist]).split()


def query_nodes(names: list[str] | None = None, env: Mapping[str, str] | None = None) -> dict[str, NodeHealth]:
    """Current Slurm state of `names` (all nodes when None)."""
    args = ["scontrol", "show", "node", "-o"] + ([",".join(names)] if names else [])
    return node_health(parse_scontrol_records(_run(args, env)))


def set_node_down(node: str, reason: str) -> None:
    """What an admin (or slurmctld) does to a failed node: DOWN, with a reason (a drill)."""
    _run(["scontrol", "update", f"nodename={node}", "state=down", f"reason={reason}"])


def cancel_jobs(job_ids: Sequence[str]) -> None:
    if job_ids:
        _run(["scancel", *job_ids])


def in_queue(job_id: str) -> bool:
    """The job is pending or running. squeue refuses an id it no longer knows: the job is gone."""
    try:
        return bool(_run(["squeue", "-h", "-j", job_id, "-o", "%T"]).strip())
    except SlurmError:
        return False


def accounting(job_id: str) -> str:
    """sacct's `State ExitCode NodeList` of the job ("" when it has no record yet)."""
    out = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode,NodeList"]).strip()
    return out.splitlines()[0].replace("|", " ") if out else ""


def job_state(job_id: str, timeout: float = SLURM_COMMAND_TIMEOUT_S) -> str | None:
    """`RUNNING`, `PENDING`, `COMPLETED`, ...: from squeue, or sacct once the job left the queue. Best
    effort: no Slurm client, a slow controller or an unknown job give None, never an error."""
    for args in (["squeue", "-h", "-j", job_id, "-o", "%T"], ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"]):
        try:
            words = _run(args, timeout=timeout).split()
        except SlurmError:
            continue
        if words:
            return words[0]  # sacct: "CANCELLED by 0" -> CANCELLED
    return None


def _run(args: list[str], env: Mapping[str, str] | None = None, timeout: float = SLURM_COMMAND_TIMEOUT_S) -> str:
    """Run a Slurm client command and return its stdout; SlurmError with its stderr otherwise."""
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                                env=dict(env) if env is not None else os.environ.copy())
    except FileNotFoundError:
        raise SlurmError(f"{args[0]}: Slurm client not installed") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(args)}: no answer within {timeout:g} s") from None
    if result.returncode != 0:
        raise SlurmError(f"{' '.join(args)}: exit {result.returncode}: {result.stderr.strip()}")
    return result.stdout
