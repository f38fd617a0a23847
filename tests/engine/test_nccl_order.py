"""NCCL's ordering rules on gloo (engine/nccl_order.py): a schedule that would deadlock on a GPU deadlocks
here too, and the engine's own p2p (1F1B, state copies) does not.

Ranks are threads of this process, each with its own real gloo group on one TCPStore."""

from __future__ import annotations

import datetime as dt
import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from exec_plans import make_plan

from oobleck_slurm.engine import nccl_order
from oobleck_slurm.engine.comm import Generation, make_group
from oobleck_slurm.engine.layout import ExecPlan, PipelineSpec
from oobleck_slurm.engine.nccl_order import OrderedGroup, P2POp
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.models import gpt_config
from oobleck_slurm.timeouts import JobTimeouts

SHORT = dt.timedelta(seconds=3)
TIMEOUTS = JobTimeouts(collective_timeout=60.0, step_timeout=300.0)  # generous: nothing here should time out


def run_ranks(n: int, fn: Callable[[int], Any], timeout: float = 120.0) -> list[Any]:
    """fn(rank) in n threads; their results (or the exception each raised)."""
    results: list[Any] = [None] * n

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - returned to the test
            results[rank] = e

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank is still running past the test's bound"
    return results


def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))


def client(s: dist.TCPStore) -> dist.TCPStore:
    """A rank's own connection: one client blocked in a get would hold up the other ranks' calls."""
    return dist.TCPStore("127.0.0.1", s.port, is_master=False, timeout=dt.timedelta(seconds=30))


def pair(s: dist.Store, prefix: str, rank: int, ordered: bool) -> Any:
    pg = make_group(client(s), prefix, rank, 2, SHORT, "gloo", dt.timedelta(seconds=30))
    return OrderedGroup(pg, prefix) if ordered else pg


BIG = 1 << 20  # elements: far above any internal buffer, as the rendezvous rule assumes


def crossing_sends(group: Any, rank: int) -> torch.Tensor:
    """Both ranks send, then receive, on one group: 1F1B's steady state on one communicator."""
    out, into = torch.full((BIG,), float(rank)), torch.empty(BIG)
    send = group.send([out], 1 - rank, 0)
    group.recv([into], 1 - rank, 0).wait(SHORT)
    send.wait(SHORT)
    return into


def test_crossing_sends_complete_on_plain_gloo_but_deadlock_under_nccl_order() -> None:
    s = store()
    plain = run_ranks(2, lambda r: crossing_sends(pair(s, "plain", r, ordered=False), r))
    assert [float(t[0]) for t in plain] == [1.0, 0.0]  # gloo buffers the sends
    ordered = run_ranks(2, lambda r: crossing_sends(pair(s, "ordered", r, ordered=True), r))
    assert all(isinstance(e, RuntimeError) and "timed out" in str(e) for e in ordered), ordered


def test_a_batch_that_sends_and_receives_starts_together() -> None:
    s = store()

    def batch(rank: int) -> torch.Tensor:
        group = pair(s, "batch", rank, ordered=True)
        out, into = torch.full((BIG,), float(rank)), torch.empty(BIG)
        group.exchange([P2POp("send", out, 1 - rank, 0), P2POp("recv", into, 1 - rank, 0)]).wait(SHORT)
        return into

    assert [float(t[0]) for t in run_ranks(2, batch)] == [1.0, 0.0]


def test_a_failed_operation_breaks_the_group_for_every_later_one() -> None:
    s = store()
    # One member only: its peer never comes, so its receive times out, and what follows fails too.
    pg = dist.ProcessGroupGloo(dist.PrefixStore("solo", s), 0, 1, SHORT)
    group = OrderedGroup(pg, "solo")
    first = group.recv([torch.empty(4)], 0, 7)  # nobody sends to rank 0 with tag 7
    second = group.allreduce([torch.ones(1)])
    with pytest.raises(RuntimeError, match="ordered group"):
        first.wait(dt.timedelta(seconds=20))
    with pytest.raises(RuntimeError, match="ordered group failed"):
        second.wait(dt.timedelta(seconds=20))


