"""The rank supervisor: `python -m oobleck_slurm.supervisor.main JOB_DIR [--backend slurm|local]`.

Under Slurm it runs in the batch step of the `--no-kill` allocation (submitted through submitit, see
`SupervisorJob`); it hosts the job's TCPStore and control server, starts one agent per node, and runs
the coordinator (membership, generations, reconfiguration) with `AgentNodes` as its backend. Losing
the node that runs it ends the job (nothing else holds the store): the job then exits non-zero and
`--time` bounds the allocation; a requeue resumes from the last complete checkpoint.

With `cluster.supervisor.failover` (docs/failover.md, "Under Slurm") there is no allocation: this
supervisor is the batch step of its own small one-node job, submits one one-node job per training node
(its batch step is the node's agent: `NodeJobLauncher`) and a standby supervisor's job on another node,
which takes over when this one's lease lapses. On the local backend a standby always runs.

Preemption / time limit (see preemption.py): the notice reaches the agents, which relay it; the
supervisor signals itself, submitit's handler calls `SupervisorJob.checkpoint`, which waits for an
on-demand checkpoint of the current step, marks the folder (`requeue`) and lets submitit requeue.

Exit codes (exit_codes.py): 0 done; otherwise the error's class says it (errors.py): EXIT_UNRECOVERABLE
(3) training cannot go on, EXIT_BAD_INPUT (2) the recipe, profile, factory or data cannot be used, 1
anything else (a timeout, Slurm or the store failed, a bug). The job's meta records `requeue`: whether
a requeue may help (not after bad input, an unrecoverable loss, a bug, a completed or cancelled job);
`SupervisorJob.checkpoint` requeues only when it may.

Every timeout and poll period is the job's `JobTimeouts` (timeouts.py), built here once from
the recipe and handed to the coordinator, the node backend, the health monitor, the workers
(elastic.json) and the agents (supervisor.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from oobleck_slurm.agent.warm import ignore_step_signals, in_slurm_step, write_output_to
from oobleck_slurm.cluster.jobdir import META_FILE, JobDir
from oobleck_slurm.errors import (
    BadInputError,
    InfrastructureError,
    OobleckError,
    exit_code_for,
    requeue_for,
    status_for,
)
from oobleck_slurm.exit_codes import EXIT_FAILED, EXIT_OK
from oobleck_slurm.stack_dumps import enable_stack_dumps
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS, JobTimeouts

if TYPE_CHECKING:
    from oobleck_slurm.agent.warm import WarmServer
    from oobleck_slurm.protocol.events import EventLog
    from oobleck_slurm.recipe import Recipe


class Exporter(Protocol):
    """A metrics logger following the event log (dashboard/tensorboard.py, dashboard/wandb_logger.py)."""

    def export(self) -> int: ...

    def close(self) -> None: ...

# Statuses after which a requeue cannot help (a job's meta from before `requeue` was recorded).
OVER = ("unrecoverable", "completed", "cancelled")
STANDBY_POLL_S = 0.05  # a standby looks at the primary's lease this often: bounds its detection of a kill -9
STALE_END_RETRY_S = 5.0  # squeue's end time of a job just requeued can still be the last run's: asked again
SUPERVISOR_MODULE = "oobleck_slurm.supervisor.main"  # how a standby is started (python -m, or forked warm)


def advertised_host() -> str:
    """The address agents and workers use to reach this node: OOBLECK_SUPERVISOR_HOST, else the
    node's name (the lab maps node names to 127.0.0.1 in /etc/hosts), else the hostname."""
    return os.environ.get("OOBLECK_SUPERVISOR_HOST") or os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def failover_enabled(backend: str, recipe: Any) -> bool:
    """Whether a standby supervisor runs: always on the local backend (a second process on this
    machine); on Slurm as a step on another node of the allocation (`standby_in_allocation`), or as
    its own job with `cluster.supervisor.failover`."""
    return backend == "local" or bool(recipe.cluster.supervisor.failover) or standby_in_allocation(backend, recipe)


def standby_in_allocation(backend: str, recipe: Any) -> bool:
    """Whether the standby is a step of the training allocation (`cluster.supervisor.standby`, the
    default under Slurm): it needs a second node, which the batch host's loss leaves."""
    cluster = recipe.cluster
    return (backend == "slurm" and not cluster.supervisor.failover and bool(cluster.supervisor.standby)
            and cluster.nodes + cluster.spare_nodes >= 2)


def standby_node(candidates: list[str], exclude: list[str]) -> str | None:
    """Where the standby step runs: the last of the allocation's nodes (spares last, so preferred: they
    train nothing) that is none of `exclude` (this supervisor's node, a lost primary's, evicted ones)."""
    allowed = [node for node in candidates if node not in exclude]
    return allowed[-1] if allowed else None


def allocation_nodes(backend: str, recipe: Any) -> list[str]:
    if backend == "local":
        return [f"node{i + 1}" for i in range(recipe.cluster.nodes + recipe.cluster.spare_nodes)]
    from oobleck_slurm.cluster.slurm import expand_hostnames

    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise BadInputError("SLURM_JOB_NODELIST is not set: the slurm backend runs inside an allocation")
    nodes = expand_hostnames(nodelist)
    batch = os.environ.get("SLURMD_NODENAME")
    if batch in nodes:  # the batch node first: it is a member (never a spare) and rank 0's home
        nodes.remove(batch)
        nodes.insert(0, batch)
    return nodes


