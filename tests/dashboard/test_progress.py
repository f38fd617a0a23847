"""progress_task: a bar on a terminal, one summary line elsewhere, nothing on failure."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from oobleck_slurm.dashboard.progress import progress_task


def test_summary_line_without_a_terminal():
    console = Console(file=io.StringIO(), width=80)
    with progress_task("profiling layers", console=console) as update:
        for i in range(5):
            update(i + 1, total=5, note=f"layer {i}")
    text = console.file.getvalue()
    assert "profiling layers: 5/5 in" in text and "━" not in text


def test_bar_on_a_terminal():
    console = Console(file=io.StringIO(), width=100, force_terminal=True, color_system=None)
    with progress_task("templates", total=3, console=console) as update:
        update(2, note="n=3")
    assert "templates: 2/3 in" in console.file.getvalue()


def test_no_summary_when_the_work_fails():
    console = Console(file=io.StringIO(), width=80)
    with pytest.raises(RuntimeError):
        with progress_task("templates", total=3, console=console) as update:
            update(1)
            raise RuntimeError("planner failed")
    assert "templates" not in console.file.getvalue()
