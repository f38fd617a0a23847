"""Helpers for the dashboard tests: the recorded event logs, and rendering a state as a terminal shows it.

Not named conftest.py so that `from dash_helpers import ...` cannot pick up another folder's conftest."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from oobleck_slurm.dashboard.panels import View
from oobleck_slurm.dashboard.render import Dashboard
from oobleck_slurm.dashboard.state import DashboardState
from oobleck_slurm.protocol.events import read_events

LOGS = Path(__file__).parent / "logs"
RUNS = ("healthy", "failure", "join")


def recorded(name: str) -> list[dict]:
    return read_events(LOGS / f"{name}.jsonl")


def state_of(name: str) -> DashboardState:
    return DashboardState().apply_all(recorded(name))


def render(state: DashboardState, width: int, height: int, view: View | None = None) -> str:
    """The screen as plain text, as a terminal of width x height would show it."""
    console = Console(record=True, width=width, height=height, file=io.StringIO(), color_system=None)
    console.print(Dashboard(state, view or View()))
    return console.export_text()
