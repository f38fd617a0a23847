"""Coordinator: membership, generations, and driving a reconfiguration. Independent of how worker
processes are started: a `NodeBackend` (agent_nodes.py) starts them and reports their losses. Its
phases and decisions are pure (decisions.py: `Phase`, `on_tick`, `decide`); this module observes the
store and the backend, carries the decisions out and writes the events (each event of a membership
change carries its `recovery` id and the `phase`). Modelled on torchelastic's rendezvous and
torchft's manager: the coordinator owns the store and the plan; workers only follow `gen{g}/...` keys
(protocol/keys.py; engine/elastic_process.py).

On a membership change in generation g (a node's processes died, a timeout, or a node joins):
1. set `gen{g}/failed`: every survivor leaves g's collectives at once (abortable waits);
2. collect the survivors' reports (step, valid layers); new deaths meanwhile join the lost set;
3. `decide` (pure; `reconfigure` inside) -> new plan + layer copies, or a checkpoint fallback; resume at
   the largest reported step (ranks one step behind complete the step they hold pending, see
   engine/recovery.py);
4. publish `gen{g+1}/config`; survivors build new groups and copy layers; training goes on.
If recovery is impossible (a layer lost every replica, too few pipelines) or the mode is
"checkpoint", every worker is stopped and restarted from the last complete checkpoint.

A collective can also fail with no node lost (a collective timeout on a loaded machine, a transient
network error, or a rank hung inside a step after its first collective). Workers report such errors
(`gen{g}/errors`, `gen{g}/error/{node}`); if no loss explains them within the heartbeat lease (a dead
or frozen node is named within it), the same members re-form under generation g+1 (a `reform`). A
member that does not leave the aborted generation within the step timeout is hung (its peers left in
milliseconds): it is lost like a dead one. Every timeout and poll period is the job's
(`CoordinatorConfig.timeouts`, timeouts.py). When it gives up it raises a CoordinatorError:
`CannotContinue` (no recovery and no checkpoint: unrecoverable, no requeue) or `CoordinatorTimeout`
(the run timed out: a requeue may help); see errors.py.
On a preemption notice (see preemption.py) the same abort collects every worker's step; the next
generation's config says `stop` with `save`: each worker reaches the largest reported step, writes its
layers as an on-demand checkpoint of that step, and exits 0; a requeued job resumes from it.
A worker that runs out of device memory reports it before it exits (`gen{g}/oom/{worker}`): its node's
loss is named `out_of_memory`, and `decide` restarts from a checkpoint (it happened while layers were
copied in memory) or gives up (CannotContinue): elsewhere the plan does not fit, and would not again.
training.loss_spike with `on_consecutive: rollback`: workers that judged `max_consecutive` spikes in a
row record it (`gen{g}/loss_spikes/{worker}`), flag it as a generation error and wait; the coordinator
fails g and carries out `decisions.loss_spike_action` (`_rollback`: every worker loads an earlier
checkpoint, whose data cursor it moves past the spikes' samples, in g+1) or stops the job.
Events (events.jsonl): failure, detection, collective_error, reform, node_lost (a hung member named
here), replan, plan, group_rebuild, state_copy, replay, resumed, node_joined, run_complete,
checkpoint, checkpoint_fallback, loss_spike_rollback, checkpoint_requested, done.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from oobleck_slurm.detection.health import Rebalance
from oobleck_slurm.engine.checkpoint import (
    complete_steps,
    latest_complete,
    layer_file,
    prune,
    read_data_record,
    step_dir,
    write_data_record,
)
from oobleck_slurm.engine.from_planner import exec_plan
from oobleck_slurm.errors import JobTimeoutError, OobleckError, UnrecoverableError
from oobleck_slurm.planning import Plan, PlanningError, instantiate
from oobleck_slurm.planning.instantiate import NodeId
from oobleck_slurm.planning.reconfigure import (
    Device,
    Reconfiguration,
    pipeline_slowdowns,
    rebalance,
    stage_devices,
)
from oobleck_slurm.planning.templates import PipelineTemplate
from oobleck_slurm.protocol import keys, records
from oobleck_slurm.protocol.events import EventLog, read_events
from oobleck_slurm.protocol.records import (
    CheckpointRef,
    Failed,
    GenerationConfig,
    LossSpikeStop,
    OutOfMemory,
    Rebuilt,
    RecoveryState,
    SupervisorState,
    WorkerError,
    WorkerReport,
)
from oobleck_slurm.supervisor.decisions import (
    Change,
    CheckpointAndStop,
    Collected,
    Complete,
    Fallback,
    Finish,
    GiveUp,
    Observation,
    Phase,
    Policy,
    Rollback,
    decide,
    on_tick,
    resume_step,
    step_to_log,
    transition,
    unreachable,
    whole_holders,
)
from oobleck_slurm.supervisor.hang_dumps import HangDumps
from oobleck_slurm.supervisor.membership import Loss, LossCause
from oobleck_slurm.supervisor.observer import StoreObserver, StoreView
from oobleck_slurm.supervisor.preemption import Preemption
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS, JobTimeouts


class NodeBackend(Protocol):
    """How worker processes of virtual or real nodes are started and watched."""

    def start(self, node: str) -> None: ...
    def exited(self) -> dict[str, Loss | None]: ...  # node -> its Loss, or None once its workers finished
    def stop(self, nodes: Sequence[str]) -> None: ...  # kill -9 and reap (no exit reported)
    def new_node(self) -> str | None: ...  # a replacement node id, or None if none can be had
    def rebalances(self) -> list[Rebalance]: ...  # straggler decisions since the last call (detection/health.py)


class CoordinatorError(OobleckError, RuntimeError):
    """The coordinator gave up; the subclass says whether a requeue may help, the message why."""


class CannotContinue(CoordinatorError, UnrecoverableError):
    """Training cannot go on: no recovery from the survivors and no complete checkpoint, or too few
    live nodes to hold the model. Exit EXIT_UNRECOVERABLE, never requeued."""


class CoordinatorTimeout(CoordinatorError, JobTimeoutError):
    """The run exceeded `run_timeout`: a requeue resumes from the last complete checkpoint."""


@dataclass(frozen=True)
class CoordinatorConfig:
    f: int
    replacement: bool = False  # ask the backend for a new node after each loss
    mode: str = "memory"  # "memory": checkpoint-free recovery; "checkpoint": always restart from one
    checkpoint_dir: str = ""
    keep_checkpoints: int = 0  # complete checkpoints kept (engine/checkpoint.prune); 0: every one
    max_rollbacks: int = 0  # training.loss_spike rollbacks (decisions.loss_spike_action); 0: stop
    devices_per_node: int = 1
    # Used here: reconfiguration_timeout (collecting reports after an abort), run_timeout,
    # checkpoint_timeout (an on-demand checkpoint, from request to complete), heartbeat_lease (a worker's
    # collective error that no node loss explains within it re-forms the generation), step_timeout (after
    # a re-form, a member still in the aborted generation this long later is hung), coordinator_poll,
    # checkpoint_poll.
    timeouts: JobTimeouts = DEFAULT_TIMEOUTS


@dataclass
class _Recovery:
    """A published recovery until its first step completes (phases REBUILDING/RESTARTING, REPLAYING)."""

    id: int  # the events' `recovery`: the generation after the aborted one (unique per change)
    generation: int  # the generation it published
    t_start: float  # kill time if known, else detection time
    step: int
    started: float = field(default_factory=time.time)
    rebuilt_at: float = 0.0
    joined: tuple[str, ...] = ()


def str_nodes(plan: Plan) -> Plan:
    """The same plan with node ids as strings: the store, the events and argv all speak strings."""
    return replace(plan, pipelines=tuple(replace(p, nodes=tuple(map(str, p.nodes))) for p in plan.pipelines),
                   spare_nodes=tuple(map(str, plan.spare_nodes)))


def plan_event(plan: Plan, generation: int, reason: str, members: list[str], workers_per_node: int = 1) -> dict[str, Any]:
    """The `plan` event: each pipeline's stages with their node, first worker (device) and rank, and all
    of the stage's workers and ranks (a stage of several devices: consecutive workers of its node)."""
    index = {n: i for i, n in enumerate(members)}

    def first_rank(dev: Device) -> int:
        return index[str(dev[0])] * workers_per_node + dev[1]
    return {
        "generation": generation, "reason": reason, "workers_per_node": workers_per_node,
        "ranks": len(members) * workers_per_node,
        "pipelines": [
            {"id": i, "nodes": list(p.nodes), "microbatches": p.microbatches,
             # memory_bytes: the planner's memory model of the stage, to set against the measured peak
             # (the step event's peak_memory on GPUs)
             "stages": [{"layers": [ls.start, ls.stop], "node": dev[0], "worker": dev[1], "rank": first_rank(dev),
                         "workers": list(range(dev[1], dev[1] + stage.devices)),
                         "ranks": list(range(first_rank(dev), first_rank(dev) + stage.devices)),
                         "memory_bytes": stage.memory_bytes, "kept": stage.keep}
                        for (dev, ls), stage in zip(stage_devices(p), p.template.stages)]}
            for i, p in enumerate(plan.pipelines)
        ],
        "spares": list(plan.spare_nodes),
    }