def slurm_restart_count() -> int:
    """How many times Slurm requeued this job (SLURM_RESTART_COUNT, set by slurmd in a requeued job's
    environment; sbatch(1), "OUTPUT ENVIRONMENT VARIABLES"); 0 outside Slurm or on the first run."""
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def nodes_share_a_machine(backend: str, nodes: list[str]) -> bool:
    """Whether the job's nodes are virtual nodes of one machine: the local backend's, or Slurm nodes
    that resolve to one address (the test lab's, all 127.0.0.1). Their agents then do not send the
    machine's own counters (agent_health.py): each would compare the machine with itself."""
    if backend == "local":
        return True
    try:
        addresses = {socket.gethostbyname(node) for node in nodes}
    except OSError:  # names this node cannot resolve: nothing says they share one
        return False
    return len(addresses) < len(nodes)


@dataclass(frozen=True)
class Takeover:
    """What a standby that claimed `epoch` takes over: the lost primary's durable state, and how old
    its lease was when the standby saw it lapse."""

    epoch: int
    state: Any  # protocol.records.SupervisorState
    lease_age: float


def run_standby(job_dir: Path, backend: str, preemption: Any = None, on_preempt: Any = None) -> int:
    """Wait while the primary holds its lease; when it lapses (or, on one machine, the primary's process
    is gone), claim the next epoch and run the job from the primary's durable state (lease.py). Under
    Slurm the primary runs on another node: only its lease's age tells."""
    enable_stack_dumps()
    from oobleck_slurm.cluster.lease import claim_epoch, current_epoch, primary_gone, read_lease
    from oobleck_slurm.protocol.records import read_state
    from oobleck_slurm.protocol.wire import ProtocolError

    job = JobDir.at(job_dir)
    lease_s = job.recipe().fault_tolerance.heartbeat_lease
    # Imported now, not after the primary's loss: a takeover is timed from the loss.
    import torch.distributed  # noqa: F401

    import oobleck_slurm.engine.from_recipe  # noqa: F401
    import oobleck_slurm.planning.pregenerate  # noqa: F401
    import oobleck_slurm.supervisor.agent_nodes  # noqa: F401
    import oobleck_slurm.supervisor.coordinator  # noqa: F401
    import oobleck_slurm.supervisor.health_monitor  # noqa: F401
    print(f"standby: watching the primary's lease (pid {os.getpid()}, {advertised_host()})", file=sys.stderr,
          flush=True)
    while True:
        lease, now = read_lease(job), time.time()
        if (lease is not None and lease.done) or job.cancel_marker.exists():
            return EXIT_OK  # over, or `cancel` is ending every job of it (the primary's lease lapses then)
        if primary_gone(lease, lease_s, now, same_machine=backend == "local"):
            assert lease is not None
            epoch = current_epoch(job) + 1
            if not claim_epoch(job, epoch):
                return EXIT_OK  # another standby took over
            print(f"standby: the primary's lease is {now - lease.t:.2f} s old: taking over as epoch {epoch}",
                  file=sys.stderr, flush=True)
            try:
                state = read_state(job.supervisor_state)
            except ProtocolError as err:  # damaged (a crash of the disk): no traceback, a named exit
                print(f"standby: cannot take over: {err}", file=sys.stderr)
                return EXIT_FAILED
            if state is None:
                print("standby: the primary was lost before it published a generation: nothing to take over",
                      file=sys.stderr)
                return EXIT_FAILED
            return run_supervisor(job_dir, backend, preemption, on_preempt,
                                  takeover=Takeover(epoch, state, now - lease.t))
        time.sleep(STANDBY_POLL_S)


def run_supervisor(job_dir: Path, backend: str = "slurm", preemption: Any = None,
                   on_preempt: Any = None, takeover: Takeover | None = None) -> int:
    """Run the job to its end; `preemption` (a Preemption) is set by whoever receives the notice,
    `on_preempt` is called when an agent relays one (default: set `preemption.requested`)."""
    from oobleck_slurm.protocol.events import EventLog
    from oobleck_slurm.supervisor.preemption import Preemption

    enable_stack_dumps()
    job = JobDir.at(job_dir)
    log = EventLog(job.events)
    preemption = preemption or Preemption()
    started = time.time()
    try:
        _run(job, backend, log, preemption, on_preempt or preemption.notice, takeover)
        # A run that stopped for a notice is preempted, checkpointed or not: a requeue goes on from the
        # newest complete checkpoint (an older periodic one if the on-demand one failed). Only a run
        # that trained every step is completed.
        stopped = preemption.finished.is_set()
        code, status, error = EXIT_OK, "preempted" if stopped else "completed", None
        requeue = stopped
        if stopped and job.cancel_marker.exists():  # `cancel`'s scancel sent the SIGTERM: checkpointed, over
            status, requeue = "cancelled", False
    except Exception as err:  # noqa: BLE001 - recorded for `status` and the user, then an exit code
        from oobleck_slurm.cluster.jobdir import SUPERVISOR_ERROR

        (job.logs / SUPERVISOR_ERROR).write_text(traceback.format_exc())
        # `cancel` leaves a marker first: the losses that scancel causes are not a failure of training.
        if job.cancel_marker.exists():
            code, status, requeue = EXIT_FAILED, "cancelled", False
        else:  # the error's class says the exit code and whether a requeue may help (errors.py)
            code, status, requeue = exit_code_for(err), status_for(err), requeue_for(err)
        error = f"{type(err).__name__}: {err}"
        print(f"supervisor: {error}", file=sys.stderr)
    log.emit("job_finished", status=status, exit_code=code, error=error, seconds=time.time() - started,
             checkpoint_step=preemption.step)
    log.close()
    job.update_meta(exit_code=code, status=status, requeue=requeue)
    if takeover is not None and backend == "slurm" and in_slurm_step():
        # After a SIGTERM (preemption, `scontrol requeue`, `scancel`) Slurm decides; after the time
        # limit's USR2 the job requeues itself, as submitit would have in the lost batch step.
        _end_allocation(job, requeue and preemption.signal != "SIGTERM")
    return code


