"""`kill-node JOB NODE [--how ...]`: fault injection for drills. The supervisor is told first (so that
detection times are measured from the injection), then:

    agent    the node's agent is killed with SIGKILL (its workers die with it)
    worker   one worker of the node (`--worker I`, default 0) is killed with SIGKILL
    hang     one worker of the node is SIGSTOPped (a hung worker)
    slow     the node keeps working, slower: its agent duty-cycles its workers with SIGSTOP/SIGCONT
             (a straggler; found from compute times, see detection.stragglers)
    corrupt  silent data corruption: one bit of a parameter of the node's worker (`--worker I`) flips
             at its next step (the replicas' checksums find it: fault_tolerance.integrity_interval)
    leak     a metric-only fault: the node's agent allocates more memory every second (found by the
             metrics detector; training is unaffected)
    down     `scontrol update nodename=NODE state=down` (an admin, or slurmctld, takes it out; Slurm only)
    freeze   every process of this job on the node is SIGSTOPped (a frozen machine: heartbeats stop)
    node     every process of this job on the node is SIGKILLed (a crashed machine)

`kill-node JOB supervisor [--how process|freeze|node]` acts on the job's primary supervisor (its pid
and host in the job folder's lease): SIGKILL (`process`), SIGSTOP (`freeze`, left stopped), or, under
Slurm, every process of the job on the supervisor's node SIGKILLed (`node`). Its standby takes over
(the local backend, or Slurm with `cluster.supervisor.failover`; docs/failover.md).

`freeze` and `node` act on the processes they can see: under Slurm, the job's processes on the node
(by their Slurm environment: run on the node itself, or on a lab where every virtual node runs on
this machine); on the local backend, the virtual node's agent and its workers.
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from oobleck_slurm.commands.common import console, fail
from oobleck_slurm.exit_codes import EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:  # imported when the command runs, not when the CLI starts
    from oobleck_slurm.cluster.jobdir import JobDir

HOWS = ("agent", "worker", "hang", "slow", "corrupt", "leak", "down", "freeze", "node", "process")
SUPERVISOR = "supervisor"  # the NODE that names the job's primary supervisor


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("kill-node", aliases=["kill_node"], help="fault injection: kill, hang, slow or down one node of a job")
    parser.add_argument("job", help="job folder, or a job id under --job-root")
    parser.add_argument("node", help="node name (Slurm's, or the job's id of a replacement such as r1), or "
                        "'supervisor' (the job's primary supervisor)")
    parser.add_argument("--how", choices=HOWS, default="agent", help="what to do to the node (default: agent)")
    parser.add_argument("--worker", type=int, default=0, help="which worker of the node, for worker, hang and corrupt (default 0)")
    parser.add_argument("--job-root", type=Path, default=Path("jobs"), help="where job ids are looked up (default: jobs)")


def job_processes(node: str, slurm_job_ids: set[str]) -> list:
    """Processes on this machine that Slurm started for these jobs on `node` (by their environment)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if env.get("SLURMD_NODENAME") == node and env.get("SLURM_JOB_ID") in slurm_job_ids:
            found.append(proc)
    return found


def local_node_processes(agent_pid: int | None) -> list:
    """A local virtual node's processes: its agent and everything it started (its workers)."""
    import psutil

    if agent_pid is None:
        return []
    try:
        agent = psutil.Process(agent_pid)
        return [agent, *agent.children(recursive=True)]
    except psutil.Error:
        return []


