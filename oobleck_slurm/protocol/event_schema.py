"""The event log's schema: one frozen dataclass per event kind, the one place that says what a job's
`events.jsonl` may hold.

Writers go through it: `EventLog.emit(kind, **fields)` calls `check_event`, so an unknown kind, an
unknown field or a missing required field raises ValueError at the call site (and the contract test,
tests/protocol/test_event_contract.py, finds every literal `emit` call in the package statically).
Readers go through it too: `read_event(record)` turns a record into its typed event, tolerantly,
since logs outlive code: an unknown kind reads as None, unknown fields are skipped, an optional field
that is missing or of the wrong type reads as None; only a record lacking its time or a required field
is unreadable (None).

A field without a default is required; optional ones default to None. Each class's docstring says
when the event is written; `render_tables()` renders the tables of docs/events.md
from this module (`python -m oobleck_slurm.protocol.event_schema --write-readme`).

Events of a membership change (a failure, a re-form, a join, a checkpoint restart) carry, from the
coordinator, the change's id (`recovery`: the generation it publishes), the coordinator's `phase`
when the event was written, and on the first event of a change that interrupted an unfinished one,
`supersedes`; the dashboard groups recoveries by that id.
"""

from __future__ import annotations

import math
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

from oobleck_slurm.protocol.phases import Phase

# The coordinator's phases (a recovery's `phase` field).
COORDINATOR_PHASES = tuple(str(p) for p in Phase)
NODE_STATES = ("healthy", "suspect", "lost", "joining", "spare")


def required(doc: str, choices: tuple[str, ...] | None = None) -> Any:
    """A field every writer must pass (and without which a record is unreadable)."""
    return field(metadata={"doc": doc, "choices": choices})


def optional(doc: str, choices: tuple[str, ...] | None = None) -> Any:
    """A field that may be missing (None)."""
    return field(default=None, metadata={"doc": doc, "choices": choices})


@dataclass(frozen=True, kw_only=True)
class Event:
    """Every record: `t` (unix time, float seconds; `emit` fills in now) and `kind`."""

    kind: ClassVar[str]
    t: float = required("unix time (s)")


@dataclass(frozen=True, kw_only=True)
class RecoveryEvent(Event):
    """An event the coordinator writes during a membership change; the three fields say which one."""

    recovery: int | None = optional("the membership change this event belongs to: the generation that change "
                                    "publishes (one id per change)")
    phase: str | None = optional("the coordinator's phase when the event was written", COORDINATOR_PHASES)
    supersedes: int | None = optional("on the first event of a change that interrupted an unfinished one: the "
                                      "interrupted change's id")


# ---- nested records (inside `plan`) ------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class PlanStage:
    layers: tuple[int, int] | None = optional("half-open layer range [start, stop)")
    node: str | None = optional("the node that runs the stage")
    worker: int | None = optional("the worker (device) on that node (a stage of several: its first)")
    rank: int | None = optional("the global rank (a stage of several: its first)")
    workers: list[int] | None = optional("every worker of the stage on that node (consecutive; several for a "
                                         "sharded stage)")
    ranks: list[int] | None = optional("every global rank of the stage")
    memory_bytes: int | None = optional("the planner's memory model of the stage")
    kept: bool | None = optional("a sharded stage's parameters gathered once per step and kept (else "
                                 "gathered around each use)")


@dataclass(frozen=True, kw_only=True)
class PlanPipeline:
    id: int | None = optional("pipeline id")
    nodes: list[str] | None = optional("its nodes")
    microbatches: int | None = optional("microbatches per step")
    stages: list[PlanStage] | None = optional("its stages")


# ---- the job -----------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class JobStarted(Event):
    """The supervisor started (first record of a run; a requeued job writes one per run)."""

    kind = "job_started"
    job_id: str | None = optional("the job folder's name")
    backend: str | None = optional('"local" or "slurm"')
    recipe: str | None = optional("the recipe's name")
    recipe_path: str | None = optional("the recipe file")
    nodes: list[str] | None = optional("node names")
    spares: list[str] | None = optional("node names held back as spares")
    f: int | None = optional("failures tolerated")
    steps: int | None = optional("total steps")
    pid: int | None = optional("the supervisor's process id")
    slurm_job_id: str | None = optional("the Slurm job, if any")
    supervisor_node: str | None = optional("the node that runs the supervisor (Slurm)")
    requeued: bool | None = optional("this run resumes a requeued job")
    workers_per_node: int | None = optional("workers (devices) per node")
    device: str | None = optional('"cuda" or "cpu"')
    resumed_from: str | None = optional("another job's checkpoint (its step folder) this job started from "
                                        "(`submit --resume-from`)")


@dataclass(frozen=True, kw_only=True)
class AgentsReady(Event):
    """Every node's agent connected."""

    kind = "agents_ready"
    nodes: list[str] = required("node names")
    seconds: float | None = optional("from launching the agents")


