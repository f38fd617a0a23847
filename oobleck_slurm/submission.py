"""Starting a job: the one way training runs. `submit`, the tests and the benchmarks all go through here.

    prepare_job    profile + pregenerate templates (the cache), a job folder holding the resolved
                   recipe, the profile file or GPU estimate planned with, and a drill's faults
    start_local    the supervisor as a local process in its own session; it starts one agent per
                   virtual node and the agents start the workers (the embedded default)
    submit_slurm   the supervisor as the batch step of a Slurm allocation (submitit); it starts one
                   `srun` step per node running an agent, and the agents start the workers. With
                   supervisor failover: the supervisor as its own one-node job, which submits one job
                   per training node (an agent) and a standby supervisor's job

Both backends run the same supervisor, agents and workers (supervisor/main.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from oobleck_slurm.cluster.jobdir import SUPERVISOR_LOG, JobDir, create_job_dir
from oobleck_slurm.planning.pregenerate import Progress, instantiate_for, plan_request, pregenerate
from oobleck_slurm.recipe import Recipe


def prepare_job(recipe: Recipe, *, cache_dir: str | os.PathLike[str] = "templates_cache",
                profile_file: str | os.PathLike[str] | None = None, estimate_gpu: str | None = None,
                job_root: str | os.PathLike[str] | None = None, faults: Sequence[dict[str, Any]] | None = None,
                drills: bool = True, progress: Progress | None = None,
                resume_from: str | os.PathLike[str] | None = None) -> JobDir:
    """Plan before the job (so recovery never waits for planning) and create its folder.

    `drills=False` leaves out the recipe's scripted drills (`submit --no-drills`). `resume_from` (or the
    recipe's fault_tolerance.resume_from) names another job's checkpoint to start from (engine/resume.py):
    a bad one is a BadInputError naming the file, and leaves no job folder behind.
    Raises PlanningError / ProfileError (a plan that cannot fit says so with its figures), and
    ValueError for a bad faults list, before anything starts."""
    profile, templates = pregenerate(recipe, cache_dir, profile_file=profile_file, estimate_gpu=estimate_gpu,
                                     progress=progress)
    # A plan that cannot fit is refused here, with the figures, not in the allocation.
    instantiate_for(profile, templates, plan_request(recipe), nodes=recipe.cluster.nodes)
    job = create_job_dir(recipe, job_root)
    job.update_meta(templates_cache=str(Path(cache_dir).resolve()), estimate_gpu=estimate_gpu, drills=drills)
    if profile_file is not None:
        shutil.copyfile(profile_file, job.profile)
    if source := resume_from or recipe.fault_tolerance.resume_from:
        from oobleck_slurm.engine.resume import start_from

        try:
            start_from(job, recipe, source)
        except BaseException:
            shutil.rmtree(job.path, ignore_errors=True)  # the new job's own folder: nothing else is touched
            raise
    if faults:
        from oobleck_slurm.engine.faults import load_faults

        job.faults.write_text(json.dumps(list(faults)))
        load_faults(job.faults)  # a bad drill is refused here, not in every worker
    return job


def start_local(job: JobDir) -> subprocess.Popen:
    """Run the job's supervisor on this machine (local backend), in its own process session so that
    the job outlives the caller and can be stopped as a whole (`os.killpg`)."""
    from oobleck_slurm.supervisor.main import local_supervisor_command

    log = open(job.logs / SUPERVISOR_LOG, "wb")  # noqa: SIM115 - owned by the child
    try:
        process = subprocess.Popen(
            local_supervisor_command(job.path),
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
            start_new_session=True)
    finally:
        log.close()
    job.update_meta(pid=process.pid)
    return process


def submit_slurm(job: JobDir, recipe: Recipe) -> str:
    """Submit the allocation through submitit (`--no-kill`, the recipe's time limit, the supervisor in
    the batch step); returns the Slurm job id. sbatch's refusal raises SlurmError (the caller reports it).
    With `cluster.supervisor.failover` only the primary supervisor's small one-node job is submitted: it
    submits the training nodes' jobs and its standby's (docs/failover.md, "Under Slurm")."""
    from oobleck_slurm.cluster.slurm import allocation_parameters, submit, supervisor_parameters
    from oobleck_slurm.supervisor.main import SupervisorJob

    if recipe.cluster.supervisor.failover:
        slurm_job_id = submit(job.submitit, supervisor_parameters(recipe.cluster, recipe.name, "primary"),
                              SupervisorJob(str(job.path)))
        job.update_meta(slurm_job_id=slurm_job_id, supervisor_jobs=[slurm_job_id])
        return slurm_job_id
    slurm_job_id = submit(job.submitit, allocation_parameters(recipe.cluster, recipe.name),
                          SupervisorJob(str(job.path)))
    job.update_meta(slurm_job_id=slurm_job_id)
    return slurm_job_id
