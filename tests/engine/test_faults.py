"""FaultHooks: which hook point strikes which fault, once (an in-process store; "pause" faults of a few
milliseconds stand for every action: the kill and hang actions are exercised by the recovery tests)."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from oobleck_slurm.engine.faults import FaultHooks
from oobleck_slurm.protocol import keys
from oobleck_slurm.timeouts import JobTimeouts

PAUSE = {"do": "pause", "seconds": 0.001}
CONDITION_S = 30.0  # the longest a test waits for a condition


def struck(store: dist.Store, count: int) -> list[int]:
    """Indices of the faults that struck."""
    return [i for i in range(count) if store.check([keys.fault_fired(i)])]


def run_steps(hooks: FaultHooks, steps: int, waits: int, start: int = 0) -> None:
    """What a worker does: each step starts, waits `waits` times, updates three layers, ends."""
    for step in range(start, start + steps):
        hooks.at_step_start(step)
        for _ in range(waits):
            hooks.before_wait(step)
        for _ in range(3):
            hooks.before_update(step)
        hooks.at_step_end()


def test_no_fault_for_this_worker_touches_nothing() -> None:
    store = dist.HashStore()
    faults = [{"node": "node2", "step": 1, **PAUSE}, {"node": "node1", "worker": 1, "step": 1, **PAUSE}]
    hooks = FaultHooks(faults, store, "node1", 0)
    run_steps(hooks, 3, waits=4)
    hooks.at_adopt(1)
    assert store.num_keys() == 0


def test_each_point_strikes_its_fault_at_its_step_only() -> None:
    points = ["start", "wait:2", "wait:last", "optimizer", "adopt"]
    faults = [{"node": "node1", "step": 2, "at": at, **PAUSE} for at in points]
    store = dist.HashStore()
    hooks = FaultHooks(faults, store, "node1", 0)
    run_steps(hooks, 2, waits=3)  # steps 0 and 1: nothing
    hooks.at_adopt(1)
    assert struck(store, len(faults)) == []
    hooks.at_step_start(2)
    assert struck(store, len(faults)) == [0]
    hooks.before_wait(2)
    hooks.before_wait(2)
    assert struck(store, len(faults)) == [0, 1]
    hooks.before_wait(2)  # the third wait: as many as the previous step had
    assert struck(store, len(faults)) == [0, 1, 2]
    hooks.before_update(2)
    assert struck(store, len(faults)) == [0, 1, 2]  # no layer updated yet
    hooks.before_update(2)
    assert struck(store, len(faults)) == [0, 1, 2, 3]
    hooks.at_adopt(2)
    assert struck(store, len(faults)) == [0, 1, 2, 3, 4]


def test_a_fault_strikes_once_even_when_the_step_is_replayed() -> None:
    store = dist.HashStore()
    faults = [{"node": "node1", "worker": 1, "step": 1, "at": "wait:1", **PAUSE}]
    for _ in range(2):  # the step replayed, or the worker restarted: the store remembers
        run_steps(FaultHooks(faults, store, "node1", 1), 2, waits=2)
    assert store.get(keys.fault_fired(0)) == b"2"  # reached twice; only the first reach (count 1) acts
    assert not store.check([keys.fault_time("node1")])  # a pause is no loss: no fault time


def test_wait_counts_restart_at_each_step() -> None:
    store = dist.HashStore()
    faults = [{"node": 7, "step": 3, "at": "wait:2", **PAUSE}]  # a node given as a number matches its name
    hooks = FaultHooks(faults, store, "7", 0)
    run_steps(hooks, 3, waits=5)
    hooks.at_step_start(3)
    hooks.before_wait(3)
    assert struck(store, 1) == []
    hooks.before_wait(3)
    assert struck(store, 1) == [0]


def test_scatter_strikes_before_the_first_reduce_scatter_wait_of_its_step() -> None:
    store = dist.HashStore()
    hooks = FaultHooks([{"node": "node1", "step": 1, "at": "scatter", **PAUSE}], store, "node1", 0)
    hooks.at_step_start(0)
    hooks.before_scatter(0)
    assert struck(store, 1) == []
    hooks.at_step_start(1)
    hooks.before_wait(1)
    assert struck(store, 1) == []
    hooks.before_scatter(1)
    assert struck(store, 1) == [0]


def in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + CONDITION_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_hold_blocks_until_the_generation_fails_then_goes_on() -> None:
    store = dist.HashStore()
    hooks = FaultHooks([{"node": "node1", "step": 2, "at": "wait:1", "do": "hold"}], store, "node1", 0)
    hooks.generation = 3
    hooks.at_step_start(2)
    thread = in_thread(lambda: hooks.before_wait(2))
    wait_for(lambda: struck(store, 1) == [0], "the hold strikes")
    assert thread.is_alive()  # held: its generation is not failed
    store.set(keys.failed(2), "{}")  # another generation's failure does not release it
    thread.join(0.05)
    assert thread.is_alive()
    store.set(keys.failed(3), "{}")
    thread.join(CONDITION_S)
    assert not thread.is_alive()
    assert not store.check([keys.fault_time("node1")])  # no loss


def test_after_waits_until_the_named_workers_reach_the_step() -> None:
    store = dist.HashStore()
    fault = {"node": "node1", "step": 4, "at": "start", "after": ["node2", "node3:1"], **PAUSE}
    hooks = FaultHooks([fault], store, "node1", 0)
    store.set(keys.worker_step("node2:0"), "4")
    store.set(keys.worker_step("node3:1"), "3")  # still in step 3: it has not applied it
    thread = in_thread(lambda: hooks.at_step_start(4))
    wait_for(lambda: struck(store, 1) == [0], "the fault is due")
    thread.join(0.05)
    assert thread.is_alive()
    store.set(keys.worker_step("node3:1"), "4")
    thread.join(CONDITION_S)
    assert not thread.is_alive()


def test_a_condition_that_never_comes_fails_the_worker_loudly() -> None:
    timeouts = JobTimeouts(fault_wait_max=0.05)
    hold = FaultHooks([{"node": "n", "step": 0, "do": "hold"}], dist.HashStore(), "n", 0, timeouts)
    with pytest.raises(TimeoutError, match="generation 0 was not declared failed"):
        hold.at_step_start(0)
    after = FaultHooks([{"node": "m", "step": 0, "after": ["n"], **PAUSE}], dist.HashStore(), "m", 0, timeouts)
    with pytest.raises(TimeoutError, match="n:0 did not reach step 0"):
        after.at_step_start(0)