@dataclass(frozen=True, kw_only=True)
class Done(Event):
    """Every member finished the last step."""

    kind = "done"
    generation: int = required("the last generation")
    note: str | None = optional("e.g. nodes that died after the end")


@dataclass(frozen=True, kw_only=True)
class RunComplete(RecoveryEvent):
    """A membership change found a member already done with the last step: the run is over, no recovery."""

    kind = "run_complete"
    generation: int | None = optional("the generation that ended")
    note: str | None = optional("why no recovery was needed")
    finished: list[str] | None = optional("the members that finished")


@dataclass(frozen=True, kw_only=True)
class JobFinished(Event):
    """The run ended (last record of a run), written by the supervisor or by `cancel`."""

    kind = "job_finished"
    status: str = required('"completed", "failed", "cancelled", "preempted", ...')
    exit_code: int | None = optional("the supervisor's exit code")
    error: str | None = optional("why it failed")
    seconds: float | None = optional("the run's duration")
    checkpoint_step: int | None = optional("the step of the on-demand checkpoint written before stopping")
    recorded_by: str | None = optional('"cancel" when the cancel command wrote it')


@dataclass(frozen=True, kw_only=True)
class Takeover(Event):
    """A standby supervisor took over from a lost one (docs/failover.md); a recovery follows."""

    kind = "takeover"
    epoch: int = required("the new supervisor's epoch (fencing token)")
    generation: int | None = optional("the generation it takes over")
    lease_age: float | None = optional("how old the lost supervisor's lease was when the standby acted (s)")
    seconds: float | None = optional("from the takeover's start to every agent back (or given up on)")
    lost: list[str] | None = optional("members whose agents did not come back")


@dataclass(frozen=True, kw_only=True)
class SlurmJob(Event):
    """The Slurm job changed state (the live dashboard applies it to its own state from squeue; not in the log)."""

    kind = "slurm_job"
    state: str = required("Slurm's job state: PENDING, RUNNING, ...")
    slurm_job_id: str | None = optional("the Slurm job id")


# ---- plan, training, checkpoints ---------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Plan(RecoveryEvent):
    """A new plan is in force: generation 0's (no recovery id), then each membership change's."""

    kind = "plan"
    pipelines: list[PlanPipeline] = required(
        "each pipeline: `id`, `nodes`, `microbatches`, `stages`: [{`layers` [start, stop), `node`, `worker`, "
        "`rank`, `workers`, `ranks`, `memory_bytes`}]; a pipeline's template is its stage count")
    generation: int | None = optional("from 0")
    reason: str | None = optional('"initial", "requeue", "failure", "reform", "join", "rebalance", "takeover" or "rollback"')
    workers_per_node: int | None = optional("workers (devices) per node")
    ranks: int | None = optional("ranks in all")
    spares: list[str] | None = optional("nodes in no pipeline")


@dataclass(frozen=True, kw_only=True)
class MetricsLogger(Event):
    """The supervisor started a metrics logger (`logging.tensorboard`, `logging.wandb`), or could not:
    training goes on without it."""

    kind = "metrics_logger"
    logger: str = required("which", ("tensorboard", "wandb"))
    folder: str | None = optional("where its files go")
    run_id: str | None = optional("W&B: the job's run id (one across requeues and takeovers)")
    error: str | None = optional("why it did not start")


@dataclass(frozen=True, kw_only=True)
class TraceRequested(Event):
    """`profile-steps` asked every worker to trace steps [start, stop) with torch.profiler."""

    kind = "trace_requested"
    id: int = required("the request's id: its traces go to JOB/traces/<id>/")
    start: int = required("the first traced step")
    stop: int = required("the step after the last traced one")


@dataclass(frozen=True, kw_only=True)
class TraceWritten(Event):
    """A worker wrote its Chrome trace of a `profile-steps` request (steps cut short by a failure: the
    ones it traced)."""

    kind = "trace_written"
    node: str = required("the worker's node")
    worker: int | None = optional("the worker's index on that node")
    rank: int | None = optional("its rank in the generation that traced")
    start: int | None = optional("the first traced step")
    stop: int | None = optional("the step after the last traced one")
    path: str | None = optional("the trace file")


@dataclass(frozen=True, kw_only=True)
class HangDump(Event):
    """A hang verdict: before stopping the hung node the supervisor asked every worker for its Python
    stacks and flight-recorder dump (engine/requests.py) and waited up to `hang_dump_wait`."""

    kind = "hang_dump"
    nodes: list[str] = required("the nodes declared hung")
    folder: str | None = optional("where the dumps are (JOB/dumps/<id>)")
    dumped: list[str] | None = optional("workers that wrote their dumps")
    missing: list[str] | None = optional("workers that did not within the wait (a stopped process cannot)")
    seconds: float | None = optional("how long the supervisor waited")


