"""`report JOB [--out DIR]`: a static HTML report with plots of a job's run, from its event log."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.markup import escape

from oobleck_slurm.commands.common import console, fail
from oobleck_slurm.exit_codes import EXIT_OK


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("report", help="write an HTML report with plots (loss, throughput, recoveries)")
    parser.add_argument("job", help="job folder, or a job id under --job-root")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: JOB/report)")
    parser.add_argument("--job-root", type=Path, default=Path("jobs"), help="where job ids are looked up (default: jobs)")


def run(args: argparse.Namespace) -> int:
    from oobleck_slurm.cluster.jobdir import JobNotFound, find_job
    from oobleck_slurm.dashboard.plots import MissingMatplotlib
    from oobleck_slurm.dashboard.report import NoEvents, write_report

    try:
        job_dir = find_job(args.job, args.job_root, needs_meta=False).path
        index = write_report(job_dir, args.out)
    except (JobNotFound, NoEvents, MissingMatplotlib) as err:
        return fail(str(err))
    except OSError as err:
        return fail(f"cannot write the report: {err}")
    console.print(f"[green]✓[/] report written: {escape(str(index))}", highlight=False)
    return EXIT_OK
