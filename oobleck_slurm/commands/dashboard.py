"""`dashboard JOB`: watch a job live in the terminal (or replay a finished or copied job folder)."""

from __future__ import annotations

import argparse
from pathlib import Path

from oobleck_slurm.commands.common import console, fail, is_interactive
from oobleck_slurm.exit_codes import EXIT_OK


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("dashboard", help="live terminal dashboard of a job (q quits, p pauses, arrows scroll)")
    parser.add_argument("job", help="job folder, or a job id under --job-root")
    parser.add_argument("--job-root", type=Path, default=Path("jobs"), help="where job ids are looked up (default: jobs)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit (default when stdout is not a terminal)")
    parser.add_argument("--refresh", type=float, default=0.5, metavar="S", help="seconds between redraws (default 0.5)")


def run(args: argparse.Namespace) -> int:
    from oobleck_slurm.cluster.jobdir import JobNotFound, find_job
    from oobleck_slurm.dashboard import run_dashboard
    from oobleck_slurm.dashboard.live import job_summary

    try:
        job_dir = find_job(args.job, args.job_root, needs_meta=False).path
    except JobNotFound as err:
        return fail(str(err))
    if args.refresh <= 0:
        return fail(f"--refresh must be positive, got {args.refresh}")
    live = not args.once and is_interactive()
    state = run_dashboard(job_dir, live=live, console=console, refresh_s=args.refresh)
    if live:
        console.print(job_summary(state, job_dir), markup=False, highlight=False)  # job ids and paths are text
    return EXIT_OK
