"""`train_local(recipe, job_dir)`: the local backend of `submit`, from a recipe to a finished run.

Resolves the recipe's data into a token file, plans with the planner (profile + templates from the
cache, `instantiate` for the recipe's nodes and f), and runs one worker process per device of
`recipe.cluster.nodes` virtual nodes through `run_local`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from oobleck_slurm.data import default_token_file, prepare
from oobleck_slurm.data.tokens import TokenFile, TokenFileError
from oobleck_slurm.engine.comm import Timeouts
from oobleck_slurm.engine.from_planner import exec_plan
from oobleck_slurm.engine.launch import LocalRun, run_local
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.planning import Plan, instantiate
from oobleck_slurm.planning.pregenerate import pregenerate


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


def job_from_recipe(recipe: Any, token_file: str | os.PathLike[str]) -> JobSpec:
    t, o, s = recipe.training, recipe.training.optimizer, recipe.training.lr_schedule
    eps: Any = o.eps
    if eps is not None and len(eps) == 1:
        eps = eps[0]
    return JobSpec(
        model=ModelSpec(recipe.model.resolve(), recipe.model.factory),
        data=DataSpec("tokens", path=str(token_file)),
        optim=OptimSpec(o.name, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=eps),
        train=TrainSpec(steps=t.steps, microbatch_size=t.microbatch_size, num_microbatches=t.global_microbatches,
                        seed=t.seed, grad_clip=t.grad_clip, warmup_steps=s.warmup_steps, decay=s.decay,
                        min_lr=s.min_lr, precision=t.precision),
        backend="nccl" if recipe.cluster.gpus_per_node > 0 else "gloo",
    )


def timeouts_from_recipe(recipe: Any) -> Timeouts:
    ft = recipe.fault_tolerance
    return Timeouts(collective=ft.collective_timeout, step=ft.step_timeout)


def local_plan(recipe: Any, cache_dir: str | os.PathLike[str] = "templates_cache") -> Plan:
    """The planner's plan for the recipe's nodes (profile and templates from `cache_dir`)."""
    profile, templates = pregenerate(recipe, cache_dir)
    t = recipe.training
    return instantiate(templates, recipe.cluster.nodes, recipe.fault_tolerance.f, t.global_microbatches,
                       microbatch_size=t.microbatch_size, profile=profile)


def train_local(recipe: Any, job_dir: str | os.PathLike[str], *, plan: Plan | None = None,
                cache_dir: str | os.PathLike[str] = "templates_cache",
                timeouts: Timeouts | None = None) -> LocalRun:
    """Train `recipe` on `recipe.cluster.nodes` local virtual nodes; events go to
    `<job_dir>/events.jsonl`. `plan` defaults to the planner's (`local_plan`)."""
    job_dir = Path(job_dir)
    token_file = token_file_for(recipe, job_dir / "data")
    plan = plan if plan is not None else local_plan(recipe, cache_dir)
    per_node = recipe.cluster.devices_per_node
    nodes = list(range(recipe.cluster.nodes))
    job = job_from_recipe(recipe, token_file)
    return run_local(job, exec_plan(plan, nodes, per_node), len(nodes) * per_node, job_dir,
                     timeouts or timeouts_from_recipe(recipe))
