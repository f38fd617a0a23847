"""`plan RECIPE [--nodes N] [--failures F] [--profile FILE | --estimate GPU] [--max-stage-devices G] [--json]`.

Shows the pipeline templates (one per node count that fits, with each stage's layers and devices) and
the plan for N nodes that survives F failures: pipelines, microbatches each, predicted step time and
samples/s, and the same cost model's pure data-parallel (FSDP) bound on the plan's devices.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from rich.markup import escape

from oobleck_slurm.commands.common import add_recipe_argument, console, fail, load_recipe_or_report
from oobleck_slurm.commands.profile import add_source_arguments, resolve_templates
from oobleck_slurm.exit_codes import EXIT_BAD_INPUT, EXIT_OK

if TYPE_CHECKING:  # the planner is imported when a command runs, not when the CLI starts
    from oobleck_slurm.planning import PipelineTemplate, Plan, Profile
    from oobleck_slurm.planning.pregenerate import PlanRequest


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plan", help="show the pipeline templates and the plan for N nodes and F failures")
    add_recipe_argument(parser)
    parser.add_argument("--nodes", type=int, metavar="N", help="nodes to plan for (default: the recipe's nodes + spares)")
    parser.add_argument("--failures", type=int, metavar="F", help="failures to survive (default: fault_tolerance.f)")
    add_source_arguments(parser)
    parser.add_argument("--max-stage-devices", type=int, metavar="G",
                        help="devices one (sharded) stage may span inside a node, a divisor of the devices per "
                             "node (default: the recipe's cluster.max_stage_devices; unset: the node's GPUs, 1 on CPU workers)")
    parser.add_argument("--json", action="store_true", help="print templates and plan as JSON")


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from oobleck_slurm.planning import PlanningError, ProfileError, UnknownGPU
    from oobleck_slurm.planning.pregenerate import instantiate_for, plan_request

    recipe = load_recipe_or_report(args.recipe)
    if recipe is None:
        return EXIT_BAD_INPUT
    for name in ("nodes", "failures"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "nodes" else 0):
            return fail(f"--{name} must be >= {1 if name == 'nodes' else 0}, got {value}")
    request = plan_request(recipe, nodes=args.nodes, failures=args.failures)
    if args.max_stage_devices is not None:
        per_node = recipe.cluster.devices_per_node
        if args.max_stage_devices < 1 or per_node % args.max_stage_devices:
            return fail(f"--max-stage-devices must divide the devices per node ({per_node}), "
                        f"got {args.max_stage_devices}")
        request = replace(request, max_stage_devices=args.max_stage_devices)
    try:
        profile, source, templates, status = resolve_templates(args, recipe, request)
    except (ProfileError, PlanningError, UnknownGPU) as err:
        return fail(str(err))
    try:
        plan = instantiate_for(profile, templates, request)
    except PlanningError as err:
        return fail(str(err))
    n0 = templates[0].num_nodes
    bound = data_parallel_bound(profile, request, plan)
    if args.json:
        print(json.dumps({
            "profile": {"source": source, "key": profile.key, "device_name": profile.device_name,
                        "devices_per_node": profile.devices_per_node},
            "request": {**request.__dict__, "num_microbatches": request.num_microbatches},
            "smallest_pipeline_nodes": n0, "templates_cache": status,
            "templates": [t.to_dict() for t in templates], "plan": plan.to_dict(),
            "stage_devices": [[s.devices for s in p.template.stages] for p in plan.pipelines],
            "data_parallel_bound": bound,
        }, indent=2))
        return EXIT_OK
    show(profile, source, request, templates, plan, status)
    console.print(f"data-parallel bound (FSDP over the plan's {bound['devices']} devices, no bubble, "
                  f"cost.data_parallel_step): {bound['step_time_s']:.4f} s, {bound['samples_per_s']:,.1f} "
                  f"samples/s; this plan reaches {plan.samples_per_s / bound['samples_per_s']:.1%} of it")
    return EXIT_OK


def data_parallel_bound(profile: Profile, request: PlanRequest, plan: Plan) -> dict[str, float]:
    """The same cost model's pure data-parallel bound on the devices the plan uses (spares left out)."""
    from oobleck_slurm.planning import cost

    devices = plan.nodes_used * profile.devices_per_node
    step = cost.data_parallel_step(profile, devices, request.global_microbatches)
    return {"devices": devices, "step_time_s": step,
            "samples_per_s": request.global_microbatches * request.microbatch_size / step}


def show(profile: Profile, source: str, request: PlanRequest, templates: list[PipelineTemplate], plan: Plan,
         status: str) -> None:
    from rich.table import Table

    gib = 2**30
    # The device name comes from a profile file: text, never markup.
    console.print(f"profile: {escape(profile.device_name)} ({escape(source)}), {profile.num_layers} layers, "
                  f"{profile.devices_per_node} devices per node; templates cache: {status}")
    table = Table(title=f"pipeline templates (each optimised for the microbatches it runs; memory for "
                        f"{request.num_microbatches} in flight)")
    for col in ("nodes", "stages", "layers per stage", "devices per stage", "microbatches", "iteration s",
                "bottleneck ms", "max memory GiB"):
        table.add_column(col, justify="right")
    for t in templates:
        ranges = " ".join(f"{s.start}-{s.stop - 1}" if s.num_layers > 1 else str(s.start) for s in t.stages)
        devices = " ".join(str(s.devices) for s in t.stages)
        table.add_row(str(t.num_nodes), str(t.num_stages), ranges, devices, str(t.num_microbatches),
                      f"{t.iteration_time_s:.4f}",
                      f"{t.bottleneck_s * 1e3:.2f}", f"{t.max_memory_bytes / gib:.2f}")
    console.print(table)
    ptable = Table(title=f"plan: {request.max_nodes} nodes, survives {request.failures} failures, "
                         f"{request.global_microbatches} microbatches of {request.microbatch_size}")
    for col in ("pipeline", "nodes", "template", "microbatches", "batch slice", "latency s"):
        ptable.add_column(col, justify="right")
    for i, p in enumerate(plan.pipelines):
        nodes = f"{p.nodes[0]}-{p.nodes[-1]}" if len(p.nodes) > 1 else str(p.nodes[0])
        ptable.add_row(str(i), nodes, f"{p.template.num_nodes} nodes", str(p.microbatches),
                       f"[{p.first_microbatch}, {p.first_microbatch + p.microbatches})", f"{p.latency_s:.4f}")
    console.print(ptable)
    spares = f", spare nodes: {list(plan.spare_nodes)}" if plan.spare_nodes else ""
    console.print(f"predicted step {plan.step_time_s:.4f} s (pipelines {plan.pipeline_time_s:.4f} s + gradient "
                  f"all-reduce not hidden by the last backward {plan.sync_time_s:.4f} s): [bold]{plan.samples_per_s:,.1f} samples/s[/]{spares}")
