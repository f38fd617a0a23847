"""Fresh processes for test_memory_model.py: an engine worker's bytes at its step's peak, and the
planner's measured profiles of the same models.

    python tests/planning/worker_memory.py worker CONFIG_JSON     ->  one JSON line on stdout
    python tests/planning/worker_memory.py profile CONFIGS_JSON   ->  the profiles, one JSON line

CONFIG: the GPT (`gpt`), `optimizer`, `precision`, `microbatch_size`, `microbatches`, `steps`, the
ExecPlan (`plan`, JSON), this worker's `rank` and the `world` size, and the `port` of the TCPStore the
test hosts. The worker is the engine's `Worker` on a real gloo Generation (as tests/recovery does it);
its peak is `oobleck_slurm.peak_memory.PeakMemory`'s, above a baseline taken after the groups
exist and before the layers do. Start it with `peak_memory.MALLOC_ENV` in its environment so that its
RSS follows the live tensors. A profile is `planning.measure.profile_model`'s (what `submit` plans
with), in a process of its own: its workspace pass sets glibc's malloc for the rest of the process.
"""

from __future__ import annotations

import datetime as dt
import json
import sys

import torch
import torch.distributed as dist

from oobleck_slurm.engine.comm import Generation
from oobleck_slurm.engine.layout import ExecPlan
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.models import GPTConfig
from oobleck_slurm.peak_memory import PeakMemory, malloc_configured, warm_up
from oobleck_slurm.timeouts import JobTimeouts


def job_spec(c: dict) -> JobSpec:
    return JobSpec(
        model=ModelSpec(GPTConfig(**c["gpt"])),
        data=DataSpec("random", num_samples=256, seed=1),
        optim=OptimSpec(c["optimizer"], lr=1e-3, weight_decay=0.1),
        train=TrainSpec(steps=c["steps"], microbatch_size=c["microbatch_size"], num_microbatches=c["microbatches"],
                        seed=0, grad_clip=1.0, precision=c["precision"]),
    )


def flat_gradients(worker: Worker) -> bool:
    """True when each held layer's gradients are views into one buffer (the engine all-reduces that
    buffer in place); False when each gradient has its own storage (the engine then all-reduces a
    concatenated copy of them)."""
    return all(
        len({p.grad.untyped_storage().data_ptr() for p in layer.parameters() if p.grad is not None}) == 1
        for layer in worker.layers.values()
    )


def main(c: dict) -> dict:
    torch.set_num_threads(1)
    job = job_spec(c)
    plan = ExecPlan.from_json(c["plan"])
    timeouts = JobTimeouts(collective_timeout=120.0, step_timeout=300.0)
    store = dist.TCPStore("127.0.0.1", c["port"], is_master=False, timeout=dt.timedelta(seconds=60))
    worker = Worker(job, c["rank"])
    gen = Generation(store, 0, c["rank"], c["world"], plan, timeouts)
    warm_up()
    probe = PeakMemory()
    worker.adopt(plan, gen)
    peaks = []
    for _ in range(job.train.steps):
        probe.start()
        worker.train_step()
        peaks.append(probe.peak())
    gen.wait(gen.world.barrier())  # no rank leaves while its neighbour still sends
    return {"peaks": peaks, "after": probe.now(), "flat_gradients": flat_gradients(worker), "probe": probe.method,
            "malloc_configured": malloc_configured(),
            "params": sum(p.numel() for layer in worker.layers.values() for p in layer.parameters())}


def profiles(configs: list[dict]) -> list[dict]:
    from oobleck_slurm.planning.measure import profile_model
    from oobleck_slurm.planning.profile import LINK_NAMES, Link

    link = Link(1e-5, 1e9)  # links do not enter the memory model
    return [profile_model(GPTConfig(**c["gpt"]), microbatch_size=c["microbatch_size"], dtype=c["precision"],
                          optimizer=c["optimizer"], repeats=1, links={name: link for name in LINK_NAMES}).to_dict()
            for c in configs]


if __name__ == "__main__":
    mode, arg = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps(main(arg) if mode == "worker" else profiles(arg)))