def _end_allocation(job: JobDir, requeue: bool) -> None:
    """A supervisor that took over inside the allocation ends it when the run ends: the batch script
    that would have ended it died with the batch host, and Slurm keeps such a job RUNNING until its
    time limit (docs/slurm.md, "The batch host"). `requeue`: the next run resumes from the newest
    complete checkpoint, off the nodes this job lost; else scancel (sacct then says CANCELLED; the job
    folder says how the run ended)."""
    from oobleck_slurm.cluster.slurm import SlurmError, cancel_jobs, requeue_job

    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return
    try:
        if requeue:  # the lost primary's node is among the evicted (`_run`)
            requeue_job(job_id, sorted(job.meta().get("evicted_nodes", [])))
        else:
            cancel_jobs([job_id])  # this process too: it has nothing left to do
    except SlurmError as err:
        print(f"supervisor: {'requeue' if requeue else 'scancel'} of job {job_id} failed: {err}", file=sys.stderr)


def _run(job: JobDir, backend: str, log: Any, preemption: Any, on_preempt: Any, takeover: Takeover | None) -> None:
    from oobleck_slurm.cluster.jobdir import load_secret
    from oobleck_slurm.cluster.lease import claim_epoch, current_epoch
    from oobleck_slurm.engine.batches import prepare_data
    from oobleck_slurm.engine.checkpoint import latest_complete
    from oobleck_slurm.engine.faults import load_faults
    from oobleck_slurm.engine.from_recipe import job_from_recipe, token_file_for, validation_file_for
    from oobleck_slurm.engine.worker import check_supported
    from oobleck_slurm.models import FactoryError, check_stage_widths
    from oobleck_slurm.planning import Plan, instantiate
    from oobleck_slurm.planning.pregenerate import pregenerate
    from oobleck_slurm.protocol import keys
    from oobleck_slurm.protocol.records import LaunchConfig, write_launch_config
    from oobleck_slurm.protocol.signed_store import serve as serve_store
    from oobleck_slurm.supervisor.agent_nodes import AgentNodes, BackendConfig
    from oobleck_slurm.supervisor.coordinator import Coordinator, CoordinatorConfig
    from oobleck_slurm.supervisor.hang_dumps import HangDumps
    from oobleck_slurm.supervisor.health_monitor import HealthMonitor
    from oobleck_slurm.supervisor.launchers import LocalLauncher, NodeJobLauncher, SrunLauncher
    from oobleck_slurm.supervisor.observer import StoreObserver

    recipe = job.recipe()
    meta = job.meta()
    ft, cluster = recipe.fault_tolerance, recipe.cluster
    # Every timeout and poll period of the job, from the recipe in this one place (timeouts.py).
    timeouts = JobTimeouts.from_recipe(ft)
    failover = failover_enabled(backend, recipe)
    # A standby takes over a lost supervisor (docs/failover.md): agents and workers wait this long for it.
    failover_s = ft.reconfiguration_timeout if failover else 0.0
    launcher: Any
    if backend == "local":
        launcher = LocalLauncher(job.path)
    elif cluster.supervisor.failover:  # no allocation: each training node is its own job (launchers.py)
        launcher = NodeJobLauncher(job.path, cluster, recipe.name)
    else:
        launcher = SrunLauncher(job.path, cluster, recipe.name)
    previous_host = (meta.get("supervisor") or {}).get("host")  # a lost primary's node: no standby there
    requeued = job.requeue_marker.exists() or slurm_restart_count() > 0  # completed below by the checkpoints
    members: list[str] = []
    spares: list[str] = []

    def begin(nodes: list[str]) -> None:
        if len(nodes) < cluster.nodes:
            raise InfrastructureError(f"the allocation has {len(nodes)} node(s) ({nodes}); the recipe needs "
                                      f"{cluster.nodes}")
        members[:], spares[:] = nodes[:cluster.nodes], nodes[cluster.nodes:]
        log.emit("job_started", job_id=job.job_id, backend=backend, recipe=recipe.name,
                 recipe_path=str(job.recipe_path), nodes=members, spares=spares, f=ft.f, steps=recipe.training.steps,
                 pid=os.getpid(), slurm_job_id=os.environ.get("SLURM_JOB_ID"),
                 supervisor_node=os.environ.get("SLURMD_NODENAME"), requeued=requeued,
                 workers_per_node=cluster.devices_per_node, device="cuda" if cluster.gpus_per_node else "cpu",
                 resumed_from=(meta.get("resumed_from") or {}).get("path"))

    token_file = token_file_for(recipe, job.data)
    try:  # `submit` checked a factory; a job started otherwise is told here
        spec = job_from_recipe(recipe, token_file, validation_file_for(recipe, job.data))
        check_stage_widths(spec.model.config, cluster.stage_devices(factory_model=recipe.model.factory is not None))
    except FactoryError as problem:  # still a FactoryError (bad input: exit 2), naming the recipe file
        raise FactoryError(problem.key, f"{recipe.source}: {problem.key}: {problem}") from problem
    check_supported(spec)
    _check_data(spec)
    # The data's identity, checked against the checkpoint resumed from, and where its stream resumes
    spec = replace(spec, data=prepare_data(spec, str(job.checkpoints)))
    # Every restart is a resume: whoever requeued the job (submitit after a notice, `scontrol requeue`,
    # a preemption, a node-failure requeue), a folder holding a complete checkpoint never trains from
    # step 0 again, nor writes an earlier step's checkpoint over a later one.
    resume_from = latest_complete(job.checkpoints, list(spec.model.keys()))
    # A job started from another job's checkpoint (engine/resume.py) holds it from the start: no requeue.
    requeued = requeued or (resume_from is not None and resume_from != (meta.get("resumed_from") or {}).get("step"))

    if takeover is None:
        epoch = current_epoch(job) + 1  # 1, or the requeued run's next
        if not claim_epoch(job, epoch):
            raise RuntimeError(f"{job.path}: epoch {epoch} was claimed by another supervisor")
        if not isinstance(launcher, NodeJobLauncher):
            begin(allocation_nodes(backend, recipe))
    else:
        epoch = takeover.epoch
        members, spares = list(takeover.state.members), []
    if job.faults.is_file():  # drills: worker faults (engine/faults.py)
        spec = replace(spec, extra={**spec.extra, "faults": load_faults(job.faults)})
    if takeover is None and isinstance(launcher, NodeJobLauncher):  # after the input checks: nothing queued for bad input
        begin(launcher.start_nodes(cluster.nodes + cluster.spare_nodes, timeouts.node_jobs_timeout,
                                   timeouts.slurm_poll))
    # The profile `submit` planned with: a file given to it (kept in the job folder), an estimate, or
    # the measured one in the cache; the job's plan is the one `plan` shows for the same inputs.
    profile, templates = pregenerate(recipe, meta.get("templates_cache", "templates_cache"),
                                     profile_file=job.profile if job.profile.is_file() else None,
                                     estimate_gpu=meta.get("estimate_gpu"))
    if takeover is None:
        plan = instantiate(templates, members, ft.f, recipe.training.global_microbatches,
                           microbatch_size=recipe.training.microbatch_size, profile=profile,
                           use_all_nodes=recipe.cluster.use_all_nodes)
    else:  # the lost supervisor's plan goes on (Coordinator.take_over)
        plan = Plan.from_dict(takeover.state.plan)
    host = advertised_host()
    # Every key hidden, every value signed, listening only where the clients connect (protocol/signed_store.py)
    store = serve_store(host, timeouts.td("store_timeout"), load_secret(job.path), log, "supervisor",
                        timeouts.forged_value_poll)
    if takeover is not None:  # before the workers find the store: the generation they report for
        store.set(keys.CURRENT_GEN, str(takeover.state.generation))
    ckpt_dir = str(job.checkpoints)  # periodic if checkpoint_interval > 0; on-demand and final always
    job.job_spec.write_text(spec.to_json())
    write_launch_config(job.elastic, LaunchConfig(
        host=host, port=store.port, timeouts=asdict(timeouts), checkpoint_interval=ft.checkpoint_interval,
        checkpoint_dir=ckpt_dir, workers_per_node=cluster.devices_per_node, epoch=epoch, failover_s=failover_s))

    # The one poller of the store: the coordinator, the node backend and the health monitor read its view.
    observer = StoreObserver(store, timeouts, cluster.devices_per_node)
    detection = recipe.detection
    health = (HealthMonitor(detection, job.path, log, cluster.devices_per_node, ckpt_dir, ft.checkpoint_interval,
                            recipe.training.steps, timeouts=timeouts) if detection.enabled else None)
    nodes_backend = AgentNodes(load_secret(job.path), launcher, log, BackendConfig(
        replacement=ft.replacement, store_host=host, store_port=store.port,
        workers_per_node=cluster.devices_per_node, threads_per_worker=cluster.threads_per_worker,
        device="cuda" if cluster.gpus_per_node else "cpu", timeouts=timeouts,
        preflight=detection.preflight if detection.preflight.enabled else None,
        shared_machine=nodes_share_a_machine(backend, members + spares)), members, observer, spares,
        on_preempt=on_preempt,
        drills=recipe.drills if meta.get("drills", True) and not requeued and takeover is None else (), health=health,
        requested=list(takeover.state.pending_joins or {}) if takeover is not None else ())
    nodes_backend.server.start()
    metrics = {"interval": detection.interval, "machine": not nodes_share_a_machine(backend, members + spares),
               "gpus": bool(cluster.gpus_per_node)}  # what agents sample (agent_health.py)
    job.write_supervisor_address(host=host, port=nodes_backend.port, timeouts=asdict(timeouts),
                                 pid=os.getpid(), store_port=store.port, epoch=epoch, failover_s=failover_s,
                                 **({"metrics": metrics} if detection.enabled else {}))
    job.update_meta(supervisor={"host": host, "port": nodes_backend.port, "pid": os.getpid()},
                    slurm_job_id=os.environ.get("SLURM_JOB_ID") or meta.get("slurm_job_id"))
    if takeover is not None and backend == "slurm":
        _end_lost_primary(meta.get("slurm_job_id"))
        if previous_host and not isinstance(launcher, NodeJobLauncher):
            launcher.lost(previous_host)  # the batch host: replacements and a requeue avoid it
    config = CoordinatorConfig(f=ft.f, replacement=ft.replacement != "none", checkpoint_dir=ckpt_dir,
                               keep_checkpoints=ft.keep_checkpoints,
                               max_rollbacks=spec.train.loss_spike.rollbacks if spec.train.loss_spike else 0,
                               devices_per_node=cluster.devices_per_node, timeouts=timeouts)
    coordinator = Coordinator(store, nodes_backend, templates, plan, spec.model.keys(), log, config, observer,
                              total_steps=recipe.training.steps, state_file=job.supervisor_state, epoch=epoch)
    coordinator.preemption = preemption
    # a hang verdict saves every worker's stacks and flight recorder first (JOB/dumps, engine/requests.py)
    coordinator.hang_dumps = nodes_backend.hang_dumps = HangDumps(job.path, log, cluster.devices_per_node,
                                                                  timeouts.hang_dump_wait)
    lease = LeaseKeeper(job, epoch, ft.heartbeat_interval)
    coordinator.fence = log.fence = lease.check
    if threading.current_thread() is threading.main_thread():
        # A supervisor thawed after a takeover (SIGSTOP, then SIGCONT) leaves before its threads act on
        # connections that are no longer its own.
        signal.signal(signal.SIGCONT, lambda signum, frame: lease.check())
    standby = (start_standby(job, backend, exclude=[h for h in (host, previous_host) if h],
                            server=launcher.server if isinstance(launcher, LocalLauncher) else None,
                            candidates=members + spares)
               if failover else None)
    observer.start()
    exporters = metrics_exporters(job, recipe, log)
    tensorboard = MetricsThread(exporters, timeouts.tensorboard_poll, lease.check) if exporters else None
    slurm_job_id = os.environ.get("SLURM_JOB_ID") if backend == "slurm" else None
    time_limit = TimeLimitNotice(slurm_job_id, cluster.signal_delay_s, on_preempt) if slurm_job_id else None
    try:
        t0 = time.time()
        if takeover is None:
            nodes_backend.launch_agents(timeout=timeouts.reconfiguration_timeout)
            log.emit("agents_ready", nodes=members + spares, seconds=time.time() - t0)
            coordinator.start(from_checkpoint=True)  # the newest complete checkpoint, if the folder has one
        else:
            lost = nodes_backend.adopt_agents(timeout=timeouts.heartbeat_lease)
            log.emit("takeover", epoch=epoch, generation=takeover.state.generation, lease_age=takeover.lease_age,
                     seconds=time.time() - t0, lost=lost)
            coordinator.take_over(takeover.state)
        coordinator.run()
    finally:
        if time_limit is not None:
            time_limit.stop()
        if tensorboard is not None:
            tensorboard.stop()
        lease.stop(done=True)
        if standby is not None and current_epoch(job) == epoch:  # not one that took over from this process
            standby()
        nodes_backend.close()
        observer.close()


