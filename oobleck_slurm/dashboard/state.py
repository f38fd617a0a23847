"""What the dashboard and the report show, as a pure reducer over the job's events.

`DashboardState.apply(record)` reads one record of `events.jsonl` through the event schema
(`protocol/event_schema.py`: `read_event`, which types every field and reads a missing or mistyped
optional one as None) and folds the typed event into plain dataclasses. No I/O and no rendering
here, so the same state drives the live dashboard, the static report and the tests. A record the
schema cannot read (no time, a required field missing) is counted in `bad_events`, a kind it does not
know in `unknown_events`; neither takes the dashboard down.

Recoveries are grouped by the coordinator's recovery id (`recovery`, on every event of one membership
change): the first event with a new id opens one, `resumed`, `run_complete` and `checkpoint_fallback`
close it, and a change whose event says `supersedes: <id>` marks that unfinished one interrupted.
An event without an id belongs to no recovery (a joining node lost before it was used stops nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from oobleck_slurm.protocol import event_schema as ev
from oobleck_slurm.protocol.event_schema import NODE_STATES, as_float, read_event

PHASES = ("detection", "replan", "group_rebuild", "state_copy", "replay")
# Kept in the events panel; a long run must not grow memory without bound.
MAX_LOG_LINES = 500
# Kinds of the schema the dashboard deliberately does not reduce (the contract test requires every kind
# to be reduced or listed here, so that a new kind is a decision, not an accident).
# a load figure for the lab, not a state; an integrity verdict and a re-fetched copy change no state the
# dashboard keeps (a verdict's eviction arrives as `node_lost`): the narration tells them (narrate.py)
IGNORED_KINDS: frozenset[str] = frozenset({"slurm_calls", "replica_mismatch", "transfer_refetch"})

__all__ = ["NODE_STATES", "PHASES", "DashboardState", "Recovery"]


@dataclass
class NodeView:
    name: str
    state: str = "healthy"
    heartbeat_age: float | None = None
    cpu: float | None = None
    gpu: float | None = None
    slurm_state: str | None = None
    cause: str | None = None  # why it was lost
    workers: list[str] = field(default_factory=list)  # each worker process's state (one per device)
    health_score: float | None = None  # the metrics detector's score (robust z of its worst metric)
    health_metric: str | None = None  # the metric behind that score
    slowdown: float | None = None  # compute time over its peers' (stragglers)
    straggler: str | None = None  # what was done about it: rebalance, evict, report
    flagged: str | None = None  # the metrics detector flagged it: what was done (evict, report)


@dataclass
class StageView:
    layers: tuple[int, int] | None
    node: str | None
    rank: int | None
    width: int = 1  # devices of the stage (a sharded stage: several workers of its node)


@dataclass
class PipelineView:
    id: int
    nodes: list[str]
    stages: list[StageView]
    microbatches: int | None
    time: float | None = None  # last step's time of this pipeline, from `step` events


@dataclass
class StepPoint:
    t: float
    step: int | None
    loss: float | None
    samples_per_s: float | None
    step_time: float | None = None
    tokens_per_s_per_device: float | None = None
    mfu: float | None = None  # absent without a device peak (a CPU)


@dataclass
class Recovery:
    """One membership change: nodes lost, collective errors (a re-form), a node folded in, or a restart
    from a checkpoint. Its facts come from its own events; `trigger` is derived from them."""

    t_start: float  # the fault (its detection time subtracted) or the change's first event
    id: int | None = None  # the coordinator's recovery id
    generation: int | None = None  # the generation that failed
    nodes: list[str] = field(default_factory=list)  # lost in it
    cause: str | None = None
    step: int | None = None  # the interrupted step
    phases: dict[str, float] = field(default_factory=dict)  # in arrival order
    state_bytes: int | None = None
    t_end: float | None = None  # when it closed (resumed, interrupted, fell back); None while recovering
    total_seconds: float | None = None
    resumed_generation: int | None = None
    reformed: bool = False  # collective errors started it (a re-form)
    restarted: bool = False  # the coordinator restarted workers from a checkpoint in it
    plan_reason: str | None = None  # the reason of the plan it published
    phase: str | None = None  # the coordinator's last phase in it
    fallback: str | None = None  # why it fell back to a checkpoint
    outcome: str | None = None  # "resumed", "interrupted", "fallback", "run_complete"; None while open

    @property
    def trigger(self) -> str:
        """What the change was for: "failure" (nodes were lost in it), "reform" (collective errors with
        nobody lost), "restart" (from a checkpoint), "join" (a node folded in) or "replan"."""
        if self.nodes:
            return "failure"
        if self.reformed:
            return "reform"
        if self.restarted:
            return "restart"
        if self.plan_reason in ("failure", "join"):
            return self.plan_reason
        return "replan"

    @property
    def done(self) -> bool:
        return self.t_end is not None

    @property
    def interrupted(self) -> bool:
        return self.outcome == "interrupted"

    @property
    def seconds(self) -> float | None:
        """The whole recovery: the producer's total if given, else its end minus its start."""
        if self.total_seconds is not None:
            return self.total_seconds
        return None if self.t_end is None else self.t_end - self.t_start


