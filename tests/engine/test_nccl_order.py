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


def test_a_pair_posted_in_different_orders_fails_at_both_ends() -> None:
    """NCCL pairs a pair's sends and receives by posting order (it has no tags): rank 1 receiving tag 1
    first would get tag 0's tensor there. gloo matches by tag, so the mode must check the order itself."""
    s = store()
    x, y = torch.full((BIG,), 1.0), torch.full((BIG,), 2.0)

    def swapped(rank: int) -> Any:
        group = pair(s, "swapped", rank, ordered=True)
        if rank == 0:
            work = group.exchange([P2POp("send", x, 1, 0), P2POp("send", y, 1, 1)])
        else:
            b0, b1 = torch.empty(BIG), torch.empty(BIG)
            work = group.exchange([P2POp("recv", b1, 0, 1), P2POp("recv", b0, 0, 0)])
        work.wait(SHORT)
        return "completed"

    results = run_ranks(2, swapped)
    for r in results:
        assert isinstance(r, RuntimeError) and "point-to-point order differs" in str(r), results
    assert "receive #1 tag 1" in str(results[0]) and "send #1 tag 0" in str(results[1]), results


def test_a_pair_posted_in_the_same_order_matches_by_order() -> None:
    """Several sends between one pair, in a batch and one by one: each meets the receive posted in the same
    place at the other end."""
    s = store()

    def in_order(rank: int) -> list[float]:
        group = pair(s, "in-order", rank, ordered=True)
        if rank == 0:
            group.exchange([P2POp("send", torch.full((BIG,), float(k)), 1, k) for k in range(3)]).wait(SHORT)
            group.send([torch.full((8,), 7.0)], 1, 9).wait(SHORT)
            return []
        bufs = [torch.empty(BIG) for _ in range(3)]
        group.exchange([P2POp("recv", b, 0, k) for k, b in enumerate(bufs)]).wait(SHORT)
        last = torch.empty(8)
        group.recv([last], 0, 9).wait(SHORT)
        return [float(b[0]) for b in bufs] + [float(last[0])]

    assert run_ranks(2, in_order)[1] == [0.0, 1.0, 2.0, 7.0]


def crossed_groups(s: dist.Store, rank: int, limit: int | None, prefix: str) -> str:
    """Two groups of the same two ranks sharing each rank's slots; rank 0 posts an all-reduce on a then on
    b, rank 1 on b then on a, then each waits for both."""
    slots = nccl_order.Slots(limit)
    groups = {name: OrderedGroup(make_group(client(s), f"{prefix}/{name}", rank, 2, SHORT, "gloo",
                                            dt.timedelta(seconds=30)), name, slots) for name in ("a", "b")}
    order = ["a", "b"] if rank == 0 else ["b", "a"]
    works = [groups[name].allreduce([torch.ones(BIG)]) for name in order]
    for work in works:
        work.wait(dt.timedelta(seconds=60))
    return "completed"


def test_rank_dependent_orders_on_two_groups_deadlock_under_one_slot_and_say_so() -> None:
    """Rule 4 of nccl_order.py: with one operation at a time per rank (a device full of kernels that wait
    for their peers), rank 0's all-reduce on a waits for rank 1's, which cannot start behind rank 1's
    all-reduce on b, which waits for rank 0's. The groups' timeout ends it, and the error names what held
    the slot and what waited for it. Without a bound, or with two slots, the same posting completes."""
    s = store()
    assert run_ranks(2, lambda r: crossed_groups(s, r, None, "unbounded")) == ["completed"] * 2
    assert run_ranks(2, lambda r: crossed_groups(s, r, 2, "two")) == ["completed"] * 2
    results = run_ranks(2, lambda r: crossed_groups(s, r, 1, "one"))
    first = {0: "a", 1: "b"}
    assert all(isinstance(r, RuntimeError) and "operation slots (1): running" in str(r) for r in results), results

    def names_the_deadlock(rank: int) -> bool:  # its own first operation held the slot, the other waited
        text = str(results[rank])
        return (f"allreduce on group {first[rank]}" in text.split("running")[1].split(";")[0]
                and f"allreduce on group {first[1 - rank]}" in text.split("ready to start")[1])

    # The rank whose timeout fires first says so. Its slot is then free: under load its other operation
    # may pair with the peer's, still waiting, and the peer fails later on the broken group instead.
    assert names_the_deadlock(0) or names_the_deadlock(1), results


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


@pytest.mark.parametrize("stages,ordered,slots", [(2, "1", "1"), (3, "1", "1"), (3, "1", "0"), (2, "0", "0")])
def test_1f1b_and_state_copies_run_under_nccl_order_and_match_one_rank(monkeypatch, stages, ordered, slots) -> None:
    """A pipeline of 2-3 stages with more microbatches than stages (steady 1F1B, where sends cross),
    then a plan change that copies every layer to other ranks; the losses equal a one-rank run's.
    Under one operation slot per rank (what the suite runs), without a bound, and on plain gloo
    (ordered "0"), which the rest of the suite does not run."""
    monkeypatch.setenv(nccl_order.ENV, ordered)
    monkeypatch.setenv(nccl_order.SLOTS_ENV, slots)
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
