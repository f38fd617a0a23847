"""The dashboard as a terminal shows it, at 100x30 and 160x48, from recorded runs."""

from __future__ import annotations

import pytest
from dash_helpers import RUNS, recorded, render, state_of

from oobleck_slurm.dashboard.panels import View
from oobleck_slurm.dashboard.state import DashboardState

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
    state = state_of("healthy")
    screen = render(state, width, height)
    head = panel(screen, "oobleck-slurm")
    for text in (f"job {state.job_id}", "backend local", "recipe dash-healthy", "gen 0", "step 60/60",
                 f"loss {state.loss:.4f}", f"samples/s {state.samples_per_s:.1f}", "COMPLETED", "elapsed", "slurm -"):
        assert text in head, text
    assert "failures" not in head
    nodes = panel(screen, "nodes")
    assert nodes.count("healthy") == 4 and "hb 0." in nodes and "cpu " in nodes
    pipes = panel(screen, "pipelines")
    for i in range(4):
        assert f"P{i} 1 stage on 1 node  mb 2" in pipes and f"node{i + 1} L0-9" in pipes
    assert "s/step" in pipes
    spark = panel(screen, "throughput").splitlines()
    assert "█" in spark[-2] and not spark[-1].strip()  # bars, no failure marks
    events = panel(screen, "events")
    assert "job finished" in events and "completed (exit 0)" in events and "step 40" in events


@pytest.mark.parametrize("width,height", SIZES)
def test_failure_and_recovery(width, height):
    state = state_of("failure")
    (rec,) = state.recoveries
    screen = render(state, width, height)
    head = panel(screen, "oobleck-slurm")
    assert "gen 1" in head and "failures 1" in head and f"recovering {rec.seconds:.2f}s" in head
    nodes = panel(screen, "nodes")
    assert "✗ node3 lost" in nodes and "process_exit" in nodes and nodes.count("healthy") == 3
    assert "nodes 3 healthy 1 lost" in screen
    pipes = panel(screen, "pipelines")
    assert "node3" not in pipes and "P2 1 stage" in pipes and "P3" not in pipes and "gen 1 (failure)" in screen
    marks = panel(screen, "throughput").splitlines()[-1]
    assert marks.index("✗") < marks.index("▲")  # failure, then resumed, left to right
    events = panel(screen, "events")
    for line in (f"failure                node3 lost (process_exit) at step {rec.step}",
                 f"detection        {rec.phases['detection']:.2f}s", "state copy",
                 f"replay           {rec.phases['replay']:.2f}s step {rec.step}",
                 f"resumed          {rec.seconds:.2f}s at step {rec.step}, gen 1"):
        assert line in events, line


def test_failure_while_recovering():
    """Mid-recovery: status RECOVERING, the band runs to the right edge, no resumed mark yet."""
    events = recorded("failure")
    cut = next(i for i, e in enumerate(events) if e["kind"] == "state_copy")
    screen = render(DashboardState().apply_all(events[:cut + 1]), 100, 30)
    assert "RECOVERING" in panel(screen, "oobleck-slurm")
    marks = panel(screen, "throughput").splitlines()[-1]
    assert "✗" in marks and "▲" not in marks and marks.rstrip().endswith(("─", "✗"))


@pytest.mark.parametrize("width,height", SIZES)
def test_failure_then_replacement_joins(width, height):
    state = state_of("join")
    screen = render(state, width, height)
    assert "nodes 4 healthy 1 lost" in screen and "● r1 healthy" in screen and "failures 1" in screen
    pipes = panel(screen, "pipelines")
    assert "gen 2 (join)" in screen and "r1 L0-9" in pipes and "node2" not in pipes
    events = panel(screen, "events")
    for text in ("plan gen 2 (join): 4 pipelines", "state copy", "MiB", "node joined", "r1 joined", "training done"):
        assert text in events, text
    marks = panel(screen, "throughput").splitlines()[-1]
    assert marks.count("▲") == 2 and marks.index("✗") < marks.rindex("─") < marks.rindex("▲")


def test_joining_node_before_it_is_used():
    events = recorded("join")
    cut = next(i for i, e in enumerate(events) if e["kind"] == "health_check")
    screen = render(DashboardState().apply_all(events[:cut]), 100, 30)
    assert "◐ r1 joining" in panel(screen, "nodes") and "replacement requested: r1" in screen


def test_taller_terminal_shows_more():
    small, large = render(state_of("join"), 100, 30), render(state_of("join"), 160, 48)
    assert len(panel(large, "throughput").splitlines()) > len(panel(small, "throughput").splitlines())
    assert len(panel(large, "events").splitlines()) > len(panel(small, "events").splitlines())
    assert "node lost" not in panel(small, "events") and "node lost" in panel(large, "events")


def test_scroll_and_pause():
    state = state_of("failure")
    scrolled = panel(render(state, 100, 30, View(scroll=10)), "events")
    assert "job started" in scrolled and "job finished" not in scrolled
    assert "(PAUSED)" in render(state, 100, 30, View(paused=True))


def test_waiting_for_events():
    screen = render(DashboardState(), 100, 30)
    assert screen.count("waiting for events") == 4 and "WAITING" in screen


def test_a_sharded_stage_shows_its_width():
    # a plan event of issue 23's shape: a 2-node pipeline of 2-wide stages, a 1-node one of one 4-wide stage
    def stage(node: str, layers: list[int], workers: list[int], first_rank: int) -> dict:
        return {"layers": layers, "node": node, "worker": workers[0], "rank": first_rank + workers[0],
                "workers": workers, "ranks": [first_rank + w for w in workers]}

    plan = {"t": 1.0, "kind": "plan", "generation": 0, "reason": "initial", "workers_per_node": 4, "ranks": 12,
            "pipelines": [{"id": 0, "nodes": ["node1", "node2"], "microbatches": 3,
                           "stages": [stage("node1", [0, 3], [0, 1], 0), stage("node1", [3, 4], [2, 3], 0),
                                      stage("node2", [4, 6], [0, 1, 2, 3], 4)]},
                          {"id": 1, "nodes": ["node3"], "microbatches": 1,
                           "stages": [stage("node3", [0, 6], [0], 8)]}]}
    state = DashboardState()
    state.apply(plan)
    assert [s.width for p in state.pipelines for s in p.stages] == [2, 2, 4, 1]
    pipelines = panel(render(state, 160, 48), "pipelines")
    assert "node1 L0-2 x2" in pipelines and "node2 L4-5 x4" in pipelines
    assert "node3 L0-5 x" not in pipelines  # a one-worker stage shows no width


@pytest.mark.parametrize("width,height", SIZES)
def test_tokens_per_device_and_mfu_in_the_header(width, height):
    # a GPU run's step events carry them (planning/flops.py); a CPU run's have no MFU and show none
    events = [{**e, "tokens_per_s_per_device": 12345.6, "mfu": 0.4013} if e["kind"] == "step" else e
              for e in recorded("healthy")]
    screen = render(DashboardState().apply_all(events), width, height)
    header = panel(screen, "oobleck-slurm")
    assert "tokens/s/device 12,346" in header and "MFU 40.1%" in header and "elapsed" in header
    assert "MFU" not in panel(render(state_of("healthy"), width, height), "oobleck-slurm")
