"""The static report: HTML and PNGs from a recorded run; clear errors for bad input."""

from __future__ import annotations

import argparse

import pytest

from oobleck_slurm.commands import dashboard as dashboard_command
from oobleck_slurm.commands import report as report_command
from oobleck_slurm.dashboard import load_state
from oobleck_slurm.protocol.events import events_path

mpimg = pytest.importorskip("matplotlib.image")


def run_command(module, argv: list[str]) -> int:
    """A command module through argparse, as cli.main wires it."""
    parser = argparse.ArgumentParser()
    module.add_parser(parser.add_subparsers())
    return module.run(parser.parse_args(argv))


def assert_real_png(path, min_bytes: int = 8000) -> None:
    assert path.stat().st_size > min_bytes, path
    pixels = mpimg.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 500
    # A plot, not a blank canvas: many distinct colours and real spread.
    assert pixels[..., :3].std() > 0.05
    assert len({tuple(p) for p in pixels[::7, ::7, :3].reshape(-1, 3).round(2).tolist()}) > 20


def test_report_of_a_failure_run(job_dir, tmp_path, capsys):
    job = job_dir("failure")
    out = tmp_path / "out"
    assert run_command(report_command, ["report", str(job), "--out", str(out)]) == 0
    assert "report written" in capsys.readouterr().out
    html = (out / "index.html").read_text()
    for png in ("training.png", "recoveries.png", "time_split.png"):
        assert f'src="{png}"' in html
        assert_real_png(out / png)
    (rec,) = load_state(job).recoveries
    assert f"node3 (process_exit) step {rec.step}" in html and f"<b>{rec.seconds:.2f}s</b>" in html  # the recovery row
    assert "<th>failures</th><td>1</td>" in html and "<th>steps</th><td>80 / 80</td>" in html
    assert f"<td>{rec.phases['replay']:.2f}s</td>" in html


def test_report_of_a_failure_and_a_join(job_dir, tmp_path):
    out = tmp_path / "out"
    assert run_command(report_command, ["report", str(job_dir("join")), "--out", str(out)]) == 0
    html = (out / "index.html").read_text()
    assert "node2 (agent_lost)" in html and "#2 join gen 2" in html
    assert_real_png(out / "recoveries.png")
    assert_real_png(out / "time_split.png", min_bytes=4000)


def test_report_of_a_healthy_run_by_job_id(job_dir, tmp_path, monkeypatch):
    job = job_dir("healthy")
    monkeypatch.chdir(tmp_path)
    assert run_command(report_command, ["report", "healthy", "--job-root", str(job.parent)]) == 0
    html = (job / "report" / "index.html").read_text()
    assert "No failures or reconfigurations." in html and "<th>failures</th><td>0</td>" in html
    assert_real_png(job / "report" / "training.png")
    assert (job / "report" / "recoveries.png").stat().st_size > 2000


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert run_command(report_command, ["report", str(tmp_path / "nope")]) == 2
    assert "no job folder" in capsys.readouterr().err
    assert run_command(report_command, ["report", str(tmp_path)]) == 2  # a folder, but no job's
    assert f"looked for {tmp_path / 'meta.json'} or {events_path(tmp_path)}" in capsys.readouterr().err
    (tmp_path / "meta.json").write_text("{}")  # a job that has not started yet
    assert run_command(report_command, ["report", str(tmp_path)]) == 2
    assert "no event log at" in capsys.readouterr().err
    events_path(tmp_path).write_text('garbled\n{"t": 1, "kind": "ste')
    assert run_command(report_command, ["report", str(tmp_path)]) == 2
    assert "no readable events" in capsys.readouterr().err
    assert run_command(dashboard_command, ["dashboard", str(tmp_path / "nope")]) == 2
    assert "no job folder" in capsys.readouterr().err


def test_dashboard_command_prints_a_frame_when_not_a_terminal(job_dir, capsys):
    assert run_command(dashboard_command, ["dashboard", str(job_dir("join"))]) == 0
    out = capsys.readouterr().out
    assert "COMPLETED" in out and "gen 2 (join)" in out and "r1 healthy" in out and "q quit" not in out


def test_report_gives_mean_tokens_per_device_and_mfu(tmp_path):
    from dash_helpers import recorded

    from oobleck_slurm.dashboard.report import render_html
    from oobleck_slurm.dashboard.state import DashboardState

    events = recorded("healthy")
    steps = [e for e in events if e["kind"] == "step"]
    # alternate two figures: their means are exact
    marked = {id(e): (1000.0, 0.3) if i % 2 else (3000.0, 0.5) for i, e in enumerate(steps)}
    events = [{**e, "tokens_per_s_per_device": marked[id(e)][0], "mfu": marked[id(e)][1]} if id(e) in marked else e
              for e in events]
    assert len(steps) % 2 == 0
    html = render_html(DashboardState().apply_all(events), tmp_path / "events.jsonl")
    assert "<th>mean tokens/s per device</th><td>2,000</td>" in html and "<th>mean MFU</th><td>40.0%</td>" in html
    cpu = render_html(DashboardState().apply_all(recorded("healthy")), tmp_path / "events.jsonl")
    assert "<th>mean MFU</th><td>- (no device peak" in cpu
