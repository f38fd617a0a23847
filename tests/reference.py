"""Single-process reference training: the same global batches, optimizer, lr schedule and clipping
as the engine, with the whole model in one process and plain autograd. The engine's exactness
tests compare against it."""

from __future__ import annotations

import torch

from oobleck_slurm.engine.batches import StepBatches, open_dataset
from oobleck_slurm.engine.layer_optim import (
    clip_coefficient,
    layer_sq_norm,
    make_layer_optimizer,
    scale_grads,
    set_lr,
    zero_grads,
)
from oobleck_slurm.engine.lr import lr_at
from oobleck_slurm.engine.spec import JobSpec
from oobleck_slurm.models.gpt import lm_loss


def train_reference(job: JobSpec, steps: int | None = None
                    ) -> tuple[list[float], dict[str, dict[str, torch.Tensor]]]:
    """Train `steps` (default job.train.steps) steps; returns per-step mean losses and the final
    parameters by layer key and parameter name."""
    t, g = job.train, job.model.gpt
    steps = t.steps if steps is None else steps
    layers = [layer.to(t.param_dtype) for layer in job.model.builder()(t.seed, 0, job.model.num_layers)]
    optimizers = [make_layer_optimizer(layer, job.optim) for layer in layers]
    batches = StepBatches(open_dataset(job.data, g.seq_len, g.vocab_size), t.global_batch_size,
                          t.microbatch_size, t.seed)
    losses = []
    for step in range(steps):
        zero_grads(layers)
        loss_sum = 0.0
        for m in range(t.num_microbatches):  # gradient accumulation over the same microbatches
            x, y = batches.microbatch(step, m)
            h = x
            for layer in layers:
                h = layer(h)
            loss = lm_loss(h, y) * (1.0 / t.num_microbatches)  # as the engine scales it
            loss.backward()
            loss_sum += float(loss.detach())
        total_sq = sum(layer_sq_norm(layer) for layer in layers)
        scale_grads(layers, clip_coefficient(total_sq, t.grad_clip))
        lr = lr_at(step, lr=job.optim.lr, warmup_steps=t.warmup_steps, total_steps=t.steps,
                   min_lr=t.min_lr, decay=t.decay)
        for opt in optimizers:
            set_lr(opt, lr)
            opt.step()
        losses.append(loss_sum)
    keys = job.model.keys()
    params = {keys[i]: {n: p.detach().clone() for n, p in layer.named_parameters()}
              for i, layer in enumerate(layers)}
    return losses, params
