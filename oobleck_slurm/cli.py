"""`python -m oobleck_slurm COMMAND`: one module per command under `oobleck_slurm.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

from oobleck_slurm import __version__
from oobleck_slurm.errors import OobleckError
from oobleck_slurm.exit_codes import EXIT_BAD_INPUT

# Order shown in --help. Modules import heavy dependencies (torch) inside run(), so --help is fast.
COMMANDS = ("validate", "prepare", "profile", "plan", "submit", "dashboard", "report", "status", "events", "cancel",
            "kill_node", "profile_steps", "export", "detect", "simulate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oobleck-slurm",
        description="Train large models on Slurm with heterogeneous pipeline replicas; "
        "survive node failures without reloading a checkpoint.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"oobleck_slurm.commands.{name}")
        module.add_parser(subparsers)
        subparsers.choices[name].set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OobleckError as err:  # one a command did not turn into a message: its class says the exit code
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return err.exit_code