def _standby_step(job: JobDir, recipe: Any, candidates: list[str], exclude: list[str]) -> Callable[[], None] | None:
    """The standby as an `srun --overlap` step on another node of the allocation (docs/slurm.md, "The
    batch host"): measured on the lab, a step launched from the batch host lives on when that machine
    dies, the job stays RUNNING on the other nodes, and a step there can launch steps, requeue and end
    the job. One CPU, no GPU; its output goes to its own log (`main`), since srun's died with the host."""
    from oobleck_slurm.cluster import slurm

    evicted = job.meta().get("evicted_nodes", [])
    node = standby_node(candidates, [*exclude, *evicted])
    if node is None:
        print("supervisor: no standby: no other node in the allocation", file=sys.stderr)
        return None
    argv = [sys.executable, "-m", SUPERVISOR_MODULE, str(job.path), "--backend", "slurm", "--standby"]
    try:
        step = slurm.start_step(node, argv, recipe.cluster.supervisor.cpus, 0, job.standby_log(node),
                                recipe.cluster.network, name=slurm.STANDBY_STEP_NAME)
    except OSError as err:  # the job goes on; only its supervisor's loss is no longer survived
        print(f"supervisor: no standby (srun failed): {err}", file=sys.stderr)
        return None
    print(f"supervisor: standby step on {node}", file=sys.stderr, flush=True)
    return lambda: step.terminate() if step.poll() is None else None


