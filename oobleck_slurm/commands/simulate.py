"""`simulate RECIPE [trace options] [--systems ...] [--estimate GPU | --profile FILE] [--json] [--out DIR]`.

A discrete-event simulation of a whole run of the recipe's model under a failure trace, for Oobleck
(the real reconfiguration on the real templates, calibrated recovery costs) and the baselines. The
trace comes from a CSV file (`--trace`), the artifact's fixed interval (`--mtbf D --nodes N
--min-nodes M`), or random node failures (`--mttf-node D --hours H`, replacements after
`--replacement-delay`). See docs/simulator.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oobleck_slurm.commands.common import add_recipe_argument, console, fail, load_recipe_or_report
from oobleck_slurm.commands.profile import add_source_arguments, resolve_templates
from oobleck_slurm.exit_codes import EXIT_BAD_INPUT, EXIT_OK

if TYPE_CHECKING:  # the simulator is imported when the command runs, not when the CLI starts
    from oobleck_slurm.simulate.traces import Trace

# DEFAULT_CALIBRATION.source, without importing the simulator at CLI start (a test holds them equal)
DEFAULT_SOURCE = "tests/dashboard/logs (failure, join, healthy): 2 failures, 1 join, 3 checkpoints"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("simulate", help="simulate a whole run under failures: Oobleck vs checkpoint "
                                                   "and redundancy baselines")
    add_recipe_argument(parser)
    trace = parser.add_argument_group("trace (one of)")
    trace.add_argument("--trace", type=Path, metavar="FILE.csv", help="CSV with header time,event,node (fail|join)")
    trace.add_argument("--mtbf", metavar="DURATION", help="fixed interval between losses (e.g. 10m): one node lost "
                       "per interval from --nodes down to --min-nodes (the Oobleck artifact's traces)")
    trace.add_argument("--mttf-node", metavar="DURATION", help="random failures: each node's mean time to failure")
    parser.add_argument("--nodes", type=int, metavar="N", help="initial nodes (default: the recipe's nodes + spares)")
    parser.add_argument("--min-nodes", type=int, metavar="M", help="with --mtbf: stop losing nodes at M (default N/2)")
    parser.add_argument("--hours", type=float, metavar="H", help="simulated wall time (default: from the trace)")
    parser.add_argument("--replacement-delay", default="10m", metavar="DURATION",
                        help="with --mttf-node: a replacement joins this long after a loss ('none': never)")
    parser.add_argument("--weibull-shape", type=float, metavar="K", help="with --mttf-node: Weibull lifetimes")
    parser.add_argument("--seed", type=int, default=0, help="random seed of generated traces")
    parser.add_argument("--systems", default="oobleck,checkpoint,redundancy",
                        help="comma-separated: oobleck, checkpoint, redundancy")
    parser.add_argument("--calibrate", nargs="+", type=Path, metavar="JOBDIR",
                        help="fit the recovery-cost model from these job folders' events.jsonl")
    parser.add_argument("--nccl-model", action="store_true",
                        help="charge each recovery and join the modelled rebuild of every NCCL communicator of the "
                             "initial plan, and the heartbeat lease as detection (docs/simulator.md#at-scale); "
                             "the default costs come from a 4-process CPU job")
    add_source_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--out", type=Path, metavar="DIR", help="write result.json and PNG plots into DIR")


def _trace(args: argparse.Namespace, default_nodes: int) -> Trace:
    from oobleck_slurm.simulate import (
        TraceError,
        fixed_interval_trace,
        parse_duration,
        random_failure_trace,
        read_trace_csv,
    )

    chosen = [name for name in ("trace", "mtbf", "mttf_node") if getattr(args, name) is not None]
    if len(chosen) > 1:
        raise TraceError(f"give one of --trace, --mtbf, --mttf-node (got {', '.join('--' + c.replace('_', '-') for c in chosen)})")
    if args.nodes is not None and args.nodes < 1:
        raise TraceError(f"--nodes must be >= 1, got {args.nodes}")
    if args.hours is not None and not args.hours > 0:
        raise TraceError(f"--hours must be > 0, got {args.hours}")
    horizon = args.hours * 3600 if args.hours is not None else None
    nodes = args.nodes or default_nodes
    if args.trace is not None:
        return read_trace_csv(args.trace, initial_nodes=args.nodes, horizon_s=horizon)
    if args.mttf_node is not None:
        if horizon is None:
            raise TraceError("--mttf-node needs --hours H (how long the run is)")
        delay = None if str(args.replacement_delay).lower() == "none" else parse_duration(
            args.replacement_delay, "--replacement-delay")
        return random_failure_trace(nodes, parse_duration(args.mttf_node, "--mttf-node"), horizon,
                                    replacement_delay_s=delay, weibull_shape=args.weibull_shape, seed=args.seed)
    interval = parse_duration(args.mtbf or "1h", "--mtbf")
    min_nodes = args.min_nodes if args.min_nodes is not None else nodes // 2
    return fixed_interval_trace(nodes, min_nodes, interval, seed=args.seed, horizon_s=horizon)


def run(args: argparse.Namespace) -> int:
    from oobleck_slurm.planning import PlanningError, ProfileError, UnknownGPU
    from oobleck_slurm.planning.pregenerate import plan_request, require_templates
    from oobleck_slurm.simulate import (
        DEFAULT_CALIBRATION,
        SYSTEMS,
        TraceError,
        fit_calibration,
        job_events,
        scenario_from,
        simulate,
    )

    recipe = load_recipe_or_report(args.recipe)
    if recipe is None:
        return EXIT_BAD_INPUT
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        return fail(f"--systems: unknown {', '.join(bad) or '(none given)'}; known: {', '.join(SYSTEMS)}")
    try:
        trace = _trace(args, recipe.cluster.nodes + recipe.cluster.spare_nodes)
        calibration = DEFAULT_CALIBRATION
        if args.calibrate:
            calibration = fit_calibration([job_events(d) for d in args.calibrate],
                                          source=", ".join(str(d) for d in args.calibrate))
    except TraceError as err:
        return fail(str(err))
    max_nodes = max(len(trace.initial_nodes) + sum(e.kind == "join" for e in trace.events), 1)
    request = plan_request(recipe, nodes=min(max_nodes, len(trace.initial_nodes) + 64))
    try:
        profile, source, templates, _ = resolve_templates(args, recipe, request)
    except (ProfileError, PlanningError, UnknownGPU) as err:
        return fail(str(err))
    try:
        require_templates(profile, templates, request)
    except PlanningError as err:
        return fail(str(err))
    scenario = scenario_from(profile, templates, f=recipe.fault_tolerance.f,
                             global_microbatches=recipe.training.global_microbatches,
                             microbatch_size=recipe.training.microbatch_size,
                             checkpoint_interval=recipe.fault_tolerance.checkpoint_interval, name=recipe.name)
    try:
        if args.nccl_model:
            calibration = _nccl_calibration(scenario, trace, calibration, recipe.fault_tolerance.heartbeat_lease)
        results = simulate(scenario, trace, systems, calibration=calibration)
    except PlanningError as err:
        return fail(str(err))
    report = {
        "recipe": recipe.name, "profile": {"source": source, "device_name": profile.device_name,
                                           "devices_per_node": profile.devices_per_node},
        "trace": {"source": trace.source, "initial_nodes": len(trace.initial_nodes), "events": len(trace.events),
                  "failures": trace.failures, "horizon_s": trace.horizon_s},
        "calibration": calibration.to_dict(),
        "systems": {name: r.to_dict(curve=bool(args.out)) for name, r in results.items()},
    }
    # flat access for scripts: report["oobleck"]["useful_fraction"]
    report.update({name: {"useful_fraction": r.useful_fraction, "samples": r.samples} for name, r in results.items()})
    if args.out:
        write_outputs(args.out, report, results)
    if args.json:
        print(json.dumps(report if args.out else {k: v for k, v in report.items()}, indent=2))
        return EXIT_OK
    show(report, results)
    if args.out:
        console.print(f"wrote {args.out / 'result.json'}, {args.out / 'samples.png'}, {args.out / 'breakdown.png'}")
    return EXIT_OK


def _nccl_calibration(scenario: Any, trace: Trace, base: Any, lease_s: float) -> Any:
    """`base` with the NCCL rebuild model of the plan the trace's initial nodes start with."""
    from oobleck_slurm.planning import instantiate
    from oobleck_slurm.simulate import DEFAULT_COMM_COSTS, build_seconds, scale_calibration
    from oobleck_slurm.simulate.nccl_model import plan_group_map

    plan = instantiate(scenario.templates, [str(n) for n in trace.initial_nodes], scenario.f,
                       scenario.global_microbatches, microbatch_size=scenario.microbatch_size, profile=scenario.profile)
    rebuild = build_seconds(plan_group_map(plan, scenario.profile.devices_per_node), DEFAULT_COMM_COSTS)
    return scale_calibration(base, rebuild, detection_s=lease_s,
                             source=f"NCCL rebuild model ({rebuild:.2f} s), detection {lease_s:g} s (lease); "
                                    f"the rest from {base.source}")


