"""A node's life in the agents backend: every (state, event) pair of the transition table, allowed or
refused, checked against the table written out here, and the table the module's docstring shows."""

from __future__ import annotations

import itertools

import pytest

from oobleck_slurm.supervisor import node_table
from oobleck_slurm.supervisor.node_table import IllegalTransition, NodeEvent, NodeState, transition

S, E = NodeState, NodeEvent

# What each state allows; every pair not listed must be refused.
ALLOWED = {
    # after a supervisor's takeover: adopted with its workers running, or lost when its agent is not back
    S.LAUNCHING: {E.REGISTER: S.IDLE, E.AWAIT_AGENT: S.AWAITING_AGENT, E.STOP: S.LAUNCHING, E.ADOPT: S.RUNNING,
                  E.LOSE: S.LOST},
    S.SPARE: {E.REGISTER: S.SPARE, E.ASSIGN: S.IDLE},
    S.REQUESTED: {E.REGISTER: S.IDLE, E.AWAIT_AGENT: S.AWAITING_AGENT, E.STOP: S.REQUESTED},
    S.IDLE: {E.REGISTER: S.IDLE, E.START_WORKER: S.RUNNING, E.CHECK_HEALTH: S.HEALTH_CHECK,
             E.AWAIT_AGENT: S.AWAITING_AGENT, E.STOP: S.IDLE},
    S.AWAITING_AGENT: {E.REGISTER: S.HEALTH_CHECK, E.STOP: S.IDLE},
    S.HEALTH_CHECK: {E.START_WORKER: S.RUNNING, E.STOP: S.IDLE, E.LOSE: S.LOST},
    S.RUNNING: {E.STOP: S.IDLE, E.FINISH: S.FINISHED, E.LOSE: S.LOST},
    S.FINISHED: {E.START_WORKER: S.RUNNING, E.AWAIT_AGENT: S.AWAITING_AGENT, E.STOP: S.FINISHED},
    S.LOST: {E.START_WORKER: S.LOST, E.CHECK_HEALTH: S.LOST, E.AWAIT_AGENT: S.LOST, E.STOP: S.LOST,
             E.FINISH: S.LOST},
}
INITIAL = (S.LAUNCHING, S.SPARE, S.REQUESTED)  # what AgentNodes creates records in


@pytest.mark.parametrize(("state", "event"), list(itertools.product(NodeState, NodeEvent)))
def test_every_pair_is_allowed_or_refused_as_written(state: NodeState, event: NodeEvent) -> None:
    expected = ALLOWED[state].get(event)
    if expected is None:
        with pytest.raises(IllegalTransition, match=f"state {state} cannot {event}"):
            transition(state, event)
    else:
        assert transition(state, event) is expected


def test_the_docstring_shows_the_table() -> None:
    assert node_table.transition_table() in node_table.__doc__, (
        "supervisor/node_table.py's docstring table differs from TRANSITIONS; paste:\n"
        + node_table.transition_table())


@pytest.mark.parametrize(("initial", "path"), [
    # an initial member: registers, runs, finishes; a restart from a checkpoint runs it again
    (S.LAUNCHING, [(E.REGISTER, S.IDLE), (E.START_WORKER, S.RUNNING), (E.FINISH, S.FINISHED),
                   (E.START_WORKER, S.RUNNING)]),
    # a requested replacement: started before its job runs, checked once its agent registers, joins, lost
    (S.REQUESTED, [(E.AWAIT_AGENT, S.AWAITING_AGENT), (E.REGISTER, S.HEALTH_CHECK), (E.START_WORKER, S.RUNNING),
                   (E.LOSE, S.LOST)]),
    # a spare: waits, is handed out, fails its check; the coordinator's stop races with the report
    (S.SPARE, [(E.REGISTER, S.SPARE), (E.ASSIGN, S.IDLE), (E.CHECK_HEALTH, S.HEALTH_CHECK), (E.LOSE, S.LOST),
               (E.STOP, S.LOST)]),
    # a member after a supervisor's takeover: its agent comes back with its workers, then it finishes
    (S.LAUNCHING, [(E.ADOPT, S.RUNNING), (E.FINISH, S.FINISHED)]),
    # stopped mid-check (a checkpoint fallback), started again: checked again
    (S.REQUESTED, [(E.REGISTER, S.IDLE), (E.CHECK_HEALTH, S.HEALTH_CHECK), (E.STOP, S.IDLE),
                   (E.CHECK_HEALTH, S.HEALTH_CHECK)]),
])
def test_lifecycles(initial: NodeState, path: list[tuple[NodeEvent, NodeState]]) -> None:
    state = initial
    for event, expected in path:
        state = transition(state, event)
        assert state is expected, (event, state)


def test_lost_is_final_and_reported_once() -> None:
    assert all(transition(S.LOST, e) is S.LOST for e in ALLOWED[S.LOST])
    with pytest.raises(IllegalTransition):
        transition(S.LOST, E.LOSE)


def test_workers_run_only_after_start_worker_and_only_a_running_node_finishes() -> None:
    for (state, event), after in node_table.TRANSITIONS.items():
        if after is S.RUNNING:  # started here, or adopted running after a takeover
            assert event is E.START_WORKER or (state, event) == (S.LAUNCHING, E.ADOPT), (state, event)
        if event is E.FINISH:
            assert state in (S.RUNNING, S.LOST)


def test_every_state_is_reachable_from_a_record_created_by_the_backend() -> None:
    seen, frontier = set(INITIAL), list(INITIAL)
    while frontier:
        state = frontier.pop()
        for after in ALLOWED[state].values():
            if after not in seen:
                seen.add(after)
                frontier.append(after)
    assert seen == set(NodeState)