def _end_lost_primary(job_id: str | None) -> None:
    """After a takeover under Slurm: cancel the lost primary's job. A dead node's job is over already;
    a frozen or cut-off primary is fenced by the epoch, and this ends its job instead of leaving it to
    its time limit (best effort: the takeover does not depend on it)."""
    from oobleck_slurm.cluster.slurm import SlurmError, cancel_jobs

    if job_id and job_id != os.environ.get("SLURM_JOB_ID"):
        try:
            cancel_jobs([job_id])
        except SlurmError as err:
            print(f"supervisor: scancel of the lost primary's job {job_id} failed: {err}", file=sys.stderr)


def _check_data(spec: Any) -> None:
    """The training and validation samples open with this model's sequence length and vocabulary, and
    enough of them: refused here (BadInputError naming the data key), before any node starts."""
    from oobleck_slurm.engine.batches import open_dataset, open_validation
    from oobleck_slurm.errors import BadInputError

    try:
        open_dataset(spec.data, spec.model.seq_len, spec.model.vocab_size)
        if spec.train.eval_interval:
            open_validation(spec.data, spec.model.seq_len, spec.model.vocab_size, spec.train.eval_samples)
    except ValueError as err:
        raise BadInputError(str(err)) from err


class TimeLimitNotice:
    """The time limit's notice as a backstop to Slurm's: `notify("SIGUSR2")` (what an agent's relay of
    `--signal=USR2@lead` calls) `lead_s` before the job's end, asked of squeue at the start and again at
    the deadline (an admin may have moved the limit): two RPCs a run. Slurm checks time limits
    periodically and may send its signal late or not at all: on the lab a 1-minute allocation with a
    30 s notice got none and ended TIMEOUT, not requeued. After a takeover inside the allocation it is
    the new primary's only notice besides the agents' relay. A notice that came already is not repeated
    (`SupervisorJob._signal_self`, `Preemption.notice`)."""

    def __init__(self, job_id: str, lead_s: float, notify: Callable[[str], None]) -> None:
        self._stop = threading.Event()
        threading.Thread(target=self._run, args=(job_id, lead_s, notify), name="time-limit", daemon=True).start()

    def _run(self, job_id: str, lead_s: float, notify: Callable[[str], None]) -> None:
        from oobleck_slurm.cluster.slurm import SlurmError, job_end_time

        while not self._stop.is_set():
            try:
                end = job_end_time(job_id)
            except SlurmError as err:  # Slurm's own signal still comes; only the backstop is lost
                print(f"supervisor: the job's end time is unknown ({err}): no time-limit backstop", file=sys.stderr)
                return
            if end is None:
                return  # no time limit
            if end <= time.time():  # a requeued job's end from before its restart (seen on the lab): ask again
                self._stop.wait(STALE_END_RETRY_S)
                continue
            wait = end - lead_s - time.time()
            if wait <= 0:
                print(f"supervisor: {lead_s:g} s before the time limit: checkpoint and requeue", file=sys.stderr,
                      flush=True)
                notify("SIGUSR2")
                return
            self._stop.wait(wait)

    def stop(self) -> None:
        self._stop.set()


