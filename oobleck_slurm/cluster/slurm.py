"""Slurm, in one module: every Slurm command this package runs (srun, sbatch through submitit, scontrol,
squeue, sacct, scancel) is run from here, and the parameters of the jobs it submits are built here.

Parsing and parameters are pure (`parse_scontrol_records`, `parse_squeue_jobs`, `node_health`,
`srun_argv`, `allocation_parameters`, `replacement_parameters`, `node_job_parameters`,
`supervisor_parameters`, `executor_arguments`, `requeue_exclude_argv`), so they are tested without Slurm; the functions
that call Slurm's clients name every timeout and raise `SlurmError` with the client's message.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oobleck_slurm.errors import InfrastructureError
from oobleck_slurm.recipe import ClusterConfig
from oobleck_slurm.recipe.schema import JOB_VNI, slurm_seconds
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS, JobTimeouts

SLURM_COMMAND_TIMEOUT_S = DEFAULT_TIMEOUTS.slurm_command  # MessageTimeout's default: see JobTimeouts
# Node states (scontrol's base state, or a flag after `+`) in which the node is gone: failed, down or
# powered off. Only these make Slurm's view a loss (docs/slurm.md, "Node states").
LOST_NODE_STATES = frozenset({"DOWN", "FAIL", "FAILING", "POWERED_DOWN", "POWERING_DOWN", "FUTURE"})
# States that are reported, never a loss: a drain (maintenance, `scontrol reboot ASAP`) lets running jobs
# run; NOT_RESPONDING (and the `*` mark) is slurmd's silence, which a rolling slurmd restart causes while
# the job's processes run on. If the node did die, its heartbeats and process exits say so first.
ADVISORY_NODE_STATES = frozenset({"DRAIN", "DRAINED", "DRAINING", "NOT_RESPONDING", "UNKNOWN", "REBOOT_REQUESTED",
                                  "REBOOT_ISSUED", "POWER_DOWN", "POWERING_UP", "MAINTENANCE", "MAINT",
                                  "INVALID_REG", "INVALID"})
# sinfo-style suffixes of a state word: `*` not responding, `~` powered off, `%` powering down, `#`
# powering up, `!` power down pending, `@` reboot pending, `^` reboot issued, `$` maintenance, `-` planned.
_STATE_SUFFIXES = {"*": "NOT_RESPONDING", "~": "POWERED_DOWN", "%": "POWERING_DOWN", "#": "POWERING_UP",
                   "!": "POWER_DOWN", "@": "REBOOT_REQUESTED", "^": "REBOOT_ISSUED", "$": "MAINTENANCE", "-": ""}
AGENT_STEP_NAME = "oobleck-agent"
STANDBY_STEP_NAME = "oobleck-standby"  # the standby supervisor's step inside the allocation
# submitit takes these as the executor's own arguments (AutoExecutor(...)), not through update_parameters.
EXECUTOR_ARGUMENTS = frozenset({"slurm_max_num_timeout"})
# HPE Slingshot: a step's SLINGSHOT_VNIS lists its own VNI first and the job's VNI (--network=job_vni)
# last, and libfabric's CXI provider uses only the first (prov/cxi cxip_gen_auth_key). Agents are
# separate steps: each keeps only the job's VNI, which its workers inherit, so that workers of
# different steps reach each other (docs/slurm.md, "One network domain per job").
_KEEP_JOB_VNI = 'if [ -n "${SLINGSHOT_VNIS:-}" ]; then export SLINGSHOT_VNIS="${SLINGSHOT_VNIS##*,}"; fi; '
# Every step starts with the time-limit notice ignored: Slurm may send `--signal=USR2@…` up to 60 s
# early (sbatch(1)), so at a short limit right at the job's start, and USR2's default action killed the
# agents of a lab allocation before Python had installed their handler. The agent installs its own
# handler once it runs (an ignored signal stays ignored across exec until then); a notice lost in that
# window is given again by the supervisor's backstop (supervisor/main.py `TimeLimitNotice`).
_IGNORE_NOTICE_AT_START = 'trap "" USR2; '



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
        "slurm_signal_delay_s": cluster.signal_delay_s,
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


def _recipe_options(cluster: ClusterConfig) -> dict[str, Any]:
    """The recipe's own sbatch options and `--network`, as submitit's additional parameters."""
    additional: dict[str, Any] = {key: True if value == "" else value  # `exclusive: true` -> plain --exclusive
                                  for key, value in cluster.sbatch.items()}
    if cluster.network:
        additional["network"] = cluster.network
    return additional


def allocation_parameters(cluster: ClusterConfig, job_name: str) -> dict[str, Any]:
    """submitit parameters for the main allocation: one agent task per node, `--no-kill`, the
    recipe's sbatch options and `--network`, `--signal=USR2@<signal_delay_s>`, and `--requeue` with
    `cluster.requeues` requeues after a time limit (submitit's `max_num_timeout`, an executor argument:
    see `executor_arguments`). `--requeue` lets submitit's `scontrol requeue` through on sites whose
    slurm.conf says JobRequeue=0 (sbatch(1) --requeue).

    The supervisor runs in the batch step itself (`use_srun=False`) and starts the agents with its
    own `srun --kill-on-bad-exit=0`, so that losing a node ends neither the job nor the step.
    """
    additional = {**_recipe_options(cluster), "no_kill": True, "requeue": True}
    params = _job_parameters(cluster, job_name, cluster.nodes + cluster.spare_nodes, additional)
    params["slurm_max_num_timeout"] = cluster.requeues
    return params


def replacement_parameters(cluster: ClusterConfig, job_name: str, token: str,
                           exclude: Sequence[str] = ()) -> dict[str, Any]:
    """submitit parameters for a replacement node: a one-node `--exclusive` job (it never shares a
    node with another job) named `<job>-<token>`, with the recipe's sbatch options (a reservation, a
    network, ...) as the allocation, and `--exclude` of the recipe's own exclusions and of `exclude`,
    the nodes this job lost (a replacement must not land on the machine that just failed). Its batch
    step runs an agent that joins the running job. submitit's USR2 notice reaches only steps, and this
    job has none: the replacement's own time limit ends it like a lost node, as the allocation's ends
    the job."""
    additional = {**_recipe_options(cluster), "exclusive": True}
    excluded = [*str(cluster.sbatch.get("exclude", "")).split(","), *exclude]
    if names := [n for n in dict.fromkeys(excluded) if n]:  # each once, in order
        additional["exclude"] = ",".join(names)
    return _job_parameters(cluster, f"{job_name}-{token}", 1, additional)


def executor_arguments(parameters: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`parameters` split into submitit's AutoExecutor arguments (`slurm_max_num_timeout`) and the
    rest, for `update_parameters` (which refuses the former)."""
    executor = {k: v for k, v in parameters.items() if k in EXECUTOR_ARGUMENTS}
    return executor, {k: v for k, v in parameters.items() if k not in EXECUTOR_ARGUMENTS}


