"""The node agent: `python -m oobleck_slurm.agent.main JOB_DIR [--node NAME] [--replacement ID]`.

One per node (Slurm: one srun task per node; local backend: a process per virtual node). It connects
to the supervisor over the authenticated control plane, beats every `heartbeat_interval` seconds (the
job's timeouts, in supervisor.json; timeouts.py) (with its workers' process states, so that a SIGSTOPped worker can be named), and obeys (messages:
protocol/messages.py):

    start {node_id, workers, threads, device}
                        start this node's workers (engine/elastic_process.py), one per device: worker
                        i of `node_id` gets `threads` CPU threads and, on GPUs, GPU i (set before CUDA
                        initialises, every GPU of the node stays visible for NCCL's peer access)
    stop                SIGKILL the workers (no exit is reported for them)
    drill {how, worker} fault injection: "agent" (kill -9 this agent), "worker" (kill -9 a worker),
                        "hang" (SIGSTOP a worker), "slow" and "leak" (agent_health.py: the node keeps
                        working, slower; its memory grows)
    health {...}        run a short collective with the supervisor (engine and network work here) and,
                        with `measure`, the pre-flight measurement (agent/preflight.py)
    shutdown            stop the workers and exit 0

Warm workers (agent/warm.py): the agent starts its warm server first thing, before it registers;
the server imports what every worker imports (torch, torch._dynamo, the engine: ~3.6 s of CPU) while
the agent registers, a replacement's health check waits and the supervisor plans, and never touches
CUDA. Workers, and the health check, are forked from it: `start` to a worker ready to join takes tens
of milliseconds instead of seconds (benchmarks/bench_recovery.py), for the job's first start as for a
replacement, a checkpoint restart or a new generation's workers on the same node. A forked worker is
what `python -m oobleck_slurm.engine.elastic_process JOB_DIR NODE LOCAL` was: exactly `worker_env`'s
environment, its log as stdout and stderr, SIGUSR2 and SIGHUP ignored, leaving with os._exit. The
server reports each exit code; the agent signals workers (kill, the SIGSTOP drills) and reads their
states by pid. Death follows the chain agent -> server -> workers (PR_SET_PDEATHSIG at each link): a
killed agent takes its server and its workers with it. A server that died takes its workers (reported
as killed: the node fails) and is replaced from the main loop; meanwhile workers start cold.

The node is the failure unit (the planner places pipelines on nodes): the first worker to exit
non-zero is reported as `worker_exit {code, worker}` and the node's other workers are killed at once;
`worker_exit {code: 0}` is reported once every worker finished. `preempt` is relayed when Slurm sends
SIGUSR2 to the job's steps (submitit's `--signal=USR2@90` before the time limit), or, inside a Slurm
step, SIGTERM (a preemption, `scontrol requeue`, `scancel`: SIGKILL follows after the grace time): the
supervisor runs in the batch step, which the first does not reach. Workers ignore both (they would end
them; `warm.ignore_step_signals`). If the supervisor goes away and no standby takes over (within
`failover_s`), the job is over: the agent kills its workers and exits (inside a Slurm allocation, after
requeueing the job: `_requeue_if_lost`), so
that nothing outlives the job on the node. With detection on (`metrics` in supervisor.json), it also
samples its node and sends the metrics (agent_health.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from oobleck_slurm.agent.health import DRILLS, MetricsReporter, NodeDrills
from oobleck_slurm.agent.preflight import parse_figures
from oobleck_slurm.agent.warm import (
    HEALTH_MODULE,
    WORKER_MODULE,
    WarmProcess,
    WarmServer,
    ignore_step_signals,
    in_slurm_step,
    preloaded,
    write_output_to,
)
from oobleck_slurm.cluster.jobdir import JobDir, load_secret
from oobleck_slurm.cluster.lease import PublishedEpoch, primary_gone, read_lease
from oobleck_slurm.cluster.slurm import SlurmError, requeue_job  # at start: a lost supervisor's requeue is urgent
from oobleck_slurm.errors import JobTimeoutError
from oobleck_slurm.exit_codes import EXIT_FAILED, EXIT_OK
from oobleck_slurm.protocol.messages import (
    Drill,
    Health,
    HealthResult,
    Heartbeat,
    Hello,
    Message,
    Preempt,
    Register,
    Shutdown,
    Start,
    Stop,
    WorkerExit,
    parse,
)
from oobleck_slurm.protocol.wire import Channel, ProtocolError, connect
from oobleck_slurm.stack_dumps import enable_stack_dumps
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS, JobTimeouts

# Set in every NCCL worker's environment, before torch starts (docs/nccl.md, "Aborting"): torch's watchdog must never act on its own (it sleeps 60 s, then tears the process down);
# the generation design aborts groups itself (engine/abort.py), and a timeout dump key left in the root
# store by one generation must not kill a later process.
NCCL_WORKER_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    "NCCL_NVLS_ENABLE": "0",
}


WARM_RESTARTS = 3  # a warm server that died is replaced this many times at most

# A worker: forked from the warm server, or (the server gone) started cold.
WorkerProcess = WarmProcess | subprocess.Popen


def _die_with_parent() -> None:
    """In a worker started cold, before exec: SIGKILL it when the agent dies, so that no orphan worker
    of a lost node goes on in a job that has moved on without it (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    ignore_step_signals()  # Slurm signals every process of the step; the agent relays it


def worker_env(base: dict[str, str] | os._Environ[str], local: int, threads: int, device: str) -> dict[str, str]:
    """Worker `local`'s environment: its CPU thread budget (the node's cores split between its workers,
    so they do not oversubscribe it) and, on GPUs, its device and NCCL's settings (engine/comm.py)."""
    env = dict(base, OMP_NUM_THREADS=str(threads), LOCAL_RANK=str(local), OOBLECK_DEVICE=device)
    if device == "cuda":
        for name, value in NCCL_WORKER_ENV.items():
            env.setdefault(name, value)  # a variable the user set is theirs (docs/nccl.md lists ours)
    return env


def node_name(explicit: str | None = None) -> str:
    """This node's name: given, else Slurm's (hostname is the same on every virtual node of a lab)."""
    return explicit or os.environ.get("SLURMD_NODENAME") or os.uname().nodename


def read_address(job: JobDir, wait_s: float = DEFAULT_TIMEOUTS.address_timeout) -> dict[str, Any]:
    """The supervisor's address (supervisor.json); before it, the agent knows only the default timeouts."""
    deadline = time.time() + wait_s
    while (address := job.supervisor_address()) is None:
        if time.time() > deadline:
            raise JobTimeoutError(f"{job.supervisor_file}: no supervisor address after {wait_s:g} s")
        time.sleep(DEFAULT_TIMEOUTS.address_poll)
    return address


class Agent:
    def __init__(self, job_dir: Path, node: str, replacement: str | None = None) -> None:
        self.job, self.node, self.replacement = JobDir.at(job_dir), node, replacement
        self.address = read_address(self.job)
        self.timeouts = JobTimeouts(**self.address.get("timeouts", {}))  # the job's, written by the supervisor
        self.interval = self.timeouts.heartbeat_interval
        self.workers: list[WorkerProcess] = []  # index = the worker's local index (device)
        self.worker_id: str | None = None  # the node id the supervisor gave this node's workers
        # How they ended (0: all finished; else the first failure's code), kept for a supervisor that
        # takes over: the exit was reported to the lost one, which may never have read it.
        self.exited: int | None = None
        self._lock = threading.Lock()  # the channel is written by the beat loop and the command reader
        self._done = threading.Event()
        self._preempt = threading.Event()  # Slurm's SIGUSR2 arrived: relay it once
        # Running health checks (the slow drill slows them too): a tuple replaced whole, under its lock, so
        # that the drill's thread reads it while a check's thread changes it.
        self.checks: tuple[WorkerProcess, ...] = ()
        self._checks_lock = threading.Lock()
        self.drills = NodeDrills(lambda: [w.pid for w in [*self.workers, *self.checks] if w.poll() is None])
        # Started before registering, in the main thread (its PR_SET_PDEATHSIG follows this thread): its
        # imports overlap the registration, a replacement's health check and the supervisor's planning.
        # An agent forked by the job's server (the local backend) is warm already: its server is its fork.
        self.warm = WarmServer(timeouts=self.timeouts, fork_here=preloaded())
        self._warm_restarts = 0
        self.epoch = int(self.address.get("epoch", 1))  # the supervisor's (lease.py): only a higher one replaces it
        self.failover_s = float(self.address.get("failover_s", 0.0))  # how long a new supervisor is awaited
        self.channel: Channel = self._connect(self.address)
        self.published = PublishedEpoch(self.job.supervisor_file)
        self._supervisor_lost = False  # its connection broke, or its lease lapsed, and no standby follows
        self._next_epoch_look = 0.0
        self.send(Register(node=node, replacement=replacement, pid=os.getpid(),
                           slurm_job_id=os.environ.get("SLURM_JOB_ID")))

    def _connect(self, address: dict[str, Any]) -> Channel:
        return connect(address["host"], int(address["port"]), load_secret(self.job.path),
                       Hello(role="agent", node=self.node).to_dict(), timeout=self.timeouts.agent_connect_timeout)

    def send(self, message: Message) -> None:
        """Send to the supervisor; while a new one is awaited (`_follow_new_supervisor`) messages are dropped."""
        with self._lock:
            try:
                self.channel.send(message.to_dict())
            except OSError:
                if self.failover_s <= 0:
                    raise

    def _follow_new_supervisor(self) -> bool:
        """The supervisor went away: wait for one of a higher epoch to publish its address, connect to it
        and register again with the workers this node runs (they keep running). False past the wait."""
        deadline = time.time() + self.failover_s
        while time.time() < deadline and not self._done.is_set():
            lease = read_lease(self.job)
            if lease is not None and lease.done and lease.epoch >= self.epoch:
                return False  # the job ended (or was stopped) under its supervisor: nothing to take over
            address = self.job.supervisor_address()
            if address is not None and int(address.get("epoch", 1)) > self.epoch:
                try:
                    channel = self._connect(address)
                except OSError:
                    time.sleep(0.05)
                    continue
                with self._lock:
                    self.channel.close()
                    self.channel, self.address, self.epoch = channel, address, int(address.get("epoch", 1))
                self.send(Register(node=self.node, replacement=self.replacement, pid=os.getpid(),
                                   slurm_job_id=os.environ.get("SLURM_JOB_ID"), running=self.worker_id,
                                   workers=tuple(self.worker_states()), exited=self.exited))
                return True
            time.sleep(0.05)
        return False

    def _leave_frozen_supervisor(self, now: float) -> None:
        """Without a standby, under Slurm: a supervisor whose lease is older than the step timeout is
        frozen or on a machine that died without closing its connections (a powered-off node sends
        nothing): requeue the job as after its loss (`_requeue_if_lost`) and drop the connection."""
        if self.failover_s > 0 or not in_slurm_step() or now < self._next_epoch_look:
            return
        self._next_epoch_look = now + self.timeouts.epoch_poll
        if primary_gone(read_lease(self.job), self.timeouts.step_timeout, now, same_machine=False):
            self._supervisor_lost = True
            self._done.set()

    def _leave_superseded(self, now: float) -> None:
        """A supervisor of a higher epoch is published while this agent's connection stays open (the
        old one is frozen, or cut off without the connection breaking): drop the connection, so that
        the command reader follows the new one (`_follow_new_supervisor`)."""
        if self.failover_s <= 0 or now < self._next_epoch_look:
            return
        self._next_epoch_look = now + self.timeouts.epoch_poll
        if self.published.read() > self.epoch:
            self.channel.shutdown()

    # ---- the workers -----------------------------------------------------------------------------

    def start_workers(self, node_id: str, count: int, threads: int, device: str) -> None:
        if any(w.poll() is None for w in self.workers):
            raise RuntimeError(f"node {self.node} already runs workers of {self.worker_id}")
        told = time.time()  # logged by each worker with its ready time (bench_recovery's warm start)
        self.workers = []
        self.exited = None
        self.worker_id = node_id  # before the workers: the beat loop reports their exits under it
        for local in range(count):
            argv = [str(self.job.path), node_id, str(local)]
            env = dict(worker_env(os.environ, local, threads, device), OOBLECK_START_T=repr(told))
            log = str(self.job.worker_log(node_id, local))
            self.workers.append(self._spawn(WORKER_MODULE, argv, env, log))

    def _spawn(self, module: str, argv: list[str], env: dict[str, str], log: str) -> WorkerProcess:
        """`python -m module argv`, forked from the warm server; started cold if the server is gone (the
        main loop starts a new one for the next time: `_keep_warm`)."""
        try:
            return self.warm.spawn(module, argv, env, log)
        except OSError as err:
            print(f"agent {self.node}: {err}; {module} starts cold", file=sys.stderr, flush=True)
        with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
            return subprocess.Popen([sys.executable, "-m", module, *argv], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, preexec_fn=_die_with_parent)

    def _keep_warm(self) -> None:
        """A warm server that died is replaced, from the main thread (a server's PR_SET_PDEATHSIG
        follows the thread that started it), a few times at most (one that cannot start stays dead)."""
        if not self.warm.alive() and self._warm_restarts < WARM_RESTARTS:
            self._warm_restarts += 1
            self.warm.close()
            self.warm = WarmServer(timeouts=self.timeouts)

    def stop_workers(self) -> None:
        self.drills.stop()
        workers, self.workers = self.workers, []
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGKILL)
        for w in workers:
            w.wait()

    def worker_states(self) -> list[str]:
        """psutil's state of each worker ("running", "sleeping", "stopped", ...; "gone" once reaped)."""
        states: list[str] = []
        with self.drills.workers_running():  # a slow drill's pauses are slowness, not a stopped worker
            for w in self.workers:
                try:
                    states.append(psutil.Process(w.pid).status())
                except psutil.Error:
                    states.append("gone")
        return states

    def _check_workers(self) -> None:
        """Report the node's end: the first worker that failed (its peers are killed: the node is the
        failure unit), or every worker done."""
        node_id = self.worker_id
        if not self.workers or node_id is None:
            return
        codes = [w.poll() for w in self.workers]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            local, code = failed[0]
            self.stop_workers()
            self.exited = code
            self.send(WorkerExit(node=self.node, node_id=node_id, code=code, worker=local))
        elif all(c == 0 for c in codes):
            self.workers = []
            self.exited = 0
            self.send(WorkerExit(node=self.node, node_id=node_id, code=0))

    # ---- commands ----------------------------------------------------------------------------------

    def _read_commands(self) -> None:
        while not self._done.is_set():
            try:
                self._obey_commands()
            except (EOFError, OSError, ProtocolError):
                # The supervisor is gone (or dropped us): the job is over for this node, unless a new
                # supervisor takes over.
                if self.failover_s > 0 and self._follow_new_supervisor():
                    continue
                self._supervisor_lost = True  # the main thread asks for the requeue (`run`)
            break
        self._done.set()

    def _requeue_if_lost(self) -> None:
        """The supervisor is gone and no standby took over: in an allocation, requeue the job rather than
        leave its allocation idle. Measured on the lab (docs/slurm.md, "The batch host"): when the node
        that runs the batch step dies, slurmctld removes it from a `--no-kill` job and ends the steps
        launched from it, and the job stays RUNNING with nothing in it until its time limit. Every
        agent that sees the loss asks; the first requeue wins (the others' fail: already pending). The
        next run resumes from the newest complete checkpoint, off the lost supervisor's node and the
        nodes this job evicted. Not when the job ended or is being cancelled (its lease says done, or
        the cancel marker exists)."""
        job_id = os.environ.get("SLURM_JOB_ID")
        if not job_id or not in_slurm_step():
            return
        lease = read_lease(self.job)
        if (lease is not None and lease.done) or self.job.cancel_marker.exists():
            return
        # Quickly: the srun of this agent's step ran on the lost node, and Slurm may end the step within
        # a second (measured on the lab: 1.3-2.2 s after the node's loss).
        print(f"{time.time():.3f} agent {self.node}: the supervisor was lost and no standby took over: requeueing job "
              f"{job_id}", file=sys.stderr, flush=True)
        meta = self.job.meta()
        lost_host = (meta.get("supervisor") or {}).get("host")
        exclude = sorted({*meta.get("evicted_nodes", []), *([lost_host] if lost_host else [])} - {self.node})
        try:
            requeue_job(job_id, exclude, self.timeouts)
            said = f"requeued job {job_id} (excluding {', '.join(exclude) or 'no node'})"
        except SlurmError as err:
            said = f"requeue of job {job_id} after the supervisor's loss: {err}"
        print(f"{time.time():.3f} agent {self.node}: {said}", file=sys.stderr, flush=True)

    def _obey_commands(self) -> None:
        """Carry out the supervisor's commands until it says shutdown (EOFError/OSError once it is gone)."""
        while not self._done.is_set():
            message = parse(self.channel.recv())
            if isinstance(message, Start):
                self.start_workers(message.node_id, message.workers, message.threads, message.device)
            elif isinstance(message, Stop):
                self.stop_workers()
            elif isinstance(message, Health):
                threading.Thread(target=self._health, args=(message,), daemon=True).start()
            elif isinstance(message, Drill):
                self._drill(message.how, message.worker)
            elif isinstance(message, Shutdown):
                self._done.set()
                return
            else:
                raise ProtocolError(f"an agent does not take {message.TYPE} messages")

    def _drill(self, how: str, worker: int) -> None:
        if how == "agent":
            os.kill(os.getpid(), signal.SIGKILL)  # the warm server follows, and its workers (PR_SET_PDEATHSIG)
        if how in DRILLS:
            self.drills.start(how)
            return
        workers = self.workers
        if 0 <= worker < len(workers) and how in ("worker", "hang"):
            workers[worker].send_signal(signal.SIGKILL if how == "worker" else signal.SIGSTOP)

    def _health(self, message: Health) -> None:
        """The joining node's check (agent/preflight.py), forked warm: torch is already imported."""
        t0 = time.time()
        fd, log = tempfile.mkstemp(prefix=f"health-{self.node}-", suffix=".log")
        os.close(fd)
        argv = [message.host, str(message.port), message.prefix, str(message.timeout), str(self.job.path)]
        if message.measure:  # the pre-flight measurement, on a worker's threads and the node's devices
            argv += [str(message.threads), message.device, str(message.devices)]
        try:
            check = self._spawn(HEALTH_MODULE, argv, dict(os.environ, OMP_NUM_THREADS=str(message.threads)), log)
            with self._checks_lock:
                self.checks = (*self.checks, check)
            try:
                code = check.wait(message.timeout + self.timeouts.health_check_timeout)  # its own, then its start
            except subprocess.TimeoutExpired:
                check.kill()
                code = check.wait()
            finally:
                with self._checks_lock:
                    self.checks = tuple(c for c in self.checks if c is not check)
            figures, detail = parse_figures(Path(log).read_text(errors="replace"))
        finally:
            Path(log).unlink(missing_ok=True)
        self.send(HealthResult(node=self.node, prefix=message.prefix, ok=code == 0,
                               seconds=time.time() - t0, detail=detail.strip()[-500:], figures=figures))

    # ---- the loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        threading.Thread(target=self._read_commands, name="agent-commands", daemon=True).start()
        notice: list[str] = []

        def on_notice(signum: int, frame: Any) -> None:
            notice.append(signal.Signals(signum).name)
            self._preempt.set()

        signal.signal(signal.SIGUSR2, on_notice)
        if in_slurm_step():  # preemption, `scontrol requeue`, `scancel`: checkpoint before SIGKILL
            signal.signal(signal.SIGTERM, on_notice)
        relayed = False
        next_beat = 0.0
        settings = self.address.get("metrics")
        reporter = MetricsReporter(self.node, settings, self.send, lambda: [w.pid for w in self.workers]).start() \
            if isinstance(settings, dict) else None
        try:
            while not self._done.is_set():
                now = time.time()
                self._check_workers()
                self._keep_warm()
                if self._preempt.is_set() and not relayed:
                    relayed = True
                    self.send(Preempt(node=self.node, signal=notice[0] if notice else "SIGUSR2", t=now))
                self._leave_superseded(now)
                self._leave_frozen_supervisor(now)
                if now >= next_beat:
                    self.send(Heartbeat(node=self.node, workers=tuple(self.worker_states()),
                                        cpu=psutil.cpu_percent(interval=None), t=now))
                    next_beat = now + self.interval
                self._done.wait(self.timeouts.agent_poll)
        except (OSError, ProtocolError):  # a send failed: the supervisor is gone
            self._supervisor_lost = True
        finally:
            # Here, in the main thread: the process ends when it returns, the command reader's daemon
            # thread with it (a requeue asked from there was cut short when this thread left first).
            if self._supervisor_lost:  # and no standby took over within failover_s
                self._requeue_if_lost()
            if reporter is not None:
                reporter.stop()
            self.stop_workers()
            self.warm.close()
            self.channel.close()
        return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oobleck_slurm.agent.main", description=__doc__.split("\n\n")[0])
    parser.add_argument("job_dir", type=Path)
    parser.add_argument("--node", default=None, help="node name (default: $SLURMD_NODENAME)")
    parser.add_argument("--replacement", default=None, help="the node id the supervisor asked Slurm for")
    args = parser.parse_args(argv)
    if in_slurm_step():
        write_output_to(JobDir.at(args.job_dir.resolve()).agent_log(node_name(args.node)))
    enable_stack_dumps()
    try:
        agent = Agent(args.job_dir.resolve(), node_name(args.node), args.replacement)
    except Exception as err:  # noqa: BLE001 - reported plainly; srun's log keeps it
        print(f"agent: cannot reach the supervisor: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_FAILED
    return agent.run()


if __name__ == "__main__":
    raise SystemExit(main())
