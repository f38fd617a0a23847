"""Each step reports its own peak of the device's memory (`StepResult.peak_memory`, the step event's
figure that the planner's memory model is checked against): `torch.cuda.max_memory_allocated` keeps the
process's highest point since its last reset, so the worker restarts it at every step's start
(peak_memory.StepPeak). Before, a step reported the highest point of any earlier moment: a first step's
warm-up, an evaluation, a checkpoint, anything the process allocated between steps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from exec_plans import make_plan

from oobleck_slurm.engine.comm import Generation
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.models import gpt_config
from oobleck_slurm.peak_memory import StepPeak
from oobleck_slurm.timeouts import JobTimeouts

SPIKE_BYTES = 2 * 2**30  # far above what a step of the tiny model allocates


def test_off_a_gpu_there_is_no_device_peak() -> None:
    probe = StepPeak(torch.device("cpu"))
    probe.start()
    assert probe.peak() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_reports_its_own_peak_not_an_earlier_one() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    job = JobSpec(model=ModelSpec(gpt_config("tiny")), data=DataSpec("random", num_samples=256, seed=1),
                  optim=OptimSpec("adamw", lr=3e-3), backend="nccl",
                  train=TrainSpec(steps=3, microbatch_size=2, num_microbatches=2, seed=0, precision="fp32"))
    timeouts = JobTimeouts()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeouts.td("store_timeout"))
    plan = make_plan(6, [[0, 6]], [2])
    worker = Worker(job, 0, device)
    worker.adopt(plan, Generation(store, 0, 0, 1, plan, timeouts, "nccl", device))
    first = worker.train_step().peak_memory[0]
    spike = torch.empty(SPIKE_BYTES, dtype=torch.uint8, device=device)  # between steps: an evaluation, say
    del spike
    second = worker.train_step().peak_memory[0]
    assert 0 < second < SPIKE_BYTES, (first, second)
    assert second <= first * 1.5 + 2**20, (first, second)  # the same step again, give or take the allocator
