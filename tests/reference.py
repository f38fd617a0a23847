"""Single-process reference training: the same global batches, optimizer, lr schedule and clipping
as the engine, with the whole model in one process, each step's batch in one pass, and plain
autograd. The engine's exactness tests compare against it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import torch

from oobleck_slurm.engine.batches import StepBatches, open_dataset, open_validation
from oobleck_slurm.engine.layer_optim import (
    clip_coefficient,
    layer_sq_norm,
    make_layer_optimizer,
    scale_grads,
    set_lr,
    zero_grads,
)
from oobleck_slurm.engine.layer_rng import LayerDraws
from oobleck_slurm.engine.lr import lr_at
from oobleck_slurm.engine.spec import JobSpec
from oobleck_slurm.models.documents import Documents, run_layer
from oobleck_slurm.optim import optimizer_state_tensors

Tensors = dict[str, dict[str, torch.Tensor]]  # by layer key, then tensor name
_TRAINED: dict[str, tuple[list[float], Tensors, dict[int, float], Tensors]] = {}


def _trajectory_key(job: JobSpec, steps: int) -> str:
    """What the reference trajectory depends on: the model, optimizer and training settings and the
    token file's bytes (every job has its own copy), not the job's folder, faults or backend."""
    d = asdict(job)
    if job.data.path is not None:
        d["data"]["path"] = hashlib.sha256(Path(job.data.path).read_bytes()).hexdigest()
    return json.dumps({"model": d["model"], "optim": d["optim"], "train": d["train"], "data": d["data"],
                       "steps": steps}, sort_keys=True, default=str)


def train_reference(job: JobSpec, steps: int | None = None
                    ) -> tuple[list[float], dict[str, dict[str, torch.Tensor]]]:
    """Train `steps` (default job.train.steps) steps; returns per-step mean losses and the final
    parameters by layer key and parameter name. Trained once per trajectory in a test session
    (several tests run the same failure-free trajectory with different faults); callers get copies."""
    steps = job.train.steps if steps is None else steps
    key = _trajectory_key(job, steps)
    if key not in _TRAINED:
        # One thread, whatever the calling test set: the same reduction order in every run. A test
        # process's thread count (2 by default here, changed by fixtures) otherwise decides the last
        # bits of every sum, and a lab test once saw its reference differ by more than the tolerance
        # from the same computation in a fresh process.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _TRAINED[key] = _train(job, steps)
        finally:
            torch.set_num_threads(threads)
    losses, params, _, _ = _TRAINED[key]
    return list(losses), {k: {n: p.clone() for n, p in tensors.items()} for k, tensors in params.items()}


def reference_optimizer_state(job: JobSpec) -> Tensors:
    """The final optimizer state of each layer, by layer key then the names `optimizer_state_tensors`
    gives it (those of a checkpoint's `state.<name>` tensors), after job.train.steps steps."""
    train_reference(job)
    states = _TRAINED[_trajectory_key(job, job.train.steps)][3]
    return {k: {n: t.clone() for n, t in tensors.items()} for k, tensors in states.items()}


def reference_evals(job: JobSpec) -> dict[int, float]:
    """The validation loss after each evaluated step count (training.eval_interval), computed on the
    whole validation set in one pass per step."""
    train_reference(job)
    return dict(_TRAINED[_trajectory_key(job, job.train.steps)][2])


def _documents(job: JobSpec, tokens: torch.Tensor) -> Documents | None:
    """The batch's documents when the job masks them (data.document_mask), else None."""
    if not job.data.document_mask:
        return None
    assert job.data.eos_id is not None, "a job spec with document masking and no eos id (prepare_data sets it)"
    return Documents.of(tokens, job.data.eos_id)


def _random_step(job: JobSpec, layers: list[torch.nn.Module], batches: StepBatches, step: int) -> torch.Tensor:
    """One step's backward for a model with random layers (dropout): microbatch by microbatch, each
    layer's draws seeded for (step, microbatch, layer) as the engine seeds them (engine/layer_rng.py), so
    a mask is the same here as on whichever rank computes that microbatch. Returns the step's mean loss."""
    t = job.train
    draws = LayerDraws(t.seed, step, torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64)
    for m in range(t.num_microbatches):
        h, y = batches.microbatch(step, m)
        documents = _documents(job, h)
        for index, layer in enumerate(layers):
            with draws.seeded(m, index):
                h = run_layer(layer, h, documents)
        loss = job.model.config.loss(h, y) / t.num_microbatches
        loss.backward()
        total += loss.detach().double()
    return total


def _train(job: JobSpec, steps: int) -> tuple[list[float], Tensors, dict[int, float], Tensors]:
    t = job.train
    layers = [layer.to(t.param_dtype) for layer in job.model.build(t.seed, 0, job.model.num_layers)]
    optimizers = [make_layer_optimizer(layer, job.optim) for layer in layers]
    batches = StepBatches(open_dataset(job.data, job.model.seq_len, job.model.vocab_size), t.global_batch_size,
                          t.microbatch_size, t.seed)
    validation = (open_validation(job.data, job.model.seq_len, job.model.vocab_size, t.eval_samples)
                  if t.eval_interval else None)
    evals: dict[int, float] = {}
    losses = []
    for step in range(steps):
        zero_grads(layers)
        # The step's microbatches as one batch: equal-sized microbatches make the mean of their mean
        # losses the batch's mean loss, and the sum of their 1/M-scaled gradients its gradient. An
        # independent check of the engine's accumulation, and 1.3x faster than looping over them.
        if getattr(job.model.config, "random_layers", ()):
            loss = _random_step(job, layers, batches, step)
        else:
            x, y = (torch.cat(parts) for parts in zip(*(batches.microbatch(step, m) for m in range(t.num_microbatches))))
            h, documents = x, _documents(job, x)
            for layer in layers:
                h = run_layer(layer, h, documents)
            loss = job.model.config.loss(h, y)
            loss.backward()
        total_sq = sum(layer_sq_norm(layer) for layer in layers)
        scale_grads(layers, clip_coefficient(total_sq, t.grad_clip))
        lr = lr_at(step, lr=job.optim.lr, warmup_steps=t.warmup_steps, total_steps=t.steps,
                   min_lr=t.min_lr, decay=t.decay)
        for opt in optimizers:
            set_lr(opt, lr)
            opt.step()
        losses.append(float(loss.detach()))
        done = step + 1
        if validation is not None and (done % t.eval_interval == 0 or done == t.steps):
            for layer in layers:
                layer.eval()
            with torch.no_grad():
                h, y = validation.batch(list(range(validation.num_samples)))
                documents = _documents(job, h)
                for layer in layers:
                    h = run_layer(layer, h, documents)
                evals[done] = float(job.model.config.loss(h, y))
            for layer in layers:
                layer.train()
    keys = job.model.keys()
    params = {keys[i]: {n: p.detach().clone() for n, p in layer.named_parameters()}
              for i, layer in enumerate(layers)}
    states = {keys[i]: {n: t.detach().clone() for n, t in optimizer_state_tensors(opt).items()}
              for i, opt in enumerate(optimizers)}
    return losses, params, evals, states
