"""What the sections compare the engine with: the uninterrupted run on generation 0 (a, f) and the
plain PyTorch loop over the same layers and batches (b, c).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from acceptance.harness import Settings, master_store, release, snapshot, start_worker

if TYPE_CHECKING:
    from oobleck_slurm.engine.layout import ExecPlan
    from oobleck_slurm.engine.spec import JobSpec


def run_uninterrupted(s: Settings, job: JobSpec, plan: ExecPlan) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    """The reference: every step on generation 0."""
    store = master_store()
    worker, gen = start_worker(s, job, plan, store)
    losses = {}
    while worker.step < job.train.steps:
        r = worker.train_step()
        losses[r.step] = r.loss
    release(gen)
    return snapshot(worker), losses


def plain_model(job: JobSpec, device: torch.device) -> torch.nn.Sequential:
    """The same layers, initialised as the engine initialises them, as one module."""
    cfg = job.model.config
    return torch.nn.Sequential(*cfg.build_layers(job.train.seed, 0, cfg.num_layers)).to(device, job.train.param_dtype)


def plain_optimizer(job: JobSpec, model: torch.nn.Module, device: torch.device, fused: bool) -> torch.optim.Optimizer:
    kw: dict[str, Any] = {}
    if fused:
        kw = {"fused": True}  # torch's fused AdamW kernel, on CUDA and on the CPU
    return torch.optim.AdamW(model.parameters(), lr=job.optim.lr, weight_decay=job.optim.weight_decay, **kw)


def plain_step(job: JobSpec, model: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
               opt: torch.optim.Optimizer, batches: Any, step: int, device: torch.device) -> None:
    """One step of the plain loop: the step's microbatches accumulated (loss / M), clip, AdamW."""
    from oobleck_slurm.models.loss import lm_loss

    t = job.train
    opt.zero_grad()
    for m in range(t.num_microbatches):
        x, y = (v.to(device) for v in batches.microbatch(step, m))
        with (torch.autocast(device.type, dtype=torch.bfloat16) if t.precision == "bf16" else contextlib.nullcontext()):
            loss = lm_loss(forward(x), y) / t.num_microbatches
        loss.backward()
    if t.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
    opt.step()


def step_batches(job: JobSpec) -> Any:
    from oobleck_slurm.engine.batches import StepBatches, open_dataset

    t = job.train
    return StepBatches(open_dataset(job.data, job.model.seq_len, job.model.vocab_size),
                       t.global_batch_size, t.microbatch_size, t.seed)