class Coordinator:
    """The thin runtime around decisions.py: observes the backend and the store (the store observer's
    view, observer.py; what it acts on it reads itself), asks the pure decisions what to do, carries it
    out, and writes the events. Its phase (`self.phase`) changes only through `decisions.transition`."""

    def __init__(self, store: dist.Store, backend: NodeBackend, templates: Sequence[PipelineTemplate],
                 plan: Plan, layer_keys: list[str], log: EventLog, config: CoordinatorConfig,
                 observer: StoreObserver, layer_bytes: Sequence[int] | None = None, total_steps: int | None = None,
                 state_file: Path | None = None, epoch: int = 1) -> None:
        """`store`: the coordinator's client, for what it writes and what it must read fresh (reports,
        rebuilt records, a failed generation's progress); `observer`: the job's one poller of the store
        (started by the caller), whose view the loop reads for its periodic observations."""
        if observer.workers_per_node != config.devices_per_node:
            raise ValueError(f"the store observer watches {observer.workers_per_node} worker(s) per node, "
                             f"the job has {config.devices_per_node}")
        self.store, self.backend, self.observer = store, backend, observer
        self.state_file, self.epoch = state_file, epoch  # the durable state, and this supervisor's fencing token
        # Called before the durable state is written or a generation published: leaves the process if
        # another supervisor holds a higher epoch (main.LeaseKeeper.check); none in unit tests.
        self.fence: Callable[[], None] = lambda: None
        self.plan, self.keys, self.log, self.cfg = str_nodes(plan), layer_keys, log, config
        self.policy = Policy(tuple(templates), config.f, layer_bytes, config.replacement, config.max_rollbacks)
        self.total_steps = total_steps
        self.phase = Phase.RUNNING
        self.gen = 0
        self.start_step = 0  # the step the current generation starts (resumes) at
        self.members: list[str] = []
        self.finished: set[str] = set()
        self.losses: dict[str, Loss] = {}  # node -> how it was lost (the failure event's cause)
        self.recovery: _Recovery | None = None
        self.pending_joins: dict[str, float] = {}
        self.checkpoints_seen: set[int] = set()
        self.errors_seen: tuple[int, float] | None = None  # (generation, when its first error was seen)
        self.reforms: dict[int, int] = {}  # resume step -> re-forms that resumed there
        # training.loss_spike rollbacks this job made: its limit holds across the supervisor's takeovers and
        # Slurm's requeues, so they are counted from the job's own log (a --resume-from job starts afresh)
        self.rollbacks = len(read_events(log.path, "loss_spike_rollback"))
        self.trained = False  # a step completed, or the job started from a checkpoint (not the seed's state)
        self._rebalance_due = False  # a rebalance decision not yet carried out
        self.slowdown: dict[NodeId, float] = {}  # stragglers awaiting a rebalance: node -> compute time over peers'
        self._supersedes: int | None = None  # an unfinished recovery that the change being collected replaces
        self._next_checkpoint_look = 0.0
        self.preemption = Preemption()  # replaced by the supervisor's, which its signal handler sets
        self.hang_dumps: HangDumps | None = None  # set by the supervisor: dumps before a hung member's stop

    # ---- phase and events --------------------------------------------------------------------------

    def _to(self, phase: Phase) -> None:
        self.phase = transition(self.phase, phase)
        self._persist()

    def _persist(self) -> None:
        """Rewrite the job folder's supervisor state (records.SupervisorState): what a supervisor taking
        over could not rebuild from the agents and workers."""
        if self.state_file is None or not self.members:
            return
        self.fence()
        r = self.recovery
        records.write_state(self.state_file, SupervisorState(
            epoch=self.epoch, generation=self.gen, members=tuple(self.members), plan=self.plan.to_dict(),
            start_step=self.start_step, phase=str(self.phase), finished=tuple(sorted(self.finished)),
            recovery=None if r is None else RecoveryState(id=r.id, generation=r.generation, t_start=r.t_start,
                                                          step=r.step, started=r.started, joined=r.joined),
            pending_joins=dict(self.pending_joins), trained=self.trained))

    def _recovery_fields(self, recovery: int | None = None) -> dict[str, Any]:
        """The fields of an event of a membership change: its recovery id (by default the next
        generation's number: the id of the change that generation g's events lead to), the phase it was
        written in, and on the first one the recovery it supersedes."""
        fields: dict[str, Any] = {"recovery": recovery if recovery is not None else self.gen + 1,
                                  "phase": str(self.phase)}
        if self._supersedes is not None:
            fields["supersedes"], self._supersedes = self._supersedes, None
        return fields

    # ---- publishing generations ------------------------------------------------------------------

    def _members_of(self, plan: Plan) -> list[str]:
        return [str(n) for p in plan.pipelines for n in p.nodes] + [str(n) for n in plan.spare_nodes]

    def _publish(self, plan: Plan, source: str, resume_step: int, reason: str,
                 change: Reconfiguration | None = None, checkpoint: CheckpointRef | None = None,
                 recovery: int | None = None) -> None:
        self.fence()
        plan = str_nodes(plan)
        members = self._members_of(plan)
        d = self.cfg.devices_per_node
        index = {n: i for i, n in enumerate(members)}
        transfers = [[t.layer, index[str(t.src[0])] * d + t.src[1], index[str(t.dst[0])] * d + t.dst[1]]
                     for t in (change.transfers if change else ())]
        cfg = GenerationConfig(generation=self.gen, members=tuple(members), plan=exec_plan(plan, members, d).to_json(),
                               transfers=tuple((int(a), int(b), int(c)) for a, b, c in transfers),
                               resume_step=resume_step, source=source, checkpoint=checkpoint)
        self.plan, self.members, self.start_step = plan, members, resume_step
        records.put(self.store, cfg, self.gen)
        self._persist()
        self.store.set(keys.CURRENT_GEN, str(self.gen))
        if recovery is None:  # generation 0: no change led to it
            self.log.emit("plan", **plan_event(plan, self.gen, reason, members, d))
        else:
            self.log.emit("plan", **plan_event(plan, self.gen, reason, members, d), **self._recovery_fields(recovery))

    def start(self, from_checkpoint: bool = False) -> None:
        """Publish generation 0 and start every member: from the seed, or (`from_checkpoint`: the
        supervisor asks it of every run) from the newest complete checkpoint in `checkpoint_dir`."""
        self.store.set(keys.CURRENT_GEN, "0")
        self._start_members(from_checkpoint)

    def _start_members(self, from_checkpoint: bool) -> None:
        """Publish generation `self.gen` as a start (no change led to it) and start every member."""
        step = latest_complete(self.cfg.checkpoint_dir, self.keys) if from_checkpoint and self.cfg.checkpoint_dir else None
        if step is None:
            self._publish(self.plan, "seed", 0, "initial")
        else:
            self.trained = True
            self.checkpoints_seen.add(step)  # an earlier run's: not reported again as written
            self._publish(self.plan, "checkpoint", step, "requeue",
                          checkpoint=CheckpointRef(root=str(self.cfg.checkpoint_dir), step=step))
        for node in self.members:
            self.backend.start(node)

    def take_over(self, state: SupervisorState) -> None:
        """Go on as the job's supervisor after the one that wrote `state` was lost (this coordinator's
        store is new; the caller set its `current_gen` to state.generation before publishing it): the
        workers report their step and layers for that generation here, and it is recovered as after a
        re-form, from the replicas in memory (members whose agents did not come back are lost)."""
        self.gen, self.members, self.start_step = state.generation, list(state.members), state.start_step
        self.plan = str_nodes(Plan.from_dict(state.plan))
        self.finished, self.trained = set(state.finished), state.trained
        if not state.trained and state.recovery is None and not self._stepped_this_run():
            # Lost while the job started: workers may not have started (their start waits for the
            # pre-flight verdicts, held by the lost supervisor), and one that did not cannot report
            # for the generation. Start again as a job starts: stop what started, skip a generation
            # (no old worker joins the new rendezvous), and start every member from where the job
            # started (the seed, or the checkpoint of a requeue). Members whose agents did not come
            # back are lost, and their loss is handled before the first step, from the seed.
            self.backend.stop(list(self.members))
            self.gen += 1
            self.store.set(keys.CURRENT_GEN, str(self.gen))
            self._start_members(from_checkpoint=True)
            return
        kept = (Phase.REBUILDING, Phase.RESTARTING, Phase.REPLAYING)  # phases a change may interrupt
        self.phase = Phase(state.phase) if state.phase in {str(p) for p in kept} else Phase.RUNNING
        r = state.recovery
        if r is not None and any(e.get("recovery") == r.id for e in read_events(self.log.path, "resumed")):
            # The lost supervisor logged this recovery's end (resumed, its joins) and was killed before
            # its state said so: it is over, and its joins are not reported twice.
            r = None
            self.phase = Phase.RUNNING
        if r is not None:
            self.recovery = _Recovery(r.id, r.generation, r.t_start, r.step, started=r.started, joined=r.joined)
        self._change(Change(lost=(), joined=(), trigger="supervisor"))
        for node, asked in (state.pending_joins or {}).items():  # replacements on their way: they join later
            self.pending_joins[node] = asked
            self.backend.start(node)

    def _stepped_this_run(self) -> bool:
        """Whether this run logged a step (rank 0 logs each): the persisted state's `trained` is written
        only with a generation, so after a takeover in steady training it may still say no."""
        records = read_events(self.log.path)
        starts = [i for i, r in enumerate(records) if r["kind"] == "job_started"]
        return any(r["kind"] == "step" for r in records[(starts[-1] if starts else 0):])

    # ---- the loop ----------------------------------------------------------------------------------

    def run(self) -> None:
        """Drive the job until every member finished; raises CannotContinue if it cannot go on, and
        CoordinatorTimeout past the run timeout."""
        t_end = time.time() + self.cfg.timeouts.run_timeout
        while True:
            action = on_tick(self._observe())
            if isinstance(action, Finish):
                # A recovery that resumed and finished since the last view: its events, from a fresh one.
                self._next_checkpoint_look = 0.0  # and the final checkpoint, now complete
                self._watch_progress(self._seen(self.observer.fresh()))
                self._to(Phase.DONE)
                self.log.emit("done", generation=self.gen, note=action.note or None)
                return
            if isinstance(action, CheckpointAndStop):
                return self._checkpoint_and_stop()
            if isinstance(action, Change):
                self._change(action)
            self._watch_progress(self._seen())
            if time.time() > t_end:
                raise CoordinatorTimeout(f"run exceeded its timeout of {self.cfg.timeouts.run_timeout:g} s")
            time.sleep(self.cfg.timeouts.coordinator_poll)

    def _seen(self, view: StoreView | None = None) -> StoreView:
        """The store observer's latest view (or `view`) if it shows the current generation, else an
        empty one of it: just after a generation is published the observer may still show the last."""
        view = view if view is not None else self.observer.view
        return view if view.generation == self.gen else StoreView(generation=self.gen)

    def _observe(self) -> Observation:
        lost = tuple(self._exits())
        live = sum(1 for n in self.members if n not in self.finished)
        joins: tuple[str, ...] = ()
        step_running = last_step_near = False
        view = self._seen()
        if self.pending_joins and self.phase == Phase.RUNNING and not lost:
            step_running = view.first_step is not None
            progress = view.progress
            last_step_near = self.total_steps is not None and progress is not None and progress + 1 >= self.total_steps
            if step_running and not last_step_near and not self.finished:
                joins = tuple(n for n in self.pending_joins
                              if self.store.check(self._workers_keys(n, keys.worker_ready)))
        for decision in self.backend.rebalances():  # the latest names every slow node ({}: none left)
            self.slowdown = {str(n): float(f) for n, f in decision.slowdown.items() if n in self.members}
            # Decisions repeat (after every new generation): only a changed split is worth a new one.
            new = rebalance(self.plan, pipeline_slowdowns(self.plan, self.slowdown))
            self._rebalance_due = [p.microbatches for p in new.pipelines] != [p.microbatches for p in self.plan.pipelines]
        if self._rebalance_due and self.phase == Phase.RUNNING and not lost and not step_running:
            step_running = view.first_step is not None
            progress = view.progress
            last_step_near = self.total_steps is not None and progress is not None and progress + 1 >= self.total_steps
        # workers that wait for a loss-spike rollback flag their report as an error of the generation
        spike = not lost and view.errors is not None and self._loss_spike_stop(self.gen, self.members) is not None
        return Observation(self.phase, lost=lost, live=live, finished=bool(self.finished),
                           preemption=self.preemption.requested.is_set(),
                           errors_expired=not lost and not spike and self._unexplained_errors(view), ready_joins=joins,
                           step_running=step_running, last_step_near=last_step_near,
                           slowdown=tuple(sorted((str(n), f) for n, f in self.slowdown.items())) if self._rebalance_due else (),
                           loss_spike=spike)

    def _exits(self) -> list[str]:
        lost = []
        for node, loss in self.backend.exited().items():
            if loss is None:
                self.finished.add(node)
            elif node in self.pending_joins:
                del self.pending_joins[node]
                self.log.emit("failure", generation=self.gen, nodes=[node], cause=f"joining node lost: {loss.cause}",
                              detail=loss.detail, step=self._seen().progress)
            elif node in self.members:
                self.losses[node] = loss
                lost.append(node)
        return lost

    def _cause(self, lost: Collection[str]) -> str:
        """Why the nodes were lost: the causes of their losses (heartbeat lease, Slurm state, hung
        worker, agent connection, process exit), comma-separated."""
        return ",".join(sorted({str(self.losses[n].cause) for n in lost if n in self.losses})) or "process_exit"

    def _name_out_of_memory(self, g: int, lost: Collection[str]) -> tuple[tuple[str, str], ...]:
        """(worker, phase) of each worker of the `lost` nodes that reported running out of device memory
        in generation g before it exited (keys.out_of_memory); their nodes' losses are named so (the
        `failure` event's cause)."""
        found = []
        for node in lost:
            for worker in keys.node_workers(node, self.cfg.devices_per_node):
                report = records.get_if(self.store, OutOfMemory, g, worker)
                if report is None:
                    continue
                found.append((worker, report.phase))
                if node in self.losses and self.losses[node].cause is not LossCause.OUT_OF_MEMORY:
                    self.losses[node] = replace(self.losses[node], cause=LossCause.OUT_OF_MEMORY,
                                                detail=f"{worker}: {report.error} ({report.phase}, step {report.step})")
        return tuple(found)

    def _loss_spike_stop(self, g: int, nodes: Collection[str]) -> LossSpikeStop | None:
        """Why the workers of `nodes` stopped, if training.loss_spike stopped them in generation g
        (records.LossSpikeStop, written before they exit or wait for the rollback); else None."""
        for node in nodes:
            for worker in keys.node_workers(node, self.cfg.devices_per_node):
                if (report := records.get_if(self.store, LossSpikeStop, g, worker)) is not None:
                    return report
        return None

    def _workers_keys(self, node: str, key: Callable[[str], str]) -> list[str]:
        """`key(worker)` for every worker of `node`."""
        return [key(w) for w in keys.node_workers(node, self.cfg.devices_per_node)]

    def _log_step_completed_in_recovery(self, logged_next: int, resume: int,
                                        reports: dict[str, WorkerReport]) -> None:
        """Log the `step` event of a step that rank 0 did not log (decisions.step_to_log)."""
        if (last := step_to_log(logged_next, resume, reports.values())) is not None:
            self.log.emit("step", **last.result.event(last.generation, last.global_batch_size))

    def _progress(self) -> int | None:
        """The current generation's last completed step, read now (the observer's view may be a period
        old: a change reads it itself)."""
        return records.get_int(self.store, keys.progress(self.gen))

    def _unexplained_errors(self, view: StoreView) -> bool:
        """True once workers' collective errors in the current generation are a heartbeat lease old and
        no loss has explained them (a loss starts a new generation first)."""
        g = self.gen
        if view.errors is None:
            return False
        now = time.time()
        if self.errors_seen is None or self.errors_seen[0] != g:
            self.errors_seen = (g, now)
            errors = {w: e for n in self.members for w in keys.node_workers(n, self.cfg.devices_per_node)
                      if (e := records.get_if(self.store, WorkerError, g, w)) is not None}
            self.log.emit("collective_error", generation=g, nodes=sorted(errors), step=view.progress,
                          errors={n: e.error for n, e in errors.items()}, grace=self.cfg.timeouts.heartbeat_lease,
                          **self._recovery_fields())
        return now - self.errors_seen[1] >= self.cfg.timeouts.heartbeat_lease

    def _killed_at(self, nodes: Collection[str]) -> float | None:
        times = [float(self.store.get(keys.fault_time(n))) for n in nodes if self.store.check([keys.fault_time(n)])]
        return min(times) if times else None

    # ---- a membership change -----------------------------------------------------------------------

    def _change(self, change: Change) -> None:
        """Abort generation g, collect the survivors' reports, then carry out `decide`'s action."""
        g = self.gen
        t_detect = time.time()
        if self.recovery is not None:  # a failure during a recovery: this change supersedes it
            self._supersedes = self.recovery.id
        self._to(Phase.COLLECTING)
        lost, joined = list(change.lost), list(change.joined)
        self._name_out_of_memory(g, lost)
        cause = self._cause(lost) if lost else change.trigger
        records.put(self.store, Failed(lost=tuple(lost), joined=tuple(joined), cause=cause), g)
        progress = self._progress()
        self.trained = self.trained or progress is not None
        # The step in progress: after the generation's last completed one, or the one it started at (a
        # failure during a recovery, before the new generation completed a step, is not at step 0).
        next_step = progress + 1 if progress is not None else self.start_step
        t_kill = self._killed_at(lost) if lost else None
        if lost:
            self._failure_events(g, lost, cause, next_step, t_detect)
        reform = change.trigger == "collective_error"
        if reform:
            self.log.emit("reform", generation=g, cause=cause, step=next_step, **self._recovery_fields())
        reports, lost_set = self._collect_reports(g, frozenset(lost),
                                                  self.cfg.timeouts.step_timeout if reform else None)
        # A step trained if a worker says so (after a takeover the new store has no progress key yet).
        self.trained = self.trained or any(r.step > 0 or r.last_step is not None for r in reports.values())
        for n in joined:
            self.pending_joins.pop(n, None)
        t0 = time.perf_counter()
        holders: dict[Device, frozenset[int]] = {(n, local): frozenset(reports[keys.worker_id(n, local)].layers)
                   for n in self.members if n not in lost_set
                   for local in range(self.cfg.devices_per_node) if keys.worker_id(n, local) in reports}
        shards = {dev: {layer: (w, k) for layer, w, k in reports[keys.worker_id(str(dev[0]), dev[1])].shards}
                  for dev in holders}
        holders = whole_holders(holders, shards)
        steps = {w: r.step for w, r in reports.items() if r.layers}
        completable = frozenset(w for w, r in reports.items() if r.layers and r.completable)
        spike = self._loss_spike_stop(g, self.members)  # lost nodes' workers (stop) or waiting ones (rollback)
        root = self.cfg.checkpoint_dir
        collected = Collected(self.plan, lost_set, tuple(joined), steps, holders, completable=completable,
                              finished=bool(self.finished),
                              checkpoint_mode=self.cfg.mode == "checkpoint",
                              reforms_at_resume=self.reforms.get(resume_step(steps.values()), 0),
                              trained=self.trained, slowdown=change.slowdown,
                              out_of_memory=self._name_out_of_memory(g, sorted(lost_set)),
                              loss_spike_stop=spike.message if spike is not None else None,
                              loss_spikes=spike.spikes if spike is not None else (),
                              checkpoints=tuple(complete_steps(root, self.keys)) if spike is not None and root else (),
                              rollbacks=self.rollbacks)
        action = decide(collected, self.policy, g, cause)
        if isinstance(action, GiveUp):
            raise CannotContinue(f"cannot continue: {action.reason}")
        recovery_id = g + 1
        self.gen = g + 1
        if isinstance(action, Complete):
            records.put(self.store, GenerationConfig(generation=self.gen, stop=True), self.gen)
            self.store.set(keys.CURRENT_GEN, str(self.gen))
            self.log.emit("run_complete", generation=g, note=action.note, finished=sorted(self.finished),
                          **self._recovery_fields(recovery_id))
            self._to(Phase.ENDING)
            self.recovery = None
            return
        if isinstance(action, Fallback):
            return self._fallback(action.reason, lost_set, recovery_id)
        if isinstance(action, Rollback):
            return self._rollback(action, lost_set, recovery_id)
        if change.trigger == "rebalance":
            self._rebalance_due = False
        if action.reason == "reform":
            self.reforms[action.resume_step] = self.reforms.get(action.resume_step, 0) + 1
        rank0 = reports.get(keys.worker_id(self.members[0], 0)) if self.members else None
        logged = rank0.last_step.result.step + 1 if rank0 is not None and rank0.last_step is not None else 0
        self._log_step_completed_in_recovery(max(next_step, logged), action.resume_step, reports)
        self.log.emit("replan", generation=self.gen, seconds=time.perf_counter() - t0,
                      rules=list(action.change.rules), transfers=len(action.change.transfers),
                      resume_step=action.resume_step, survivor_steps=steps, **self._recovery_fields(recovery_id))
        self._publish(action.change.plan, action.source, action.resume_step, action.reason, action.change,
                      recovery=recovery_id)
        # A join whose recovery was interrupted (a re-form, a failure) completes with this one.
        unfinished = self.recovery.joined if self.recovery is not None else ()
        joining = tuple(dict.fromkeys(n for n in (*unfinished, *joined) if n not in lost_set))
        self.recovery = _Recovery(recovery_id, self.gen, t_kill or t_detect, action.resume_step, joined=joining)
        self._to(Phase.REBUILDING)
        for _ in range(action.replacements):
            node = self.backend.new_node()
            if node is None:
                break
            self.pending_joins[node] = time.time()
            self.backend.start(node)
        self._persist()  # the replacements asked for

    def _failure_events(self, g: int, nodes: list[str], cause: str, step: int | None, t_detect: float) -> None:
        t_kill = self._killed_at(nodes)
        # what a named cause saw (a worker's out-of-memory error); other losses are told by their cause
        detail = "; ".join(loss.detail for n in nodes if (loss := self.losses.get(n)) is not None
                           and loss.cause is LossCause.OUT_OF_MEMORY) or None
        self.log.emit("failure", generation=g, nodes=nodes, cause=cause, step=step, detail=detail,
                      **self._recovery_fields())
        self.log.emit("detection", generation=g, seconds=(t_detect - t_kill) if t_kill else 0.0,
                      known_kill_time=t_kill is not None, **self._recovery_fields())

    def _collect_reports(self, g: int, lost: frozenset[str], hung_after: float | None = None
                         ) -> tuple[dict[str, WorkerReport], frozenset[str]]:
        """Every worker's {step, layers} after leaving generation g, by worker id, from each live member
        node (a node counts once all its workers reported), and the lost nodes: `lost` and the deaths
        meanwhile. With `hung_after` (a re-form: the step timeout), nodes that have not left by then are
        hung: lost."""
        reports: dict[str, WorkerReport] = {}
        lost_now = set(lost)
        t_abort = time.time()
        deadline = t_abort + self.cfg.timeouts.reconfiguration_timeout
        hung_at = t_abort + hung_after if hung_after is not None else None
        while True:
            for n in self._exits():
                if n in lost_now:
                    continue
                if hung_after is not None and not lost_now:  # the loss a re-form was waiting for
                    self._failure_events(g, [n], self._cause([n]), None, time.time())
                else:
                    self.log.emit("failure", generation=g, nodes=[n], cause="process exit during recovery", step=None,
                                  **self._recovery_fields())
                lost_now.add(n)
            pending = [n for n in self.members if n not in lost_now and n not in self.finished]
            for n in pending:
                for w in keys.node_workers(n, self.cfg.devices_per_node):
                    if w not in reports and (report := records.get_if(self.store, WorkerReport, g, w)) is not None:
                        reports[w] = report
            late = [n for n in pending if not all(w in reports for w in keys.node_workers(n, self.cfg.devices_per_node))]
            if not late:
                return reports, frozenset(lost_now)
            if hung_at is not None and time.time() > hung_at:
                self._lose_hung(g, late, time.time() - t_abort)
                lost_now.update(late)
                hung_at = None
            elif time.time() > deadline:
                self.backend.stop(late)
                lost_now.update(late)
                self.log.emit("failure", generation=g, nodes=late, cause="no report within the reconfiguration "
                              f"timeout ({self.cfg.timeouts.reconfiguration_timeout} s)", step=None,
                              **self._recovery_fields())
            time.sleep(self.cfg.timeouts.coordinator_poll)

    def _lose_hung(self, g: int, late: list[str], waited: float) -> None:
        """Members that did not leave generation g while every peer did: hung inside the step."""
        if self.hang_dumps is not None:  # before they are stopped: what they and their peers were doing
            self.hang_dumps.collect(late, self.members)
        self.backend.stop(late)
        t_fault = self._killed_at(late)
        now = time.time()
        detail = (f"did not leave generation {g} within {waited:.1f} s of its abort (step timeout "
                  f"{self.cfg.timeouts.step_timeout:g} s) while its peers did: hung inside a step")
        for n in late:
            self.log.emit("node_lost", node=n, cause="hung", detail=detail, t=now,
                          detection_seconds=(now - t_fault) if t_fault else None, **self._recovery_fields())
        self._failure_events(g, late, "hung", None, now)

    def _fallback(self, reason: str, lost: frozenset[str], recovery_id: int) -> None:
        """Stop every worker and restart all live nodes from the last complete checkpoint."""
        self.log.emit("checkpoint_fallback", reason=reason, generation=self.gen, **self._recovery_fields(recovery_id))
        t_kill = self._killed_at(sorted(lost)) or time.time()
        live = [n for n in self.members if n not in lost] + list(self.pending_joins)
        self.pending_joins.clear()
        self.backend.stop(live)
        # Losses reported since the last look are losses too (the backend reports each once): a restart
        # on a dead node would wait for it until a re-form names it hung.
        late = [n for n in self._exits() if n not in lost]
        if late:
            self.log.emit("failure", generation=self.gen, nodes=late, cause=self._cause(late), step=None,
                          **self._recovery_fields(recovery_id))
            live = [n for n in live if n not in late]
        root = self.cfg.checkpoint_dir
        step = latest_complete(root, self.keys) if root else None
        if step is None:
            raise CannotContinue(f"cannot continue: {reason}; and no complete checkpoint exists in "
                                 f"{root or '(no checkpoint directory)'}")
        plan = self._plan_on(live, reason)
        # Stopping the old workers is asynchronous (their agents kill them): skip a generation, so that
        # none of them, waiting for the next config, joins the restarted workers' group rendezvous.
        self.gen += 1
        self._to(Phase.RESTARTING)
        restart_id = self.gen  # the restart is a recovery of its own (the fallback closed the in-memory one)
        self._publish(plan, "checkpoint", step, "failure", checkpoint=CheckpointRef(root=str(root), step=step),
                      recovery=restart_id)
        self.recovery = _Recovery(restart_id, self.gen, t_kill, step)
        self.trained = True
        for n in self.members:
            self.backend.start(n)

    def _rollback(self, action: Rollback, lost: frozenset[str], recovery_id: int) -> None:
        """training.loss_spike: every live worker (they wait in the aborted generation) restarts from
        the checkpoint of `action.checkpoint`, whose data record's cursor is moved past the samples of
        the steps from there to the last spike: the run then reads what step `action.data_step` would
        have read. Written into the checkpoint (durable: a requeue or a later fallback resumes the same
        way, and the data identity is unchanged); the newer checkpoints, of the abandoned trajectory,
        are deleted, else a requeue would resume from one of them."""
        root, c = self.cfg.checkpoint_dir, action.checkpoint
        record = read_data_record(root, c)
        if record is None:  # every checkpoint of a job records its data; one from before that cannot move
            raise CannotContinue(f"cannot continue: training.loss_spike rollback to the checkpoint of step {c}: "
                                 f"it has no data record ({step_dir(root, c)}), so its data cannot be skipped")
        gbs = int(record["global_batch_size"])
        skipped = (action.data_step - c) * gbs
        record["consumed_samples"] = int(record["consumed_samples"]) + skipped
        record["rollbacks"] = [*record.get("rollbacks", []), {"spikes": list(action.spikes), "data_step": action.data_step,
                                                             "skipped_samples": skipped}]
        self.fence()
        write_data_record(root, c, record)
        newer = sorted(int(d.name[4:]) for d in Path(root).glob("step*") if d.name[4:].isdigit() and int(d.name[4:]) > c)
        for s in newer:
            shutil.rmtree(step_dir(root, s), ignore_errors=True)
            self.checkpoints_seen.discard(s)
        self.rollbacks = action.number
        self.log.emit("loss_spike_rollback", generation=self.gen, step=action.spikes[-1], spikes=list(action.spikes),
                      checkpoint=c, data_step=action.data_step, skipped_samples=skipped, rollback=action.number,
                      max_rollbacks=self.cfg.max_rollbacks, discarded=newer, **self._recovery_fields(recovery_id))
        live = [n for n in self.members if n not in lost]
        plan = self.plan
        if lost:  # nodes lost meanwhile: a plan over the live ones (the same search as a fallback's)
            plan = self._plan_on(live, "training.loss_spike rollback")
        self._to(Phase.RESTARTING)
        self._publish(plan, "checkpoint", c, "rollback", checkpoint=CheckpointRef(root=str(root), step=c),
                      recovery=recovery_id)
        self.recovery = _Recovery(recovery_id, self.gen, time.time(), c)

    def _plan_on(self, live: list[str], reason: str) -> Plan:
        for f in range(self.cfg.f, -1, -1):
            try:
                return instantiate(self.policy.templates, live, f, self.plan.global_microbatches,
                                   microbatch_size=self.plan.microbatch_size)
            except PlanningError:
                continue
        raise CannotContinue(f"cannot continue: {reason}; {len(live)} live node(s) cannot hold the model")

    # ---- preemption: an on-demand checkpoint, then every worker stops ----------------------------

    def _checkpoint_and_stop(self) -> None:
        """Abort generation g (every worker reports its step), then publish a `stop` generation whose
        workers write the smallest reported step as a checkpoint; wait until it is complete."""
        g, t0 = self.gen, time.time()
        root = self.cfg.checkpoint_dir
        self._to(Phase.CHECKPOINTING)
        self.log.emit("checkpoint_requested", generation=g, reason="preemption or time limit")
        if not root:
            self.log.emit("checkpoint", step=None, ok=False, on_demand=True, detail="no checkpoint directory")
            return self._stopped(None)
        records.put(self.store, Failed(cause="checkpoint"), g)
        reports, _ = self._collect_reports(g, frozenset())
        steps = {w: r.step for w, r in reports.items() if r.layers}
        completable = [w for w, r in reports.items() if r.layers and r.completable]
        self.gen = g + 1
        if not steps:  # the notice came before any worker held layers: nothing to save
            records.put(self.store, GenerationConfig(generation=self.gen, stop=True), self.gen)
            self.log.emit("checkpoint", step=None, ok=False, on_demand=True, detail="no worker holds layers yet")
            return self._stopped(None)
        step = resume_step(steps.values())
        if behind := unreachable(steps, completable):
            records.put(self.store, GenerationConfig(generation=self.gen, stop=True), self.gen)
            self.log.emit("checkpoint", step=step, ok=False, on_demand=True,
                          detail=f"worker(s) {behind} cannot reach step {step}")
            return self._stopped(None)
        # With the plan and members: a wide stage gathers its layers to write them, through groups of
        # this generation (the last one's are aborted: its failed key is how the workers were stopped).
        d = self.cfg.devices_per_node
        records.put(self.store, GenerationConfig(
            generation=self.gen, stop=True, save=CheckpointRef(root=root, step=step), members=tuple(self.members),
            plan=exec_plan(self.plan, self.members, d).to_json()), self.gen)
        self.store.set(keys.CURRENT_GEN, str(self.gen))
        deadline = time.time() + self.cfg.timeouts.checkpoint_timeout
        while not all(layer_file(root, step, k).exists() for k in self.keys):
            if time.time() > deadline:
                self.log.emit("checkpoint", step=step, ok=False, on_demand=True,
                              detail=f"not complete within {self.cfg.timeouts.checkpoint_timeout:g} s")
                return self._stopped(None)
            time.sleep(self.cfg.timeouts.coordinator_poll)
        self.checkpoints_seen.add(step)
        self.log.emit("checkpoint", step=step, ok=True, on_demand=True, seconds=time.time() - t0,
                      path=str(step_dir(root, step)), pruned=self._prune() or None)
        self._stopped(step)

    def _stopped(self, step: int | None) -> None:
        self._to(Phase.DONE)
        self.preemption.step = step
        self.preemption.finished.set()

    # ---- events of a recovery in progress, checkpoints ---------------------------------------------

    def _watch_progress(self, view: StoreView) -> None:
        """A recovery's progress (its members rebuilt, its first step) as the observer's view of the
        current generation shows it; the checkpoint folder every checkpoint_poll."""
        r = self.recovery
        g = self.gen
        if r is not None and self.phase in (Phase.REBUILDING, Phase.RESTARTING):
            workers = [w for n in self.members for w in keys.node_workers(n, self.cfg.devices_per_node)]
            if view.rebuilt:  # every member's worker wrote its record: read them once
                info = [records.get(self.store, Rebuilt, g, w) for w in workers]
                self.log.emit("group_rebuild", generation=g, seconds=max(i.groups_s for i in info),
                              **self._recovery_fields(r.id))
                self.log.emit("state_copy", generation=g, seconds=max(i.copy_s for i in info),
                              bytes=sum(i.bytes for i in info), **self._recovery_fields(r.id))
                r.rebuilt_at = max(i.t for i in info)
                self._to(Phase.REPLAYING)
        if r is not None and self.phase == Phase.REPLAYING and (first := view.first_step) is not None:
            self.log.emit("replay", generation=g, step=first.step, seconds=first.t - r.rebuilt_at,
                          **self._recovery_fields(r.id))
            self.log.emit("resumed", generation=g, step=first.step, total_seconds=first.t - r.t_start,
                          **self._recovery_fields(r.id))
            for n in r.joined:
                self.log.emit("node_joined", node=n, generation=g, seconds=first.t - r.started,
                              **self._recovery_fields(r.id))
            self.recovery = None
            self._to(Phase.RUNNING)
        if self.cfg.checkpoint_dir and time.time() >= self._next_checkpoint_look:
            self._next_checkpoint_look = time.time() + self.cfg.timeouts.checkpoint_poll
            step = latest_complete(self.cfg.checkpoint_dir, self.keys)
            if step is not None and step not in self.checkpoints_seen:
                self.checkpoints_seen.add(step)
                d = step_dir(self.cfg.checkpoint_dir, step)
                secs = [float(p.read_text()) for p in Path(d).glob(".*.seconds")]
                self.log.emit("checkpoint", step=step, seconds=max(secs, default=0.0), path=str(d),
                              pruned=self._prune() or None)

    def _prune(self) -> list[int]:
        """Retention, once a newer checkpoint is complete. While workers may still be loading the
        checkpoint this generation started from (a restart that has not trained a step), it stays."""
        loading = {self.start_step} if self.phase in (Phase.RESTARTING, Phase.REPLAYING) else set()
        return prune(self.cfg.checkpoint_dir, self.keys, self.cfg.keep_checkpoints, loading)
