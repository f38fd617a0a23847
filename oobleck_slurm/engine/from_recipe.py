"""From a recipe to what the workers run: the training tokens and the JobSpec (the supervisor's part)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oobleck_slurm.data import default_token_file, prepare
from oobleck_slurm.data.tokens import TokenFile, TokenFileError
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec


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
    """The recipe's model: the GPT shape (preset and overrides) and, if given, the factory and its kwargs."""
    return ModelSpec(recipe.model.resolve(), recipe.model.factory, _plain(recipe.model.kwargs))


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


def _plain(value: Any) -> Any:
    """A recipe value as plain JSON types (the recipe's mappings are read-only views)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
