"""Fixtures for the dashboard tests: recorded event logs copied into job folders, and rendering."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from oobleck_slurm.dashboard.panels import View
from oobleck_slurm.dashboard.render import Dashboard
from oobleck_slurm.dashboard.state import DashboardState
from oobleck_slurm.events import events_path, read_events

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


@pytest.fixture
def job_dir(tmp_path):
    """make(name) -> a job folder holding the recorded log `name` as its events.jsonl."""

    def make(name: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(LOGS / f"{name}.jsonl", events_path(folder))
        return folder

    return make
