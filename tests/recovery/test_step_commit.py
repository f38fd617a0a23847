"""A step interrupted at its commit point is completed or replayed exactly, with no copy of the state
(engine/recovery.py). One rank on a real gloo group; the failure is the coordinator's `gen{g}/failed`
key, set while the rank waits for the step's last collective."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
import torch
import torch.distributed as dist
from exec_plans import make_plan

from oobleck_slurm.engine.abort import AbortableGeneration, GenerationAborted
from oobleck_slurm.engine.recovery import StepMismatchError, can_complete, reach_step
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.models import gpt_config
from oobleck_slurm.optim import optimizer_state_tensors
from oobleck_slurm.protocol import keys
from oobleck_slurm.timeouts import JobTimeouts

PLAN = make_plan(6, [[0, 6]], [8])
TIMEOUTS = JobTimeouts(collective_timeout=60.0, step_timeout=300.0)  # generous: nothing here should time out


def tiny_job(optimizer: str) -> JobSpec:
    return JobSpec(
        model=ModelSpec(gpt_config("tiny")),  # 4 blocks, d=64, seq 64: 6 layers
        data=DataSpec("random", num_samples=512, seed=1),
        optim=OptimSpec(optimizer, lr=3e-3, weight_decay=0.1),
        train=TrainSpec(steps=4, microbatch_size=2, num_microbatches=8, seed=0, grad_clip=0.5,
                        warmup_steps=2, precision="fp64"),
    )


def state_of(worker: Worker) -> dict[str, torch.Tensor]:
    out = {}
    for i, layer in worker.layers.items():
        out.update({f"{i}.p.{n}": p.detach().clone() for n, p in layer.named_parameters()})
        out.update({f"{i}.s.{n}": t.clone() for n, t in optimizer_state_tensors(worker.optimizers[i]).items()})
    return out


class FailAtWait:
    """Sets the generation's failed key before wait number `at` of the step (counted from 1), and
    returns once the generation's watch has seen it (the coordinator's key arrives asynchronously)."""

    def __init__(self, store: dist.Store, generation: int) -> None:
        self.store, self.generation, self.count, self.at = store, generation, 0, 0
        self.gen: AbortableGeneration | None = None

    def __call__(self) -> None:
        self.count += 1
        if self.count == self.at:
            self.store.set(keys.failed(self.generation), "{}")
            deadline = time.monotonic() + 30
            while self.gen is not None and not self.gen.watch.failed() and time.monotonic() < deadline:
                time.sleep(0.001)


def worker_on_generation(optimizer: str, store: dist.TCPStore, g: int) -> tuple[Worker, FailAtWait]:
    worker = Worker(tiny_job(optimizer), 0)
    hook = FailAtWait(store, g)
    hook.gen = AbortableGeneration(store, g, 0, 1, PLAN, TIMEOUTS, on_wait=hook)
    worker.adopt(PLAN, hook.gen)
    return worker, hook


@pytest.mark.parametrize("optimizer", ["adamw", "came"])
def test_a_step_aborted_at_its_commit_point_is_completed_or_replayed_bit_for_bit(optimizer):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))
    reference, _ = worker_on_generation(optimizer, store, 0)
    losses = [reference.train_step().loss for _ in range(3)]
    after = [state_of(reference)]

    for outcome, g in (("complete", 1), ("replay", 2)):
        worker, hook = worker_on_generation(optimizer, store, g)
        assert worker.train_step().loss == losses[0]
        hook.count, hook.at = 0, 0
        worker.train_step()
        waits = hook.count  # the waits of a step; the last is the metrics all-reduce, the commit point
        hook.count, hook.at = 0, waits
        with pytest.raises(GenerationAborted):
            worker.train_step()  # step 2, failed while waiting at its commit point
        assert worker.step == 2 and can_complete(worker)
        if outcome == "complete":  # a survivor applied step 2: this one completes it, no peer needed
            assert reach_step(worker, 3) and worker.step == 3 and not can_complete(worker)
            assert all(torch.equal(after[0][k], v) for k, v in state_of(worker).items())
        else:  # no survivor applied it: dropped, and the replay trains it again to the same bits
            assert not reach_step(worker, 2) and worker.step == 2 and not can_complete(worker)
            worker.adopt(PLAN, AbortableGeneration(store, 10 + g, 0, 1, PLAN, TIMEOUTS), "memory")
            assert worker.train_step().loss == losses[2]
            assert all(torch.equal(after[0][k], v) for k, v in state_of(worker).items())
        with pytest.raises(StepMismatchError, match="cannot reach step 1"):
            reach_step(worker, 1)  # behind is impossible: nothing to undo with


def test_ranks_aborted_before_the_commit_point_hold_no_pending_step():
    """Two data-parallel ranks (threads): the failure strikes at their first wait, a layer's gradient
    all-reduce; neither can complete the step, and both are still at its start."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))
    plan = make_plan(6, [[0, 6], [0, 6]], [4, 4])
    outcome: dict[int, tuple[int, bool, str]] = {}

    def rank(r: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=dt.timedelta(seconds=30))
        worker = Worker(tiny_job("adamw"), r)
        hook = FailAtWait(client, 0)
        hook.gen = AbortableGeneration(client, 0, r, 2, plan, TIMEOUTS, on_wait=hook)
        worker.adopt(plan, hook.gen)
        hook.at = 1
        try:
            worker.train_step()
            outcome[r] = (worker.step, can_complete(worker), "no abort")
        except GenerationAborted as e:
            outcome[r] = (worker.step, can_complete(worker), str(e))

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [outcome[r][:2] for r in range(2)] == [(0, False), (0, False)], outcome
