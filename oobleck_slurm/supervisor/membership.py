"""Which nodes the supervisor watches, and the decision that one is lost, with its cause. Pure logic.

Every detection path feeds this one object, and the first path to fire wins: a node is reported lost
once, with the cause and time of the first evidence, whichever it was:

    agent_lost    the agent's control connection closed (its process or machine died: milliseconds)
    srun_exit     the srun step that runs the node's agent ended (Slurm saw the task or node end)
    heartbeat     no heartbeat within the lease (a frozen or partitioned machine: no FIN ever comes)
    slurm_down    Slurm says the node is gone: DOWN, FAIL, FAILING or powered down (cluster/slurm.py
                  LOST_NODE_STATES). A drain or NOT_RESPONDING is no loss: running jobs outlive both (a
                  maintenance drain, `scontrol reboot ASAP`, a rolling slurmd restart); the supervisor
                  reports them, and a node that did die is named by the paths above
    hung          the node's worker has been stopped (SIGSTOP, a debugger) for longer than the lease, or
                  training made no progress within the step timeout and its step is behind its peers'
                  (it never reached the all-reduce they wait in)
    process_exit  the node's worker exited non-zero (reported by its live agent)
    out_of_memory a process_exit whose worker first reported running out of device memory (the
                  coordinator reads the report, keys.out_of_memory, and names the loss so)
    faulty_metrics  the health monitor flagged its metrics (Minder-style: far from its peers', lasting)
    straggler     the health monitor found it computing slower than its peers (`detection.stragglers: evict`)
    replica_mismatch  its replica of a layer disagreed with the others' at an integrity check (the
                  workers' verdict, keys.replica_mismatch: engine/integrity.py)

The caller supplies `now` and the observations (see detection/ for the same style). Time-based
judgements (`check`) are suspended once when the caller itself was not running for longer than half a
lease (its process stopped or starved of CPU): it cannot tell silent agents from its own silence, so
every node gets a fresh lease instead of all being declared lost at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from oobleck_slurm.detection import LeaseTable, ProgressWatch

STOPPED_STATES = frozenset({"stopped", "tracing-stop"})  # psutil's names for SIGSTOP / ptrace stops
JOB = "job"  # ProgressWatch key: the job's step (rank 0 reports it; every rank waits for the slowest)


class LossCause(StrEnum):
    """Why a node was lost: the evidence that fired first (the table above), or a failed join."""

    AGENT_LOST = "agent_lost"
    SRUN_EXIT = "srun_exit"
    HEARTBEAT = "heartbeat"
    SLURM_DOWN = "slurm_down"
    HUNG = "hung"
    PROCESS_EXIT = "process_exit"
    OUT_OF_MEMORY = "out_of_memory"  # a process exit that its worker reported as device memory exhausted
    JOIN_FAILED = "join_failed"  # a joining node failed its health check; it never became a member
    FAULTY_METRICS = "faulty_metrics"  # evicted: its monitoring metrics stood out (supervisor/health_monitor.py)
    STRAGGLER = "straggler"  # evicted: its compute was slower than its peers' (detection.stragglers: evict)
    REPLICA_MISMATCH = "replica_mismatch"  # evicted: its replica of a layer disagreed (engine/integrity.py)


@dataclass(frozen=True)
class Loss:
    """A node lost, with the cause and time of the first evidence (`detail` says what was seen)."""

    node: str
    cause: LossCause
    detail: str
    t: float


class Membership:
    """Watched nodes (workers running or joining) and their evidence of life."""

    def __init__(self, lease_s: float, step_timeout_s: float) -> None:
        self.leases = LeaseTable(lease_s)
        self.progress = ProgressWatch(step_timeout_s)
        self.rank_steps = ProgressWatch(step_timeout_s)  # per node: the last step it reached a collective in
        self.watched: set[str] = set()
        self.worker_state: dict[str, str] = {}
        self.stopped_since: dict[str, float] = {}  # first heartbeat that saw the worker stopped
        self._lost: set[str] = set()
        self._last_check: float | None = None

    # ---- what is watched -----------------------------------------------------------------------

    def watch(self, node: str, now: float) -> None:
        """Start watching `node` (its worker starts now); a node that was lost and came back is new."""
        self.watched.add(node)
        self._lost.discard(node)
        self.leases.renew(node, now)

    def unwatch(self, node: str) -> None:
        self.watched.discard(node)
        self.leases.forget(node)
        self.rank_steps.forget(node)
        self.worker_state.pop(node, None)
        self.stopped_since.pop(node, None)

    def is_lost(self, node: str) -> bool:
        return node in self._lost

    # ---- evidence -----------------------------------------------------------------------------------

    def heartbeat(self, node: str, now: float, worker_state: str | None = None) -> None:
        if node in self.watched and node not in self._lost:
            self.leases.renew(node, now)
            if worker_state is not None:
                self.worker_state[node] = worker_state
                if worker_state in STOPPED_STATES:
                    self.stopped_since.setdefault(node, now)
                else:
                    self.stopped_since.pop(node, None)

    def step(self, step: int, now: float) -> None:
        """The job's latest completed step (or -1 before the first one of a generation)."""
        self.progress.report(JOB, step, now)

    def node_step(self, node: str, step: int, now: float) -> None:
        """`node`'s worker reached a collective of `step` (it did its share of the step's compute)."""
        if node in self.watched and node not in self._lost:
            self.rank_steps.report(node, step, now)

    def restart_progress(self, now: float) -> None:
        """A new generation: recovering and starting up are not hangs; the step clock starts again."""
        self.progress.restart(now)
        self.rank_steps.restart(now)

    def agent_lost(self, node: str, now: float, detail: str = "control connection closed") -> Loss | None:
        return self._lose(node, LossCause.AGENT_LOST, detail, now)

    def srun_exited(self, node: str, code: int | None, now: float) -> Loss | None:
        return self._lose(node, LossCause.SRUN_EXIT, f"srun step of the node's agent exited ({code})", now)

    def slurm_state(self, node: str, state: str, usable: bool, now: float) -> Loss | None:
        """Slurm's `state` of `node`; `usable` is False only for a lost state (NodeHealth.usable): an
        advisory state (DRAIN, NOT_RESPONDING) is usable, and never a loss."""
        return None if usable else self._lose(node, LossCause.SLURM_DOWN, f"Slurm state {state}", now)

    def worker_exited(self, node: str, code: int, now: float) -> Loss | None:
        return None if code == 0 else self._lose(node, LossCause.PROCESS_EXIT, f"worker exited with code {code}", now)

    def evict(self, node: str, cause: LossCause, detail: str, now: float) -> Loss | None:
        """The health monitor judged a live node faulty (its metrics, or a straggler): lost like a dead one."""
        return self._lose(node, cause, detail, now)

    def check(self, now: float) -> list[Loss]:
        """Losses that only the passing of time reveals: expired leases, and hung workers. None after a
        gap of more than half a lease since the last check (module doc): every lease starts again."""
        gap = 0.0 if self._last_check is None else now - self._last_check
        self._last_check = now
        if gap > self.leases.lease_s / 2:
            for node in self.leases.members():
                self.leases.renew(node, now)
            for node in self.stopped_since:
                self.stopped_since[node] = now
            return []
        losses = []
        for node in self.leases.expired(now):
            age = self.leases.age(node, now)
            loss = self._lose(str(node), LossCause.HEARTBEAT, f"no heartbeat for {age:.2f} s "
                              f"(lease {self.leases.lease_s:g} s)", now)
            if loss:
                losses.append(loss)
        for node, since in sorted(self.stopped_since.items()):
            # A stopped worker cannot train, and its peers' collectives are already failing: the same
            # lease as a silent node, not the (much longer) step timeout.
            if now - since > self.leases.lease_s:
                loss = self._lose(node, LossCause.HUNG, f"the worker has been {self.worker_state.get(node)} for "
                                  f"{now - since:.2f} s (lease {self.leases.lease_s:g} s)", now)
                if loss:
                    losses.append(loss)
        if self.progress.hung(now):
            # Every rank waits for the slowest in the all-reduce, so a stall alone does not say who;
            # a worker that its agent sees stopped (SIGSTOP, a debugger) does, and so does a running
            # one (deadlocked, spinning) that never reached the step its peers reached.
            behind = set(self.rank_steps.behind(now))
            for node in sorted(self.watched - self._lost):
                if self.worker_state.get(node) in STOPPED_STATES:
                    why = f"the worker is {self.worker_state[node]}"
                elif node in behind:
                    why = (f"it reached a collective of step {self.rank_steps.step_of(node)}, its peers "
                           f"of step {self.rank_steps.top()}")
                else:
                    continue
                loss = self._lose(node, LossCause.HUNG, f"no step progress for more than "
                                  f"{self.progress.step_timeout_s:g} s and {why}", now)
                if loss:
                    losses.append(loss)
        return losses

    def _lose(self, node: str, cause: LossCause, detail: str, now: float) -> Loss | None:
        if node not in self.watched or node in self._lost:
            return None
        self._lost.add(node)
        self.leases.forget(node)
        self.rank_steps.forget(node)
        self.stopped_since.pop(node, None)
        return Loss(node, cause, detail, now)
