"""Finding a job's folder from what the user typed: a path, or a job id under the jobs root."""

from __future__ import annotations

from pathlib import Path

from oobleck_slurm.events import events_path

DEFAULT_JOBS_ROOT = Path("jobs")


class JobNotFound(Exception):
    """The job folder does not exist; the message says where we looked."""


def resolve_job_dir(job: str | Path, jobs_root: str | Path = DEFAULT_JOBS_ROOT) -> Path:
    """`job` if it is a folder (or an events.jsonl inside one), else `<jobs_root>/<job>`."""
    path = Path(job)
    if path.is_file() and path.name == events_path(".").name:
        return path.parent
    if path.is_dir():
        return path
    under_root = Path(jobs_root) / str(job)
    if under_root.is_dir():
        return under_root
    if under_root == path:
        raise JobNotFound(f"no job folder {str(job)!r}")
    raise JobNotFound(f"no job folder {str(job)!r}: neither {path} nor {under_root} is a folder")