def metrics_exporters(job: JobDir, recipe: Recipe, log: EventLog) -> list[Callable[[], Exporter | None]]:
    """The recipe's metric loggers (`logging.tensorboard`, `logging.wandb`), as makers that MetricsThread
    calls in its own thread (W&B's start talks to its servers: never on the supervisor's path). Each
    follows the event log from where the job's last supervisor left it. W&B failing to start (online
    without a network, a bad key) is logged and leaves training alone: metrics are not worth a job."""
    makers: list[Callable[[], Exporter | None]] = []
    if recipe.logging.tensorboard:
        def tensorboard() -> Exporter:
            from oobleck_slurm.dashboard.tensorboard import TensorBoardExporter

            exporter = TensorBoardExporter(job.events, job.tensorboard)
            log.emit("metrics_logger", logger="tensorboard", folder=str(job.tensorboard))
            return exporter

        makers.append(tensorboard)
    if (wb := recipe.logging.wandb) is not None:
        def wandb() -> Exporter | None:
            import yaml

            from oobleck_slurm.dashboard.wandb_logger import WandbExporter

            try:
                exporter = WandbExporter(job.events, job.wandb, project=wb.project, entity=wb.entity, mode=wb.mode,
                                         name=job.job_id, config=yaml.safe_load(job.recipe_path.read_text()) or {})
            except Exception as err:  # wandb's own errors are many and not one type
                log.emit("metrics_logger", logger="wandb", folder=str(job.wandb),
                         error=f"{type(err).__name__}: {err}")
                return None
            log.emit("metrics_logger", logger="wandb", folder=str(job.wandb), run_id=exporter.run_id)
            return exporter

        makers.append(wandb)
    return makers


class MetricsThread:
    """The job's metrics to TensorBoard and W&B while it runs (dashboard/tensorboard.py, wandb_logger.py):
    the loggers made in this thread, then new events exported every `poll` seconds, the rest at `stop`.
    `fence` first: a primary thawed after a takeover exports nothing (the new one goes on from the
    exported offset)."""

    def __init__(self, makers: list[Callable[[], Exporter | None]], poll: float, fence: Callable[[], None]) -> None:
        self.makers, self.poll, self.fence = makers, poll, fence
        self.exporters: list[Exporter] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for make in self.makers:
            if (exporter := make()) is not None:
                self.exporters.append(exporter)
        while not self._stop.wait(self.poll):
            self.fence()
            for exporter in self.exporters:
                exporter.export()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.fence()
        for exporter in self.exporters:
            exporter.close()


