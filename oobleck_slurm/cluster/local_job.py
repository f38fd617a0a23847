"""`python -m oobleck_slurm.cluster.local_job JOB_DIR`: run a job of the `local` backend.

`submit` starts this in its own process session, so the job outlives the terminal that submitted
it and `dashboard` / `events` can follow it from the job folder.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

from oobleck_slurm.cluster.jobdir import JobDir, find_job
from oobleck_slurm.events import EventLog, events_path
from oobleck_slurm.recipe import Recipe

EXIT_OK = 0
EXIT_FAILED = 1


def train_recipe(recipe: Recipe, job_dir: Path, cache_dir: str | os.PathLike[str]) -> None:
    """Train on `recipe.cluster.nodes` local virtual nodes with checkpoint-free recovery."""
    from oobleck_slurm.engine.local import job_from_recipe, timeouts_from_recipe, token_file_for
    from oobleck_slurm.planning import instantiate
    from oobleck_slurm.planning.pregenerate import pregenerate
    from oobleck_slurm.supervisor.local import run_elastic_local

    profile, templates = pregenerate(recipe, cache_dir)  # a cache hit: `submit` made them already
    t, ft = recipe.training, recipe.fault_tolerance
    plan = instantiate(templates, recipe.cluster.nodes, ft.f, t.global_microbatches,
                       microbatch_size=t.microbatch_size, profile=profile)
    spec = job_from_recipe(recipe, token_file_for(recipe, job_dir / "data"))
    # Virtual nodes cost nothing to add, so 'spare' and 'request' both mean: start a new one.
    run_elastic_local(spec, plan, templates, job_dir, f=ft.f, timeouts=timeouts_from_recipe(recipe),
                      reconfiguration_timeout=ft.reconfiguration_timeout, replacement=ft.replacement != "none",
                      checkpoint_interval=ft.checkpoint_interval)


def run(job: JobDir) -> int:
    recipe = job.recipe()
    log = EventLog(events_path(job.path))
    log.emit("job_started", job_id=job.job_id, backend="local", recipe=recipe.name,
             recipe_path=str(job.recipe_path), nodes=[f"node{i}" for i in range(recipe.cluster.nodes)],
             f=recipe.fault_tolerance.f, steps=recipe.training.steps, pid=os.getpid())
    started = time.time()
    try:
        train_recipe(recipe, job.path, job.meta().get("templates_cache", "templates_cache"))
    except Exception as err:  # noqa: BLE001 - recorded for the user, then a non-zero exit
        (job.path / "logs" / "local_job.err").write_text(traceback.format_exc())
        log.emit("job_finished", status="failed", exit_code=EXIT_FAILED, error=f"{type(err).__name__}: {err}",
                 seconds=time.time() - started)
        print(f"job failed: {err}", file=sys.stderr)
        return EXIT_FAILED
    log.emit("job_finished", status="completed", exit_code=EXIT_OK, seconds=time.time() - started)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(run(find_job(sys.argv[1])))
