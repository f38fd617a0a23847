"""`profile RECIPE [--estimate GPU | --profile FILE] [--json]`: the layer profile the planner uses.

Measured on this machine (cached in templates_cache/), estimated from a GPU's peak figures, or read
from a file. `--json` prints the profile file format, so `profile RECIPE --json > FILE` on a compute
node makes a file that `plan --profile FILE` reads anywhere.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from oobleck_slurm.commands.common import add_recipe_argument, console, fail, load_recipe_or_report
from oobleck_slurm.exit_codes import EXIT_BAD_INPUT, EXIT_OK

if TYPE_CHECKING:  # the planner is imported when a command runs, not when the CLI starts
    from oobleck_slurm.planning import PipelineTemplate, Profile
    from oobleck_slurm.planning.pregenerate import PlanRequest
    from oobleck_slurm.planning.pregenerate import Progress as PlanningProgress
    from oobleck_slurm.recipe import Recipe


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the profile comes from; shared with `plan`."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--estimate", metavar="GPU", help="derive the profile from a GPU's peak figures (e.g. H100)")
    source.add_argument("--profile", metavar="FILE", type=Path, help="read the profile from a JSON file")
    parser.add_argument("--cache", metavar="DIR", type=Path, default=Path("templates_cache"),
                        help="cache directory (default: templates_cache)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("profile", help="measure (or estimate) the per-layer profile of a recipe's model")
    add_recipe_argument(parser)
    add_source_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the profile as JSON (the --profile file format)")


@contextmanager
def planning_progress(enabled: bool) -> Iterator[PlanningProgress | None]:
    """The planner's `progress(phase, done, total)`, drawn as one transient bar per phase; None when
    output is for a script."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), console=console, transient=True)
    tasks: dict[str, TaskID] = {}

    def report(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = bar.add_task(phase, total=total)
        bar.update(tasks[phase], completed=done, total=total)

    with bar:
        yield report


def resolve_profile(args: argparse.Namespace, recipe: Recipe,
                    progress: PlanningProgress | None) -> tuple[Profile, str]:
    """(Profile, source) for the command's arguments, or raise ProfileError / PlanningError / UnknownGPU."""
    from oobleck_slurm.planning.cache import TemplateCache
    from oobleck_slurm.planning.pregenerate import recipe_profile

    cache = TemplateCache(args.cache)
    result = recipe_profile(recipe, cache, profile_file=args.profile, estimate_gpu=args.estimate, progress=progress)
    for problem in cache.problems:
        console.print(f"[yellow]warning:[/] {escape(problem)}", highlight=False)
    return result


def resolve_templates(args: argparse.Namespace, recipe: Recipe,
                      request: PlanRequest) -> tuple[Profile, str, list[PipelineTemplate], str]:
    """(profile, its source, templates, cache status) for a planning command's arguments and `request`,
    with progress bars unless --json; raises ProfileError / PlanningError / UnknownGPU."""
    from oobleck_slurm.planning.cache import TemplateCache
    from oobleck_slurm.planning.pregenerate import cached_templates

    with planning_progress(not args.json) as progress:
        profile, source = resolve_profile(args, recipe, progress)
        templates, status = cached_templates(profile, request, TemplateCache(args.cache), progress)
    return profile, source, templates, status


def run(args: argparse.Namespace) -> int:
    from oobleck_slurm.planning import PlanningError, ProfileError, UnknownGPU

    recipe = load_recipe_or_report(args.recipe)
    if recipe is None:
        return EXIT_BAD_INPUT
    try:
        with planning_progress(not args.json) as progress:
            profile, source = resolve_profile(args, recipe, progress)
    except (ProfileError, PlanningError, UnknownGPU) as err:
        return fail(str(err))
    if args.json:
        print(json.dumps(profile.to_dict(), indent=2))
        return EXIT_OK
    show_profile(profile, source)
    return EXIT_OK


def show_profile(profile: Profile, source: str) -> None:
    from rich.table import Table

    # Names and labels come from a profile file (`--profile FILE`): escaped, a table cell or title is markup.
    table = Table(title=f"profile: {escape(profile.device_name)}, {profile.devices_per_node} per node, "
                        f"microbatch {profile.microbatch_size}, {escape(profile.dtype)}, {escape(profile.optimizer)} "
                        f"({escape(source)})")
    for col in ("layer", "fwd ms", "bwd ms", "params MiB", "optim MiB", "act MiB/mb", "out MiB/mb"):
        table.add_column(col, justify="right" if col != "layer" else "left")
    mib = 2**20
    for layer in profile.layers:
        table.add_row(
            escape(layer.name), f"{layer.forward_s * 1e3:.3f}", f"{layer.backward_s * 1e3:.3f}",
            f"{layer.param_bytes / mib:.2f}", f"{layer.optimizer_bytes / mib:.2f}",
            f"{layer.activation_bytes / mib:.2f}", f"{layer.output_bytes / mib:.3f}",
        )
    console.print(table)
    links = Table(title="links (alpha-beta)")
    for col in ("link", "latency us", "bandwidth GB/s"):
        links.add_column(col)
    for name, link in profile.links.items():
        links.add_row(escape(name), f"{link.latency_s * 1e6:.1f}", f"{link.bandwidth_Bps / 1e9:.2f}")
    console.print(links)
    console.print(f"device memory {profile.device_memory_bytes / 2**30:.1f} GiB; key {escape(profile.key[:16])}")
