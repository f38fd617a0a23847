"""Slurm mechanics: the allocation's submitit parameters, and reading node and job state.

Parsing is pure (`parse_scontrol_records`, `node_health`) so it is tested on captured output; the
few functions that call Slurm's clients name every timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from oobleck_slurm.recipe import ClusterConfig

SLURM_COMMAND_TIMEOUT_S = 10.0  # slurmctld answers in milliseconds; 10 s means it is unreachable
# Node states in which a node's processes cannot be trusted to run (scontrol's base state or flags).
BAD_NODE_STATES = frozenset({"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING",
                             "POWERED_DOWN", "POWERING_DOWN", "FUTURE", "UNKNOWN"})


_KEY_VALUE = re.compile(r"(?:^| )([A-Za-z][\w/:]*)=(.*?)(?= [A-Za-z][\w/:]*=|$)")


class SlurmError(Exception):
    """A Slurm client command failed or could not be reached."""


def allocation_parameters(cluster: ClusterConfig, job_name: str) -> dict[str, Any]:
    """submitit `update_parameters` for the main allocation: one agent task per node, `--no-kill`.

    The supervisor runs in the batch step itself (`use_srun=False`) and starts the agents with its
    own `srun --kill-on-bad-exit=0`, so that losing a node ends neither the job nor the step.
    """
    additional: dict[str, Any] = {"no_kill": True}
    for key, value in cluster.sbatch.items():
        additional[key] = True if value == "" else value  # `exclusive: true` -> plain --exclusive
    params: dict[str, Any] = {
        "name": job_name,
        "nodes": cluster.nodes + cluster.spare_nodes,
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


def query_nodes(names: list[str] | None = None, env: Mapping[str, str] | None = None) -> dict[str, NodeHealth]:
    """Current Slurm state of `names` (all nodes when None)."""
    args = ["scontrol", "show", "node", "-o"] + ([",".join(names)] if names else [])
    return node_health(parse_scontrol_records(run_slurm(args, env)))


def run_slurm(args: list[str], env: Mapping[str, str] | None = None, timeout: float = SLURM_COMMAND_TIMEOUT_S) -> str:
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
