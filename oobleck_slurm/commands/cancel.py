"""`cancel JOB`: stop a job: scancel its allocation and any replacement jobs (slurm), or end its
process group (local)."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from rich.markup import escape

from oobleck_slurm.commands.common import EXIT_FAILED, EXIT_OK, console, fail


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("cancel", help="stop a job (its allocation and replacement jobs)")
    parser.add_argument("job", help="job folder, or a job id under --job-root")
    parser.add_argument("--job-root", type=Path, default=Path("jobs"), help="where job ids are looked up (default: jobs)")


def slurm_job_ids(meta: dict, events: list[dict]) -> list[str]:
    """The job's allocation and every replacement job it asked for (pure)."""
    ids = [str(meta["slurm_job_id"])] if meta.get("slurm_job_id") else []
    ids += [str(e["slurm_job"]) for e in events
            if e["kind"] == "replacement_requested" and e.get("how") == "request" and e.get("slurm_job")]
    return list(dict.fromkeys(ids))


def run(args: argparse.Namespace) -> int:
    from oobleck_slurm.cluster.jobdir import JobNotFound, find_job
    from oobleck_slurm.cluster.slurm import SlurmError, run_slurm
    from oobleck_slurm.events import events_path, read_events

    try:
        job = find_job(args.job, args.job_root)
    except JobNotFound as err:
        return fail(str(err))
    meta = job.meta()
    if meta.get("backend") == "slurm":
        ids = slurm_job_ids(meta, read_events(events_path(job.path), "replacement_requested"))
        if not ids:
            return fail(f"{job.job_id}: no Slurm job id recorded in {job.path / 'meta.json'}")
        from oobleck_slurm.supervisor.main import CANCEL_MARKER

        (job.path / CANCEL_MARKER).write_text("cancelled by the user\n")
        try:
            run_slurm(["scancel", *ids])
        except SlurmError as err:
            return fail(str(err), EXIT_FAILED)
        console.print(f"cancelled Slurm job(s) {escape(', '.join(ids))} of {escape(job.job_id)}", highlight=False)
        return EXIT_OK
    # `submit` records the job's process group; a supervisor started by hand records only itself
    # (its agents exit, and kill their workers, when it is gone).
    pid, kill = meta.get("pid"), os.killpg
    if not pid and meta.get("supervisor"):
        pid, kill = meta["supervisor"].get("pid"), os.kill
    if not pid:
        return fail(f"{job.job_id}: no process id recorded in {job.path / 'meta.json'}")
    try:
        kill(int(pid), signal.SIGTERM)
    except ProcessLookupError:
        console.print(f"{escape(job.job_id)} is not running", highlight=False)
        return EXIT_OK
    console.print(f"stopped {escape(job.job_id)} (process group {pid})", highlight=False)
    return EXIT_OK