@dataclass
class LogLine:
    """One line of the events panel: when, what, how long it took (if it has a duration)."""

    t: float
    kind: str
    text: str
    seconds: float | None = None


@dataclass
class Checkpoint:
    t: float
    step: int | None
    seconds: float | None
    path: str | None


class DashboardState:
    """Everything the panels show; build it by `apply`-ing events in log order."""

    def __init__(self) -> None:
        self.job_id: str | None = None
        self.backend: str | None = None
        self.recipe: str | None = None
        self.recipe_path: str | None = None
        self.f: int | None = None
        self.total_steps: int | None = None
        self.slurm_job_id: str | None = None
        self.slurm_state: str | None = None
        self.status = "waiting"  # waiting, running, recovering, finished, failed, ...
        self.exit_code: int | None = None
        self.t_start: float | None = None
        self.t_last: float | None = None
        self.t_end: float | None = None

        self.step: int | None = None
        self.loss: float | None = None
        self.samples_per_s: float | None = None
        self.tokens_per_s_per_device: float | None = None
        self.mfu: float | None = None
        self.step_time: float | None = None
        self.history: list[StepPoint] = []
        # Validation loss by steps done: (time first measured, loss); a recovery may repeat one.
        self.evals: dict[int, tuple[float, float]] = {}

        self.nodes: dict[str, NodeView] = {}
        self.generation: int | None = None
        self.plan_reason: str | None = None
        self.pipelines: list[PipelineView] = []

        self.recoveries: list[Recovery] = []
        self._recovery_by_id: dict[int, Recovery] = {}
        self.checkpoints: list[Checkpoint] = []
        self.fallback_reason: str | None = None
        self.log: list[LogLine] = []
        self.events_seen = 0
        self.unknown_events = 0
        self.bad_events = 0

    # -- derived -----------------------------------------------------------------------------

    @property
    def has_events(self) -> bool:
        return self.events_seen > 0

    @property
    def current_recovery(self) -> Recovery | None:
        if self.recoveries and not self.recoveries[-1].done:
            return self.recoveries[-1]
        return None

    @property
    def steps_done(self) -> int | None:
        """Steps finished: `step` is the 0-based index of the last one (as the engine writes it)."""
        return None if self.step is None else self.step + 1

    @property
    def elapsed(self) -> float | None:
        if self.t_start is None:
            return None
        end = self.t_end if self.t_end is not None else self.t_last
        return None if end is None else max(0.0, end - self.t_start)

    # -- the reducer -------------------------------------------------------------------------

    def apply(self, record: object) -> None:
        """Fold one record in. Never raises: an unreadable record is counted in `bad_events`."""
        if not isinstance(record, dict):
            self.bad_events += 1
            return
        t, kind = as_float(record.get("t")), record.get("kind")
        if t is None or not isinstance(kind, str):
            self.bad_events += 1
            return
        self.events_seen += 1
        if self.t_start is None:
            self.t_start = t
        self.t_last = t if self.t_last is None else max(self.t_last, t)
        handler = _HANDLERS.get(kind)
        if handler is None:
            if kind not in ev.EVENT_TYPES:
                self.unknown_events += 1
            return
        event = read_event(record)
        if event is None:
            self.bad_events += 1
            return
        handler(self, event)

    def apply_all(self, records: Iterable[object]) -> DashboardState:
        for record in records:
            self.apply(record)
        return self

    # -- recoveries ----------------------------------------------------------------------------

    def _recovery_of(self, e: ev.RecoveryEvent, start: float | None = None) -> Recovery | None:
        """The recovery of `e`'s id, opened by the first event that carries it (starting at `start`, a
        phase's beginning, else at `e.t`); None for an event without an id."""
        if e.recovery is None:
            return None
        rec = self._recovery_by_id.get(e.recovery)
        if rec is None:
            rec = self._recovery_by_id[e.recovery] = Recovery(e.t if start is None else start, id=e.recovery)
            self.recoveries.append(rec)
        superseded = self._recovery_by_id.get(e.supersedes) if e.supersedes is not None else None
        if superseded is not None and superseded is not rec and not superseded.done:
            superseded.t_end, superseded.outcome = e.t, "interrupted"
        if e.phase is not None:
            rec.phase = e.phase
            rec.restarted = rec.restarted or e.phase == "restarting"
        return rec

    @staticmethod
    def _close(rec: Recovery, t: float, outcome: str) -> None:
        rec.t_end, rec.outcome = t, outcome

    # -- handlers, one per kind --------------------------------------------------------------

    def _job_started(self, e: ev.JobStarted) -> None:
        self.t_start = e.t
        self.job_id, self.backend, self.recipe, self.recipe_path = e.job_id, e.backend, e.recipe, e.recipe_path
        self.f, self.total_steps, self.slurm_job_id = e.f, e.steps, e.slurm_job_id
        self.status = "running"
        for name in e.nodes or []:
            self._node(name)
        for name in e.spares or []:
            self._node(name).state = "spare"
        where = f" on {self.backend}" if self.backend else ""
        self._log(e.t, e.kind, f"job {self.job_id or '?'} started{where}, {len(self.nodes)} nodes")

    def _job_finished(self, e: ev.JobFinished) -> None:
        self.t_end = e.t
        self.status = e.status or "finished"
        self.exit_code = e.exit_code
        code = f" (exit {self.exit_code})" if self.exit_code is not None else ""
        self._log(e.t, e.kind, f"job {self.status}{code}")

    def _slurm_job(self, e: ev.SlurmJob) -> None:
        self.slurm_job_id = e.slurm_job_id or self.slurm_job_id
        if e.state != self.slurm_state:
            self.slurm_state = e.state
            self._log(e.t, e.kind, f"Slurm job {self.slurm_job_id or ''} {e.state}".replace("  ", " "))

    def _plan(self, e: ev.Plan) -> None:
        self.generation = e.generation
        self.plan_reason = e.reason
        pipelines: list[PipelineView] = []
        for p in e.pipelines:
            stages = [StageView(s.layers, s.node, s.rank, len(s.workers or ()) or 1) for s in p.stages or []]
            nodes = p.nodes or _unique(s.node for s in stages if s.node)
            pipelines.append(PipelineView(p.id if p.id is not None else len(pipelines), nodes, stages, p.microbatches))
        self.pipelines = pipelines
        rec = self._recovery_of(e)
        if rec is not None:
            rec.plan_reason = e.reason
        for name in e.spares or []:
            if self._node(name).state != "lost":
                self._node(name).state = "spare"
        in_use = {n for p in pipelines for n in p.nodes}
        for name in in_use:
            node = self._node(name)
            if node.state in ("spare", "joining"):
                node.state = "healthy"
        for node in self.nodes.values():
            # A node outside every pipeline that is not known to be lost waits as a spare.
            if node.name not in in_use and node.state in ("healthy", "joining"):
                node.state = "spare"
        templates = ", ".join(str(len(p.stages) or len(p.nodes)) for p in pipelines)
        self._log(e.t, e.kind, f"plan gen {_fmt(self.generation)} ({self.plan_reason or '?'}): "
                  f"{len(pipelines)} pipelines, stages [{templates}]")

    def _takeover(self, e: ev.Takeover) -> None:
        lost = f"; agents not back: {', '.join(e.lost)}" if e.lost else ""
        age = f"{e.lease_age:.2f} s" if e.lease_age is not None else "?"
        self._log(e.t, e.kind, f"a standby supervisor took over (epoch {e.epoch}, the lease {age} old){lost}")

    def _eval(self, e: ev.Eval) -> None:
        t = self.evals[e.step][0] if e.step in self.evals else e.t
        self.evals[e.step] = (t, e.loss)
        self._log(e.t, e.kind, f"eval after {e.step} steps: loss {e.loss:.4f}")

    @property
    def eval_loss(self) -> float | None:
        """The latest validation loss."""
        return self.evals[max(self.evals)][1] if self.evals else None

    def _step(self, e: ev.Step) -> None:
        self.step = e.step
        self.loss = e.loss if e.loss is not None else self.loss
        self.samples_per_s = e.samples_per_s if e.samples_per_s is not None else self.samples_per_s
        self.step_time = e.seconds if e.seconds is not None else self.step_time
        self.tokens_per_s_per_device = (e.tokens_per_s_per_device if e.tokens_per_s_per_device is not None
                                        else self.tokens_per_s_per_device)
        self.mfu = e.mfu if e.mfu is not None else self.mfu
        self.history.append(StepPoint(e.t, e.step, e.loss, e.samples_per_s, e.seconds, e.tokens_per_s_per_device,
                                      e.mfu))
        if self.status in ("waiting", "recovering") and self.current_recovery is None:
            self.status = "running"
        times = dict(enumerate(e.pipeline_seconds or []))
        for p in self.pipelines:
            if p.id in times:
                p.time = times[p.id]

    def _node_event(self, e: ev.Node) -> None:
        node = self._node(e.node)
        if e.state is not None and e.state != node.state:
            if e.state in ("suspect", "lost") or node.state in ("suspect", "lost"):
                self._log(e.t, "node", f"{e.node} {node.state} -> {e.state}")
            node.state = e.state
        node.heartbeat_age, node.cpu, node.gpu = e.heartbeat_age, e.cpu, e.gpu
        if e.workers is not None:
            node.workers = list(e.workers)
        node.slurm_state = e.slurm_state or node.slurm_state
        node.cause = e.cause or (node.cause if node.state == "lost" else None)

    def _failure(self, e: ev.Failure) -> None:
        for name in e.nodes:
            self._node(name).state = "lost"
            self._node(name).cause = self._node(name).cause or e.cause
        rec = self._recovery_of(e)
        during = False
        if rec is not None:
            # A node lost while the change runs: the same recovery, now for one more node.
            during = bool(rec.phases) or any(n not in e.nodes for n in rec.nodes)
            rec.nodes += [n for n in e.nodes if n not in rec.nodes]
            rec.cause = rec.cause or e.cause
            rec.step = rec.step if rec.step is not None else e.step
            rec.generation = rec.generation if rec.generation is not None else e.generation
            self.status = "recovering"
        where = f" at step {e.step}" if e.step is not None else " during recovery" if during else ""
        self._log(e.t, e.kind, f"{', '.join(e.nodes) or 'node'} lost ({e.cause or '?'}){where}")

    def _out_of_memory(self, e: ev.OutOfMemory) -> None:
        held = f": {_bytes(e.allocated)} of {_bytes(e.capacity)}" if e.capacity is not None else ""
        self._log(e.t, e.kind, f"{e.node}:{e.worker} ran out of device memory ({e.phase}, step {e.step}){held}")

    def _loss_spike_stop(self, e: ev.LossSpikeStop) -> None:
        self._log(e.t, e.kind, e.message or f"training.loss_spike: spikes at steps {e.spikes}: stopping")

    def _loss_spike_rollback(self, e: ev.LossSpikeRollback) -> None:
        self._log(e.t, e.kind, f"loss spikes at steps {e.spikes}: rolling back to the checkpoint of step "
                  f"{e.checkpoint}, {e.skipped_samples} samples skipped")

    def _collective_error(self, e: ev.CollectiveError) -> None:
        rec = self._recovery_of(e)
        if rec is not None:
            rec.reformed = True  # unless a loss explains the errors: then `failure` events follow
            rec.generation = rec.generation if rec.generation is not None else e.generation
        self._log(e.t, e.kind, f"collective error on {', '.join(e.nodes) or '?'} at step {_fmt(e.step)}")

    def _reform(self, e: ev.Reform) -> None:
        rec = self._recovery_of(e)
        if rec is not None:
            rec.reformed = True
            rec.cause = rec.cause or e.cause
            rec.step = rec.step if rec.step is not None else e.step
            rec.generation = rec.generation if rec.generation is not None else e.generation
            self.status = "recovering"
        self._log(e.t, e.kind, f"re-forming the same members at step {_fmt(e.step)} ({e.cause or '?'})")

    def _phase(self, e: ev.Detection | ev.Replan | ev.GroupRebuild | ev.StateCopy | ev.Replay) -> None:
        seconds = e.seconds
        rec = self._recovery_of(e, e.t - seconds)
        if rec is not None:
            if isinstance(e, ev.Detection):
                rec.t_start = min(rec.t_start, e.t - seconds)
            rec.phases[e.kind] = rec.phases.get(e.kind, 0.0) + seconds
            if isinstance(e, ev.StateCopy):
                rec.state_bytes = e.bytes
            if rec.trigger == "failure":
                self.status = "recovering"
        detail = ""
        if isinstance(e, ev.StateCopy) and e.bytes is not None:
            detail = _bytes(e.bytes)
        elif isinstance(e, ev.Replay) and e.step is not None:
            detail = f"step {e.step}"
        self._log(e.t, e.kind, detail, seconds)

    def _resumed(self, e: ev.Resumed) -> None:
        rec = self._recovery_of(e)
        if rec is not None:
            self._close(rec, e.t, "resumed")
            rec.total_seconds = e.total_seconds
            rec.resumed_generation = e.generation
        if self.status == "recovering":
            self.status = "running"
        self._log(e.t, e.kind, f"at step {e.step}, gen {_fmt(e.generation)}", rec.seconds if rec else e.total_seconds)

    def _checkpoint_fallback(self, e: ev.CheckpointFallback) -> None:
        self.fallback_reason = e.reason
        rec = self._recovery_of(e)
        if rec is not None:
            rec.fallback = e.reason
            self._close(rec, e.t, "fallback")
        self._log(e.t, e.kind, f"falling back to checkpoint: {self.fallback_reason}")

    def _run_complete(self, e: ev.RunComplete) -> None:
        rec = self._recovery_of(e)
        if rec is not None:
            self._close(rec, e.t, "run_complete")
        self._log(e.t, e.kind, f"run complete: {e.note or ''}")

    def _replacement_requested(self, e: ev.ReplacementRequested) -> None:
        if e.node:
            self._node(e.node).state = "joining"
            self._log(e.t, e.kind, f"replacement requested: {e.node}")
        else:
            self._log(e.t, e.kind, f"replacement requested: Slurm job {_fmt(e.slurm_job)}")

    def _node_joined(self, e: ev.NodeJoined) -> None:
        self._recovery_of(e)
        node = self._node(e.node)
        if node.state in ("lost", "spare"):
            node.state = "joining"
        self._log(e.t, e.kind, f"{e.node} joined", e.seconds)

    def _health_check(self, e: ev.HealthCheck) -> None:
        if not e.ok:
            self._node(e.node).state = "suspect"
        self._log(e.t, e.kind, f"{e.node} {'ok' if e.ok else 'FAILED'}", e.seconds)

    def _preflight(self, e: ev.Preflight) -> None:
        if not e.admitted:
            self._node(e.node).state = "suspect"
        shown = ", ".join(f"{k} {v:.4g}" for k, v in (e.figures or {}).items())
        self._log(e.t, e.kind, f"{e.node} {'admitted' if e.admitted else 'REFUSED: ' + (e.reason or '?')} ({shown})",
                  e.seconds)

    def _checkpoint(self, e: ev.Checkpoint) -> None:
        if e.ok is False:
            by = f" by {e.worker}" if e.worker else ""
            self._log(e.t, e.kind, f"step {_fmt(e.step)} FAILED{by}: {e.detail or '?'}")
            return
        cp = Checkpoint(e.t, e.step, e.seconds, e.path)
        self.checkpoints.append(cp)
        self._log(e.t, e.kind, f"step {_fmt(cp.step)}" + (" (on demand)" if e.on_demand else ""), cp.seconds)

    def _node_lost(self, e: ev.NodeLost) -> None:
        self._recovery_of(e)  # the coordinator's (a hung member) belongs to its change; a `failure` follows
        node = self._node(e.node)
        node.state, node.cause = "lost", e.cause
        self._log(e.t, e.kind, f"{e.node}: {e.cause}" + (f" ({e.detail})" if e.detail else ""),
                  e.detection_seconds)

    # -- detection (supervisor/health_monitor.py): scores, flagged machines, stragglers

    def _health(self, e: ev.Health) -> None:
        scores, metrics, slow = e.scores or {}, e.metrics or {}, e.slowdowns or {}
        for name, node in self.nodes.items():
            if name in scores or name in slow:
                node.health_score, node.health_metric, node.slowdown = scores.get(name), metrics.get(name), slow.get(name)

    def _faulty_node(self, e: ev.FaultyNode) -> None:
        self._node(e.node).flagged = e.action
        self._log(e.t, e.kind, f"{e.node} flagged ({e.action}): {e.detail or '?'}")

    def _straggler(self, e: ev.Straggler) -> None:
        slow = e.nodes or {}
        if e.action == "rebalance":  # a rebalance names every slow node: the others are back to normal
            for node in self.nodes.values():
                if node.straggler == "rebalance" and node.name not in slow:
                    node.straggler = None
        for name, factor in slow.items():
            node = self._node(name)
            node.straggler, node.slowdown = e.action, factor if factor is not None else node.slowdown
        named = ", ".join(f"{n} x{f:.2f}" if f is not None else n for n, f in slow.items())
        self._log(e.t, e.kind, f"{e.action}: {named or 'no straggler left'}")

    def _note(self, e: ev.Event) -> None:
        """Kinds shown as a line in the events panel and nothing else."""
        seconds = e.seconds if isinstance(e, ev.AgentsReady) else None
        self._log(e.t, e.kind, _NOTES[e.kind](e), seconds)

    # -- helpers -----------------------------------------------------------------------------

    def _node(self, name: str) -> NodeView:
        if name not in self.nodes:
            self.nodes[name] = NodeView(name)
        return self.nodes[name]

    def _log(self, t: float, kind: str, text: str, seconds: float | None = None) -> None:
        self.log.append(LogLine(t, kind, text, seconds))
        if len(self.log) > MAX_LOG_LINES:
            del self.log[: len(self.log) - MAX_LOG_LINES]