@dataclass(frozen=True, kw_only=True)
class Step(Event):
    """One optimizer step finished (written once per step, by rank 0)."""

    kind = "step"
    step: int = required("the 0-based index of the step that finished (`step + 1` steps done)")
    loss: float | None = optional("mean loss over the global batch")
    grad_norm: float | None = optional("global gradient norm before clipping")
    lr: float | None = optional("learning rate")
    seconds: float | None = optional("rank 0's wall time for the step")
    samples_per_s: float | None = optional("global batch / seconds")
    tokens_per_s: float | None = optional("tokens of the global batch / seconds")
    devices: int | None = optional("ranks that trained the step (spares excluded): the per-device figures' divisor")
    tokens_per_s_per_device: float | None = optional("tokens_per_s / devices")
    tflops_per_device: float | None = optional("model FLOPs of the step (forward + backward, no recompute: "
                                               "planning/flops.py) / seconds / devices, in TFLOP/s; absent "
                                               "for a model without FLOP counts")
    mfu: float | None = optional("model FLOPs utilisation: tflops_per_device over one device's peak (its "
                                 "GPU's data-sheet bf16 figure or `logging.peak_tflops`); absent without "
                                 "a peak (a CPU)")
    pipeline_seconds: list[float | None] | None = optional("per pipeline id: its first stage's schedule time (s)")
    compute_seconds: list[float | None] | None = optional("per rank: forward and backward only (s)")
    peak_memory: list[float | None] | None = optional("per rank: peak bytes allocated on its GPU during the step")
    data_s: float | None = optional("the longest any rank waited for its samples in the step (s)")
    generation: int | None = optional("the generation that ran it")
    skipped: bool | None = optional("true when every rank skipped the step's update (`skip_reason` says why): "
                                    "parameters and optimizer state unchanged, and the next step reads the next "
                                    "samples")
    skip_reason: str | None = optional("why the step was skipped: the global gradient norm or the loss was not "
                                       "finite (a NaN or Inf on any rank), or the loss exceeded "
                                       "`loss_threshold` (training.loss_spike)", ("non_finite", "loss_spike"))
    loss_threshold: float | None = optional("training.loss_spike: the bar the step's loss was judged against (mean "
                                            "of the window's accepted losses + sigma standard deviations); absent "
                                            "while the policy warms up or is off")


@dataclass(frozen=True, kw_only=True)
class Eval(Event):
    """The validation loss after `step` steps (rank 0, every `training.eval_interval` steps and at the
    end). Computed on the same samples whatever the plan. A recovery that resumes at that step does not
    repeat a logged one (it may after a supervisor's takeover, or with rank 0 lost right after logging
    it); steps redone from a checkpoint log theirs again."""

    kind = "eval"
    step: int = required("steps done when it was measured")
    loss: float = required("mean loss over the validation samples")
    samples: int | None = optional("validation samples")
    seconds: float | None = optional("rank 0's wall time for it")
    generation: int | None = optional("the generation that ran it")


@dataclass(frozen=True, kw_only=True)
class Checkpoint(Event):
    """A checkpoint was written (periodic, or on demand before a preemption), or could not be (`ok` false)."""

    kind = "checkpoint"
    step: int | None = optional("the step it holds")
    seconds: float | None = optional("time to write it")
    path: str | None = optional("its folder")
    ok: bool | None = optional("false when it could not be written")
    on_demand: bool | None = optional("written for a preemption or the time limit")
    detail: str | None = optional("why it could not be written")
    worker: str | None = optional("the worker whose write failed (ok false, written by that worker; training goes "
                                  "on, the next interval tries again)")
    failures: int | None = optional("that worker's failed checkpoint writes in this run so far")
    pruned: list[int] | None = optional("older checkpoints' steps deleted once this one was complete "
                                        "(fault_tolerance.keep_checkpoints)")


@dataclass(frozen=True, kw_only=True)
class CheckpointRequested(Event):
    """An on-demand checkpoint was asked for (preemption, time limit)."""

    kind = "checkpoint_requested"
    reason: str = required("why")
    generation: int | None = optional("the generation aborted to take it")


@dataclass(frozen=True, kw_only=True)
class CheckpointFallback(RecoveryEvent):
    """Recovery from memory is impossible (e.g. a layer lost every replica): restart from the last checkpoint."""

    kind = "checkpoint_fallback"
    reason: str = required("which failure forced it")
    generation: int | None = optional("the coordinator's generation then")


