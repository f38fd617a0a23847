"""The coordinator's state machine and decisions, as pure functions: no store, no processes, no clock.

The coordinator (coordinator.py) observes the backend and the store, hands what it saw to these
functions, and carries out the action they return. Modelled on torchelastic's rendezvous, whose
join/exit decisions are pure ops returning an action. Tested exhaustively in
tests/supervisor/test_decisions.py.

Phases of a job (`Phase`, protocol/phases.py: the events carry them) and their transitions (`TRANSITIONS`):

    RUNNING        training in generation g           -> COLLECTING (a loss, a join, collective errors)
                                                       -> CHECKPOINTING (a preemption notice)
                                                       -> DONE (every member finished)
    COLLECTING     g aborted: survivors report their step and layers
                                                       -> REBUILDING (g+1 published)
                                                       -> RESTARTING (no in-memory recovery: checkpoint)
                                                       -> ENDING (a member finished the last step meanwhile)
    REBUILDING     g+1's workers build groups and copy the layers they lack
                                                       -> REPLAYING (every worker rebuilt)
    RESTARTING     every worker restarts from the last complete checkpoint (a loss-spike
                   rollback: from the one `loss_spike_action` chose)
                                                       -> REPLAYING (every worker rebuilt)
    REPLAYING      rebuilt: the first step of g+1 runs (a rolled-back step is replayed)
                                                       -> RUNNING (its first step completed)
    ENDING         the run ended during a change: members stop; their exits are awaited  -> DONE
    CHECKPOINTING  preemption: workers save the largest reported step and stop  -> DONE
    DONE           terminal

Workers that stop on training.loss_spike's `max_consecutive` spikes in a row (every rank at the same
step, each reporting why: records.LossSpikeStop) are not recovered as after a loss: the engine is exact,
so a recovery, from memory or a checkpoint, would replay into the same spikes. `loss_spike_action`:
with `on_consecutive: rollback` every worker restarts from the newest complete checkpoint at or before
the first spike with the data cursor moved past the last one (`Rollback`), at most `max_rollbacks` times;
else, or without such a checkpoint, the job stops (`GiveUp`, with their message).

A worker that ran out of device memory is a loss whose cause is named (`out_of_memory_action`): the
change restarts from a checkpoint if it happened while layers were copied in memory, and otherwise stops
the job (`GiveUp`): the same plan would fail the same way, however often it is recovered.

A new loss during REBUILDING, RESTARTING or REPLAYING starts the next recovery at once (-> COLLECTING),
superseding the unfinished one: failures during a recovery are the norm at scale, not an edge case.
A loss during COLLECTING joins the lost set of the change being collected.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from oobleck_slurm.errors import InternalError
from oobleck_slurm.planning import Plan
from oobleck_slurm.planning.reconfigure import (
    Device,
    Reconfiguration,
    RecoveryImpossible,
    pipeline_slowdowns,
    plan_copies,
    rebalance,
    reconfigure,
)
from oobleck_slurm.planning.templates import PipelineTemplate
from oobleck_slurm.protocol.phases import Phase
from oobleck_slurm.protocol.records import LastStep, WorkerReport

MAX_REFORMS_PER_STEP = 3  # re-forms that resume at the same step before the job stops trusting them


RECOVERING = frozenset({Phase.REBUILDING, Phase.RESTARTING, Phase.REPLAYING})

TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.RUNNING: frozenset({Phase.COLLECTING, Phase.CHECKPOINTING, Phase.DONE}),
    Phase.COLLECTING: frozenset({Phase.REBUILDING, Phase.RESTARTING, Phase.ENDING}),
    Phase.REBUILDING: frozenset({Phase.REPLAYING, Phase.COLLECTING, Phase.DONE}),
    Phase.RESTARTING: frozenset({Phase.REPLAYING, Phase.COLLECTING, Phase.DONE}),
    Phase.REPLAYING: frozenset({Phase.RUNNING, Phase.COLLECTING, Phase.DONE}),
    Phase.ENDING: frozenset({Phase.DONE}),
    Phase.CHECKPOINTING: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}


class IllegalTransition(InternalError, RuntimeError):
    """A phase change that the state machine does not allow: a bug in the coordinator, never input."""


def transition(current: Phase, target: Phase) -> Phase:
    if target not in TRANSITIONS[current]:
        raise IllegalTransition(f"coordinator phase {current} cannot go to {target}")
    return target


# ---- the loop: what to do this tick ---------------------------------------------------------------

@dataclass(frozen=True)
class Observation:
    """What the coordinator's loop saw in one tick."""

    phase: Phase
    lost: tuple[str, ...] = ()  # members lost since the last tick
    live: int = 1  # members that have not finished
    finished: bool = False  # some member completed the last step
    preemption: bool = False  # a preemption / time-limit notice is pending
    errors_expired: bool = False  # collective errors that no loss explained within the grace
    ready_joins: tuple[str, ...] = ()  # joining nodes whose workers are up and healthy
    step_running: bool = False  # the current generation completed a step (a join can be folded in)
    last_step_near: bool = False  # the run is at its last step (a join would only abort it)
    slowdown: tuple[tuple[str, float], ...] = ()  # stragglers to rebalance for: (node, compute time over peers')
    loss_spike: bool = False  # workers reported training.loss_spike's max_consecutive spikes and wait (rollback)