_NOTES: dict[str, Callable[[Any], str]] = {
    "agents_ready": lambda e: f"{len(e.nodes)} agents ready",
    "done": lambda e: "training done" + (f": {e.note}" if e.note else ""),
    "fault_injected": lambda e: f"drill: {e.how} on {e.node}",
    "checkpoint_requested": lambda e: f"checkpoint requested ({e.reason})",
    "preempt_notice": lambda e: f"preemption notice from {e.node or '?'}",
    "slurm_unreachable": lambda e: f"Slurm unreachable: {e.error}",
    "refused": lambda e: f"refused {e.peer}: {e.reason}",
    "store_rejected": lambda e: f"store: refused {e.key} ({e.reason}, {e.reader or '?'})",
    "drill": lambda e: f"scripted drill at step {_fmt(e.step)}: {e.how} on {e.node}",
    "metrics_logger": lambda e: (f"{e.logger} not started: {e.error}" if e.error else
                                 f"{e.logger} logging" + (f" to run {e.run_id}" if e.run_id else "")),
    "trace_requested": lambda e: f"profiler: every worker traces steps {e.start}..{e.stop - 1}",
    "trace_written": lambda e: f"trace of {e.node} (rank {_fmt(e.rank)}) written",
    "hang_dump": lambda e: (f"hang dumps of {len(e.dumped or [])} workers in {e.folder}"
                            + (f", missing {', '.join(e.missing)}" if e.missing else "")),
}

