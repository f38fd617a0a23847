"""`profile-steps JOB --steps N|A:B`: every worker of a running job traces steps with torch.profiler.

`--steps N`: the next N steps, from a step far enough ahead that every worker has seen the request
(its watcher looks every `request_poll` seconds); `--steps A:B`: steps A to B-1. The traces (Chrome
trace format: chrome://tracing, https://ui.perfetto.dev) go to JOB/traces/<id>/<worker>-rank<r>.json,
each announced by a `trace_written` event (engine/requests.py).
"""

from __future__ import annotations

import argparse
import math
import statistics

from rich.markup import escape

from oobleck_slurm.commands.common import console, fail
from oobleck_slurm.exit_codes import EXIT_OK

RECENT_STEPS = 5  # the step time the lead is counted in: the median of the last few steps


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("profile-steps", aliases=["profile_steps"],
                                   help="trace steps of a running job with torch.profiler (Chrome traces)")
    parser.add_argument("job", help="job folder, or a job id under --job-root")
    parser.add_argument("--steps", required=True, metavar="N|A:B",
                        help="the next N steps, or steps A to B-1 (0-based, as the step events number them)")
    parser.add_argument("--job-root", default="jobs", help="where job ids are looked up (default: jobs)")


def steps_window(spec: str, last_step: int | None, step_s: float | None, poll: float) -> tuple[int, int]:
    """[start, stop) from `--steps`: "A:B" as given; "N" after a lead of the steps that pass in two
    request polls (every worker sees the request before the window starts), at least one."""
    if ":" in spec:
        a, _, b = spec.partition(":")
        start, stop = int(a), int(b)
    else:
        n = int(spec)
        if n < 1:
            raise ValueError(f"--steps {spec}: at least one step")
        lead = 1 + (math.ceil(2 * poll / step_s) if step_s else 1)
        start = (last_step + 1 if last_step is not None else 0) + lead
        stop = start + n
    if not 0 <= start < stop:
        raise ValueError(f"--steps {spec}: the window [{start}, {stop}) is empty")
    return start, stop


def run(args: argparse.Namespace) -> int:
    from oobleck_slurm.cluster.jobdir import JobNotFound, find_job
    from oobleck_slurm.engine.requests import write_request
    from oobleck_slurm.protocol.events import EventLog, read_events
    from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS

    try:
        job = find_job(args.job, args.job_root, needs_meta=False)
    except JobNotFound as err:
        return fail(str(err))
    steps = read_events(job.events, "step")
    recent = [e["seconds"] for e in steps[-RECENT_STEPS:] if isinstance(e.get("seconds"), (int, float))]
    try:
        start, stop = steps_window(args.steps, steps[-1]["step"] if steps else None,
                                   statistics.median(recent) if recent else None, DEFAULT_TIMEOUTS.request_poll)
    except ValueError as err:
        return fail(str(err))
    ident = write_request(job.trace_request, start=start, stop=stop)
    EventLog(job.events).emit("trace_requested", id=ident, start=start, stop=stop)
    console.print(f"[green]✓[/] every worker traces steps {start}..{stop - 1}: "
                  f"{escape(str(job.traces / str(ident)))}/", highlight=False)
    return EXIT_OK
