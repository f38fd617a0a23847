"""`submit [RECIPE]`: validate, pregenerate pipeline templates, start the job, follow it.

The local backend runs the supervisor (and through it the agents and workers) in its own process
session, so the job outlives this command: `--detach` returns at once, and Ctrl-C while following
stops the job. The Slurm backend submits the supervisor as the batch step of an allocation.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from oobleck_slurm.commands.common import add_recipe_argument, console, err_console, fail, load_recipe_or_report
from oobleck_slurm.commands.profile import add_source_arguments, planning_progress
from oobleck_slurm.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:  # imported when the command runs, not when the CLI starts
    from oobleck_slurm.cluster.jobdir import JobDir
    from oobleck_slurm.recipe import Recipe

FOLLOW_POLL_S = 0.5


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("submit", help="plan and start a training job, then follow it")
    add_recipe_argument(parser)
    add_source_arguments(parser)
    parser.add_argument("--detach", action="store_true", help="print the job id and folder and return")
    parser.add_argument("--job-root", type=Path, default=None, help="where job folders go (default: cluster.job_root)")
    parser.add_argument("--no-dashboard", action="store_true", help="print sentences instead of the live dashboard")
    parser.add_argument("--json", action="store_true",
                        help="print the job's events as JSON lines on stdout (everything else on stderr)")
    parser.add_argument("--resume-from", type=Path, default=None, metavar="PATH",
                        help="start from another job's checkpoint: its folder (the newest complete one) or one of "
                             "its step<S> folders; node count, f and non-model training keys may differ")
    parser.add_argument("--no-drills", action="store_true", help="leave out the recipe's scripted drills (drills:)")


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe_or_report(args.recipe, check_model=True)
    if recipe is None:
        return EXIT_BAD_INPUT
    from oobleck_slurm.errors import BadInputError  # a plan that cannot fit, a profile, a checkpoint to start from
    from oobleck_slurm.submission import prepare_job, start_local

    try:
        with planning_progress(console.is_terminal) as progress:
            job = prepare_job(recipe, cache_dir=args.cache, profile_file=args.profile, estimate_gpu=args.estimate,
                              job_root=args.job_root, drills=not args.no_drills, progress=progress,
                              resume_from=args.resume_from)
    except BadInputError as err:
        return fail(str(err))
    if recipe.cluster.backend == "slurm":
        return _submit_slurm(job, recipe, args)
    # The local backend runs the same supervisor and agents as Slurm, as processes on this machine.
    out = err_console if args.json else console  # --json: stdout carries the events alone
    process = start_local(job)
    out.print(f"job [bold]{escape(job.job_id)}[/] submitted (local backend, pid {process.pid})")
    out.print(f"folder: {escape(str(job.path))}")
    if args.detach:
        return EXIT_OK
    try:
        _follow(job.path, _mode(args), running=lambda: process.poll() is None or _supervised(job))
    except KeyboardInterrupt:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()
        out.print("[yellow]interrupted: job stopped[/]")
        return 130
    code = process.wait()
    from oobleck_slurm.protocol.events import read_events

    if code != 0 and (finished := read_events(job.events, "job_finished")):
        code = int(finished[-1].get("exit_code") or 0)  # a standby supervisor took over and ended the job
    print_summary(job.path, out)
    if code != 0:
        out.print(f"[red]job failed (exit {code}); see {escape(str(job.logs))}[/]")
        return EXIT_FAILED
    return EXIT_OK


def print_summary(job_dir: Path, out: Console) -> None:
    """The run in a few sentences (dashboard/narrate.py), and the report command."""
    from oobleck_slurm.dashboard.narrate import summary_lines
    from oobleck_slurm.protocol.events import events_path, read_events

    for line in summary_lines(read_events(events_path(job_dir))):
        out.print(escape(line), highlight=False, soft_wrap=True)
    out.print(f"  report: python -m oobleck_slurm report {escape(str(job_dir))}", highlight=False, soft_wrap=True)


def _supervised(job: JobDir) -> bool:
    """Whether a supervisor other than the one `submit` started holds the job (a standby took over):
    its lease is renewed and the job is not over."""
    from oobleck_slurm.cluster.lease import read_lease

    lease = read_lease(job)
    return lease is not None and not lease.done and time.time() - lease.t < 2 * job.recipe().fault_tolerance.heartbeat_lease


def _follow(job_dir: Path, mode: str, running: Callable[[], bool]) -> None:
    """Show the job until it records job_finished, or until `running()` says it ended without it
    (a crash, a lost batch node); the events written by then are shown first. `mode`: "dashboard"
    (the live dashboard), "sentences" (dashboard/narrate.py) or "json" (each event as a JSON line)."""
    if mode == "dashboard":
        from oobleck_slurm.dashboard.live import run_dashboard

        run_dashboard(job_dir, live=True, console=console, exit_when_done=True)
        return
    from oobleck_slurm.dashboard.narrate import Narrator
    from oobleck_slurm.protocol.events import EventTail, events_path

    narrator = Narrator()

    def show(event: dict) -> None:
        if mode == "json":
            print(json.dumps(event), flush=True)
            return
        for line in narrator.lines(event):
            console.print(escape(line), highlight=False, soft_wrap=True)  # event text: no markup

    tail = EventTail(events_path(job_dir))
    while True:
        events = tail.poll()
        for event in events:
            show(event)
        if any(event["kind"] == "job_finished" for event in events):
            return
        if not running():
            for event in tail.poll():
                show(event)
            return
        time.sleep(FOLLOW_POLL_S)


def _mode(args: argparse.Namespace) -> str:
    if args.json:
        return "json"
    return "dashboard" if console.is_terminal and not args.no_dashboard else "sentences"


def _submit_slurm(job: JobDir, recipe: Recipe, args: argparse.Namespace) -> int:
    """Submit the allocation (the supervisor in the batch step, one agent per node through srun).
    Returns once submitted (--detach) or finished."""
    from oobleck_slurm.submission import submit_slurm

    try:
        slurm_job_id = submit_slurm(job, recipe)
    except Exception as err:  # noqa: BLE001 - sbatch's refusal (bad partition, account...) is the user's to fix
        return fail(f"sbatch refused the job: {str(err).strip()}", EXIT_FAILED)
    out = err_console if args.json else console  # --json: stdout carries the events alone
    out.print(f"job [bold]{escape(job.job_id)}[/] submitted (Slurm job {escape(slurm_job_id)})")
    out.print(f"folder: {escape(str(job.path))}")
    if args.detach:
        return EXIT_OK
    try:
        code = _follow_slurm(job.path, slurm_job_id, _mode(args), out)
    except KeyboardInterrupt:
        out.print(f"[yellow]stopped following; the job goes on (cancel it with: cancel {escape(job.job_id)})[/]")
        return 130
    print_summary(job.path, out)
    if code != 0:
        out.print(f"[red]job failed (exit {code}); see {escape(str(job.logs))}[/]")
        return EXIT_FAILED
    return EXIT_OK


def _follow_slurm(job_dir: Path, slurm_job_id: str, mode: str, out: Console) -> int:
    """Follow until the supervisor records job_finished, or Slurm says the job is gone without it."""
    from oobleck_slurm.cluster.jobdir import JobDir
    from oobleck_slurm.cluster.slurm import in_queue
    from oobleck_slurm.protocol.events import events_path, read_events
    from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS

    asked = [0.0]  # when squeue was last asked: once per slurm_follow_poll

    def running() -> bool:
        # Under supervisor failover any supervisor job of it (docs/failover.md), else the allocation.
        # Only Slurm's "gone" for every one of them ends the follow: an unknown answer (slurmctld slow or
        # restarting, after its retries) keeps following.
        now = time.monotonic()
        if now - asked[0] < DEFAULT_TIMEOUTS.slurm_follow_poll:
            return True
        asked[0] = now
        ids = JobDir.at(job_dir).meta().get("supervisor_jobs") or [slurm_job_id]
        answers = [in_queue(str(i)) for i in ids]
        if None in answers and True not in answers:
            out.print("[yellow]Slurm did not answer squeue; still following the job[/]")
        return any(answer is not False for answer in answers)

    _follow(job_dir, mode, running=running)
    finished = read_events(events_path(job_dir), "job_finished")
    if finished:
        return int(finished[-1].get("exit_code") or 0)
    out.print(f"[red]Slurm job {escape(slurm_job_id)} ended without a supervisor record (lost batch node, "
                  "cancelled, or it never started); see the submitit/ folder[/]")
    return EXIT_FAILED

