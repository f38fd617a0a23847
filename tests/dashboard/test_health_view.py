"""Faulty machines and stragglers on the dashboard and in the report: the health monitor's `health`,
`faulty_node` and `straggler` events (supervisor/health_monitor.py) on top of a recorded run."""

from __future__ import annotations

from pathlib import Path

from dash_helpers import recorded, render

from oobleck_slurm.dashboard.report import render_html
from oobleck_slurm.dashboard.state import DashboardState


def with_detection() -> DashboardState:
    events = recorded("healthy")
    t = events[len(events) // 2]["t"]
    extra = [
        {"t": t, "kind": "health", "scores": {"node1": 0.4, "node2": 3.6, "node3": 0.2, "node4": 0.1},
         "metrics": {"node1": "procs.cpu_pct", "node2": "procs.rss_gib", "node3": "procs.cpu_pct"},
         "slowdowns": {"node1": 1.0, "node2": 1.02, "node3": 1.84, "node4": 0.98}, "threshold": 4.5, "generation": 0},
        {"t": t + 0.1, "kind": "straggler", "action": "rebalance", "nodes": {"node3": 1.84},
         "detail": "node3: rank 2 computes 1.84x its peers' time (51.5 ms vs 28.0 ms per microbatch)", "generation": 0},
        {"t": t + 0.2, "kind": "faulty_node", "node": "node2", "action": "report", "metrics": ["procs.rss_gib"],
         "score": 6.1, "since": t - 2, "detail": "procs.rss_gib far from the peers' (score 6.1, threshold 4.5)"},
    ]
    return DashboardState().apply_all(sorted(events + extra, key=lambda e: e["t"]))


def test_scores_flags_and_straggler_marks_are_kept() -> None:
    s = with_detection()
    assert s.unknown_events == 0 and s.bad_events == 0
    node2, node3 = s.nodes["node2"], s.nodes["node3"]
    assert (node2.health_score, node2.health_metric) == (3.6, "procs.rss_gib")
    assert node2.flagged == "report" and node2.state == "healthy"  # flagged, only reported (evict: false)
    assert (node3.straggler, node3.slowdown) == ("rebalance", 1.84)
    assert [line.kind for line in s.log if line.kind in ("straggler", "faulty_node")] == ["straggler", "faulty_node"]
    # A later rebalance without node3 (it recovered): its mark goes.
    s.apply({"t": s.t_last + 1, "kind": "straggler", "action": "rebalance", "nodes": {}, "detail": "no straggler left"})
    assert node3.straggler is None


def test_bad_detection_events_are_tolerated() -> None:
    s = DashboardState()
    for e in ({"t": 1.0, "kind": "health", "scores": "x"}, {"t": 2.0, "kind": "straggler", "nodes": [1, 2]},
              {"t": 3.0, "kind": "faulty_node"}, {"t": 4.0, "kind": "straggler", "nodes": {"n1": "fast"}}):
        s.apply(e)
    assert s.unknown_events == 0 and s.events_seen == 4


def test_the_node_cells_show_the_score_the_metric_and_the_straggler() -> None:
    screen = render(with_detection(), 120, 40)
    assert "z3.6 rss_gib" in screen and "slow x1.8 rebalance" in screen and "node2 healthy flagged" in screen
    assert "faulty node" in screen and "straggler" in screen


def test_the_report_has_a_section_on_faulty_machines_and_stragglers(tmp_path: Path) -> None:
    page = render_html(with_detection(), tmp_path / "events.jsonl")
    assert "Faulty machines and stragglers" in page
    assert "<td>node3</td><td>healthy</td><td>0.20</td><td>procs.cpu_pct</td><td>1.84</td><td>rebalance</td>" in page
    assert "faulty node: node2 flagged (report)" in page
    healthy = render_html(DashboardState().apply_all(recorded("healthy")), tmp_path / "events.jsonl")
    assert "Faulty machines and stragglers" not in healthy  # a run without detection events: no section
