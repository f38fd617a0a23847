"""The supervisor's store observer (supervisor/observer.py) on an in-memory store: its view follows the
keys as the coordinator and the workers write them, a new generation starts a fresh view, and its
requests per period stay bounded (three in a steady generation, one multi_get of the workers' steps
every rank_step_poll whatever the number of nodes). No process is started."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from oobleck_slurm.protocol import keys
from oobleck_slurm.supervisor.observer import StoreObserver, StoreView
from oobleck_slurm.timeouts import JobTimeouts

DEADLINE_S = 10.0


class CountingStore(dist.HashStore):
    """A HashStore that counts the requests made through it, by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def total(self) -> int:
        return sum(self.counts.values())


def _counted(name: str) -> Any:
    base = getattr(dist.HashStore, name)

    def request(self: CountingStore, *args: Any, **kwargs: Any) -> Any:
        self.counts[name] += 1
        return base(self, *args, **kwargs)

    return request


for _name in ("set", "get", "add", "check", "wait", "multi_get", "multi_set", "compare_set", "delete_key", "num_keys"):
    setattr(CountingStore, _name, _counted(_name))


def publish(store: dist.Store, gen: int, members: list[str]) -> None:
    """What the coordinator writes for a generation: its config, then current_gen."""
    store.set(keys.config(gen), json.dumps({"generation": gen, "members": members}))
    store.set(keys.CURRENT_GEN, str(gen))


def train(store: dist.Store, gen: int, step: int, workers: list[str], first: bool = False) -> None:
    """What the workers write per step: each worker's step, rank 0's progress and compute."""
    for w in workers:
        store.set(keys.worker_step(w), str(step))
    store.set(keys.progress(gen), str(step))
    store.set(keys.step_compute(gen), json.dumps({"step": step, "compute_seconds": [0.01] * len(workers)}))
    if first:
        store.set(keys.first_step(gen), json.dumps({"step": step, "t": 123.0}))


def wait_for(observer: StoreObserver, condition: Callable[[StoreView], bool], what: str) -> StoreView:
    deadline = time.monotonic() + DEADLINE_S
    while not condition(view := observer.view):
        assert time.monotonic() < deadline, f"the view never showed {what}: {view}"
        time.sleep(0.005)
    return view


def test_the_view_follows_the_generation_as_its_keys_change() -> None:
    store = dist.HashStore()
    observer = StoreObserver(store, JobTimeouts(rank_step_poll=1e-9), workers_per_node=2)  # steps every read
    view = observer.refresh()  # nothing published yet
    assert (view.seq, view.generation, view.config, view.progress, dict(view.worker_steps)) == (1, -1, None, None, {})
    publish(store, 0, ["a", "b"])
    view = observer.refresh()
    assert (view.generation, view.config is not None, view.progress, view.first_step) == (0, True, None, None)
    assert view.config is not None and view.config.members == ("a", "b")
    assert not view.failed and view.errors is None and not view.rebuilt and dict(view.worker_steps) == {}

    workers = ["a:0", "a:1", "b:0", "b:1"]
    for w in workers:
        store.set(keys.rebuilt(0, w), json.dumps({"groups_s": 0.1, "copy_s": 0.0, "bytes": 0, "t": 1.0}))
    train(store, 0, 0, workers, first=True)
    view = observer.refresh()
    assert view.rebuilt and view.progress == 0 and view.first_step is not None and view.first_step.step == 0
    assert view.compute is not None and view.compute.step == 0
    assert dict(view.worker_steps) == dict.fromkeys(workers, 0)

    train(store, 0, 1, workers)
    store.add(keys.errors(0), 1)
    store.add(keys.errors(0), 1)
    store.set(keys.failed(0), json.dumps({"cause": "collective_error"}))
    view = observer.refresh()
    assert (view.progress, view.errors, view.failed) == (1, 2, True)
    assert view.compute is not None and view.compute.step == 1
    assert view.first_step is not None and view.first_step.step == 0  # the generation's first, read once

    # A new generation: nothing of the last one is carried over but the workers' steps (per worker).
    publish(store, 1, ["b"])
    view = observer.refresh()
    assert (view.generation, view.progress, view.first_step, view.failed, view.errors, view.rebuilt) == (
        1, None, None, False, None, False)
    assert view.config is not None and view.config.members == ("b",)
    assert view.seq == 5


