"""The dashboard as a terminal shows it, at 100x30 and 160x48, from recorded runs."""

from __future__ import annotations

import pytest

from oobleck_slurm.dashboard.panels import View
from oobleck_slurm.dashboard.state import DashboardState

from dash_helpers import RUNS, recorded, render, state_of

SIZES = [(100, 30), (160, 48)]


def panel(screen: str, title: str) -> str:
    """The lines of the panel whose top border starts with `title`, up to its bottom border."""
    lines = screen.splitlines()
    start = next(i for i, line in enumerate(lines) if f"╭─ {title}" in line)
    col = lines[start].index(f"╭─ {title}")
    end = lines[start].index("╮", col)
    out = []
    for line in lines[start + 1:]:
        if line[col:col + 1] == "╰":
            break
        out.append(line[col + 1:end])
    return "\n".join(out)


@pytest.mark.parametrize("width,height", SIZES)
@pytest.mark.parametrize("run", RUNS)
def test_fits_the_screen_and_shows_every_panel(run, width, height):
    screen = render(state_of(run), width, height)
    lines = screen.splitlines()
    assert len(lines) == height and max(len(line) for line in lines) <= width
    for title in ("oobleck-slurm", "nodes", "pipelines", "throughput", "events"):
        assert f"╭─ {title}" in screen, title
    assert "q quit" in lines[-1]


@pytest.mark.parametrize("width,height", SIZES)
def test_healthy_run(width, height):
    screen = render(state_of("healthy"), width, height)
    head = panel(screen, "oobleck-slurm")
    for text in ("job healthy", "backend local", "recipe local-mini", "step 40/40", "loss 2.59", "samples/s 29.9",
                 "COMPLETED", "elapsed"):
        assert text in head, text
    assert "failures" not in head
    nodes = panel(screen, "nodes")
    assert nodes.count("healthy") == 4 and "hb 0." in nodes and "cpu " in nodes
    pipes = panel(screen, "pipelines")
    assert "P0 2 stages on 2 nodes  mb 4" in pipes and "P1 2 stages" in pipes
    assert "node-0 L0-4 │ node-1 L5-9" in pipes and "node-2 L0-4 │ node-3 L5-9" in pipes
    spark = panel(screen, "throughput").splitlines()
    assert "█" in spark[-2] and not spark[-1].strip()  # bars, no failure marks
    events = panel(screen, "events")
    assert "job finished" in events and "completed (exit 0)" in events and "checkpoint       0.80s" in events


@pytest.mark.parametrize("width,height", SIZES)
def test_failure_and_recovery(width, height):
    screen = render(state_of("failure"), width, height)
    head = panel(screen, "oobleck-slurm")
    assert "gen 2" in head and "failures 1" in head and "recovering 6.43s" in head
    nodes = panel(screen, "nodes")
    assert "✗ node-2 lost" in nodes and "hb 29s" in nodes and nodes.count("healthy") == 4
    assert "nodes 4 healthy 1 lost" in screen
    pipes = panel(screen, "pipelines")
    assert "node-2" not in pipes and "gen 2 (failure)" in screen
    marks = panel(screen, "throughput").splitlines()[-1]
    # Failure, then the recovery band, then resumed, left to right.
    assert marks.index("✗") < marks.index("─") < marks.index("▲")
    events = panel(screen, "events")
    for line in ("failure                node-2 lost (heartbeat) at step 25", "detection        3.00s",
                 "state copy       1.40s 48.0 MiB", "replay           1.10s step 25",
                 "resumed          6.43s at step 25, gen 2"):
        assert line in events, line


def test_failure_while_recovering():
    """Mid-recovery: status RECOVERING, the band runs to the right edge, no resumed mark yet."""
    events = recorded("failure")
    cut = next(i for i, e in enumerate(events) if e["kind"] == "state_copy")
    screen = render(DashboardState().apply_all(events[:cut + 1]), 100, 30)
    assert "RECOVERING" in panel(screen, "oobleck-slurm")
    marks = panel(screen, "throughput").splitlines()[-1]
    assert "✗" in marks and "▲" not in marks and marks.rstrip().endswith("─")


@pytest.mark.parametrize("width,height", SIZES)
def test_join(width, height):
    screen = render(state_of("join"), width, height)
    assert "nodes 5 healthy" in screen
    pipes = panel(screen, "pipelines")
    assert "P0 3 stages on 3 nodes  mb 5" in pipes and "node-4 L7-9" in pipes and "gen 2 (join)" in screen
    events = panel(screen, "events")
    for line in ("replace req            replacement requested: node-4", "node joined      4.20s node-4 joined",
                 "health check     0.60s node-4 ok", "resumed          1.70s at step 16, gen 2"):
        assert line in events, line


def test_spare_node_before_join():
    events = recorded("join")
    cut = next(i for i, e in enumerate(events) if e["kind"] == "replacement_requested")
    screen = render(DashboardState().apply_all(events[:cut]), 100, 30)
    assert "○ node-4 spare" in panel(screen, "nodes") and "4 healthy 1 spare" in screen


def test_taller_terminal_shows_more():
    small, large = render(state_of("failure"), 100, 30), render(state_of("failure"), 160, 48)
    assert len(panel(large, "throughput").splitlines()) > len(panel(small, "throughput").splitlines())
    assert "job started" not in panel(small, "events") and "job started" in panel(large, "events")


def test_scroll_and_pause():
    state = state_of("failure")
    scrolled = panel(render(state, 100, 30, View(scroll=10)), "events")
    assert "job started" in scrolled and "job finished" not in scrolled
    assert "(PAUSED)" in render(state, 100, 30, View(paused=True))


def test_waiting_for_events():
    screen = render(DashboardState(), 100, 30)
    assert screen.count("waiting for events") == 4 and "WAITING" in screen