# ---- nodes -------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Node(Event):
    """A node's health and use (every few seconds per node), or its registration or loss."""

    kind = "node"
    node: str = required("the node's id in the job")
    state: str | None = optional("its state", NODE_STATES)
    slurm_node: str | None = optional("the host it runs on")
    agent_pid: int | None = optional("its agent's process id (on registration)")
    heartbeat_age: float | None = optional("seconds since its last heartbeat")
    cpu: float | None = optional("CPU use (%)")
    gpu: float | None = optional("GPU use (%)")
    worker: str | None = optional("one state for its workers (stopped if any is)")
    workers: list[str] | None = optional("each worker process's state")
    cause: str | None = optional("why it was lost")
    slurm_state: str | None = optional("Slurm's node state (IDLE, ALLOCATED, DOWN, ...)")


@dataclass(frozen=True, kw_only=True)
class NodeLost(RecoveryEvent):
    """A node was declared lost (by the agents' backend; by the coordinator, with its change's id, when hung); a
    `failure` follows."""

    kind = "node_lost"
    node: str = required("the node's id in the job")
    cause: str = required("process_exit, agent_lost, heartbeat, slurm_down, hung, ...")
    slurm_node: str | None = optional("the host")
    detail: str | None = optional("what was seen")
    detection_seconds: float | None = optional("from a known fault time to the loss")


@dataclass(frozen=True, kw_only=True)
class ReplacementRequested(Event):
    """The supervisor asked for a replacement node."""

    kind = "replacement_requested"
    how: str = required('"spare" (one of the allocation) or "request" (a new one-node job)')
    ok: bool = required("whether one could be had")
    node: str | None = optional("the spare, or the id the requested node will have")
    slurm_job: str | None = optional("the request's handle (a Slurm job id)")
    detail: str | None = optional("why none could be had")


@dataclass(frozen=True, kw_only=True)
class NodeJoined(RecoveryEvent):
    """A replacement node trains with the others (written after the `resumed` of the change that folded it in)."""

    kind = "node_joined"
    node: str = required("the node's id in the job")
    generation: int | None = optional("the generation it joined")
    seconds: float | None = optional("from the change's start to its first step")


@dataclass(frozen=True, kw_only=True)
class HealthCheck(Event):
    """A joining node ran a collective with the supervisor before being used."""

    kind = "health_check"
    node: str = required("the node's id in the job")
    ok: bool = required("passed")
    slurm_node: str | None = optional("the host")
    seconds: float | None = optional("its duration")
    detail: str | None = optional("what failed")


@dataclass(frozen=True, kw_only=True)
class Preflight(Event):
    """A node's pre-flight measurement and its verdict (detection/preflight.py), at the start (every
    member, judged against the start's median) or before a join (before its `health_check`)."""

    kind = "preflight"
    node: str = required("the node's id in the job")
    admitted: bool = required("false: the node is not used (at the start it is lost as a failed join)")
    at: str = required("when", choices=("start", "join"))
    slurm_node: str | None = optional("the host")
    reason: str | None = optional("why it was refused, or what was not judged")
    figures: dict[str, float] | None = optional("its figures: matmul_gflops, link_mib_s, allreduce_gib_s (>= 2 GPUs)")
    medians: dict[str, float] | None = optional("the fleet's medians it was judged against")
    seconds: float | None = optional("the check's duration, as the supervisor saw it")


@dataclass(frozen=True, kw_only=True)
class FaultInjected(Event):
    """A drill (`kill-node`) hit a node."""

    kind = "fault_injected"
    node: str = required("the node's id in the job")
    how: str = required("what was done to it")
    slurm_node: str | None = optional("the host")
    at: float | None = optional("when (unix time)")


@dataclass(frozen=True, kw_only=True)
class Drill(Event):
    """A recipe's scripted drill fired."""

    kind = "drill"
    node: str = required("its target")
    how: str = required("what was done")
    ok: bool = required("whether it was done")
    worker: int | None = optional("the worker, if one")
    step: int | None = optional("the step it fired at")
    detail: str | None = optional("why not")


@dataclass(frozen=True, kw_only=True)
class PreemptNotice(Event):
    """An agent relayed a preemption or time-limit signal."""

    kind = "preempt_notice"
    node: str | None = optional("the node that got it")
    signal: str | None = optional("the signal")


@dataclass(frozen=True, kw_only=True)
class SlurmUnreachable(Event):
    """Polling Slurm's node states failed (other detectors go on)."""

    kind = "slurm_unreachable"
    error: str = required("the error")


@dataclass(frozen=True, kw_only=True)
class SlurmCalls(Event):
    """The Slurm client commands (controller RPCs) the supervisor ran, every `slurm_calls_report` (60 s):
    the load this job puts on the centre's slurmctld (docs/slurm.md, "A gentle client")."""

    kind = "slurm_calls"
    calls: int = required("all so far (each attempt of a retried query counts)")
    failed: int = required("those that timed out or failed, so far")
    window_calls: int = required("those of the last window")
    window_s: float = required("the window's seconds")
    commands: dict[str, int] | None = optional("all so far, per command (squeue, scontrol show, scancel, ...)")


