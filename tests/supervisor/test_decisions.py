"""The coordinator's pure state machine and decisions: every transition, every tick observation, every
branch of `decide`, on real plans and templates."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
from planning_helpers import random_profile

from oobleck_slurm.planning import generate_templates, instantiate
from oobleck_slurm.planning.reconfigure import plan_holders
from oobleck_slurm.supervisor.decisions import (
    MAX_REFORMS_PER_STEP,
    RECOVERING,
    TRANSITIONS,
    Change,
    CheckpointAndStop,
    Collected,
    Complete,
    Fallback,
    Finish,
    GiveUp,
    IllegalTransition,
    Observation,
    Phase,
    Policy,
    Publish,
    Rollback,
    Wait,
    decide,
    loss_spike_action,
    on_tick,
    resume_step,
    transition,
)

# ---- transitions ------------------------------------------------------------------------------------


@pytest.mark.parametrize("current,target", list(itertools.product(Phase, Phase)))
def test_every_transition_is_allowed_or_refused_by_the_table(current, target):
    if target in TRANSITIONS[current]:
        assert transition(current, target) is target
    else:
        with pytest.raises(IllegalTransition, match=f"{current}.*{target}"):
            transition(current, target)


def test_every_phase_is_reachable_from_running_and_reaches_done():
    def closure(start):
        seen, todo = {start}, [start]
        while todo:
            for nxt in TRANSITIONS[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    assert closure(Phase.RUNNING) == set(Phase)
    assert all(Phase.DONE in closure(p) for p in Phase)
    assert TRANSITIONS[Phase.DONE] == frozenset()


def test_a_loss_during_any_recovering_phase_starts_the_next_recovery():
    for phase in RECOVERING:
        assert Phase.COLLECTING in TRANSITIONS[phase]


# ---- the loop: every observation --------------------------------------------------------------------

def observations():
    for phase, lost, live, finished, preempt, errors, joins, running, near, slow, spike in itertools.product(
            Phase, [(), ("n2",)], [0, 3], [False, True], [False, True], [False, True], [(), ("r1",)],
            [False, True], [False, True], [(), (("n3", 2.0),)], [False, True]):
        yield Observation(phase, lost, live, finished, preempt, errors, joins, running, near, slow, spike)


def expected(o: Observation):
    """The specification of `on_tick`, written as a plain decision list."""
    if o.phase in (Phase.DONE, Phase.CHECKPOINTING, Phase.COLLECTING):
        return Wait()
    if o.live == 0:
        return Finish()
    if o.lost and (o.finished or o.phase == Phase.ENDING):
        return Finish(note=f"node(s) {list(o.lost)} died after the end")
    if o.phase == Phase.ENDING:
        return Wait()
    if o.lost:
        return Change(o.lost, (), "failure")
    if o.preemption and o.phase == Phase.RUNNING:
        return CheckpointAndStop()
    if o.loss_spike:
        return Change((), (), "loss_spike")
    if o.errors_expired:
        return Change((), (), "collective_error")
    if o.ready_joins and o.phase == Phase.RUNNING and o.step_running and not o.finished and not o.last_step_near:
        return Change((), o.ready_joins, "join")
    if o.slowdown and o.phase == Phase.RUNNING and o.step_running and not o.finished and not o.last_step_near:
        return Change((), (), "rebalance", o.slowdown)
    return Wait()


def test_on_tick_matches_its_specification_for_every_observation():
    checked = 0
    for o in observations():
        assert on_tick(o) == expected(o), o
        checked += 1
    assert checked == len(Phase) * 2 ** 10


def test_on_tick_properties():
    for o in observations():
        action = on_tick(o)
        if isinstance(action, Change):  # a change only from a phase that may go to COLLECTING
            assert Phase.COLLECTING in TRANSITIONS[o.phase]
        if isinstance(action, CheckpointAndStop):
            assert o.phase == Phase.RUNNING and not o.lost
        if isinstance(action, Change) and action.joined:  # never folds a join into a recovery or the end
            assert o.phase == Phase.RUNNING and not o.finished and not o.last_step_near and not o.lost
        if o.lost and o.phase in (Phase.RUNNING, *RECOVERING) and o.live and not o.finished:
            assert action == Change(o.lost, (), "failure"), "a loss is never deferred"


# ---- after the reports: decide ----------------------------------------------------------------------

def expected_spike_action(message, spikes, checkpoints, rollbacks, max_rollbacks):
    """The specification of `loss_spike_action`, as a plain decision list."""
    if max_rollbacks == 0:
        return "give_up", message
    if rollbacks >= max_rollbacks:
        return "give_up", "rolled back"
    before = [c for c in checkpoints if c <= spikes[0]]
    if not before:
        return "give_up", f"no complete checkpoint exists at or before step {spikes[0]}"
    return "rollback", Rollback(max(before), spikes[-1] + 1, tuple(spikes), rollbacks + 1)


def test_the_loss_spike_action_matches_its_specification_for_every_case():
    """Every set of checkpoints among steps 0..7, runs of spikes starting at 2..5, limits 0..3 and
    rollbacks made 0..3: a rollback goes to the newest checkpoint at or before the first spike (never
    one the spikes reached), reads on after the last, and counts itself; anything else stops, saying why."""
    why = "training.loss_spike: 2 loss spikes in a row"
    checked = 0
    for mask in range(2 ** 8):
        checkpoints = tuple(c for c in range(8) if mask >> c & 1)
        for first, length, made, limit in itertools.product(range(2, 6), (1, 2, 3), range(4), range(4)):
            spikes = tuple(range(first, first + length))
            action = loss_spike_action(why, spikes, checkpoints, made, limit)
            kind, detail = expected_spike_action(why, spikes, checkpoints, made, limit)
            if kind == "rollback":
                assert action == detail
                assert action.checkpoint <= spikes[0] < action.data_step and action.number <= limit
            else:
                assert isinstance(action, GiveUp) and action.reason.startswith(why) and detail in action.reason
            checked += 1
    assert checked == 2 ** 8 * 4 * 3 * 4 * 4


def test_decide_rolls_back_on_a_loss_spike_stop_with_or_without_a_loss(setup):
    templates, plan = setup
    why = "training.loss_spike: 2 loss spikes in a row (steps 5, 6 ...)"
    policy = Policy(templates, 1, max_rollbacks=3)
    for lost in ((), plan.pipelines[0].nodes[:1]):
        for mode in (False, True):
            action = decide(collected(plan, lost, loss_spike_stop=why, loss_spikes=(5, 6), checkpoints=(2, 4, 6),
                                      rollbacks=1, checkpoint_mode=mode), policy, 4, "loss_spike")
            assert action == Rollback(4, 7, (5, 6), 2)
    action = decide(collected(plan, (), loss_spike_stop=why, loss_spikes=(5, 6), checkpoints=(2, 4), rollbacks=3),
                    policy, 4, "loss_spike")
    assert isinstance(action, GiveUp) and "rolled back 3 time(s) already" in action.reason
    assert isinstance(decide(collected(plan, (), loss_spike_stop=why, loss_spikes=(5, 6), finished=True), policy, 4,
                             "loss_spike"), Complete)


@pytest.fixture(scope="module")
def setup():
    profile = random_profile(random.Random(3), 6, 1, tight_memory=False)
    templates = tuple(generate_templates(profile, 4, num_microbatches=4))
    plan = instantiate(templates, [f"n{i}" for i in range(6)], 1, 12)
    return templates, plan


def collected(plan, lost=(), joined=(), steps=None, **kw):
    holders = {d: ls for d, ls in plan_holders(plan).items() if d[0] not in set(lost)}
    steps = steps if steps is not None else {f"{d[0]}:{d[1]}": 7 for d in holders}
    return Collected(plan, frozenset(lost), tuple(joined), steps, holders, **kw)


def test_a_loss_with_replicas_publishes_a_new_plan_and_asks_for_replacements(setup):
    templates, plan = setup
    lost = plan.pipelines[0].nodes[:1]
    action = decide(collected(plan, lost), Policy(templates, 1, replacement=True), 4, "agent_lost")
    assert isinstance(action, Publish) and action.reason == "failure" and action.resume_step == 7
    assert action.replacements == 1
    used = {n for p in action.change.plan.pipelines for n in p.nodes} | set(action.change.plan.spare_nodes)
    assert not used & set(lost)
    assert decide(collected(plan, lost), Policy(templates, 1), 4, "x").replacements == 0


def test_running_out_of_device_memory_never_runs_the_same_plan_again(setup):
    templates, plan = setup
    lost = plan.pipelines[0].nodes[:1]
    worker = f"{lost[0]}:0"
    # a loss that replicas would recover from in memory, or (checkpoint mode) from the checkpoint, on the
    # same plan's shape: the worker said its device was full in a step, so neither is tried
    for mode in (False, True):
        action = decide(collected(plan, lost, out_of_memory=((worker, "step"),), checkpoint_mode=mode),
                        Policy(templates, 1, replacement=True), 4, "out_of_memory")
        assert isinstance(action, GiveUp) and f"{worker} (step) ran out of device memory" in action.reason
    for phase in ("evaluate", "checkpoint", "adopt:checkpoint", "adopt:seed", "groups"):
        action = decide(collected(plan, lost, out_of_memory=((worker, phase),)), Policy(templates, 1), 4, "x")
        assert isinstance(action, GiveUp), phase
    # while layers were copied from their holders: the old and new state together; a checkpoint restart
    # holds the new one only
    action = decide(collected(plan, lost, out_of_memory=((worker, "adopt:memory"),)), Policy(templates, 1), 4, "x")
    assert isinstance(action, Fallback) and "while copying layers" in action.reason
    both = ((worker, "adopt:memory"), (f"{lost[0]}:1", "step"))
    assert isinstance(decide(collected(plan, lost, out_of_memory=both), Policy(templates, 1), 4, "x"), GiveUp)
    # a run that ended meanwhile needs nothing
    action = decide(collected(plan, lost, out_of_memory=((worker, "step"),), finished=True), Policy(templates, 1), 4, "x")
    assert isinstance(action, Complete)


def test_a_loss_spike_stop_stops_the_job_with_its_reason_whatever_else_holds(setup):
    """on_consecutive: stop (the policy's max_rollbacks 0)."""
    templates, plan = setup
    lost = plan.pipelines[0].nodes[:1]
    why = "training.loss_spike: 5 loss spikes in a row (steps 10, 11, 12, 13, 14 ...)"
    # recovering in memory, from a checkpoint, or on another plan would replay into the same spikes
    for mode in (False, True):
        for oom in ((), ((f"{lost[0]}:0", "adopt:memory"),)):
            action = decide(collected(plan, lost, loss_spike_stop=why, checkpoint_mode=mode, out_of_memory=oom),
                            Policy(templates, 1, replacement=True), 4, "process_exit")
            assert isinstance(action, GiveUp) and action.reason == why
    # a run that ended meanwhile needs nothing
    assert isinstance(decide(collected(plan, lost, loss_spike_stop=why, finished=True), Policy(templates, 1), 4, "x"),
                      Complete)


def test_the_resume_step_is_the_largest_reported():
    assert resume_step([]) == 0
    for steps in itertools.product(range(3), repeat=3):
        assert resume_step(steps) == max(steps)


def test_workers_one_step_behind_complete_their_pending_step_others_fall_back(setup):
    templates, plan = setup
    holders = plan_holders(plan)
    workers = [f"{d[0]}:{d[1]}" for d in holders]
    lost = [plan.pipelines[0].nodes[-1]]
    one = dict.fromkeys(workers, 8) | {workers[0]: 7}
    action = decide(collected(plan, lost, steps=one, completable=frozenset(workers)), Policy(templates, 1), 2, "x")
    assert isinstance(action, Publish) and action.resume_step == 8
    # Behind without the step pending: the commit rule was broken somewhere; no in-memory recovery.
    action = decide(collected(plan, lost, steps=one, completable=frozenset(workers[1:])), Policy(templates, 1), 2, "x")
    assert isinstance(action, Fallback) and f"['{workers[0]}'] cannot reach step 8" in action.reason
    two = dict.fromkeys(workers, 9) | {workers[0]: 7}
    action = decide(collected(plan, lost, steps=two, completable=frozenset(workers)), Policy(templates, 1), 2, "x")
    assert isinstance(action, Fallback) and "cannot reach step 9" in action.reason
    # Everyone at the same step, some with it pending: nobody applied it, it is replayed.
    same = dict.fromkeys(workers, 8)
    action = decide(collected(plan, lost, steps=same, completable=frozenset(workers[:2])), Policy(templates, 1), 2, "x")
    assert isinstance(action, Publish) and action.resume_step == 8


def test_a_layer_without_a_replica_falls_back_naming_the_failure(setup):
    templates, plan = setup
    lost = [n for p in plan.pipelines for n in p.nodes]  # every pipeline loses everything
    action = decide(collected(plan, lost), Policy(templates, 1), 5, "heartbeat")
    assert isinstance(action, Fallback) and "generation 5" in action.reason


def test_checkpoint_mode_always_falls_back_on_a_loss_but_not_on_a_join(setup):
    templates, plan = setup
    lost = plan.pipelines[0].nodes[:1]
    action = decide(collected(plan, lost, checkpoint_mode=True), Policy(templates, 1), 0, "x")
    assert isinstance(action, Fallback) and "checkpoint-restart mode" in action.reason
    joined = decide(collected(plan, joined=["r1"], checkpoint_mode=True), Policy(templates, 1), 0, "join")
    assert isinstance(joined, Publish) and joined.reason == "join"


def test_a_finished_member_completes_the_run_whatever_else(setup):
    templates, plan = setup
    for lost in ([], plan.pipelines[0].nodes[:1], [n for p in plan.pipelines for n in p.nodes]):
        action = decide(collected(plan, lost, finished=True), Policy(templates, 1), 3, "join")
        assert action == Complete("join as the run ended: no recovery needed")


def test_a_reform_keeps_the_plan_and_stops_trusting_itself_after_the_limit(setup):
    templates, plan = setup
    action = decide(collected(plan), Policy(templates, 1), 1, "collective_error")
    assert isinstance(action, Publish) and action.reason == "reform"
    assert action.change.plan == plan and action.change.transfers == () and action.replacements == 0
    for done in range(MAX_REFORMS_PER_STEP + 2):
        action = decide(collected(plan, reforms_at_resume=done), Policy(templates, 1), 1, "collective_error")
        assert isinstance(action, Fallback) == (done >= MAX_REFORMS_PER_STEP)


def test_a_reform_copies_what_an_interrupted_join_left_missing(setup):
    templates, plan = setup
    holders = plan_holders(plan)
    device = next(iter(holders))
    partial = dict(holders) | {device: frozenset()}  # a joiner that never received its layers
    c = Collected(plan, frozenset(), (), {f"{d[0]}:{d[1]}": 3 for d in holders}, partial)
    action = decide(c, Policy(templates, 1), 1, "collective_error")
    assert isinstance(action, Publish)
    assert {t.dst for t in action.change.transfers} == {device}
    assert {t.layer for t in action.change.transfers} == set(holders[device])


def test_every_loss_set_gets_a_publish_or_a_fallback_never_an_exception(setup):
    templates, plan = setup
    nodes = [n for p in plan.pipelines for n in p.nodes] + list(plan.spare_nodes)
    for k in range(len(nodes) + 1):
        for lost in itertools.combinations(nodes, k):
            action = decide(collected(plan, lost), Policy(templates, 1), 0, "x")
            assert isinstance(action, Publish | Fallback)
            if isinstance(action, Publish):
                assert len(action.change.plan.pipelines) >= 2


def test_a_loss_before_the_first_step_restarts_from_the_seed_even_without_holders(setup):
    templates, plan = setup
    lost = plan.pipelines[0].nodes[:1]
    empty = Collected(plan, frozenset(lost), (), {}, {}, trained=False)  # nobody had built its layers
    action = decide(empty, Policy(templates, 1, replacement=True), 0, "heartbeat")
    assert isinstance(action, Publish) and action.source == "seed" and action.resume_step == 0
    assert action.change.transfers == () and action.replacements == 1
    assert not set(lost) & {n for p in action.change.plan.pipelines for n in p.nodes}
    # once a step trained (or the job started from a checkpoint), the same reports are a real loss
    assert isinstance(decide(replace(empty, trained=True), Policy(templates, 1), 0, "heartbeat"), Fallback)


def test_a_straggler_gives_its_pipeline_fewer_microbatches_on_the_same_nodes(setup):
    templates, plan = setup
    slow = plan.pipelines[0].nodes[0]
    action = decide(collected(plan, slowdown=((slow, 3.0),)), Policy(templates, 1), 4, "rebalance")
    assert isinstance(action, Publish) and action.reason == "rebalance" and action.replacements == 0
    new = action.change.plan
    assert [p.nodes for p in new.pipelines] == [p.nodes for p in plan.pipelines]  # nothing moves
    assert action.change.transfers == ()  # every device keeps its layers
    assert new.global_microbatches == plan.global_microbatches
    assert new.pipelines[0].microbatches < plan.pipelines[0].microbatches


def test_a_wide_stage_holds_its_layers_only_all_together():
    from oobleck_slurm.supervisor.decisions import whole_holders

    # node a: a stage of 2 (devices 0, 1) holding layers 0-2 as shards, device 2 a whole layer 3;
    # node b: a stage of 2 whose device 1 lost its shard of layer 4 (a failed copy), and whose device 0
    # reports layer 5 as shard 0 of 4 (its stage-mates do not)
    layers = {("a", 0): frozenset({0, 1, 2}), ("a", 1): frozenset({0, 1, 2}), ("a", 2): frozenset({3}),
              ("b", 0): frozenset({4, 5}), ("b", 1): frozenset()}
    shards = {("a", 0): {0: (2, 0), 1: (2, 0), 2: (2, 0)}, ("a", 1): {0: (2, 1), 1: (2, 1), 2: (2, 1)},
              ("b", 0): {4: (2, 0), 5: (4, 0)}}
    held = whole_holders(layers, shards)
    assert held[("a", 0)] == held[("a", 1)] == {0, 1, 2} and held[("a", 2)] == {3}
    assert held[("b", 0)] == frozenset() and held[("b", 1)] == frozenset()
    # shard indices must match the devices' positions in the stage
    swapped = {("a", 0): shards[("a", 1)], ("a", 1): shards[("a", 0)]}
    assert whole_holders({k: layers[k] for k in swapped}, swapped) == {("a", 0): frozenset(), ("a", 1): frozenset()}


def test_step_to_log_takes_a_members_report_over_a_spares_in_any_order():
    """The step a recovery completes is logged from a member's report: a spare's figures lack what it
    never sees (the gradient norm, so a skip for a non-finite one); the reports come in any order (the
    suite saw a spare's first under load, and the step was logged as applied)."""
    from oobleck_slurm.protocol.records import LastStep, StepResult, WorkerReport
    from oobleck_slurm.supervisor.decisions import step_to_log

    def report(step: int, layers: tuple[int, ...], skipped: bool, grad_norm: float) -> WorkerReport:
        result = StepResult(step=step, loss=9.0, grad_norm=grad_norm, lr=0.1, seconds=1.0, skipped=skipped,
                            skip_reason="loss_spike" if skipped else None)
        return WorkerReport(step=step + 1, layers=layers, last_step=LastStep(result=result, generation=0, global_batch_size=16))

    member, spare = report(4, (0, 1), True, 2.5), report(4, (), False, 0.0)
    behind = WorkerReport(step=4, layers=(0, 1), completable=True, last_step=report(3, (0,), False, 1.0).last_step)
    for order in itertools.permutations([member, spare, behind]):
        last = step_to_log(4, 5, order)
        assert last is not None and last.result.skipped and last.result.grad_norm == 2.5
        assert step_to_log(5, 5, order) is None  # rank 0 logged it
    assert step_to_log(4, 5, [spare]).result.step == 4  # no member's report: the spare's figures still log it
    assert step_to_log(4, 5, [behind]) is None
