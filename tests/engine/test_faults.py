"""FaultHooks: which hook point strikes which fault, once (an in-process store; "pause" faults of a few
milliseconds stand for every action: the kill and hang actions are exercised by the recovery tests)."""

from __future__ import annotations

import torch.distributed as dist

from oobleck_slurm.engine.faults import FaultHooks
from oobleck_slurm.protocol import keys

PAUSE = {"do": "pause", "seconds": 0.001}


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