@dataclass(frozen=True)
class Wait:
    """Nothing to do this tick."""


@dataclass(frozen=True)
class Finish:
    note: str = ""


@dataclass(frozen=True)
class CheckpointAndStop:
    """Preemption: abort, have every worker save the largest reported step, stop."""


@dataclass(frozen=True)
class Change:
    """A membership change of the current generation: abort it and recover."""

    lost: tuple[str, ...]
    joined: tuple[str, ...]
    trigger: str  # "failure" | "join" | "collective_error" | "rebalance" | "supervisor" (a takeover) | "loss_spike"
    slowdown: tuple[tuple[str, float], ...] = ()  # a rebalance's stragglers


TickAction = Wait | Finish | CheckpointAndStop | Change


def on_tick(o: Observation) -> TickAction:
    if o.phase in (Phase.DONE, Phase.CHECKPOINTING, Phase.COLLECTING):
        return Wait()  # the last two are carried out synchronously: never observed
    if o.live == 0:
        return Finish()
    if o.lost and (o.finished or o.phase == Phase.ENDING):  # someone completed the last step: it is over
        return Finish(note=f"node(s) {list(o.lost)} died after the end")
    if o.phase == Phase.ENDING:
        return Wait()
    if o.lost:
        return Change(o.lost, (), "failure")
    if o.preemption and o.phase == Phase.RUNNING:
        return CheckpointAndStop()
    if o.loss_spike:  # the workers wait for the rollback (or the stop) to be decided
        return Change((), (), "loss_spike")
    if o.errors_expired:
        return Change((), (), "collective_error")
    between_steps = o.phase == Phase.RUNNING and o.step_running and not o.finished and not o.last_step_near
    if o.ready_joins and between_steps:
        return Change((), o.ready_joins, "join")
    if o.slowdown and between_steps:
        return Change((), (), "rebalance", o.slowdown)
    return Wait()


# ---- after the survivors reported: how to go on --------------------------------------------------

@dataclass(frozen=True)
class Collected:
    """A change after its reports came in."""

    plan: Plan  # the aborted generation's plan
    lost: frozenset[str]  # every node lost, including those lost while collecting
    joined: tuple[str, ...]
    steps: Mapping[str, int]  # worker -> the step it reports (workers that hold layers)
    holders: Mapping[Device, frozenset[int]]  # (node, device) -> the layers it holds valid
    completable: frozenset[str] = frozenset()  # workers that hold their step pending (engine/recovery.py)
    finished: bool = False  # a member completed the last step meanwhile
    checkpoint_mode: bool = False  # the recipe's recovery mode is "checkpoint"
    reforms_at_resume: int = 0  # re-forms that already resumed at this change's resume step
    trained: bool = True  # a step completed, or the job started from a checkpoint: state is not the seed's
    slowdown: tuple[tuple[str, float], ...] = ()  # a rebalance: stragglers' compute time over their peers'
    # (worker, phase) of each lost worker that reported running out of device memory (keys.out_of_memory)
    out_of_memory: tuple[tuple[str, str], ...] = ()
    # training.loss_spike stopped the workers (records.LossSpikeStop): why, as a worker reported it
    loss_spike_stop: str | None = None
    loss_spikes: tuple[int, ...] = ()  # and the steps of the spikes in a row
    checkpoints: tuple[int, ...] = ()  # the steps of the complete checkpoints (read for a loss-spike stop)
    rollbacks: int = 0  # loss-spike rollbacks this job made so far


@dataclass(frozen=True)
class Policy:
    templates: tuple[PipelineTemplate, ...]
    f: int
    layer_bytes: Sequence[int] | None = None
    replacement: bool = False  # ask the backend for a new node per lost node
    max_rollbacks: int = 0  # training.loss_spike rollbacks a job may make (0: on_consecutive stop, or off)


@dataclass(frozen=True)
class Complete:
    """The run ended while the change was collected: nothing to recover."""

    note: str


@dataclass(frozen=True)
class Fallback:
    """No in-memory recovery: restart every live node from the last complete checkpoint."""

    reason: str


