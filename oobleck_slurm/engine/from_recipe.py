"""From a recipe to what the workers run: the training tokens and the JobSpec (the supervisor's part)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from oobleck_slurm.data import cache_file, default_token_file, prepared
from oobleck_slurm.data.tokens import TokenFile, TokenFileError
from oobleck_slurm.engine.loss_spike import SpikePolicy
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.models import with_layers

# Flight-recorder entries on GPUs unless the recipe says otherwise: NCCL operations take milliseconds,
# a record costs microseconds. Off on CPUs, where a gloo operation of the tiny test models takes tens of
# microseconds and the record (with its stack) as much again.
DEFAULT_FLIGHT_RECORDER = 2000


def tokenizer_for(recipe: Any) -> str:
    """The recipe's tokenizer: data.tokenizer, except that with the default ('byte') a Hugging Face
    model folder's own tokenizer.json is used when it has one."""
    tok = recipe.data.tokenizer
    if tok == "byte" and recipe.model.hf is not None and (Path(recipe.model.hf) / "tokenizer.json").is_file():
        return str(Path(recipe.model.hf) / "tokenizer.json")
    return str(tok)


def token_file_for(recipe: Any, cache_dir: str | os.PathLike[str]) -> Path:
    """The recipe's training tokens: data.path as is, data.text prepared into `cache_dir` (once,
    redone if the text changed), or the shipped text."""
    d = recipe.data
    if d.path:
        return Path(d.path)
    if d.sources:  # nothing to prepare: job_from_recipe names data.sources, the workers open them
        return Path(d.sources[0].path)
    if not d.text:
        return default_token_file(cache_dir, tokenizer_for(recipe)).path
    return _prepared(Path(d.text), tokenizer_for(recipe), cache_dir)


def validation_file_for(recipe: Any, cache_dir: str | os.PathLike[str]) -> Path | None:
    """data.validation as a token file: as is if it is one, else the text prepared into `cache_dir`."""
    v = recipe.data.validation
    if not v:
        return None
    try:
        TokenFile(v)
        return Path(v)
    except TokenFileError:
        return _prepared(Path(v), tokenizer_for(recipe), cache_dir)


def _prepared(src: Path, tokenizer: str, cache_dir: str | os.PathLike[str]) -> Path:
    return prepared(src, cache_file(cache_dir, src, tokenizer), tokenizer).path


def model_spec(recipe: Any) -> ModelSpec:
    """The recipe's model, its layers known (a factory's inspected: FactoryError if it does not fit),
    starting from the weights of its Hugging Face folder when it holds some."""
    cfg = with_layers(recipe.model.resolve(), recipe.training.seed)
    if recipe.model.hf is None:
        return ModelSpec(cfg)
    from oobleck_slurm.models.hf import has_weights

    return ModelSpec(cfg, weights=recipe.model.hf if has_weights(recipe.model.hf) else None)


def job_from_recipe(recipe: Any, token_file: str | os.PathLike[str],
                    validation_file: str | os.PathLike[str] | None = None) -> JobSpec:
    """What the workers run. Without `validation_file`, an evaluating job holds the last
    training.eval_samples samples of `token_file` out of training and evaluates on them."""
    t, o, s = recipe.training, recipe.training.optimizer, recipe.training.lr_schedule
    holdout = t.eval_samples if t.eval_interval and validation_file is None else 0
    eps: Any = o.eps
    if eps is not None and len(eps) == 1:
        eps = eps[0]
    return JobSpec(
        model=model_spec(recipe),
        data=DataSpec("tokens", path=None if recipe.data.sources else str(token_file), holdout=holdout,
                      validation=None if validation_file is None else str(validation_file),
                      sources=tuple((s.path, s.weight or 0.0) for s in recipe.data.sources),
                      epochs=recipe.data.epochs or 0, prefetch=recipe.data.prefetch,
                      document_mask=recipe.data.document_mask, eos_id=recipe.data.eos_id),
        optim=OptimSpec(o.name, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=eps),
        train=TrainSpec(steps=t.steps, microbatch_size=t.microbatch_size, num_microbatches=t.global_microbatches,
                        seed=t.seed, grad_clip=t.grad_clip, warmup_steps=s.warmup_steps, decay=s.decay,
                        min_lr=s.min_lr, precision=t.precision, eval_interval=t.eval_interval, recompute=t.recompute,
                        eval_samples=t.eval_samples if t.eval_interval else 0, deterministic=t.deterministic,
                        bucket_mb=t.bucket_mb, loss_spike=None if (ls := t.loss_spike) is None else
                        SpikePolicy(ls.sigma, ls.window, ls.warmup, ls.max_consecutive,
                                    ls.on_consecutive, ls.max_rollbacks),
                        integrity_interval=recipe.fault_tolerance.integrity_interval,
                        integrity_max_cost=recipe.fault_tolerance.integrity_max_cost),
        backend="nccl" if recipe.cluster.gpus_per_node > 0 else "gloo",
        peak_tflops=recipe.logging.peak_tflops,
        flight_recorder=(recipe.logging.flight_recorder if recipe.logging.flight_recorder is not None
                         else DEFAULT_FLIGHT_RECORDER if recipe.cluster.gpus_per_node > 0 else 0),
    )