class LeaseKeeper:
    """Renews this primary's lease every heartbeat interval in a thread; a higher epoch in the job folder
    means a standby took over (this process was frozen or cut off): it leaves at once (fencing)."""

    def __init__(self, job: JobDir, epoch: int, interval: float) -> None:
        from oobleck_slurm.cluster.lease import renew

        self.job, self.epoch, self.interval = job, epoch, interval
        self._stop = threading.Event()
        renew(job, epoch)
        threading.Thread(target=self._run, name="lease", daemon=True).start()

    def _run(self) -> None:
        from oobleck_slurm.cluster.lease import renew

        while not self._stop.wait(self.interval):
            self.check()
            renew(self.job, self.epoch)

    def check(self) -> None:
        """Leave at once (no teardown: the job is another supervisor's now) if a higher epoch was
        claimed. Also called by the coordinator before it writes the durable state or publishes a
        generation: a primary thawed after a takeover must not act before its next renewal."""
        from oobleck_slurm.cluster.lease import epoch_claimed

        if epoch_claimed(self.job, self.epoch + 1):  # epochs are claimed in turn: one stat
            print(f"supervisor: epoch {self.epoch + 1} took over from epoch {self.epoch}: leaving", file=sys.stderr)
            exit_now(EXIT_FAILED)

    def stop(self, done: bool) -> None:
        from oobleck_slurm.cluster.lease import current_epoch, renew

        self._stop.set()
        if current_epoch(self.job) == self.epoch:
            renew(self.job, self.epoch, done=done)


def local_supervisor_command(job_dir: Path, *extra: str) -> list[str]:
    """How a local job's supervisor is started (`submit`, a cold standby). Its job's warm server is a
    fork of it (LocalLauncher), whose children show their command lines in the room of this argv:
    `--title-room` reserves warm.TITLE_ROOM bytes of it, hidden once the supervisor runs (`main`)."""
    from oobleck_slurm.agent.warm import TITLE_ROOM

    return [sys.executable, "-m", SUPERVISOR_MODULE, str(job_dir), "--backend", "local", *extra,
            "--title-room", "_" * TITLE_ROOM]