@dataclass(frozen=True, kw_only=True)
class Refused(Event):
    """The control server refused a peer (no secret, a garbled or replayed frame, an unknown replacement)."""

    kind = "refused"
    peer: str = required("who")
    reason: str = required("why")


@dataclass(frozen=True, kw_only=True)
class StoreRejected(Event):
    """A process of the job refused what it found in the job's store (protocol/signed_store.py): a value
    whose signature fails or that is unsigned (read as not written), or a key that is not one of the
    job's hidden names (deleted by the supervisor's sweep): a write by a process without the job secret.
    At most once a minute per key, reason and reader; `count` says how many it stands for."""

    kind = "store_rejected"
    key: str = required("the key: the job's key name for a refused value, the stored name for a foreign key")
    reason: str = required("why", ("bad signature", "unsigned value", "foreign key"))
    reader: str | None = optional('who found it: "supervisor", a worker (`node:local`), "health check ..."')
    op: str | None = optional('the request that found it ("get", "wait", "check", "add", "compare_set", "sweep")')
    count: int | None = optional("refusals of this key and reason since its last event (1: this one)")
    suppressed: int | None = optional("other refusals not reported since this reader's last event (rate limit)")


# ---- failure and recovery ----------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class CollectiveError(RecoveryEvent):
    """Workers reported failed collectives in a generation (a re-form follows unless a loss explains them)."""

    kind = "collective_error"
    nodes: list[str] = required("the workers that reported (`node:local`)")
    generation: int | None = optional("the generation")
    step: int | None = optional("its last completed step")
    errors: dict[str, str] | None = optional("each worker's error text")
    grace: float | None = optional("how long a loss may take to explain them")


@dataclass(frozen=True, kw_only=True)
class Failure(RecoveryEvent):
    """Nodes were lost: at a step, during a recovery (`step` null), or a joining node before use."""

    kind = "failure"
    nodes: list[str] = required("the lost nodes")
    generation: int | None = optional("the generation that failed")
    cause: str | None = optional("process_exit, out_of_memory, agent_lost, heartbeat, slurm_down, hung, ... "
                                 "(comma-separated)")
    detail: str | None = optional("what was seen")
    step: int | None = optional("the interrupted step (discarded and replayed); null if unknown")


@dataclass(frozen=True, kw_only=True)
class OutOfMemory(Event):
    """A worker ran out of device memory (written by the worker, which then exits): the coordinator's
    `failure` event follows with cause `out_of_memory`, and the job does not run the same plan again."""

    kind = "out_of_memory"
    node: str = required("the worker's node")
    worker: int = required("the worker (device) on that node")
    generation: int = required("the generation it was in")
    step: int = required("the worker's step")
    phase: str = required("what it was doing: adopt:memory (copying layers from their holders), adopt:checkpoint, "
                          "adopt:seed, groups, step, evaluate or checkpoint")
    error: str = required("the error, as torch raised it")
    allocated: int | None = optional("bytes its device held then (torch.cuda.memory_allocated); null on the CPU")
    peak: int | None = optional("the device's peak since the generation started (max_memory_allocated)")
    capacity: int | None = optional("the device's total memory")


@dataclass(frozen=True, kw_only=True)
class LossSpikeStop(Event):
    """training.loss_spike: `max_consecutive` loss spikes in a row (written by rank 0; every worker then
    stops): the coordinator rolls back (`loss_spike_rollback`) or stops the job with `message`."""

    kind = "loss_spike_stop"
    step: int = required("the step of the last spike (skipped like the others)")
    spikes: list[int] = required("the steps of the spikes in a row")
    loss: float | None = optional("the last spike's loss")
    threshold: float | None = optional("the bar it exceeded")
    checkpoint: int | None = optional("the newest complete checkpoint's step; null if none")
    message: str | None = optional("what happened and what to do")


@dataclass(frozen=True, kw_only=True)
class LossSpikeRollback(RecoveryEvent):
    """training.loss_spike (`on_consecutive: rollback`): every worker restarts from a checkpoint at or
    before the first spike, its data cursor moved so that it reads on from the last spike's successor."""

    kind = "loss_spike_rollback"
    step: int = required("the step of the last spike")
    spikes: list[int] = required("the steps of the spikes in a row")
    checkpoint: int = required("the step of the checkpoint rolled back to: the next step run")
    data_step: int = required("the step whose samples the checkpoint's step reads (the last spike's + 1)")
    skipped_samples: int = required("the samples skipped: those of the steps from the checkpoint's to the last spike")
    rollback: int = required("this job's rollbacks so far, this one included")
    max_rollbacks: int | None = optional("training.loss_spike.max_rollbacks")
    discarded: list[int] | None = optional("the newer checkpoints deleted (the abandoned trajectory's)")
    generation: int | None = optional("the generation whose workers stopped")


