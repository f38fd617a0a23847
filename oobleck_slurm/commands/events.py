"""`events JOB`: the job's event log, one line per event (or raw JSON lines), optionally followed."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from oobleck_slurm.commands.common import console, fail
from oobleck_slurm.exit_codes import EXIT_OK

FOLLOW_POLL_S = 0.5
QUIET_KINDS = ("step", "node")  # frequent: shown with --all or asked for by --kind


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("events", help="print a job's event log (failures, recoveries with timings, ...)")
    parser.add_argument("job", help="job folder, or a job id under --job-root")
    parser.add_argument("--job-root", type=Path, default=Path("jobs"), help="where job ids are looked up (default: jobs)")
    parser.add_argument("--kind", action="append", default=None, help="only these kinds (repeatable)")
    parser.add_argument("--all", action="store_true", help="also the per-step and per-node events")
    parser.add_argument("--json", action="store_true", help="raw JSON lines")
    parser.add_argument("--follow", "-f", action="store_true", help="keep printing new events until the job ends")


def format_event(event: dict[str, Any], t0: float) -> str:
    """`+12.345s kind  key=value ...`: seconds since the job started, then every field."""
    fields = []
    for key, value in event.items():
        if key in ("t", "kind"):
            continue
        if isinstance(value, float):
            value = f"{value:.3f}"
        elif isinstance(value, (list, dict)):
            value = json.dumps(value, separators=(",", ":"))
            value = value if len(value) <= 120 else value[:117] + "..."
        fields.append(f"{key}={value}")
    return f"{event['t'] - t0:+10.3f}s {event['kind']:<22} {' '.join(fields)}"


def run(args: argparse.Namespace) -> int:
    from oobleck_slurm.cluster.jobdir import JobNotFound, find_job
    from oobleck_slurm.protocol.events import EventTail, events_path

    try:
        job = find_job(args.job, args.job_root)
    except JobNotFound as err:
        return fail(str(err))
    tail = EventTail(events_path(job.path))
    t0: float | None = None
    while True:
        for event in tail.poll():
            t0 = event["t"] if t0 is None else t0
            if args.kind and event["kind"] not in args.kind:
                continue
            if not args.kind and not args.all and event["kind"] in QUIET_KINDS:
                continue
            if args.json:
                print(json.dumps(event, separators=(",", ":")))
            else:
                # Event text is the job's (exception messages such as gloo's "[/path/pair.cc:553]"): no markup.
                console.print(format_event(event, t0), markup=False, highlight=False, soft_wrap=True)
            if args.follow and event["kind"] == "job_finished":
                return EXIT_OK
        if not args.follow:
            return EXIT_OK
        time.sleep(FOLLOW_POLL_S)