def start_standby(job: JobDir, backend: str, exclude: list[str], server: WarmServer | None = None,
                  candidates: list[str] | None = None) -> Callable[[], None] | None:
    """A second supervisor that takes over if this one is lost; returns what ends it (None: none could be
    started). Local backend: a process on this machine, in the job's process group, so that `cancel` ends
    it too; forked from the job's warm `server` if there is one (detached: it outlives that server).
    Slurm: a step of the allocation on one of `candidates` (`standby_node`), or with
    `cluster.supervisor.failover` its own small one-node job; on none of the `exclude` nodes (this
    supervisor's, and a lost primary's); a job is recorded in meta.json (`supervisor_jobs`) for `cancel`
    and `kill-node`."""
    if backend == "slurm":
        from oobleck_slurm.cluster import slurm

        recipe = job.recipe()
        if standby_in_allocation(backend, recipe):
            return _standby_step(job, recipe, candidates or [], exclude)
        try:
            job_id = slurm.submit(job.submitit, slurm.supervisor_parameters(recipe.cluster, recipe.name, "standby",
                                                                            exclude),
                                  SupervisorJob(str(job.path), standby=True))
        except slurm.SlurmError as err:  # the job goes on; only its supervisor's loss is no longer survived
            print(f"supervisor: no standby (sbatch refused it): {err}", file=sys.stderr)
            return None
        job.update_meta(supervisor_jobs=[*job.meta().get("supervisor_jobs", []), job_id])

        def cancel() -> None:
            try:
                slurm.cancel_jobs([job_id])
            except slurm.SlurmError as err:
                print(f"supervisor: scancel of the standby job {job_id} failed: {err}", file=sys.stderr)

        return cancel
    log_path = job.logs / f"supervisor-standby-{os.getpid()}.log"
    if server is not None:  # forked warm: it imports nothing, where a new interpreter spends seconds of CPU
        try:
            warm = server.spawn(SUPERVISOR_MODULE, [str(job.path), "--backend", "local", "--standby"], os.environ,
                                str(log_path), detached=True)
            return lambda: warm.send_signal(signal.SIGTERM) if warm.poll() is None else None
        except OSError as err:
            print(f"supervisor: {err}; the standby starts cold", file=sys.stderr, flush=True)
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the child
    try:
        proc = subprocess.Popen(local_supervisor_command(job.path, "--standby"), stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()
    return lambda: proc.terminate() if proc.poll() is None else None


class SupervisorJob:
    """What submitit runs in the batch step. The supervisor runs in a thread so that the main thread,
    which receives signals, stays free: on preemption or the time limit (submitit's USR2 handler)
    `checkpoint` asks the coordinator for an on-demand checkpoint, waits for the supervisor to end,
    marks the job folder and returns the same callable for submitit to requeue. `standby`: a standby
    supervisor's job under failover, which runs the job only once it took over."""

    def __init__(self, job_dir: str, standby: bool = False) -> None:
        self.job_dir, self.standby = job_dir, standby

    def __call__(self) -> int:
        from oobleck_slurm.supervisor.preemption import Preemption

        self._preemption = Preemption()
        self._relayed = threading.Event()
        codes: list[int] = []
        run = run_standby if self.standby else run_supervisor
        # submitit's handler ignores SIGTERM in the batch step; Slurm sends it before SIGKILL on a
        # preemption, `scontrol requeue` or `scancel`: the same on-demand checkpoint as for the notice,
        # but Slurm, not this process, decides whether the job runs again.
        signal.signal(signal.SIGTERM, lambda signum, frame: self._signal_self("SIGTERM"))
        self._thread = threading.Thread(target=lambda: codes.append(run(
            Path(self.job_dir), "slurm", self._preemption, self._signal_self)), name="supervisor")
        self._thread.start()
        while self._thread.is_alive():
            self._thread.join(DEFAULT_TIMEOUTS.join_poll)
        exit_now(codes[0] if codes else EXIT_FAILED)  # Slurm records this exit code

    def _signal_self(self, signal_name: str = "SIGUSR2") -> None:
        """Slurm's notice, relayed by an agent or received here. USR2 (the time limit, submitit's
        `--signal`): hand it to submitit's handler in this process, once; it checkpoints and requeues.
        SIGTERM: checkpoint only (the run then ends as preempted; Slurm requeues it, or not)."""
        if signal_name == "SIGTERM":
            self._preemption.notice(signal_name)
            return
        if not self._relayed.is_set():
            self._relayed.set()
            os.kill(os.getpid(), signal.SIGUSR2)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        import submitit

        from oobleck_slurm.cluster.lease import read_lease

        job = JobDir.at(self.job_dir)
        lease = read_lease(job)
        if self.standby and (lease is None or lease.pid != os.getpid()):
            return None  # a standby that never took over holds nothing to checkpoint or requeue
        thread = getattr(self, "_thread", None)
        # Not from the recipe: the job's values are the defaults (timeouts.py).
        t = DEFAULT_TIMEOUTS
        if thread is not None:
            self._relayed.set()  # the notice came straight to this process: no relay needed
            self._preemption.notice("SIGUSR2")
            self._preemption.finished.wait(t.checkpoint_timeout + t.teardown_timeout)
            thread.join(t.teardown_timeout)
        meta = job.meta()
        if meta.get("requeue") is False or meta.get("status") in OVER or job.cancel_marker.exists():
            return None  # do not requeue what a requeue cannot help (errors.py), nor what is over
        job.requeue_marker.write_text(dt.datetime.now().isoformat())
        return submitit.helpers.DelayedSubmission(SupervisorJob(self.job_dir))  # requeued as the primary

    def __getstate__(self) -> dict[str, Any]:
        return {"job_dir": self.job_dir, "standby": self.standby}  # submitit pickles it again: no threads

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.job_dir, self.standby = state["job_dir"], state.get("standby", False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oobleck_slurm.supervisor.main", description=__doc__.split("\n\n")[0])
    parser.add_argument("job_dir", type=Path)
    parser.add_argument("--backend", choices=["slurm", "local"], default="slurm")
    parser.add_argument("--standby", action="store_true", help="take over if the primary supervisor is lost")
    parser.add_argument("--title-room", default="", help=argparse.SUPPRESS)  # see local_supervisor_command
    args = parser.parse_args(argv)
    if args.title_room:  # the command line it was started with, less the room
        from oobleck_slurm.agent.warm import set_command_line

        given = sys.argv[1:] if argv is None else argv
        set_command_line([sys.executable, "-m", SUPERVISOR_MODULE,
                          *[a for a in given if a not in ("--title-room", args.title_room)]])
    if not (args.job_dir / META_FILE).is_file():
        print(f"supervisor: {args.job_dir} is not a job folder (no {META_FILE})", file=sys.stderr)
        return EXIT_FAILED
    # No job process has a terminal to hang up, but the kernel sends SIGHUP to a whole process group
    # that holds a stopped process when another member exits: a frozen supervisor (a drill's SIGSTOP)
    # would take every agent and worker of its group down with it. Ignored here, and so in every
    # process started from here (an ignored signal stays ignored across exec).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if args.standby:
        if args.backend == "slurm" and in_slurm_step():  # a step of the allocation (`_standby_step`)
            write_output_to(JobDir.at(args.job_dir).standby_log(os.environ.get("SLURMD_NODENAME", "")))
            # Slurm's notices reach every step: the agents relay them to whichever supervisor is the
            # primary, this one after a takeover; dying of them would end the job's coordinator.
            ignore_step_signals()
        return run_standby(args.job_dir, args.backend)
    # SIGTERM (`cancel`, a test's teardown) stops the job: the run ends through its `finally` (the lease
    # marked done, so that the standby leaves instead of taking over; the agents told to shut down).
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    return run_supervisor(args.job_dir, args.backend)


class StoppedBySignal(OobleckError):
    """The supervisor was told to stop (SIGTERM): the job ends here, and no standby takes it over."""

    exit_code = EXIT_FAILED
    requeue = False


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the teardown that follows must not be cut short
    raise StoppedBySignal("stopped by SIGTERM")


def exit_now(code: int) -> NoReturn:
    """End the process with `code` without finalising the interpreter. A daemon thread may still be
    inside a C++ call on the job's store when the job ends (a joining node's health check building its
    gloo group); finalisation tears the store down under it and the C++ runtime aborts the process
    (exit -6 after a completed job). The event log is unbuffered; stdout and stderr are flushed here."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
