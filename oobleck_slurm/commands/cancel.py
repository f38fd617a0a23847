"""`cancel JOB`: stop a job: scancel its allocation and any replacement jobs (slurm), or end its
process group (local) and record it as cancelled.

On the local backend the supervisor dies from SIGTERM without writing its own record, so `cancel`
writes it: the cancel marker first (as for Slurm), then SIGTERM to the job's process group, SIGKILL
after `TERM_GRACE_S` if anything is left, and, unless the supervisor recorded `job_finished` by
then, a `job_finished` event with status "cancelled" and the same status in meta.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from oobleck_slurm.commands.common import console, fail
from oobleck_slurm.exit_codes import EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:  # imported when the command runs, not when the CLI starts
    from oobleck_slurm.cluster.jobdir import JobDir

TERM_GRACE_S = 10.0  # SIGTERM to SIGKILL: the supervisor and agents end at once; workers may be in a collective
KILL_WAIT_S = 5.0  # after SIGKILL: only the kernel's tear-down is left
POLL_S = 0.1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("cancel", help="stop a job (its allocation and replacement jobs)")
    parser.add_argument("job", help="job folder, or a job id under --job-root")
    parser.add_argument("--job-root", type=Path, default=Path("jobs"), help="where job ids are looked up (default: jobs)")


def slurm_job_ids(meta: dict, events: list[dict]) -> list[str]:
    """The job's allocation and every replacement job it asked for (pure); under supervisor failover
    also its supervisors' and training nodes' jobs (docs/failover.md, "Under Slurm")."""
    ids = [str(meta["slurm_job_id"])] if meta.get("slurm_job_id") else []
    ids += [str(i) for i in [*meta.get("supervisor_jobs", []), *meta.get("node_jobs", [])]]
    ids += [str(e["slurm_job"]) for e in events
            if e["kind"] == "replacement_requested" and e.get("how") == "request" and e.get("slurm_job")]
    return list(dict.fromkeys(ids))


def run(args: argparse.Namespace) -> int:
    from oobleck_slurm.cluster.jobdir import JobNotFound, find_job
    from oobleck_slurm.cluster.slurm import SlurmError, cancel_jobs
    from oobleck_slurm.protocol.events import events_path, read_events

    try:
        job = find_job(args.job, args.job_root)
    except JobNotFound as err:
        return fail(str(err))
    meta = job.meta()
    if meta.get("backend") == "slurm":
        ids = slurm_job_ids(meta, read_events(events_path(job.path), "replacement_requested"))
        if not ids:
            return fail(f"{job.job_id}: no Slurm job id recorded in {job.meta_path}")
        job.cancel_marker.write_text("cancelled by the user\n")
        try:
            cancel_jobs(ids)
        except SlurmError as err:
            return fail(str(err), EXIT_FAILED)
        console.print(f"cancelled Slurm job(s) {escape(', '.join(ids))} of {escape(job.job_id)}", highlight=False)
        return EXIT_OK
    return _cancel_local(job, meta)


def _cancel_local(job: JobDir, meta: dict[str, Any]) -> int:
    from oobleck_slurm.protocol.events import events_path, read_events

    finished = read_events(events_path(job.path), "job_finished")
    if finished:
        console.print(f"{escape(job.job_id)} already finished ({escape(str(finished[-1].get('status')))})",
                      highlight=False)
        return EXIT_OK
    # `submit` records the job's process group; a supervisor started by hand records only itself
    # (its agents exit, and kill their workers, when it is gone).
    pid, group = meta.get("pid"), True
    if not pid and meta.get("supervisor"):
        pid, group = meta["supervisor"].get("pid"), False
    if not pid:
        return fail(f"{job.job_id}: no process id recorded in {job.meta_path}")
    pid = int(pid)
    # The marker first: a supervisor that sees it while dying reports "cancelled", never "failed".
    job.cancel_marker.write_text("cancelled by the user\n")
    alive = (lambda: _group_alive(pid)) if group else (lambda: _process_alive(pid))
    if not _ours(pid, job.path):
        # The job ended unrecorded long ago and its pid now names another program: signal nothing.
        alive = lambda: False  # noqa: E731
    was_running = alive()
    started = time.time()
    if was_running:
        kill = os.killpg if group else os.kill
        _signal(kill, pid, signal.SIGTERM)
        if not _wait(lambda: not alive() or _recorded(job), TERM_GRACE_S):
            _signal(kill, pid, signal.SIGKILL)
            _wait(lambda: not alive(), KILL_WAIT_S)
    if not _recorded(job):
        _record_cancelled(job, started, was_running)
    what = f"process group {pid}" if group else f"supervisor {pid}"
    if was_running:
        console.print(f"stopped {escape(job.job_id)} ({what}); recorded as cancelled", highlight=False,
                      soft_wrap=True)
    else:
        console.print(f"{escape(job.job_id)} was not running ({what} gone); recorded as cancelled", highlight=False,
                      soft_wrap=True)
    return EXIT_OK


def _record_cancelled(job: JobDir, started: float, was_running: bool) -> None:
    from oobleck_slurm.protocol.events import EventLog, events_path

    error = None if was_running else "no process was running when the job was cancelled (it had ended unrecorded)"
    with EventLog(events_path(job.path)) as log:
        log.emit("job_finished", status="cancelled", exit_code=None, error=error, seconds=time.time() - started,
                 checkpoint_step=None, recorded_by="cancel")
    job.update_meta(status="cancelled", exit_code=None)


def _recorded(job: JobDir) -> bool:
    from oobleck_slurm.protocol.events import events_path, read_events

    return bool(read_events(events_path(job.path), "job_finished"))


def _wait(done: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def _signal(kill: Callable[[int, int], None], pid: int, sig: int) -> None:
    try:
        kill(pid, sig)
    except ProcessLookupError:  # ended meanwhile
        pass


def _ours(pid: int, folder: Path) -> bool:
    """Whether `pid` is still this job's supervisor (its command line names the job folder), or gone.

    A pid is reused once its process is reaped; a process group id is not while any member lives, so
    a group whose leader is gone is still the job's."""
    import psutil

    try:
        return any(folder.name in arg for arg in psutil.Process(pid).cmdline())
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:  # another user's process: certainly not this job's
        return False


def _process_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _group_alive(pgid: int) -> bool:
    """A process of group `pgid` still runs (zombies, waiting for a parent to reap them, do not count)."""
    import psutil

    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return False
