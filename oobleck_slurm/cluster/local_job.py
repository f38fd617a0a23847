"""`python -m oobleck_slurm.cluster.local_job JOB_DIR`: run a job of the `local` backend.

`submit` starts this in its own process session, so the job outlives the terminal that submitted
it and `dashboard` / `events` can follow it from the job folder.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from oobleck_slurm.cluster.jobdir import JobDir, find_job
from oobleck_slurm.events import EventLog, events_path

EXIT_OK = 0
EXIT_FAILED = 1


def run(job: JobDir) -> int:
    from oobleck_slurm.engine.local import train_local

    recipe = job.recipe()
    log = EventLog(events_path(job.path))
    log.emit("job_started", job_id=job.job_id, backend="local", recipe=recipe.name,
             recipe_path=str(job.recipe_path), nodes=[f"node{i}" for i in range(recipe.cluster.nodes)],
             f=recipe.fault_tolerance.f, steps=recipe.training.steps, pid=os.getpid())
    started = time.time()
    try:
        train_local(recipe, job.path, cache_dir=job.meta().get("templates_cache", "templates_cache"))
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
