"""Every timeout and poll period of a job's processes, named once (modelled on torchft's named timeouts).

`JobTimeouts.from_recipe(recipe.fault_tolerance)` is the one place where the recipe's values become
timeouts, and each keeps the recipe's name: `heartbeat_lease` is the heartbeat lease wherever it is
used (the node backend's lease, and the coordinator's grace for collective errors), `step_timeout` is
the step timeout (a rank's step that does not advance, and a member that does not leave an aborted
generation). The supervisor builds the record once (supervisor/main.py) and hands it on: to the
coordinator (`CoordinatorConfig.timeouts`), the node backend (`BackendConfig.timeouts`), the health
monitor, the workers (elastic.json's `timeouts`: `asdict` of this record, rebuilt with
`JobTimeouts(**timeouts)`) and the agents (supervisor.json's `timeouts`).

A process that needs a value before it can read the job's record (an agent waiting for the
supervisor's address, the batch step's signal handling) uses the record's default: every field the
recipe does not set has its default in every job. The recipe's fields default to the recipe's own
defaults (recipe/schema.py `FaultToleranceConfig`; a test keeps the two equal).

The recipe validates the nesting (recipe/validate.py): collective_timeout < heartbeat_lease <
step_timeout < reconfiguration_timeout, and heartbeat_interval < heartbeat_lease: a stuck collective
fails before its node is declared lost, and a recovery is never cut short by a step timeout.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, fields
from typing import Protocol

DAY_S = 24 * 60 * 60.0

# The fields that `from_recipe` takes from `fault_tolerance`, under the same names.
RECIPE_FIELDS = ("heartbeat_interval", "heartbeat_lease", "collective_timeout", "step_timeout",
                 "reconfiguration_timeout")


class FaultTolerance(Protocol):
    """What `from_recipe` reads: the recipe's `fault_tolerance` (recipe/schema.py FaultToleranceConfig;
    protocol/ is below recipe/, so it is named by its shape)."""

    @property
    def heartbeat_interval(self) -> float: ...
    @property
    def heartbeat_lease(self) -> float: ...
    @property
    def collective_timeout(self) -> float: ...
    @property
    def step_timeout(self) -> float: ...
    @property
    def reconfiguration_timeout(self) -> float: ...


@dataclass(frozen=True)
class JobTimeouts:
    """Every timeout and poll period of the job, in seconds, each with the reason for its value."""

    # ---- from the recipe (`fault_tolerance`), under its names and with its defaults -------------------
    # An agent's heartbeat period: several beats fit in one lease.
    heartbeat_interval: float = 0.5
    # A node silent this long is lost; workers' collective errors that no loss explains within it
    # re-form the generation (a dead or frozen node is named within a lease). Well under the ~10 s
    # Slurm takes to mark a node DOWN.
    heartbeat_lease: float = 3.0
    # A step's wait on a collective or p2p operation may take this long beyond twice the generation's longest
    # step (engine/comm.py Generation.wait_timeout; a generation's first step: step_timeout): a wait
    # includes its peers' compute, legitimately. A dead peer is named sooner by its node's loss.
    collective_timeout: float = 2.0
    # No healthy rank computes longer than a step between collectives: a rank whose step does not advance
    # this long is hung, and so is a member that has not left an aborted generation this long after it.
    step_timeout: float = 60.0
    # Collecting every survivor's report after an abort (a late one is lost), and the agents' registration.
    reconfiguration_timeout: float = 120.0

    # ---- the job's own timeouts ---------------------------------------------------------------------
    # A connect or get on the job's TCPStore: the supervisor hosts it, only its node's loss reaches this.
    store_timeout: float = 60.0
    # One attempt to open a second connection to a store this process is connected to already (a thread's
    # own, engine/abort.py clone_store): a live store answers within it; a refused connect after it means
    # its supervisor died, and the attempts stop (torch alone retries a refused connect for store_timeout).
    store_clone_attempt: float = 2.0
    # Building a group: every member must have started (torch's import, building its layers).
    connect_timeout: float = 120.0
    # The whole run, and a worker's wait for its next generation: only catches a supervisor that stopped
    # publishing; Slurm's --time bounds the job.
    run_timeout: float = 30 * DAY_S
    # An on-demand checkpoint, from the preemption notice to complete: submitit signals 90 s ahead.
    checkpoint_timeout: float = 60.0
    # After the on-demand checkpoint: agents stopped, events closed; with the checkpoint, within the 90 s.
    teardown_timeout: float = 30.0
    # A joining node's collective with the supervisor, which includes its process's torch import.
    health_check_timeout: float = 60.0
    # A control-plane peer that does not authenticate within this is dropped (a round trip is milliseconds).
    handshake_timeout: float = 2.0
    # An agent's connection to the control server: the supervisor is up once its address is written.
    agent_connect_timeout: float = 10.0
    # An agent's wait for the supervisor's address: a replacement job may start before it is written.
    address_timeout: float = 120.0
    # The health monitor holds its judgement while a checkpoint is written, at most this long.
    checkpoint_hold_max: float = 300.0
    # An agent's wait for its warm server (agent/warm.py) to fork a worker: includes what remains of
    # the server's imports (torch's: seconds of CPU) when the agent is told to start right after it started.
    warm_spawn_timeout: float = 120.0
    # A warm server that died takes its workers with it (PR_SET_PDEATHSIG): their ends are reported once
    # their pids are gone, at most this long after (a SIGKILL takes milliseconds).
    warm_orphan_wait: float = 5.0
    # A worker leaving a generation stops its reader thread (engine/prefetch.py) and waits this long for
    # the read it is in (one step's samples: milliseconds); past it the daemon thread ends on its own.
    prefetch_stop: float = 1.0
    # A drill's "hold" fault waits this long at most for its generation to be declared failed, and an
    # "after" condition for the workers it names to reach the fault's step (engine/faults.py): both
    # come within a recovery's detection, so past it the drill was written wrong and the worker says so.
    fault_wait_max: float = 120.0
    # Under Slurm with supervisor failover, the training nodes are one-node jobs the supervisor submits
    # when it starts (docs/failover.md): how long they may wait in the queue before the job gives up.
    node_jobs_timeout: float = 600.0

    # ---- poll periods: each bounds a latency against the load it costs ------------------------------
    # The coordinator's loop: bounds the detection latency on the local backend (it reads the store
    # observer's view and the node backend's exits: no store request).
    coordinator_poll: float = 0.005
    # The supervisor's store observer (supervisor/observer.py) reads the current generation's keys this
    # often, for the coordinator, the node backend and the health monitor: bounds how late they see a
    # step, a collective error, a rebuilt or resumed generation (three requests a period when steady).
    store_poll: float = 0.02
    # The checkpoint folder is scanned for completed checkpoints this often (a directory listing).
    checkpoint_poll: float = 0.5
    # The node backend's watcher: bounds the detection latency of srun exits and expired leases.
    backend_poll: float = 0.02
    # While a submitted job waits to start (a transient wait: seconds to minutes), squeue is asked this
    # often; never in the steady state.
    slurm_poll: float = 1.0
    # The steady state's one query: the job's nodes' Slurm states (scontrol show node) this often. slurmctld
    # is shared by every user of the centre (docs/slurm.md, "A gentle client"): one `scontrol show node` is
    # two RPCs (REQUEST_NODE_INFO and REQUEST_PARTITION_INFO, counted with sdiag on the lab), so 6 RPCs a
    # minute per job. Slurm's node state is the slowest detector anyway (SlurmdTimeout, 300 s by default,
    # before a dead node is DOWN); the job's heartbeats and process exits find a loss first.
    slurm_node_poll: float = 20.0
    # `submit` following a Slurm job asks squeue this often whether the job is still queued (the job's
    # events say everything else; squeue only catches a job that ended without writing them).
    slurm_follow_poll: float = 60.0
    # One Slurm client command: slurm.conf's MessageTimeout defaults to 10 s, so a controller that has not
    # answered within it is unreachable for now (the query is retried, see slurm_retry_backoff).
    slurm_command: float = 10.0
    # The pause before the second attempt of a read-only Slurm query that timed out or failed transiently;
    # doubled before each further attempt (cluster/slurm.py READ_ATTEMPTS): a restarting slurmctld is
    # given seconds, not hammered.
    slurm_retry_backoff: float = 1.0
    # The supervisor reports how many Slurm client commands it ran (`slurm_calls` event) this often.
    slurm_calls_report: float = 60.0
    # A read of a job-folder file that NFS reports stale (ESTALE: it was renamed over between lookup and
    # open) is retried after this pause (cluster/durable.py STALE_ATTEMPTS).
    stale_file_retry: float = 0.05
    # Per-worker steps are read (by the store observer, one request) this often: a hang takes
    # step_timeout to name anyway.
    rank_step_poll: float = 0.25
    # An agent polls its workers' exits this often: bounds process-exit detection.
    agent_poll: float = 0.02
    # An agent looks for the supervisor's address file this often while it waits.
    address_poll: float = 0.2
    # A drill's "after" condition reads the progress of the workers it names this often (a store read each).
    fault_poll: float = 0.01
    # A waiting worker reads its FailureWatch's flag (no store request) this often: bounds abort latency.
    abort_poll: float = 0.01
    # A FailureWatch thread re-issues its blocking store wait this often, on a fresh connection.
    watch_renew: float = 300.0
    # A read or wait on the job's store that met a refused value (forged, or unsigned: protocol/signed_store.py)
    # reads the key again this often until the writer's valid value replaces it: only under attack.
    forged_value_poll: float = 0.05
    # The supervisor lists the store's keys this often and deletes those that are not the job's (written by
    # a process without the job secret): one request whose answer grows with the keys (tens of kB per
    # thousand), so not every store_poll; bounds how late such a write is reported.
    store_sweep_poll: float = 10.0
    # NCCL work is polled at most this often: a step's p2p waits are short. A wait re-checks its work at
    # once (a yield), then after nccl_poll_first, doubling the pause up to nccl_poll: a short operation is
    # seen within microseconds rather than a whole period later, and a long one costs a poll a period.
    nccl_poll: float = 0.0005
    nccl_poll_first: float = 0.00002
    # A group's warm-up operation is polled this often: it completes in microseconds.
    warm_up_poll: float = 0.001
    # The batch step's main thread waits on the supervisor thread in slices: signals arrive between them.
    join_poll: float = 0.2
    # The supervisor exports new events to TensorBoard this often (`logging.tensorboard`): a few reads and
    # writes per period, however many steps it covers.
    tensorboard_poll: float = 2.0
    # Agents and workers look at the job folder's published supervisor epoch this often (a stat, and a
    # read when it changed): a frozen supervisor keeps their connections open, so only a higher epoch
    # tells them that a standby took over. Bounds how late they follow it.
    epoch_poll: float = 0.25
    # Workers look at the job folder's requests (engine/requests.py: `profile-steps`, a hang's dumps) this
    # often, from a thread: a stat of two files, nothing on the training path. Bounds how late a hang's
    # dump starts and how many steps ahead `profile-steps` places its window.
    request_poll: float = 0.5
    # On a hang verdict the supervisor waits this long for every worker's stacks and flight-recorder
    # dump before it stops the hung node (its workers may be past answering: it goes on without them).
    hang_dump_wait: float = 5.0
    # The W&B logger records as exported only the log offset it reached this long ago: W&B writes from its
    # own process with no flush to wait on, so a supervisor killed with kill -9 leaves the last records
    # it logged to its successor (logged again: duplicates, never a gap). One export period (2 s) of lag
    # was not enough once under load.
    wandb_commit_lag: float = 10.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"timeout {f.name} must be a positive number of seconds, got {value!r}")

    @classmethod
    def from_recipe(cls, fault_tolerance: FaultTolerance) -> JobTimeouts:
        """The job's timeouts: the recipe's `fault_tolerance` values under their own names, the rest
        at their defaults. The one place where recipe values become timeouts."""
        return cls(**{name: float(getattr(fault_tolerance, name)) for name in RECIPE_FIELDS})

    def td(self, name: str) -> dt.timedelta:
        """Timeout `name` as a timedelta (what torch's stores and groups take)."""
        return dt.timedelta(seconds=getattr(self, name))


# Every field at its default: what a process uses before (or without) the job's record, and the default
# argument of the functions and classes that take one.
DEFAULT_TIMEOUTS = JobTimeouts()
