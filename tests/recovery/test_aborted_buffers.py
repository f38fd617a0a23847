"""Work of an aborted generation that gloo cannot abort must not write into what the replay uses.

`AbortableGeneration.wait` raises GenerationAborted at the coordinator's key while gloo's thread goes on
with the operation (a gloo group has no abort; it ends with its peers or its timeout). A layer's
gradient is all-reduced in place, so an interrupted step leaves all-reduces that may still write into
the layer's gradient buffer. Real gloo groups; the aborted generation's other rank is played by the
test, which posts its part of the all-reduces only once the aborted rank has moved on: the moment at
which the old work lands is then chosen, not raced."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
import torch
import torch.distributed as dist
from exec_plans import make_plan
from test_step_commit import TIMEOUTS, FailAtWait, state_of, tiny_job

from oobleck_slurm.engine.abort import AbortableGeneration, GenerationAborted
from oobleck_slurm.engine.recovery import can_complete, reach_step
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.protocol import keys

TWO = make_plan(6, [[0, 6], [0, 6]], [4, 4])  # two data-parallel pipelines: every layer all-reduced by ranks 0 and 1
ALONE = make_plan(6, [[0, 6]], [8])  # rank 0 alone, after the loss of rank 1's pipeline
CONDITION_S = 60.0  # the longest a test waits for a condition (a loaded machine), never a fixed sleep
LATE = 1.0e6  # what the late peer contributes: far above any gradient of the tiny model


def store_and_client() -> tuple[dist.TCPStore, dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))
    return store, dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=dt.timedelta(seconds=30))


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + CONDITION_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {CONDITION_S:g} s: {what}"
        time.sleep(0.001)


class Once:
    """A generation's wait hook that runs `fn` before its first wait only."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


def peer_generation(client: dist.Store, g: int, plan, box: dict) -> threading.Thread:
    """Rank 1 of generation g, built in a thread (a group forms only with all its members)."""
    def build() -> None:
        box["gen"] = AbortableGeneration(client, g, 1, 2, plan, TIMEOUTS)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    return thread


def test_gloo_writes_into_an_aborted_allreduces_buffer_after_the_wait_raised():
    """The premise, on a large tensor: the wait raises at once, and the buffer, zeroed after that (as a
    replay zeroes its gradients), is written again by the aborted all-reduce."""
    torch.set_num_threads(1)
    store, client = store_and_client()
    box: dict = {}
    thread = peer_generation(client, 0, TWO, box)
    gen = AbortableGeneration(store, 0, 0, 2, TWO, TIMEOUTS)
    thread.join(CONDITION_S)
    n = 2**24  # 64 MiB of float32
    buf = torch.ones(n)
    work = gen.world.allreduce([buf])  # in place, as a layer's gradient
    store.set(keys.failed(0), "{}")
    wait_until(gen.watch.failed, "the watch sees the failed key")
    t0 = time.monotonic()
    with pytest.raises(GenerationAborted):
        gen.wait(work)
    buf.zero_()
    late = box["gen"].world.allreduce([torch.full((n,), 2.0)])  # the other member's part arrives now
    late.wait()
    wait_until(lambda: bool((buf != 0).all()), "the aborted all-reduce fills the zeroed buffer")
    print(f"aborted all-reduce of {n * 4 / 2**20:.0f} MiB wrote its result {time.monotonic() - t0:.3f} s after the wait raised")


def test_a_replay_gets_gradient_buffers_that_the_aborted_steps_allreduces_cannot_reach():
    """Rank 0 trains step 0 with rank 1 (played by the test); the generation fails at rank 0's first wait,
    with every layer's all-reduce posted. Rank 1's pipeline is lost, so rank 0 replays step 0 alone on a
    new generation, keeping its layers. While the replay waits at its commit point (gradients reduced,
    norm taken, update not applied), rank 1's part of the old all-reduces arrives. The replayed step must
    equal the same step trained alone from the start, parameters and optimizer state bit for bit."""
    torch.set_num_threads(1)
    store, client = store_and_client()
    job = tiny_job("adamw")

    reference = Worker(job, 0)
    reference.adopt(ALONE, AbortableGeneration(store, 100, 0, 1, ALONE, TIMEOUTS))
    reference.train_step()

    box: dict = {}
    thread = peer_generation(client, 0, TWO, box)
    worker = Worker(job, 0)
    hook = FailAtWait(store, 0)
    hook.gen = AbortableGeneration(store, 0, 0, 2, TWO, TIMEOUTS, on_wait=hook)
    thread.join(CONDITION_S)
    worker.adopt(TWO, hook.gen)
    old = dict(worker.grads)  # the buffers step 0's all-reduces are posted on
    hook.at = 1  # the first wait: every layer's all-reduce is posted (a one-stage pipeline has no p2p)
    with pytest.raises(GenerationAborted):
        worker.train_step()
    assert worker.step == 0 and not can_complete(worker)

    peer = box["gen"]
    sizes = {i: g.numel() for i, g in old.items()}

    def old_work_lands() -> None:
        """At the replay's commit point: rank 1 posts its part of generation 0's all-reduces, in the
        order rank 0 posted them (the last layer first), and every old buffer receives its sum."""
        works = [peer.layer_group[i].allreduce([torch.full((sizes[i],), LATE, dtype=torch.float64)])
                 for i in sorted(sizes, reverse=True)]
        for work in works:
            work.wait()
        wait_until(lambda: all(bool((b > LATE / 2).all()) for b in old.values()),
                   "generation 0's all-reduces write their sums")

    assert not reach_step(worker, 0)  # nobody applied step 0: it is replayed
    gen = AbortableGeneration(store, 1, 0, 1, ALONE, TIMEOUTS)
    worker.adopt(ALONE, gen, "memory")
    gen.on_wait = Once(old_work_lands)  # a generation of one rank: its step's only wait is the commit point
    worker.train_step()
    expected, got = state_of(reference), state_of(worker)
    assert sorted(got) == sorted(expected)
    wrong = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not wrong, f"{len(wrong)} of {len(expected)} tensors differ after the replay, e.g. {wrong[:4]}"