def show(report: dict, results: dict) -> None:
    from rich.table import Table

    from oobleck_slurm.simulate import CATEGORIES

    tr = report["trace"]
    console.print(f"trace: {tr['source']}; {tr['initial_nodes']} nodes, {tr['failures']} failures, "
                  f"{tr['events']} events over {tr['horizon_s'] / 3600:.2f} h; profile {report['profile']['device_name']} "
                  f"({report['profile']['source']}); calibration: {report['calibration']['source']}")
    table = Table(title="simulated run: where the wall time went")
    shown = [c for c in CATEGORIES[1:] if any(r.seconds[c] > 0 for r in results.values())]
    table.add_column("system", no_wrap=True)
    table.add_column("useful", justify="right", no_wrap=True)
    for cat in shown:
        table.add_column(cat, justify="right", no_wrap=True)
    table.add_column("samples", justify="right", no_wrap=True)
    for name, r in results.items():
        frac = {k: v / r.wall_s for k, v in r.seconds.items()}
        table.add_row(name, f"[bold]{r.useful_fraction:.2%}[/]", *[f"{frac[c]:.2%}" if frac[c] else "-" for c in shown],
                      f"{r.samples:.3g}")
    console.print(table)
    if report["calibration"]["source"] == DEFAULT_SOURCE and report["trace"]["initial_nodes"] >= 64:
        console.print("[yellow]note:[/] Oobleck's recovery costs come from a 4-process CPU job (rebuild 0.0134 s, "
                      "detection 0.041 s); at this scale add --nccl-model (docs/simulator.md#at-scale)", highlight=False)
    for name, r in results.items():
        for note in r.notes:
            console.print(f"[yellow]{name}:[/] {note}", highlight=False)


