"""StepUndo: a step's optimizer update can be undone exactly (one rank, a real gloo group)."""

from __future__ import annotations

import datetime as dt

import pytest
import torch
import torch.distributed as dist
from exec_plans import make_plan

from oobleck_slurm.engine.comm import Generation, Timeouts
from oobleck_slurm.engine.recovery import RollbackError, StepUndo
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.models.config import gpt_config
from oobleck_slurm.optim import optimizer_state_tensors


def tiny_job(optimizer: str, steps: int) -> JobSpec:
    return JobSpec(
        model=ModelSpec(gpt_config("tiny")),  # 4 blocks, d=64, seq 64: 6 layers
        data=DataSpec("random", num_samples=512, seed=1),
        optim=OptimSpec(optimizer, lr=3e-3, weight_decay=0.1),
        train=TrainSpec(steps=steps, microbatch_size=2, num_microbatches=8, seed=0, grad_clip=1.0,
                        warmup_steps=2, precision="fp64"),
    )


def state_of(worker):
    out = {}
    for i, layer in worker.layers.items():
        out.update({f"{i}.p.{n}": p.detach().clone() for n, p in layer.named_parameters()})
        out.update({f"{i}.s.{n}": t.clone() for n, t in optimizer_state_tensors(worker.optimizers[i]).items()})
    return out


@pytest.mark.parametrize("optimizer", ["adamw", "came"])
def test_rollback_restores_the_pre_step_state_and_replay_is_identical(optimizer):
    torch.set_num_threads(1)
    job = tiny_job(optimizer, steps=4)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))
    plan = make_plan(6, [[0, 6]], [8])
    worker = Worker(job, 0)
    worker.adopt(plan, Generation(store, 0, 0, 1, plan, Timeouts()))
    undo = StepUndo(worker)
    undo.attach()
    worker.train_step()
    before = state_of(worker)  # start of step 1
    first = worker.train_step()
    after = state_of(worker)
    assert worker.step == 2 and any(not torch.equal(before[k], after[k]) for k in before)
    assert undo.rollback_to(1) and worker.step == 1
    restored = state_of(worker)
    assert all(torch.equal(before[k], restored[k]) for k in before)
    again = worker.train_step()  # the replayed step: same samples, same update, bit for bit
    assert again.loss == first.loss
    assert all(torch.equal(after[k], v) for k, v in state_of(worker).items())
    with pytest.raises(RollbackError, match="cannot return to step 0"):
        undo.rollback_to(0)  # two steps back: no copy for that
