"""The worker process: `python -m oobleck_slurm.engine.process JOB_DIR RANK`.

Reads `JOB_DIR/job.json` (JobSpec) and `JOB_DIR/launch.json` (store address, world size, timeouts,
and the plan segments: plan p applies from step `from_step`), trains, and writes per-step events
(rank 0) to `JOB_DIR/events.jsonl`. Each segment runs on its own generation of process groups,
and the worker is rebuilt in place between segments.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

from oobleck_slurm.engine.comm import Generation, Timeouts, connect_store
from oobleck_slurm.engine.layout import ExecPlan, plan_transfers
from oobleck_slurm.engine.spec import JobSpec
from oobleck_slurm.engine.worker import StepResult, Worker
from oobleck_slurm.events import EventLog, events_path


def step_event(r: StepResult, generation: int, global_batch_size: int) -> dict:
    return {
        "step": r.step,
        "loss": r.loss,
        "grad_norm": r.grad_norm,
        "lr": r.lr,
        "seconds": r.seconds,
        "samples_per_s": global_batch_size / r.seconds if r.seconds > 0 else 0.0,
        "pipeline_seconds": r.pipeline_seconds,
        "compute_seconds": r.compute_seconds,
        "generation": generation,
    }


def run(job_dir: Path, rank: int) -> None:
    torch.set_num_threads(1)
    job = JobSpec.from_json((job_dir / "job.json").read_text())
    launch = json.loads((job_dir / "launch.json").read_text())
    timeouts = Timeouts(**launch["timeouts"])
    world = int(launch["world_size"])
    device = None
    if job.backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    store = connect_store(launch["host"], int(launch["port"]), timeouts)
    worker = Worker(job, rank, device)
    log = EventLog(events_path(job_dir)) if rank == 0 else None
    segments = launch["segments"]
    # Fault injection for tests and benchmarks: {"rank": r, "step": s} kills rank r before step s.
    fault = job.extra.get("fault", {})
    gen = None
    for g, segment in enumerate(segments):
        end = segments[g + 1]["from_step"] if g + 1 < len(segments) else job.train.steps
        plan = ExecPlan.from_json(segment["plan"])
        gen = Generation(store, g, rank, world, plan, timeouts, job.backend)
        if worker.plan is None:
            received = worker.adopt(plan, gen, "seed")
        else:  # same ranks, a new plan: copy what each rank lacks from the previous plan's holders
            old = {layer: list(worker.plan.holders(layer)) for layer in range(plan.num_layers)}
            received = worker.adopt(plan, gen, "memory", plan_transfers(old, plan))
        if log is not None:
            log.emit("generation", generation=g, step=worker.step, received_bytes_rank0=received)
        while worker.step < end:
            if fault.get("rank") == rank and fault.get("step") == worker.step:
                os._exit(int(fault.get("code", 17)))  # injected crash, no cleanup: like a dead node
            result = worker.train_step()
            if log is not None:
                log.emit("step", **step_event(result, g, job.train.global_batch_size))
    if job.extra.get("save_params"):
        out = job_dir / "params"
        out.mkdir(exist_ok=True)
        torch.save(worker.layer_state(), out / f"rank{rank}.pt")
    if gen is not None:  # nobody leaves while a peer may still use a group
        gen.wait(gen.world.barrier())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m oobleck_slurm.engine.process JOB_DIR RANK", file=sys.stderr)
        return 2
    try:
        run(Path(args[0]), int(args[1]))
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
