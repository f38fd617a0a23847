"""`validate RECIPE`: print the resolved recipe, or every problem with file, line and key (exit 2)."""

from __future__ import annotations

import argparse
import json

from rich.markup import escape
from rich.tree import Tree

from oobleck_slurm.commands.common import add_recipe_argument, console, load_recipe_or_report
from oobleck_slurm.exit_codes import EXIT_BAD_INPUT, EXIT_OK
from oobleck_slurm.models import with_layers
from oobleck_slurm.recipe import recipe_to_dict


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("validate", help="check a recipe and print it with every default filled in")
    add_recipe_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the resolved recipe as JSON")


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe_or_report(args.recipe, check_model=True)
    if recipe is None:
        return EXIT_BAD_INPUT
    values = recipe_to_dict(recipe)
    if args.json:
        print(json.dumps(values, indent=2))
        return EXIT_OK
    # Names, paths and values are the user's text (setup lines, descriptions): escaped, never markup.
    tree = Tree(f"[bold green]✓[/] [bold]{escape(recipe.name)}[/]  [dim]{escape(recipe.source)}[/]")
    _add_branch(tree, {k: v for k, v in values.items() if k not in ("name", "source")})
    model = with_layers(recipe.model.resolve(), recipe.training.seed)  # a factory was checked on load
    console.print(tree)
    console.print(f"model: {escape(model.describe())}", highlight=False)
    return EXIT_OK


def _add_branch(tree: Tree, values: dict) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and value:
            _add_branch(tree.add(f"[bold cyan]{escape(str(key))}[/]"), value)
        else:
            shown = escape(repr(value))
            tree.add(f"[cyan]{escape(str(key))}[/]: {shown}" if value not in (None, {}, [])
                     else f"[cyan]{escape(str(key))}[/]: [dim]{shown}[/]")
