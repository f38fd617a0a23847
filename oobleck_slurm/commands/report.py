"""`report JOB [--out DIR] [--tensorboard [DIR]]`: a static HTML report with plots of a job's run, from its
event log; with --tensorboard, its metrics as TensorBoard scalars too (dashboard/tensorboard.py)."""

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
    parser.add_argument("--tensorboard", type=Path, nargs="?", const=True, default=None, metavar="DIR",
                        help="also write the metrics as TensorBoard scalars (default DIR: JOB/tensorboard); "
                             "only what is not there yet")


def run(args: argparse.Namespace) -> int:
    from oobleck_slurm.cluster.jobdir import JobNotFound, find_job
    from oobleck_slurm.dashboard.plots import MissingMatplotlib
    from oobleck_slurm.dashboard.report import NoEvents, write_report

    try:
        job = find_job(args.job, args.job_root, needs_meta=False)
        index = write_report(job.path, args.out)
    except (JobNotFound, NoEvents, MissingMatplotlib) as err:
        return fail(str(err))
    except OSError as err:
        return fail(f"cannot write the report: {err}")
    console.print(f"[green]✓[/] report written: {escape(str(index))}", highlight=False)
    if args.tensorboard is not None:
        from oobleck_slurm.dashboard.tensorboard import TensorBoardExporter, TensorBoardUnavailable

        folder = job.tensorboard if args.tensorboard is True else args.tensorboard
        try:
            exporter = TensorBoardExporter(job.events, folder)
            exporter.close()
        except TensorBoardUnavailable as err:
            return fail(str(err))
        except OSError as err:
            return fail(f"cannot write the TensorBoard files: {err}")
        console.print(f"[green]✓[/] TensorBoard scalars: {escape(str(folder))} (tensorboard --logdir "
                      f"{escape(str(folder))})", highlight=False)
    return EXIT_OK