def requeue_exclude_argv(job_id: str, nodes: Sequence[str]) -> list[str]:
    """`scontrol update` that keeps a job's next run off `nodes` (scontrol(1): ExcNodeList). It
    replaces the job's list, so `nodes` must hold the recipe's own `sbatch.exclude` too; Slurm changes
    it only while the job is pending, i.e. after `scontrol requeue` (or `requeuehold`, then `release`)."""
    if not nodes:
        raise ValueError("requeue_exclude_argv: no nodes (an empty ExcNodeList= would clear the job's list)")
    return ["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"]


def node_job_parameters(cluster: ClusterConfig, job_name: str, index: int) -> dict[str, Any]:
    """submitit `update_parameters` for a training node under supervisor failover: a one-node
    `--exclusive` job (two training nodes never share a machine, nor does a supervisor) named
    `<job>-train<index>`, whose batch step is the node's agent. Its loss ends only this job; the
    recipe's sbatch options and `--network` apply as to the allocation."""
    additional = {**_recipe_options(cluster), "exclusive": True}
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
        "slurm_signal_delay_s": cluster.signal_delay_s,
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


def srun_argv(node: str, command: Sequence[str], cpus: int, gpus: int = 0, network: str | None = None,
              name: str = AGENT_STEP_NAME) -> list[str]:
    """The step `name` that runs `command` (a node's agent, or the standby supervisor) on `node`. `--no-kill --kill-on-bad-exit=0`: the
    loss of another node or task must not end this one (measured: `--kill-on-bad-exit=0` alone is not
    enough); `--overlap`: the agent shares the node's CPUs with nothing else of ours but the batch step.
    With GPUs the step takes all of the node's (`--gpus-per-node`) with no per-task binding
    (`--gpu-bind=none`): the agent starts one worker per GPU and pins each itself before CUDA
    initialises, and every worker sees its peers' GPUs for NCCL's peer access (docs/nccl.md, "Slurm and GPUs").
    `network` (the recipe's `cluster.network`) goes to every step as to the allocation; with a job VNI
    the agent keeps only that one (see `JOB_VNI`). The command runs under a shell line that ignores the
    notice until the process handles it (`_IGNORE_NOTICE_AT_START`)."""
    gpu_args = [f"--gpus-per-node={gpus}", "--gpu-bind=none"] if gpus else []
    net_args = [f"--network={network}"] if network else []
    keep_vni = _KEEP_JOB_VNI if network and JOB_VNI in network.split(",") else ""
    command = ["/bin/sh", "-c", _IGNORE_NOTICE_AT_START + keep_vni + 'exec "$@"', name, *command]  # "$@": the command
    return ["srun", "--no-kill", "--kill-on-bad-exit=0", "--overlap", "-N1", "-n1", f"--nodelist={node}",
            f"--cpus-per-task={cpus}", *gpu_args, *net_args, f"--job-name={name}", *command]