@dataclass(frozen=True)
class Publish:
    """Recover in memory: publish the next generation with this plan and these copies."""

    change: Reconfiguration
    resume_step: int
    reason: str  # the plan event's reason: "failure" | "join" | "reform" | "rebalance"
    replacements: int  # new nodes to ask the backend for
    source: str = "memory"  # where the layers come from: "memory" (copies) or "seed" (nothing trained yet)


@dataclass(frozen=True)
class GiveUp:
    """Stop the job, unrecoverable: going on would fail the same way."""

    reason: str


@dataclass(frozen=True)
class Rollback:
    """training.loss_spike: restart every worker from the checkpoint of step `checkpoint`, the data
    cursor moved so that it reads the samples step `data_step` (the last spike's + 1) would have read."""

    checkpoint: int
    data_step: int
    spikes: tuple[int, ...]
    number: int  # this job's rollbacks with this one


ChangeAction = Complete | Fallback | Publish | GiveUp | Rollback


def loss_spike_action(message: str, spikes: Sequence[int], checkpoints: Collection[int], rollbacks: int,
                      max_rollbacks: int) -> Rollback | GiveUp:
    """What `max_consecutive` loss spikes in a row (steps `spikes`) call for, the workers having said
    why (`message`): roll back to the newest complete checkpoint (of those at `checkpoints`) at or
    before the first spike, which the spikes did not reach, skipping the data to the last one's
    successor (the same data would spike again: the engine is exact), if fewer than `max_rollbacks`
    were made (0: on_consecutive stop); else stop, saying why no rollback."""
    if max_rollbacks <= 0:
        return GiveUp(message)
    if not spikes:
        raise InternalError("a loss-spike stop without its spikes' steps")
    if rollbacks >= max_rollbacks:
        return GiveUp(f"{message}; but the job rolled back {rollbacks} time(s) already "
                      f"(training.loss_spike.max_rollbacks is {max_rollbacks}): it stops")
    before = [c for c in checkpoints if c <= spikes[0]]
    if not before:
        return GiveUp(f"{message}; but no complete checkpoint exists at or before step {spikes[0]}"
                      + (f" (those kept: steps {', '.join(map(str, sorted(checkpoints)))})" if checkpoints else "")
                      + ": the job stops")
    return Rollback(max(before), max(spikes) + 1, tuple(spikes), rollbacks + 1)


# Where running out of device memory says only that two states were held at once: copying layers from
# their holders keeps the old state until the new one is complete (docs/engine.md, plan changes).
COPY_PHASE = "adopt:memory"


def out_of_memory_action(ooms: Sequence[tuple[str, str]]) -> Fallback | GiveUp:
    """What a worker's running out of device memory calls for. While layers were copied in memory:
    restart from the last checkpoint, which holds no old state beside the new. Anywhere else (a step,
    an evaluation, a checkpoint's gathers, an adopt from a checkpoint or the seed, group building): the
    plan does not fit its devices, and running it, or a plan on fewer nodes, again would fail the same
    way: stop, naming it."""
    named = ", ".join(f"{worker} ({phase})" for worker, phase in ooms)
    if all(phase == COPY_PHASE for _, phase in ooms):
        return Fallback(f"{named} ran out of device memory while copying layers from their holders (the old "
                        f"and the new state at once): restarting from the last complete checkpoint")
    return GiveUp(f"{named} ran out of device memory: the plan does not fit its devices, and running it again "
                  f"would fail the same way; plan with less memory per device (cluster.memory_per_device), "
                  f"turn on training.recompute or use smaller microbatches")


def resume_step(steps: Collection[int]) -> int:
    """Survivors resume at the largest reported step: those one step behind hold it pending and
    complete it (engine/recovery.py); if none completed it, everyone replays it."""
    return max(steps) if steps else 0


def whole_holders(layers: Mapping[Device, frozenset[int]],
                  shards: Mapping[Device, Mapping[int, tuple[int, int]]]) -> dict[Device, frozenset[int]]:
    """The layers each device holds as part of a whole replica. `shards`: the layers a device holds as
    shard `index` of `width` (a stage of several devices: consecutive devices of one node, the shard's
    index its position). A shard counts only if every device of its stage reports its own shard of
    the same width: a wide stage holds its layers only all together. A node's workers fail together,
    so this only drops a layer whose copy failed on part of a stage."""
    out: dict[Device, frozenset[int]] = {}
    for (node, d), held in layers.items():
        mine = shards.get((node, d), {})
        kept = set()
        for layer in held:
            if layer not in mine:
                kept.add(layer)
                continue
            width, index = mine[layer]
            stage = [(node, d - index + j) for j in range(width)]
            if all(layer in layers.get(dev, frozenset()) and shards.get(dev, {}).get(layer) == (width, j)
                   for j, dev in enumerate(stage)):
                kept.add(layer)
        out[(node, d)] = frozenset(kept)
    return out