_HANDLERS: dict[str, Callable[[DashboardState, Any], None]] = {
    "job_started": DashboardState._job_started,
    "job_finished": DashboardState._job_finished,
    "slurm_job": DashboardState._slurm_job,
    "plan": DashboardState._plan,
    "step": DashboardState._step,
    "eval": DashboardState._eval,
    "takeover": DashboardState._takeover,
    "node": DashboardState._node_event,
    "failure": DashboardState._failure,
    "out_of_memory": DashboardState._out_of_memory,
    "loss_spike_stop": DashboardState._loss_spike_stop,
    "loss_spike_rollback": DashboardState._loss_spike_rollback,
    "collective_error": DashboardState._collective_error,
    "reform": DashboardState._reform,
    **{phase: DashboardState._phase for phase in PHASES},
    "resumed": DashboardState._resumed,
    "checkpoint_fallback": DashboardState._checkpoint_fallback,
    "run_complete": DashboardState._run_complete,
    "replacement_requested": DashboardState._replacement_requested,
    "node_joined": DashboardState._node_joined,
    "health_check": DashboardState._health_check,
    "preflight": DashboardState._preflight,
    "checkpoint": DashboardState._checkpoint,
    "node_lost": DashboardState._node_lost,
    "health": DashboardState._health,
    "faulty_node": DashboardState._faulty_node,
    "straggler": DashboardState._straggler,
    **{kind: DashboardState._note for kind in _NOTES},
}
REDUCED_KINDS = frozenset(_HANDLERS)


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _fmt(value: Any) -> str:
    return "-" if value is None else str(value)


def _bytes(n: int | None) -> str:
    """Human size, for the events panel (`384.0 MiB`)."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