@dataclass(frozen=True, kw_only=True)
class Detection(RecoveryEvent):
    """Phase: from the failure to its detection (0 when the fault time is unknown)."""

    kind = "detection"
    seconds: float = required("its duration")
    generation: int | None = optional("the generation that failed")
    known_kill_time: bool | None = optional("the fault time was known (a drill)")


@dataclass(frozen=True, kw_only=True)
class Reform(RecoveryEvent):
    """Collective errors that no loss explained: the same members re-form under a new generation."""

    kind = "reform"
    cause: str = required("why")
    generation: int | None = optional("the generation re-formed")
    step: int | None = optional("the step that is replayed")


@dataclass(frozen=True, kw_only=True)
class Replan(RecoveryEvent):
    """Phase: the new plan was computed."""

    kind = "replan"
    seconds: float = required("its duration")
    generation: int | None = optional("the new generation")
    rules: list[str] | None = optional("the planner's rules applied")
    transfers: int | None = optional("layer copies planned")
    resume_step: int | None = optional("the step training resumes at")
    survivor_steps: dict[str, int] | None = optional("each survivor's reported step")


@dataclass(frozen=True, kw_only=True)
class GroupRebuild(RecoveryEvent):
    """Phase: process groups were rebuilt under the new generation."""

    kind = "group_rebuild"
    seconds: float = required("its duration (the slowest rank)")
    generation: int | None = optional("the new generation")


@dataclass(frozen=True, kw_only=True)
class StateCopy(RecoveryEvent):
    """Phase: parameters and optimizer state of the layers ranks lacked were copied from replicas."""

    kind = "state_copy"
    seconds: float = required("its duration (the slowest rank)")
    bytes: int | None = optional("bytes copied")
    generation: int | None = optional("the new generation")


@dataclass(frozen=True, kw_only=True)
class Replay(RecoveryEvent):
    """Phase: the interrupted step was replayed."""

    kind = "replay"
    seconds: float = required("its duration")
    step: int | None = optional("the replayed step")
    generation: int | None = optional("the new generation")


@dataclass(frozen=True, kw_only=True)
class Resumed(RecoveryEvent):
    """Training runs again: the first step of the new generation finished."""

    kind = "resumed"
    step: int = required("that step")
    total_seconds: float | None = optional("the whole recovery, from the fault (or its detection) to now")
    generation: int | None = optional("the new generation")


# The README's sections, in order; the registry is built from them, so a kind is in exactly one.
@dataclass(frozen=True, kw_only=True)
class Health(Event):
    """The detectors' view of every node (every few seconds while the monitor has scores)."""

    kind = "health"
    scores: dict[str, float] | None = optional("node -> the metrics detector's score (robust z of its worst metric; 0 while the node is not judged)")
    metrics: dict[str, str] | None = optional("node -> the metric behind its score")
    slowdowns: dict[str, float] | None = optional("node -> its compute time over its peers'")
    threshold: float | None = optional("the score at which a machine is flagged")
    generation: int | None = optional("the generation")


@dataclass(frozen=True, kw_only=True)
class FaultyNode(Event):
    """The metrics detector flagged a machine; with `evict` a `node_lost` (cause faulty_metrics) follows."""

    kind = "faulty_node"
    node: str = required("the node's id in the job")
    action: str = required('"evict" or "report"')
    detail: str | None = optional("what deviates, how far")
    metrics: list[str] | None = optional("the deviating metrics, most deviant first")
    score: float | None = optional("its score")
    since: float | None = optional("when the deviation began (unix time)")


@dataclass(frozen=True, kw_only=True)
class Straggler(Event):
    """A straggler decision; with `evict` a `node_lost` (cause straggler) follows, with `rebalance` a
    membership change that gives the straggler's pipeline fewer microbatches."""

    kind = "straggler"
    action: str = required('"rebalance", "evict" or "report"')
    nodes: dict[str, float] | None = optional("node -> slowdown (a rebalance names every slow node; {}: back to the "
                                              "plain split)")
    detail: str | None = optional("what was measured")
    generation: int | None = optional("the generation")
    rank: int | None = optional("the slow rank (evict, report)")
    median_s: float | None = optional("its compute time per microbatch (s)")
    peers_median_s: float | None = optional("its peers' (s)")


@dataclass(frozen=True, kw_only=True)
class ReplicaMismatch(Event):
    """Replicas of a layer disagreed at an integrity check (engine/integrity.py); the step is withheld on
    every rank and a `node_lost` (cause replica_mismatch) follows for each node named."""

    kind = "replica_mismatch"
    step: int = required("the step whose check found it (withheld: replayed after the eviction)")
    nodes: list[str] = required("the nodes to evict")
    attributed: list[int] | None = optional("ranks singled out by a majority or by a second read")
    unresolved: list[int] | None = optional("holders of a pair that disagrees steadily (neither singled out)")
    detail: str | None = optional("which layers, which holders")
    generation: int | None = optional("the generation")


