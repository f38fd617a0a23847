"""From a recipe to what the workers run: the training tokens and the JobSpec (the supervisor's part)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from oobleck_slurm.data import default_token_file, prepare
from oobleck_slurm.data.tokens import TokenFile, TokenFileError
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.models import with_layers


def token_file_for(recipe: Any, cache_dir: str | os.PathLike[str]) -> Path:
    """The recipe's training tokens: data.path as is, data.text prepared into `cache_dir` (once,
    redone if the text changed), or the shipped text."""
    d = recipe.data
    if d.path:
        return Path(d.path)
    if not d.text:
        return default_token_file(cache_dir, d.tokenizer).path
    src = Path(d.text)
    safe_tok = d.tokenizer.replace(":", "_").replace("/", "_")
    out = Path(cache_dir) / f"{src.stem}.{safe_tok}.bin"
    try:
        TokenFile(out)
    except TokenFileError:
        prepare(src, out, d.tokenizer)
    return out


def model_spec(recipe: Any) -> ModelSpec:
    """The recipe's model, its layers known (a factory's inspected: FactoryError if it does not fit),
    starting from the weights of its Hugging Face folder when it holds some."""
    cfg = with_layers(recipe.model.resolve(), recipe.training.seed)
    if recipe.model.hf is None:
        return ModelSpec(cfg)
    from oobleck_slurm.models.hf import has_weights

    return ModelSpec(cfg, weights=recipe.model.hf if has_weights(recipe.model.hf) else None)


def job_from_recipe(recipe: Any, token_file: str | os.PathLike[str]) -> JobSpec:
    t, o, s = recipe.training, recipe.training.optimizer, recipe.training.lr_schedule
    eps: Any = o.eps
    if eps is not None and len(eps) == 1:
        eps = eps[0]
    return JobSpec(
        model=model_spec(recipe),
        data=DataSpec("tokens", path=str(token_file)),
        optim=OptimSpec(o.name, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=eps),
        train=TrainSpec(steps=t.steps, microbatch_size=t.microbatch_size, num_microbatches=t.global_microbatches,
                        seed=t.seed, grad_clip=t.grad_clip, warmup_steps=s.warmup_steps, decay=s.decay,
                        min_lr=s.min_lr, precision=t.precision),
        backend="nccl" if recipe.cluster.gpus_per_node > 0 else "gloo",
    )