def test_the_thread_publishes_views_and_fresh_waits_for_a_read_after_the_call() -> None:
    store = dist.HashStore()
    observer = StoreObserver(store, JobTimeouts(store_poll=0.005, rank_step_poll=0.01))
    observer.start()
    try:
        publish(store, 0, ["a"])
        wait_for(observer, lambda v: v.generation == 0 and v.config is not None, "generation 0")
        train(store, 0, 3, ["a:0"], first=True)
        view = observer.fresh(DEADLINE_S)  # the keys were set before the call: a fresh view shows them all
        assert (view.progress, view.first_step is not None, dict(view.worker_steps)) == (3, True, {"a:0": 3})
        with pytest.raises(RuntimeError, match="not while the observer's thread runs"):
            observer.refresh()
    finally:
        observer.close()
    assert observer._thread is not None
    observer._thread.join(DEADLINE_S)
    assert not observer._thread.is_alive()  # closed: no more reads


def test_requests_per_period_are_bounded_whatever_the_number_of_nodes() -> None:
    store = CountingStore()
    nodes = [f"n{i}" for i in range(64)]
    workers = [keys.worker_id(n, local) for n in nodes for local in range(8)]
    observer = StoreObserver(store, JobTimeouts(rank_step_poll=3600.0), workers_per_node=8)
    publish(store, 0, nodes)
    for w in workers:
        store.set(keys.rebuilt(0, w), json.dumps({"groups_s": 0.1, "copy_s": 0.0, "bytes": 0, "t": 1.0}))
    train(store, 0, 0, workers, first=True)
    observer.refresh()  # the first read finds every key (and reads the steps: rank_step_poll is due)
    assert len(observer.view.worker_steps) == len(workers)

    for step in range(1, 6):  # a steady generation: a step between two reads
        train(store, 0, step, workers)
        store.counts.clear()
        view = observer.refresh()
        assert view.progress == step and view.compute is not None and view.compute.step == step
        # current_gen, progress and compute in one multi_get; failed, errors and mismatch checked (not set yet)
        assert store.counts == Counter(multi_get=1, check=3), store.counts

    observer._next_steps = 0.0  # the workers' steps are due: one more request, for 512 workers
    store.counts.clear()
    view = observer.refresh()
    assert store.counts == Counter(multi_get=2, check=3), store.counts
    assert dict(view.worker_steps) == dict.fromkeys(workers, 5)

    # Errors once reported are read with the rest; a failed generation is not checked again.
    store.add(keys.errors(0), 1)
    store.set(keys.failed(0), json.dumps({"cause": "x"}))
    observer.refresh()
    store.counts.clear()
    view = observer.refresh()
    assert (view.errors, view.failed) == (1, True)
    assert store.counts == Counter(multi_get=1), store.counts


def test_a_node_counts_in_the_steps_once_every_worker_of_it_reached_a_collective() -> None:
    store = CountingStore()
    observer = StoreObserver(store, JobTimeouts(rank_step_poll=1e-9), workers_per_node=2)
    publish(store, 0, ["a", "b", "c"])
    store.set(keys.worker_step("a:0"), "4")
    store.set(keys.worker_step("a:1"), "4")
    store.set(keys.worker_step("b:1"), "3")
    assert dict(observer.refresh().worker_steps) == {"a:0": 4, "a:1": 4}

    def requests(steps_due: bool) -> Counter[str]:
        observer._next_steps = 0.0 if steps_due else float("inf")
        store.counts.clear()
        observer.refresh()
        return Counter(store.counts)

    steps = requests(True)
    steps.subtract(requests(False))
    # a's keys are known (read); b's and c's are checked together, then node by node
    assert +steps == Counter(check=3, multi_get=1), steps
    store.set(keys.worker_step("b:0"), "3")
    observer._next_steps = 0.0
    assert dict(observer.refresh().worker_steps) == {"a:0": 4, "a:1": 4, "b:0": 3, "b:1": 3}


def test_a_value_that_is_not_what_its_key_holds_keeps_the_last_view() -> None:
    store = dist.HashStore()
    observer = StoreObserver(store, JobTimeouts(store_poll=0.005))
    publish(store, 0, ["a"])
    store.set(keys.progress(0), "not a step")
    observer.start()
    try:
        deadline = time.monotonic() + DEADLINE_S
        while observer.last_error is None:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert "gen0/progress" in observer.last_error and observer.view.seq == 0
        store.set(keys.progress(0), "7")
        assert wait_for(observer, lambda v: v.progress == 7, "the step").generation == 0
    finally:
        observer.close()