def step_to_log(logged_next: int, resume: int, reports: Iterable[WorkerReport]) -> LastStep | None:
    """The step a recovery completes that rank 0 did not log (its last collective completed on some
    ranks only, and rank 0 completes it in the recovery: engine/recovery.py), as a survivor that
    finished the collective reported it; None when there is none to log. A member's report first: a
    spare never sees the gradient norm, so it cannot tell a step skipped for a non-finite one."""
    if resume <= logged_next:
        return None
    done = [r.last_step for r in sorted(reports, key=lambda r: not r.layers)
            if r.last_step is not None and r.last_step.result.step == resume - 1]
    return done[0] if done else None


def unreachable(steps: Mapping[str, int], completable: Collection[str]) -> list[str]:
    """Workers that cannot reach `resume_step`: behind it without the step pending, or further behind
    (none, if the engine's commit rule holds)."""
    resume = resume_step(steps.values())
    return sorted(w for w, s in steps.items() if not (s == resume or (s == resume - 1 and w in completable)))


def decide(c: Collected, policy: Policy, generation: int, trigger: str) -> ChangeAction:
    """How to go on after generation `generation` was aborted by `trigger` and its reports collected."""
    steps = set(c.steps.values())
    resume = resume_step(steps)
    lost = sorted(c.lost)
    if c.finished:
        return Complete(f"{trigger} as the run ended: no recovery needed")
    if c.loss_spike_stop is not None:  # every rank stopped at the same step: recovering replays the spikes
        return loss_spike_action(c.loss_spike_stop, c.loss_spikes, c.checkpoints, c.rollbacks, policy.max_rollbacks)
    if c.out_of_memory:  # before the checkpoint mode: its restart would run the same plan again
        return out_of_memory_action(c.out_of_memory)
    if c.checkpoint_mode and c.lost:
        return Fallback(f"checkpoint-restart mode: node(s) {lost} lost at step {resume}")
    if behind := unreachable(c.steps, c.completable):
        return Fallback(f"survivors report steps {sorted(steps)}: {behind} cannot reach step {resume}")
    if c.slowdown and not c.lost and not c.joined:
        # Stragglers: the same pipelines on the same nodes, a straggler's pipeline gets fewer
        # microbatches; the global batch and its order are kept, so the trajectory is unchanged.
        try:
            plan = rebalance(c.plan, pipeline_slowdowns(c.plan, dict(c.slowdown)))
            copies = plan_copies(plan, dict(c.holders), policy.layer_bytes)
        except RecoveryImpossible as e:
            return Fallback(f"rebalance of generation {generation}: {e}")
        return Publish(Reconfiguration(plan, copies, ("rebalance",), 0.0), resume, "rebalance", 0)
    reform = not c.lost and not c.joined
    if reform and trigger == "supervisor":  # a new supervisor took over: the same plan goes on
        try:
            change = Reconfiguration(c.plan, plan_copies(c.plan, dict(c.holders), policy.layer_bytes),
                                     ("takeover",), 0.0)
        except RecoveryImpossible as e:
            return Fallback(f"takeover of generation {generation}: {e}")
        return Publish(change, resume, "takeover", 0)
    if reform and c.reforms_at_resume + 1 > MAX_REFORMS_PER_STEP:
        return Fallback(f"collective errors persist: re-formed {MAX_REFORMS_PER_STEP} times at step {resume} "
                        "without progress")
    if reform:  # every member left in time: the same plan, and copies only of what an interrupted
        try:    # recovery left missing (a join's copy)
            change = Reconfiguration(c.plan, plan_copies(c.plan, dict(c.holders), policy.layer_bytes),
                                     ("re-form",), 0.0)
        except RecoveryImpossible as e:
            return Fallback(f"re-form of generation {generation}: {e}")
        return Publish(change, resume, "reform", 0)
    reason, replacements = "failure" if c.lost else "join", len(lost) if policy.replacement else 0
    if not c.trained:
        # A change before the first step (a node lost while the job starts): every layer is still the
        # seed's (some workers may not have built theirs yet); the new plan starts from the seed.
        try:
            change = reconfigure(c.plan, lost, list(c.joined), policy.templates, policy.f,
                                 layer_bytes=policy.layer_bytes)
        except RecoveryImpossible as e:
            return Fallback(f"failure of node(s) {lost} in generation {generation}, before the first step: {e}")
        return Publish(replace(change, transfers=()), 0, reason, replacements, source="seed")
    try:
        change = reconfigure(c.plan, lost, list(c.joined), policy.templates, policy.f,
                             holders=dict(c.holders), layer_bytes=policy.layer_bytes)
    except RecoveryImpossible as e:
        return Fallback(f"failure of node(s) {lost} in generation {generation}: {e}")
    return Publish(change, resume, reason, replacements)