@dataclass(frozen=True, kw_only=True)
class TransferRefetch(Event):
    """A layer received in a recovery copy disagreed with its sender's checksum: fetched again from
    another holder (engine/transfer.py)."""

    kind = "transfer_refetch"
    layer: int = required("the layer")
    sender: int = required("the rank whose copy arrived corrupted")
    receiver: int = required("the receiving rank")
    retry_from: int | None = optional("the holder it is fetched from next")
    generation: int | None = optional("the generation")


SECTIONS: dict[str, tuple[type[Event], ...]] = {
    "Job": (JobStarted, AgentsReady, Takeover, Done, RunComplete, JobFinished, SlurmJob),
    "Plan and training": (Plan, Step, Eval, Checkpoint, CheckpointRequested, CheckpointFallback),
    "Nodes": (Node, NodeLost, ReplacementRequested, NodeJoined, HealthCheck, Preflight, FaultInjected, Drill, PreemptNotice,
              SlurmUnreachable, SlurmCalls, Refused, StoreRejected),
    "Failure and recovery": (CollectiveError, Failure, OutOfMemory, LossSpikeStop, LossSpikeRollback, Detection, Reform, Replan, GroupRebuild,
                             StateCopy, Replay, Resumed),
    "Faulty machines and stragglers": (Health, FaultyNode, Straggler, ReplicaMismatch, TransferRefetch),
    "Metrics": (MetricsLogger, TraceRequested, TraceWritten, HangDump),
}
EVENT_TYPES: dict[str, type[Event]] = {cls.kind: cls for group in SECTIONS.values() for cls in group}
RECOVERY_FIELDS = tuple(f.name for f in fields(RecoveryEvent) if f.name != "t")


# ---- writing -----------------------------------------------------------------------------------------

def check_event(kind: str, values: Mapping[str, Any]) -> None:
    """Raise ValueError naming the kind and the field if `values` are not a `kind` event's fields: an
    unknown kind or field, a required field missing (or None), a value outside a field's choices.
    Types are not checked here (the reader tolerates them): a typo must not stop a running job's
    rarely taken paths, and the contract test checks field names statically."""
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"event kind {kind!r} is not in the event schema (oobleck_slurm/protocol/event_schema.py)")
    specs = {f.name: f for f in fields(cls)}
    for name, value in values.items():
        spec = specs.get(name)
        if spec is None:
            known = ", ".join(sorted(specs))
            raise ValueError(f"event {kind!r}: unknown field {name!r} (its fields: {known})")
        choices = spec.metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise ValueError(f"event {kind!r}: field {name!r} is {value!r}, not one of {', '.join(choices)}")
    for name in required_fields(kind):
        if values.get(name) is None:
            raise ValueError(f"event {kind!r}: required field {name!r} is missing")


def required_fields(kind: str) -> list[str]:
    """The fields a writer of `kind` must pass (`t` aside: `emit` fills it in)."""
    return [spec.name for spec in fields(EVENT_TYPES[kind]) if _is_required(spec) and spec.name != "t"]


def _is_required(spec: Field[Any]) -> bool:
    return spec.default is MISSING and spec.default_factory is MISSING


# ---- reading -----------------------------------------------------------------------------------------

def read_event(record: object) -> Event | None:
    """The typed event of a record, or None when it is not one: not a JSON object, an unknown kind, no
    time, or a required field missing or of the wrong type. Unknown fields are skipped; an optional
    field that is missing, of the wrong type or outside its choices reads as None."""
    if not isinstance(record, dict):
        return None
    kind = record.get("kind")
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    return None if cls is None else _read(cls, record)


def _read(cls: type, record: Mapping[str, Any]) -> Any:
    """An instance of the dataclass `cls` from `record`, or None if a required field does not read."""
    values = {}
    for name, (convert, is_required) in _readers(cls).items():
        raw = record.get(name)
        value = None if raw is None else convert(raw)
        if value is None:
            if is_required:
                return None
            continue
        values[name] = value
    return cls(**values)


@cache
def _readers(cls: type) -> dict[str, tuple[Callable[[Any], Any], bool]]:
    """Per field of `cls`: a converter (value -> typed value, or None when it does not fit) and required."""
    hints = typing.get_type_hints(cls)
    out = {}
    for spec in fields(cls):
        convert = _converter(hints[spec.name])
        choices = spec.metadata.get("choices")
        if choices:
            convert = _within(convert, choices)
        out[spec.name] = (convert, _is_required(spec))
    return out