def run(args: argparse.Namespace) -> int:
    from oobleck_slurm.cluster.jobdir import JobNotFound, find_job
    from oobleck_slurm.cluster.slurm import SlurmError, set_node_down
    from oobleck_slurm.commands.cancel import slurm_job_ids
    from oobleck_slurm.protocol.events import events_path, read_events
    from oobleck_slurm.supervisor.client import SupervisorUnreachable, live_status, notify_fault

    try:
        job = find_job(args.job, args.job_root)
    except JobNotFound as err:
        return fail(str(err))
    local = job.meta().get("backend") == "local"
    if args.node == SUPERVISOR:
        return _kill_supervisor(job, "process" if args.how == "agent" else args.how, local)
    if args.how == "process":
        return fail("--how process names the supervisor: kill-node JOB supervisor --how process")
    if args.how == "down" and local:
        return fail(f"{job.job_id}: --how down needs Slurm (scontrol); this job runs on the local backend")
    if args.worker < 0:
        return fail(f"--worker must be >= 0, got {args.worker}")
    try:
        live = live_status(job.path)
        slurm_node = live.node_of.get(args.node, args.node)
        reply = notify_fault(job.path, args.node, args.how, worker=args.worker)
    except SupervisorUnreachable as err:
        return fail(f"{job.job_id}: {err}", EXIT_FAILED)
    if not reply.ok:
        return fail(f"{job.job_id}: {reply.detail or 'the supervisor refused the drill'}", EXIT_FAILED)
    if args.how == "corrupt":  # the worker reads it from the job folder (engine/requests.py)
        from oobleck_slurm.engine.requests import write_request
        from oobleck_slurm.protocol.keys import worker_id

        write_request(job.corrupt_request, workers=[worker_id(n, args.worker) for n in {args.node, slurm_node}])
    elif args.how == "down":
        try:
            set_node_down(slurm_node, "oobleck-drill")
        except SlurmError as err:
            return fail(str(err), EXIT_FAILED)
    elif args.how in ("freeze", "node"):
        if local:
            procs = local_node_processes(live.agent_pids.get(slurm_node))
            if not procs:
                return fail(f"{job.job_id}: no live agent for {args.node}", EXIT_FAILED)
        else:
            ids = set(slurm_job_ids(job.meta(), read_events(events_path(job.path), "replacement_requested")))
            procs = job_processes(slurm_node, ids)
            if not procs:
                return fail(f"no process of job(s) {sorted(ids)} on {slurm_node} is visible from here", EXIT_FAILED)
        for sig in ((signal.SIGSTOP,) if args.how == "freeze" else (signal.SIGSTOP, signal.SIGKILL)):
            for proc in procs:
                try:
                    proc.send_signal(sig)
                except Exception:  # noqa: BLE001 - already gone
                    pass
    console.print(f"{args.how}: {args.node} ({slurm_node}) of {job.job_id}", markup=False, highlight=False)
    return EXIT_OK


SUPERVISOR_HOWS = ("process", "node", "freeze")


def _kill_supervisor(job: JobDir, how: str, local: bool) -> int:
    """Fault injection into the job's primary supervisor (the pid and host in its lease): `process`
    SIGKILLs it, `freeze` SIGSTOPs it (it is left stopped: a frozen machine), `node` (Slurm) SIGKILLs
    every process of the job on its node. Its standby takes over (docs/failover.md)."""
    import os
    import socket

    from oobleck_slurm.cluster.lease import read_lease
    from oobleck_slurm.commands.cancel import slurm_job_ids
    from oobleck_slurm.protocol.events import events_path, read_events

    if how not in SUPERVISOR_HOWS:
        return fail(f"kill-node {SUPERVISOR}: --how must be one of {', '.join(SUPERVISOR_HOWS)}, got {how}")
    meta = job.meta()
    if not local and not meta.get("supervisor_jobs"):
        return fail(f"{job.job_id}: its supervisor has no standby (it runs in the allocation's batch step): "
                    f"set cluster.supervisor.failover: true (docs/failover.md)")
    lease = read_lease(job)
    if lease is None or lease.done:
        return fail(f"{job.job_id}: no running supervisor (no live lease in {job.supervisor_lease})", EXIT_FAILED)
    what = f"supervisor (pid {lease.pid}, epoch {lease.epoch})"
    if how == "node":
        if local:
            return fail(f"{job.job_id}: on the local backend the supervisor has no node of its own; use "
                        f"--how process or --how freeze")
        node = (meta.get("supervisor") or {}).get("host")
        ids = set(slurm_job_ids(meta, read_events(events_path(job.path), "replacement_requested")))
        procs = job_processes(node, ids) if node else []
        if not procs:
            return fail(f"no process of job(s) {sorted(ids)} on the supervisor's node {node} is visible from here",
                        EXIT_FAILED)
        for sig in (signal.SIGSTOP, signal.SIGKILL):  # all stopped first: none sees another die
            for proc in procs:
                try:
                    proc.send_signal(sig)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        what += f" and every process of the job on {node} ({len(procs)})"
    else:
        if lease.host != socket.gethostname():
            return fail(f"{job.job_id}: the supervisor runs on {lease.host}: run kill-node there", EXIT_FAILED)
        try:
            os.kill(lease.pid, signal.SIGKILL if how == "process" else signal.SIGSTOP)
        except ProcessLookupError:
            return fail(f"{job.job_id}: the supervisor (pid {lease.pid}) is gone", EXIT_FAILED)
    console.print(f"{how}: {what} of {job.job_id}", markup=False, highlight=False)
    return EXIT_OK
