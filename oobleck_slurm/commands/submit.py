"""`submit [RECIPE]`: validate, pregenerate pipeline templates, start the job, follow it.

The job runs in its own process session (local backend), so it outlives this command: `--detach`
returns at once, and Ctrl-C while following stops the job.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from oobleck_slurm.commands.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    add_recipe_argument,
    console,
    fail,
    load_recipe_or_report,
)
from oobleck_slurm.commands.profile import add_source_arguments, progress_bar

FOLLOW_POLL_S = 0.5


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("submit", help="plan and start a training job, then follow it")
    add_recipe_argument(parser)
    add_source_arguments(parser)
    parser.add_argument("--detach", action="store_true", help="print the job id and folder and return")
    parser.add_argument("--job-root", type=Path, default=None, help="where job folders go (default: cluster.job_root)")
    parser.add_argument("--no-dashboard", action="store_true", help="print step lines instead of the live dashboard")


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe_or_report(args.recipe)
    if recipe is None:
        return EXIT_BAD_INPUT
    if recipe.cluster.backend != "local":
        return fail(f"{recipe.source}: cluster.backend: the {recipe.cluster.backend!r} backend cannot be submitted "
                    "yet; use 'local' (virtual nodes on this machine)")

    from oobleck_slurm.planning import PlanningError, ProfileError
    from oobleck_slurm.planning.pregenerate import pregenerate

    bar = progress_bar(console.is_terminal)
    try:
        if bar is not None:
            with bar:
                pregenerate(recipe, args.cache, profile_file=args.profile, estimate_gpu=args.estimate, progress=bar)
        else:
            pregenerate(recipe, args.cache, profile_file=args.profile, estimate_gpu=args.estimate)
    except (PlanningError, ProfileError, KeyError) as err:
        return fail(str(err).strip("'\""))

    from oobleck_slurm.cluster.jobdir import create_job_dir

    job = create_job_dir(recipe, args.job_root)
    log_file = open(job.path / "logs" / "local_job.log", "wb")  # noqa: SIM115 - owned by the child
    job.update_meta(templates_cache=str(Path(args.cache).resolve()))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen([sys.executable, "-m", "oobleck_slurm.cluster.local_job", str(job.path)],
                               stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                               cwd=os.getcwd())
    log_file.close()
    job.update_meta(pid=process.pid)
    console.print(f"job [bold]{job.job_id}[/] submitted (local backend, pid {process.pid})")
    console.print(f"folder: {job.path}")
    if args.detach:
        return EXIT_OK
    try:
        _follow(job.path, process, dashboard=console.is_terminal and not args.no_dashboard)
    except KeyboardInterrupt:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()
        console.print("[yellow]interrupted: job stopped[/]")
        return 130
    code = process.wait()
    if code != 0:
        console.print(f"[red]job failed (exit {code}); see {job.path / 'logs'}[/]")
        return EXIT_FAILED
    return EXIT_OK


def _follow(job_dir: Path, process: subprocess.Popen, dashboard: bool) -> None:
    if dashboard:
        from oobleck_slurm.dashboard.live import run_dashboard

        run_dashboard(job_dir, live=True, console=console, exit_when_done=True)
        return
    from oobleck_slurm.events import EventTail, events_path

    tail = EventTail(events_path(job_dir))
    while True:
        for event in tail.poll():
            _print_event(event)
        if process.poll() is not None:
            for event in tail.poll():
                _print_event(event)
            return
        time.sleep(FOLLOW_POLL_S)


def _print_event(event: dict) -> None:
    kind = event["kind"]
    if kind == "step":
        console.print(f"step {event.get('step')}: loss {event.get('loss', float('nan')):.4f}, "
                      f"{event.get('samples_per_s', 0):,.1f} samples/s", highlight=False)
    elif kind in ("job_started", "job_finished", "failure", "resumed", "checkpoint_fallback"):
        fields = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("t", "kind"))
        console.print(f"[bold]{kind}[/] {fields}", highlight=False)
