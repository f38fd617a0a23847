"""What every command shares: the console, error lines, and loading a recipe with a clear report
(exit codes: oobleck_slurm/exit_codes.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from oobleck_slurm.exit_codes import EXIT_BAD_INPUT
from oobleck_slurm.recipe import Recipe, RecipeError, RecipeIssue, load_recipe
from oobleck_slurm.recipe.validate import data_issues

console = Console()
# soft_wrap: an error line is copied into tickets and grepped; never break it at the terminal width.
err_console = Console(stderr=True, soft_wrap=True)


def add_recipe_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "recipe", nargs="?", default=None, type=Path,
        help="recipe YAML file (default: the embedded local recipe)",
    )


def load_recipe_or_report(path: Path | None, check_model: bool = False) -> Recipe | None:
    """The validated recipe, or None after printing every issue to stderr. `check_model`: also build a
    model factory's layers on the meta device (importing the user's code) and check them."""
    try:
        recipe = load_recipe(path)
        if check_model:  # validate and submit: the recipe must be runnable as it stands
            issues = model_factory_issues(recipe) + data_issues(recipe)
            if issues:
                raise RecipeError(issues)
        return recipe
    except RecipeError as err:
        report_recipe_error(err)
        return None


def model_factory_issues(recipe: Recipe) -> list[RecipeIssue]:
    """What is wrong with the recipe's model factory (`models.inspect_factory`), named by the recipe
    file, line and key; empty without a factory or when it fits."""
    if not recipe.model.factory:
        return []
    from oobleck_slurm.models import FactoryError, check_stage_widths, with_layers
    from oobleck_slurm.recipe.source import read_source

    try:
        check_stage_widths(with_layers(recipe.model.resolve(), recipe.training.seed), recipe.cluster.stage_devices(factory_model=True))
    except FactoryError as problem:
        return [read_source(Path(recipe.source)).issue(tuple(problem.key.split(".")), str(problem))]
    return []


def report_recipe_error(err: RecipeError) -> None:
    count = len(err.issues)
    err_console.print(f"[bold red]recipe has {count} problem{'s' if count != 1 else ''}:[/]")
    for issue in err.issues:
        err_console.print(f"  [red]•[/] {escape(str(issue))}", highlight=False)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> int:
    """Print an error line to stderr and return the exit code, for `return fail(...)` in commands."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return code


def is_interactive() -> bool:
    return sys.stdout.isatty()
