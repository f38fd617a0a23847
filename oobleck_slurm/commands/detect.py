"""`detect JOB` or `detect --metrics FILE.csv`: find faulty machines in recorded metrics, offline.

Runs the same Minder-style detector the runtime uses (oobleck_slurm.detection) over a metrics file
with the header `time,node,metric,value` (a job folder's metrics.csv and its rotated predecessors,
or any such file), and prints each flagged machine with the time it was first flagged, since when it
deviated, and the metrics behind it. With JOB, the knobs come from the job's recipe (`detection:`);
otherwise from the defaults; --threshold/--window/--continuity/--interval override either.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from oobleck_slurm.commands.common import console, fail
from oobleck_slurm.exit_codes import EXIT_OK


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("detect", help="find faulty machines in recorded metrics (offline Minder-style detector)")
    parser.add_argument("job", nargs="?", help="job folder, or a job id under --job-root (reads its metrics.csv)")
    parser.add_argument("--metrics", type=Path, metavar="FILE", help="a CSV file with header time,node,metric,value")
    parser.add_argument("--job-root", type=Path, default=Path("jobs"), help="where job ids are looked up (default: jobs)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of flags (node, time, since, metrics, score)")
    for knob, what in (("threshold", "robust z-score"), ("window", "seconds"), ("continuity", "seconds"),
                       ("interval", "seconds between samples")):
        parser.add_argument(f"--{knob}", type=float, help=f"override detection.{knob} ({what})")


def run(args: argparse.Namespace) -> int:
    from oobleck_slurm.detection import DetectorConfig, MetricsFileError, bucket, detect, metrics_files, read_metrics

    if (args.job is None) == (args.metrics is None):
        return fail("give a job (detect JOB) or a metrics file (detect --metrics FILE.csv), not both or neither")
    config = DetectorConfig()
    live = False
    if args.metrics is not None:
        files = [args.metrics]
    else:
        from oobleck_slurm.cluster.jobdir import RECIPE_FILE, JobNotFound, find_job
        from oobleck_slurm.recipe import RecipeError, load_recipe

        folder = Path(args.job)
        if not metrics_files(folder):  # a folder copied with just its metrics is fine too
            try:
                folder = find_job(args.job, args.job_root, needs_meta=False).path
            except JobNotFound as err:
                return fail(str(err))
        try:
            config = DetectorConfig.from_recipe(load_recipe(folder / RECIPE_FILE).detection)
        except (RecipeError, OSError, ValueError):
            pass  # no recipe, or an older one: the defaults still judge its metrics
        files = metrics_files(folder)
        if not files:
            return fail(f"{folder}: no metrics.csv (the job recorded no metrics yet)")
        live = True  # the job may still be writing: a torn last line is skipped
    overrides = {k: getattr(args, k) for k in ("threshold", "window", "continuity", "interval") if getattr(args, k) is not None}
    try:
        config = DetectorConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__}, **overrides})
    except ValueError as err:
        return fail(str(err))
    try:
        trace = [sample for path in files for sample in read_metrics(path, live=live)]
    except MetricsFileError as err:
        return fail(str(err))
    trace = bucket(trace, config.interval)
    flags = detect(trace, config)
    nodes = sorted({node for _, sample in trace for node in sample})
    if args.json:
        print(json.dumps([{"node": str(f.node), "time": f.time, "since": f.since, "metrics": list(f.metrics),
                                        "score": round(f.score, 3)} for f in flags]))
        return EXIT_OK
    span = f"{len(trace)} samples of {len(nodes)} machines, t={trace[0][0]:g}..{trace[-1][0]:g} s" if trace else "no samples"
    if not flags:
        console.print(f"no faulty machine found ({escape(span)})")
        return EXIT_OK
    table = Table(title=f"{len(flags)} machine(s) flagged ({escape(span)})")
    for col in ("node", "flagged at s", "deviating since s", "metrics", "score"):
        table.add_column(col, justify="right" if col in ("flagged at s", "deviating since s", "score") else "left")
    for f in flags:
        table.add_row(escape(str(f.node)), f"{f.time:g}", f"{f.since:g}", escape(", ".join(f.metrics)), f"{f.score:.1f}")
    console.print(table)
    return EXIT_OK