def slurm_time_minutes(text: str) -> int:
    """Minutes in a Slurm time limit ('90', 'H:M:S', 'D-H:M:S', ...), rounded up; the recipe validated it."""
    return max(1, -(-slurm_seconds(text) // 60))


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


def state_flags(state: str) -> frozenset[str]:
    """The words of a node's State as scontrol (or sinfo) prints it, suffix marks spelled out:
    "DOWN*+NOT_RESPONDING" -> {DOWN, NOT_RESPONDING}; "IDLE~" -> {IDLE, POWERED_DOWN} (pure)."""
    flags: set[str] = set()
    for word in state.upper().replace(" ", "+").split("+"):
        base = word.rstrip("".join(_STATE_SUFFIXES))
        flags.update(_STATE_SUFFIXES[mark] for mark in word[len(base):] if _STATE_SUFFIXES[mark])
        if base:
            flags.add(base)
    return frozenset(flags)


@dataclass(frozen=True)
class NodeHealth:
    name: str
    state: str  # scontrol's full State, e.g. "IDLE", "ALLOCATED+DRAIN", "DOWN*+NOT_RESPONDING"
    reason: str

    @property
    def lost(self) -> bool:
        """Slurm says the node is gone (LOST_NODE_STATES): its processes are dead or about to be."""
        return bool(state_flags(self.state) & LOST_NODE_STATES)

    @property
    def usable(self) -> bool:
        """Not lost: the node may still run the job's processes (a drained or silent node does)."""
        return not self.lost

    @property
    def advisory(self) -> tuple[str, ...]:
        """The advisory states of a node that is not lost (ADVISORY_NODE_STATES): reported, never a loss."""
        return () if self.lost else tuple(sorted(state_flags(self.state) & ADVISORY_NODE_STATES))


def node_health(records: list[dict[str, str]]) -> dict[str, NodeHealth]:
    return {r["NodeName"]: NodeHealth(r["NodeName"], r.get("State", "UNKNOWN"), r.get("Reason", ""))
            for r in records if "NodeName" in r}


# ---- Slurm's clients ------------------------------------------------------------------------------
# Every client command runs through `_run`, which counts it (`client_calls`): each is an RPC to slurmctld,
# which every user of the centre shares (docs/slurm.md, "A gentle client"). Read-only queries, and the
# writes that are idempotent (scancel, scontrol update), are retried by `_retried`: a timeout or a failed
# command is tried READ_ATTEMPTS times, with a doubling pause from JobTimeouts.slurm_retry_backoff; then
# the answer is unknown (SlurmUnavailable), never "no" nor "ended". sbatch (through submitit) is not.

READ_ATTEMPTS = 3  # 3 x slurm_command (10 s) + 1 s + 2 s: a slurmctld restart or failover fits within
# Commands the client answers from the configuration alone: no RPC, not counted.
LOCAL_COMMANDS = (("scontrol", "show", "hostnames"),)
# stderr of a client whose question has an answer: the job or node it names is unknown to slurmctld.
# Any other failure ("Socket timed out on send/recv operation", "Unable to contact slurm controller",
# "Zero Bytes were transmitted or received", another exit code) is transient: retried, then unknown.
UNKNOWN_NAME = ("invalid job id", "invalid node name")

_calls: dict[str, int] = {}
_calls_lock = threading.Lock()  # the supervisor's threads (its node poll, its launcher) share the counter


class SlurmUnavailable(SlurmError):
    """slurmctld did not answer (no answer within slurm_command, or a transient error, on every attempt):
    the answer is unknown. A caller keeps waiting; it never takes this for "the job ended"."""


def client_calls() -> dict[str, int]:
    """The Slurm client commands this process ran that reach slurmctld, each attempt counted: `total`,
    `failed` and one count per command ("squeue", "scontrol show", "scancel", ...)."""
    with _calls_lock:
        return {"total": 0, "failed": 0, **_calls}


def _count(args: Sequence[str], failed: bool) -> None:
    if tuple(args[:3]) in LOCAL_COMMANDS:
        return
    name = " ".join(args[:2]) if args[0] == "scontrol" else args[0]
    with _calls_lock:
        for key in ("total", name, *(("failed",) if failed else ())):
            _calls[key] = _calls.get(key, 0) + 1


def submit(folder: Path, parameters: Mapping[str, Any], function: Callable[[], Any]) -> str:
    """Submit `function` as a batch job through submitit (which runs sbatch, and keeps its files and
    the job's output in `folder`); returns the Slurm job id. SlurmError when sbatch refuses. Never
    retried: a second sbatch after one that timed out may queue the job twice."""
    import submitit
    from submitit.core.utils import FailedJobError

    executor_args, update = executor_arguments(parameters)
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm", **executor_args)
    executor.update_parameters(**update)
    try:
        job_id = str(executor.submit(function).job_id)
    except (FailedJobError, OSError) as err:
        _count(["sbatch"], failed=True)
        raise SlurmError(str(err).strip() or f"sbatch failed: {type(err).__name__}") from None
    _count(["sbatch"], failed=False)
    return job_id


def start_step(node: str, command: Sequence[str], cpus: int, gpus: int, output: Path,
               network: str | None = None, name: str = AGENT_STEP_NAME) -> subprocess.Popen:
    """Start `command` as its own srun step on `node` (see `srun_argv`); its output goes to `output`.
    The step's exit is the evidence that the node's task ended."""
    _count(["srun"], failed=False)
    with open(output, "ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(srun_argv(node, command, cpus, gpus, network, name), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def queued_jobs(job_ids: Sequence[str], timeouts: JobTimeouts = DEFAULT_TIMEOUTS) -> dict[str, tuple[str, str]]:
    """The state and node list of those of `job_ids` still in the queue (see `parse_squeue_jobs`);
    SlurmUnavailable when slurmctld did not answer (then nothing is known about them)."""
    if not job_ids:
        return {}
    try:
        return parse_squeue_jobs(_retried(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i %T %N"],
                                          timeouts=timeouts))
    except SlurmUnavailable:
        raise
    except SlurmError as err:
        if _names_unknown(err):
            return {}  # none of them is known any more: all left the queue
        raise


def job_end_time(job_id: str, timeouts: JobTimeouts = DEFAULT_TIMEOUTS) -> float | None:
    """When the job's time limit ends (squeue's %e, the controller's local time, read here as this
    node's), as a Unix time; None with no limit or an answer that is not a time (pending: "N/A")."""
    text = _retried(["squeue", "-h", "-j", job_id, "-o", "%e"], timeouts=timeouts).strip()
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def expand_hostnames(nodelist: str) -> list[str]:
    """`node[1-4]` -> node1..node4, as Slurm expands it (the client alone: no RPC)."""
    return _run(["scontrol", "show", "hostnames", nodelist]).split()


def query_nodes(names: list[str] | None = None, env: Mapping[str, str] | None = None,
                timeouts: JobTimeouts = DEFAULT_TIMEOUTS) -> dict[str, NodeHealth]:
    """Current Slurm state of `names` (all nodes when None): one RPC when slurmctld answers at once;
    SlurmUnavailable when it did not answer any attempt."""
    args = ["scontrol", "show", "node", "-o"] + ([",".join(names)] if names else [])
    return node_health(parse_scontrol_records(_retried(args, env, timeouts)))


def set_node_down(node: str, reason: str, timeouts: JobTimeouts = DEFAULT_TIMEOUTS) -> None:
    """What an admin (or slurmctld) does to a failed node: DOWN, with a reason (a drill). Idempotent:
    retried like a query."""
    _retried(["scontrol", "update", f"nodename={node}", "state=down", f"reason={reason}"], timeouts=timeouts)


def cancel_jobs(job_ids: Sequence[str], timeouts: JobTimeouts = DEFAULT_TIMEOUTS) -> None:
    """scancel `job_ids`; idempotent, so retried like a query. A job Slurm no longer knows is over
    already: what the cancel wanted."""
    if not job_ids:
        return
    try:
        _retried(["scancel", *job_ids], timeouts=timeouts)
    except SlurmUnavailable:
        raise
    except SlurmError as err:
        if not _names_unknown(err):
            raise


def requeue_job(job_id: str, exclude: Sequence[str] = (), timeouts: JobTimeouts = DEFAULT_TIMEOUTS) -> None:
    """`scontrol requeue` the job (it runs again under the same id, SLURM_RESTART_COUNT + 1, and
    resumes from its newest complete checkpoint), then keep its next run off `exclude`
    (`requeue_exclude_argv`: only a pending job's list can change). Not retried: a second requeue of a
    job already requeued fails, and the caller tells that from a failure to reach Slurm by the answer."""
    _run(["scontrol", "requeue", job_id], timeout=timeouts.slurm_command)
    if exclude:
        _retried(requeue_exclude_argv(job_id, exclude), timeouts=timeouts)


# Job states in which a job has left for good (squeue may still list it for MinJobAge after it ended).
ENDED_JOB_STATES = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL",
                              "DEADLINE", "OUT_OF_MEMORY", "PREEMPTED", "REVOKED", "SPECIAL_EXIT"})


def queue_answer(stdout: str) -> bool:
    """squeue -h -o '%T' of one job -> whether it is still pending or running: listed, in a state
    that is not an end (pure)."""
    states = stdout.split()
    return any(state not in ENDED_JOB_STATES for state in states)


def in_queue(job_id: str, timeouts: JobTimeouts = DEFAULT_TIMEOUTS) -> bool | None:
    """True while the job is pending or running, False once Slurm says it is gone (no longer listed, or
    an id squeue no longer knows), None when slurmctld did not answer (unknown: keep waiting, never
    "ended", never a reason to cancel)."""
    try:
        return queue_answer(_retried(["squeue", "-h", "-j", job_id, "-o", "%T"], timeouts=timeouts))
    except SlurmUnavailable:
        return None
    except SlurmError as err:
        return False if _names_unknown(err) else None


def accounting(job_id: str, timeouts: JobTimeouts = DEFAULT_TIMEOUTS) -> str:
    """sacct's `State ExitCode NodeList` of the job ("" when it has no record yet); SlurmUnavailable
    when slurmdbd or slurmctld did not answer."""
    out = _retried(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode,NodeList"],
                   timeouts=timeouts).strip()
    return out.splitlines()[0].replace("|", " ") if out else ""


def job_state(job_id: str, timeout: float = SLURM_COMMAND_TIMEOUT_S) -> str | None:
    """`RUNNING`, `PENDING`, `COMPLETED`, ...: from squeue, or sacct once the job left the queue. Best
    effort, one attempt each (the live dashboard asks again at its next refresh): no Slurm client, a
    slow controller or an unknown job give None, never an error."""
    for args in (["squeue", "-h", "-j", job_id, "-o", "%T"], ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"]):
        try:
            words = _run(args, timeout=timeout).split()
        except SlurmError:
            continue
        if words:
            return words[0]  # sacct: "CANCELLED by 0" -> CANCELLED
    return None


def _names_unknown(err: SlurmError) -> bool:
    return any(marker in str(err).lower() for marker in UNKNOWN_NAME)


def _retried(args: list[str], env: Mapping[str, str] | None = None,
             timeouts: JobTimeouts = DEFAULT_TIMEOUTS, attempts: int = READ_ATTEMPTS) -> str:
    """`_run` of a read-only (or idempotent) command, tried again after a transient failure, pausing
    slurm_retry_backoff, then twice that, ...; SlurmUnavailable naming the attempts when none answered.
    An answer (exit 0, or an unknown job or node) ends the attempts at once."""
    pause = timeouts.slurm_retry_backoff
    for attempt in range(1, attempts + 1):
        try:
            return _run(args, env, timeouts.slurm_command)
        except SlurmUnavailable as err:
            if attempt == attempts:
                raise SlurmUnavailable(f"{err} (attempt {attempt} of {attempts}: the answer is unknown)") from None
            time.sleep(pause)
            pause *= 2
    raise AssertionError("unreachable")  # the loop returns or raises


def _run(args: list[str], env: Mapping[str, str] | None = None, timeout: float = SLURM_COMMAND_TIMEOUT_S) -> str:
    """Run a Slurm client command once, counted (`client_calls`), and return its stdout. SlurmError
    when the client is missing or names an unknown job or node (answers); SlurmUnavailable for a
    timeout or any other failure (slurmctld unreachable or busy: worth another attempt)."""
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                                env=dict(env) if env is not None else os.environ.copy())
    except FileNotFoundError:
        raise SlurmError(f"{args[0]}: Slurm client not installed") from None
    except subprocess.TimeoutExpired:
        _count(args, failed=True)
        raise SlurmUnavailable(f"{' '.join(args)}: no answer within {timeout:g} s (slurm_command)") from None
    _count(args, failed=result.returncode != 0)
    if result.returncode != 0:
        message = f"{' '.join(args)}: exit {result.returncode}: {result.stderr.strip()}"
        if any(marker in result.stderr.lower() for marker in UNKNOWN_NAME):
            raise SlurmError(message)
        raise SlurmUnavailable(message)
    return result.stdout