def write_outputs(out: Path, report: dict, results: dict) -> None:
    from oobleck_slurm.dashboard.plots import load_pyplot
    from oobleck_slurm.simulate import CATEGORIES

    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(report, indent=2))
    plt = load_pyplot()
    colours = {"oobleck": "tab:green", "checkpoint": "tab:purple", "redundancy": "tab:orange"}
    fig, ax = plt.subplots(figsize=(10, 4))
    for name, r in results.items():
        if r.samples_curve:
            t, s = zip(*r.samples_curve)
            ax.plot([x / 3600 for x in t], s, lw=1.5, label=f"{name} ({r.useful_fraction:.1%} useful)",
                    color=colours.get(name))
    ax.set_xlabel("hours since start")
    ax.set_ylabel("samples trained")
    ax.set_title(f"samples over time: {report['trace']['source']}")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "samples.png", dpi=100)
    plt.close(fig)
    cat_colours = {"useful": "tab:green", "recovering": "tab:red", "replayed": "tab:orange",
                   "checkpointing": "tab:purple", "fallback": "tab:brown", "lost": "tab:gray",
                   "redundant": "tab:olive", "idle": "tab:blue"}
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * len(results)))
    for i, r in enumerate(results.values()):
        left = 0.0
        for cat in CATEGORIES:
            share = r.seconds[cat] / r.wall_s
            if share > 0:
                ax.barh(i, share, left=left, color=cat_colours[cat], label=cat, edgecolor="white")
                left += share
    ax.set_yticks(range(len(results)), list(results))
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of wall time")
    ax.set_title("where the time went")
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend(seen.values(), seen.keys(), loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=len(seen),
              fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out / "breakdown.png", dpi=100)
    plt.close(fig)
