"""The non-finite guard (engine/worker.py complete_step): a NaN in one rank's gradient makes every rank
skip the step, parameters and optimizer state bitwise unchanged, and training goes on with the next
step's samples. Two data-parallel pipelines as threads on real gloo groups: the poisoned gradient of
rank 1 reaches rank 0 through the layers' all-reduce, so both see the same non-finite norm (the same
bits), the one thing every rank agrees on before it updates, also a rank that completes a pending
step alone in a recovery."""

from __future__ import annotations

import datetime as dt
import math

import torch
import torch.distributed as dist
from exec_plans import make_plan
from rank_threads import on_ranks, worker_state

from oobleck_slurm.engine.abort import AbortableGeneration
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.models import gpt_config
from oobleck_slurm.timeouts import JobTimeouts

TIMEOUTS = JobTimeouts(collective_timeout=60.0, step_timeout=300.0)
PLAN = make_plan(6, [[0, 6], [0, 6]], [2, 2])  # two pipelines of one stage: data parallel
POISONED = 1  # the step whose gradient rank 1 poisons


def test_a_nan_on_one_rank_makes_every_rank_skip_the_step_unchanged():
    job = JobSpec(model=ModelSpec(gpt_config("tiny")), data=DataSpec("random", num_samples=256, seed=1),
                  optim=OptimSpec("adamw", lr=3e-3, weight_decay=0.1),
                  train=TrainSpec(steps=3, microbatch_size=2, num_microbatches=4, seed=0, precision="fp64"))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))
    seen: dict[int, list] = {0: [], 1: []}
    finals: dict[int, dict[str, torch.Tensor]] = {}

    def rank(r: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=dt.timedelta(seconds=30))
        worker = Worker(job, r)
        worker.adopt(PLAN, AbortableGeneration(client, 0, r, 2, PLAN, TIMEOUTS))
        for step in range(job.train.steps):
            before = worker_state(worker)
            hook = None
            if r == 1 and step == POISONED:  # one element of one layer's gradient, on one rank
                p = next(worker.layers[3].parameters())
                hook = p.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("nan")))
            result = worker.train_step()
            if hook is not None:
                hook.remove()
            after = worker_state(worker)
            unchanged = all(torch.equal(before[k], after[k]) for k in before)
            seen[r].append((result.step, result.skipped, unchanged, result.grad_norm, worker.step))
        finals[r] = worker_state(worker)

    on_ranks(2, rank)
    for r in (0, 1):
        steps = seen[r]
        assert [s[0] for s in steps] == [0, 1, 2] and [s[4] for s in steps] == [1, 2, 3]  # the step is consumed
        assert [s[1] for s in steps] == [False, True, False], steps  # both ranks skipped step 1 only
        assert steps[1][2] is True and not math.isfinite(steps[1][3])  # bitwise unchanged, the norm says why
        assert steps[0][2] is False and steps[2][2] is False  # the others trained
    assert seen[0][2][3] == seen[1][2][3]  # and the replicas still agree afterwards
    # Replicas of a layer receive the same reduced gradients and the same clip coefficient: with
    # single-device stages they hold bitwise the same parameters and optimizer state after every step
    # (the premise of a cross-replica checksum, issue: replica integrity).
    assert finals[0].keys() == finals[1].keys() and all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
