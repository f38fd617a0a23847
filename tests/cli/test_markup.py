"""Text from a job (event messages, errors, node names), a recipe or a profile file never reaches rich
as markup: square brackets print as they are, and never raise a MarkupError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oobleck_slurm.cli import main
from oobleck_slurm.cluster.jobdir import create_job_dir
from oobleck_slurm.protocol.events import EventLog, events_path
from oobleck_slurm.recipe import load_recipe

# What gloo really says when a peer dies: a closing-tag look-alike, `[/__w/...]`.
GLOO_ERROR = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
              "Read error [127.0.0.1]:41234: Connection reset by peer")
TRICKY = "[bold red]not a style[/] [/] [link=x] \\"


@pytest.fixture
def job(tmp_path: Path) -> Path:
    """A local job folder (meta.json, recipe, secret) whose log holds bracketed text everywhere."""
    folder = create_job_dir(load_recipe(), tmp_path / "jobs").path
    with EventLog(events_path(folder)) as log:
        log.emit("job_started", t=100.0, job_id=folder.name, backend="local", recipe="default-local", nodes=["node1"],
                 spares=[], f=1, steps=10)
        log.emit("plan", t=100.5, generation=0, reason=TRICKY, pipelines=[{"nodes": ["node1"], "stages": []}])
        log.emit("collective_error", t=101.0, generation=0, nodes=["node1"], step=3, errors={"node1": GLOO_ERROR},
                 grace=3.0)
        log.emit("node", t=101.5, node="node1", state="lost", cause=TRICKY)
        log.emit("node_lost", t=102.0, node="node1", cause="hung", detail=GLOO_ERROR, detection_seconds=1.0)
        log.emit("job_finished", t=103.0, status="failed", exit_code=1, error=GLOO_ERROR)
    return folder


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "MarkupError" not in out.out + out.err
    return code, out.out + out.err


def test_events_prints_gloo_errors_with_brackets(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(capsys, "events", str(job), "--all")
    assert code == 0
    flat = out.replace("\n", "")
    assert "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]" in flat
    assert "[bold red]not a style[/]" in flat


def test_events_kind_filter_with_brackets(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(capsys, "events", str(job), "--kind", "collective_error")
    assert code == 0 and "pair.cc:553]" in out.replace("\n", "")


def test_status_prints_error_and_causes_with_brackets(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(capsys, "status", str(job))
    assert code == 0
    assert "[/__w/pytorch" in out.replace("\n", "")


def test_dashboard_once_renders_bracketed_plan_reason(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(capsys, "dashboard", str(job), "--once")
    assert code == 0


def test_validate_prints_bracketed_recipe_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"description: {json.dumps(TRICKY)}\ncluster:\n  setup: ['echo [/]', 'export X=[red]']\n")
    code, out = run_cli(capsys, "validate", str(recipe))
    assert code == 0
    assert "echo [/]" in out and "[bold red]not a style[/]" in out


def test_bad_input_messages_with_brackets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(capsys, "status", "[/]nonexistent", "--job-root", str(tmp_path))
    assert code == 2 and "[/]nonexistent" in out