def tiny_job(microbatches: int) -> JobSpec:
    return JobSpec(
        model=ModelSpec(gpt_config("tiny")),  # 6 layers: embedding, 4 blocks, head
        data=DataSpec("random", num_samples=256, seed=1),
        optim=OptimSpec("adamw", lr=3e-3, weight_decay=0.1),
        train=TrainSpec(steps=3, microbatch_size=2, num_microbatches=microbatches, seed=0, precision="fp64"),
    )


@pytest.mark.parametrize("stages,ordered", [(2, "1"), (3, "1"), (2, "0")])
def test_1f1b_and_state_copies_run_under_nccl_order_and_match_one_rank(monkeypatch, stages, ordered) -> None:
    """A pipeline of 2-3 stages with more microbatches than stages (steady 1F1B, where sends cross),
    then a plan change that copies every layer to other ranks; the losses equal a one-rank run's.
    Also on plain gloo (ordered "0"), which the rest of the suite does not run."""
    monkeypatch.setenv(nccl_order.ENV, ordered)
    torch.set_num_threads(1)
    job = tiny_job(microbatches=6)
    bounds = {2: [0, 3, 6], 3: [0, 2, 4, 6]}[stages]
    s = store()
    one = Worker(job, 0)
    plan1 = make_plan(6, [[0, 6]], [6])
    one.adopt(plan1, Generation(s, 100, 0, 1, plan1, TIMEOUTS))
    expected = [one.train_step().loss for _ in range(3)]

    pipeline = make_plan(6, [bounds], [6])
    # The second plan runs the same pipeline with its stages on the ranks in reverse order: every
    # layer moves, each rank both sends and receives (copies that cross).
    reverse = ExecPlan(6, 6, (PipelineSpec(tuple(reversed(range(stages))), tuple(bounds), 0, 6),))
    timeouts = JobTimeouts(collective_timeout=20.0, step_timeout=300.0)

    def rank_fn(rank: int) -> list[float]:
        w = Worker(job, rank)
        c = client(s)
        w.adopt(pipeline, Generation(c, 0, rank, stages, pipeline, timeouts))
        losses = [w.train_step().loss, w.train_step().loss]
        transfers = [(layer, pipeline.holders(layer)[0], reverse.holders(layer)[0]) for layer in range(6)
                     if pipeline.holders(layer)[0] != reverse.holders(layer)[0]]
        w.adopt(reverse, Generation(c, 1, rank, stages, reverse, timeouts), "memory", transfers)
        losses.append(w.train_step().loss)
        return losses

    results = run_ranks(stages, rank_fn)
    assert not any(isinstance(r, BaseException) for r in results), results
    assert results[0] == pytest.approx(expected, rel=1e-12)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def thread_count(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def test_released_generations_free_their_groups(monkeypatch) -> None:
    """Ten generations of a 2-stage pipeline, each released once the next has formed (as a worker
    does): their groups' threads end and the process's sockets do not grow with each generation."""
    monkeypatch.setenv(nccl_order.ENV, "1")
    s = store()
    plan = make_plan(6, [[0, 3, 6]], [2])

    def generations(rank: int, first: int) -> None:
        c = client(s)
        previous = None
        for g in range(first, first + 10):
            gen = Generation(c, g, rank, 2, plan, TIMEOUTS)
            if previous is not None:
                previous.release()
            previous = gen
        if previous is not None:
            previous.release()  # the job's end

    def settle(first: int) -> int:
        executors = thread_count("nccl-order:")
        run_ranks(2, lambda rank: generations(rank, first))
        deadline = time.monotonic() + 60  # reaper threads drop the groups in the background
        while time.monotonic() < deadline and (thread_count("release:") or thread_count("nccl-order:") > executors):
            time.sleep(0.05)
        assert thread_count("nccl-order:") <= executors, "a released group's executor is still running"
        gc.collect()
        return open_fds()

    fds1 = settle(0)  # 10 generations
    fds2 = settle(10)  # 10 more: nothing left behind by the first ten
    assert fds2 - fds1 < 10, (fds1, fds2)
