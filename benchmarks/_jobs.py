"""Shared by the benchmarks: recipes as dicts, run through the production start path
(oobleck_slurm.submission: prepare_job + start_local -> supervisor, agents, workers as real processes),
and the figures read back from the job's events.jsonl.

Nothing here drives the engine itself: a job is prepared, started and waited for exactly as `submit`
does it; only its event log and folder are read afterwards.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from oobleck_slurm.recipe import Recipe, load_recipe, recipe_to_dict
from oobleck_slurm.submission import prepare_job

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from jobrun import JobRun, start_and_wait  # noqa: E402 - tests/jobrun.py: the one way to run a job and read it


def recipe_dict(*, size: str, nodes: int, workers: int = 1, steps: int, global_batch: int, microbatch: int,
                precision: str = "fp32", f: int = 1, memory: str | None = None, checkpoint_interval: int = 0,
                replacement: str = "none", gpus_per_node: int = 0, name: str = "bench", optimizer: str = "adamw",
                lr: float = 1.0e-3, warmup_steps: int = 1, **fault_tolerance: Any) -> dict[str, Any]:
    """A local-backend recipe. CPU: `workers` worker processes per node with one thread each
    (cpus_per_node = workers). GPU: `gpus_per_node` workers per node, one per GPU."""
    cluster: dict[str, Any] = {"backend": "local", "nodes": nodes}
    if gpus_per_node:
        cluster.update(gpus_per_node=gpus_per_node, cpus_per_node=max(1, gpus_per_node))
    else:
        cluster.update(workers_per_node=workers, cpus_per_node=workers)
    if memory is not None:
        cluster["memory_per_device"] = memory
    return {
        "name": name, "cluster": cluster, "model": {"size": size},
        "training": {"global_batch_size": global_batch, "microbatch_size": microbatch, "steps": steps,
                     "precision": precision, "optimizer": {"name": optimizer, "lr": lr, "weight_decay": 0.01},
                     "lr_schedule": {"warmup_steps": warmup_steps}},
        "fault_tolerance": {"f": f, "checkpoint_interval": checkpoint_interval, "replacement": replacement,
                            **fault_tolerance},
    }


def default_recipe_dict(**training: Any) -> dict[str, Any]:
    """The embedded default recipe (`submit` with no file) as a dict, with `training` keys replaced and
    without its scripted drill."""
    d = recipe_to_dict(load_recipe())
    d["training"] = {**d["training"], **training}
    d["drills"] = []  # throughput of training, not of its scripted failure
    return d


def load(d: dict[str, Any], folder: str | os.PathLike[str]) -> Recipe:
    """Write the dict as a recipe file and load it like a user's file (validated)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkstemp(suffix=".yaml", prefix=f"{d.get('name', 'recipe')}-", dir=folder)[1])
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return load_recipe(path)


def planned(recipe: Recipe, cache_dir: str | os.PathLike[str], estimate: str | None) -> Any:
    """The plan the supervisor will start with (same inputs: pregenerate + instantiate)."""
    from oobleck_slurm.planning import instantiate
    from oobleck_slurm.planning.pregenerate import pregenerate

    profile, templates = pregenerate(recipe, cache_dir, estimate_gpu=estimate)
    members = [f"node{i + 1}" for i in range(recipe.cluster.nodes)]
    return instantiate(templates, members, recipe.fault_tolerance.f, recipe.training.global_microbatches,
                       microbatch_size=recipe.training.microbatch_size, profile=profile)


def budget_for_span(d: dict[str, Any], span: int, cache_dir: str | os.PathLike[str], estimate: str | None,
                    folder: str | os.PathLike[str], fs: Sequence[int] | None = None) -> str:
    """A `cluster.memory_per_device` for which every pipeline of the plan spans `span` nodes (the
    largest such budget: the least constrained), for each f in `fs` (default: the recipe's)."""
    from oobleck_slurm.planning.cache import TemplateCache
    from oobleck_slurm.planning.pregenerate import recipe_profile

    profile, _ = recipe_profile(load(d, folder), TemplateCache(cache_dir), estimate_gpu=estimate)
    microbatches = d["training"]["global_batch_size"] // d["training"]["microbatch_size"]
    # an upper bound: the whole model's state and every microbatch's activations on one device
    budget = 2 * sum(x.state_bytes + microbatches * x.activation_bytes for x in profile.layers)
    fs = list(fs) if fs is not None else [d["fault_tolerance"]["f"]]
    while budget > 2**16:
        mem = f"{budget // 1024}KiB"
        ok = True
        for f in fs:
            trial = {**d, "cluster": {**d["cluster"], "memory_per_device": mem},
                     "fault_tolerance": {**d["fault_tolerance"], "f": f}}
            try:
                plan = planned(load(trial, folder), cache_dir, estimate)
            except Exception:  # noqa: BLE001 - PlanningError: the budget is too small (or f too large)
                ok = False
                break
            if not all(len(p.nodes) == span for p in plan.pipelines):
                ok = False
                break
        if ok:
            return mem
        budget = int(budget * 0.9)
    raise SystemExit(f"no memory_per_device makes every pipeline span {span} node(s) for {d['model']} on "
                     f"{d['cluster']['nodes']} node(s) with f in {fs}")


def run_job(d: dict[str, Any], root: str | os.PathLike[str], cache_dir: str | os.PathLike[str], *,
            faults: list[dict[str, Any]] | None = None, estimate: str | None = "A100-40",
            timeout: float = 900.0) -> JobRun:
    """prepare_job + start_local, wait for the supervisor to exit, read the events. A job that does
    not finish in `timeout` s is killed (its whole process session); a non-zero exit raises with
    the logs' tails."""
    recipe = load(d, Path(root) / "recipes")
    job = prepare_job(recipe, cache_dir=cache_dir, estimate_gpu=estimate, job_root=Path(root) / "jobs",
                      faults=faults)
    run = start_and_wait(job, timeout)
    if run.exit_code == -1:
        raise SystemExit(f"job {job.path} did not finish within {timeout:g} s\n{run.log_tails()}")
    if run.exit_code != 0:
        raise SystemExit(f"job {job.path} exited {run.exit_code}\n{run.log_tails()}")
    return run


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def drop_warmup(values: Sequence[float], drop: int) -> list[float]:
    """Leave out the first `drop` values when enough remain (at least 2), else keep what is there."""
    return list(values[drop:]) if len(values) >= drop + 2 else list(values[-1:] if values else [])


def _workers(stage: dict[str, Any]) -> str:
    """'0' for a stage on worker 0, '0-3' for a stage sharded over workers 0 to 3."""
    workers = stage.get("workers") or [stage["worker"]]
    return str(workers[0]) if len(workers) == 1 else f"{workers[0]}-{workers[-1]}"


def plan_summary(plan_event: dict[str, Any]) -> str:
    """'2 x [n1 0-3 | n2 3-6]'-style text of a `plan` event."""
    parts = []
    for p in plan_event["pipelines"]:
        stages = " | ".join(f"{s['node']}.{_workers(s)} {s['layers'][0]}-{s['layers'][1]}" for s in p["stages"])
        parts.append(f"({stages}) x{p['microbatches']}mb")
    spares = f" spares ({', '.join(plan_event['spares'])})" if plan_event.get("spares") else ""
    return " ".join(parts) + spares