def _within(convert: Callable[[Any], Any], choices: tuple[str, ...]) -> Callable[[Any], Any]:
    def within(v: Any) -> Any:
        value = convert(v)
        return value if value in choices else None
    return within


def _converter(hint: Any) -> Callable[[Any], Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"event schema: unsupported union {hint}")
        return _converter(inner[0])
    if hint in _SCALARS:
        return _SCALARS[hint]
    if origin is list:
        (item_hint,) = args
        item = _converter(item_hint)
        keep_none = type(None) in typing.get_args(item_hint)  # list[float | None]: positions matter, keep them

        def as_list(v: Any) -> list | None:
            if not isinstance(v, list):
                return None
            items = [item(x) for x in v]
            return items if keep_none else [x for x in items if x is not None]
        return as_list
    if origin is dict:
        value = _converter(args[1])

        def as_dict(v: Any) -> dict | None:
            if not isinstance(v, dict):
                return None
            items = {str(k): value(x) for k, x in v.items()}
            return {k: x for k, x in items.items() if x is not None}
        return as_dict
    if origin is tuple:
        parts = [_converter(a) for a in args]

        def as_tuple(v: Any) -> tuple | None:
            if not isinstance(v, (list, tuple)) or len(v) != len(parts):
                return None
            out = tuple(p(x) for p, x in zip(parts, v))
            return None if any(x is None for x in out) else out
        return as_tuple
    if isinstance(hint, type) and hasattr(hint, "__dataclass_fields__"):
        return lambda v: _read(hint, v) if isinstance(v, dict) else None
    raise TypeError(f"event schema: unsupported field type {hint}")


def as_float(value: Any) -> float | None:
    """A finite number as float, else None (JSON's NaN/Infinity extensions read as unknown)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def as_str(value: Any) -> str | None:
    """A string; a number reads as its text (an id written as a number)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None


def _as_bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


_SCALARS: dict[Any, Callable[[Any], Any]] = {float: as_float, int: as_int, str: as_str, bool: _as_bool,
                                              Any: lambda v: v}


# ---- the README's tables -----------------------------------------------------------------------------

README = Path(__file__).resolve().parents[2] / "docs" / "events.md"  # the repository's docs/
TABLES_BEGIN = "<!-- event tables: generated from oobleck_slurm/protocol/event_schema.py; do not edit by hand -->"
TABLES_END = "<!-- end of event tables -->"
UPDATE_COMMAND = "python -m oobleck_slurm.protocol.event_schema --write-readme"


def render_tables() -> str:
    """The README's event tables (markdown), one per section: kind, fields, when it is written."""
    out = []
    for title, group in SECTIONS.items():
        out += [f"### {title}", "", "| kind | fields (**required**) | written when |", "|---|---|---|"]
        for cls in group:
            mark = " ↻" if issubclass(cls, RecoveryEvent) else ""
            described = "; ".join(_describe(spec, typing.get_type_hints(cls)[spec.name])
                                  for spec in fields(cls) if spec.name not in ("t", *RECOVERY_FIELDS))
            out.append(f"| `{cls.kind}`{mark} | {described} | {_summary(cls.__doc__)} |")
        out.append("")
    out += ["↻: written by the coordinator during a membership change, with the change's fields: "
            + "; ".join(_describe(spec, typing.get_type_hints(RecoveryEvent)[spec.name])
                        for spec in fields(RecoveryEvent) if spec.name != "t") + "."]
    return "\n".join(out) + "\n"


def _describe(spec: Field[Any], hint: Any) -> str:
    name = f"**`{spec.name}`**" if _is_required(spec) else f"`{spec.name}`"
    choices = spec.metadata.get("choices")
    doc = spec.metadata.get("doc", "")
    if choices:
        doc += ": " + "/".join(f"`{c}`" for c in choices)
    return f"{name} ({_type_name(hint)}): {doc}".replace("|", "\\|")


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _type_name(next(a for a in args if a is not type(None)))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return "any" if hint is Any else "object" if hasattr(hint, "__dataclass_fields__") else hint.__name__


def _summary(doc: str | None) -> str:
    """A docstring's first paragraph, on one line."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def replace_tables(readme: str, tables: str) -> str:
    """`readme` with the text between the table markers replaced by `tables`."""
    head, found, rest = readme.partition(TABLES_BEGIN)
    _, found_end, tail = rest.partition(TABLES_END)
    if not found or not found_end:
        raise ValueError(f"the README has no `{TABLES_BEGIN}` ... `{TABLES_END}` section")
    return f"{head}{TABLES_BEGIN}\n\n{tables}\n{TABLES_END}{tail}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-readme"]:
        README.write_text(replace_tables(README.read_text(), render_tables()))
        print(f"wrote the event tables of {README}")
    else:
        print(render_tables(), end="")
