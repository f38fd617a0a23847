"""run_dashboard: one frame, a live tail of a growing (partly written) log, keys; and in a real terminal."""

from __future__ import annotations

import io
import threading
import time

from dash_helpers import LOGS
from rich.console import Console

from oobleck_slurm.dashboard.keys import parse_keys
from oobleck_slurm.dashboard.live import handle_keys, load_state, run_dashboard
from oobleck_slurm.dashboard.panels import View
from oobleck_slurm.protocol.events import events_path


def _console() -> Console:
    return Console(file=io.StringIO(), width=100, height=30, color_system=None)


def test_once_prints_one_frame(job_dir):
    console = _console()
    state = run_dashboard(job_dir("failure"), live=False, console=console)
    text = console.file.getvalue()
    assert state.steps_done == 80 and state.job_id in text and "node3 lost (process_exit)" in text
    assert "q quit" not in text  # no keys in a printed frame


def test_missing_and_garbled_logs_wait(tmp_path):
    console = _console()
    state = run_dashboard(tmp_path, live=False, console=console)
    assert not state.has_events and "waiting for events" in console.file.getvalue()
    events_path(tmp_path).write_text("not json\n{\"kind\": \"step\"}\n{\"t\": 1, \"kind\": \"st")
    assert not load_state(tmp_path).has_events


def test_live_tails_a_growing_log_until_the_job_finishes(tmp_path):
    """A writer appends the recorded run in pieces (cutting lines in half); the dashboard ends on job_finished."""
    lines = (LOGS / "failure.jsonl").read_text().splitlines(keepends=True)
    log = events_path(tmp_path)

    def writer() -> None:
        time.sleep(0.15)  # the dashboard starts before the log exists
        with open(log, "a") as f:
            for i in range(0, len(lines), 20):
                chunk = "".join(lines[i:i + 20])
                f.write(chunk[:-30])
                f.flush()
                time.sleep(0.06)  # a poll sees the partial last line
                f.write(chunk[-30:])
                f.flush()

    result = {}
    thread = threading.Thread(target=writer)
    thread.start()
    viewer = threading.Thread(target=lambda: result.update(state=run_dashboard(
        tmp_path, live=True, console=_console(), refresh_s=0.02, exit_when_done=True, keys=False)))
    viewer.start()
    viewer.join(timeout=20)
    thread.join()
    assert not viewer.is_alive(), "the dashboard did not stop after job_finished"
    state = result["state"]
    assert state.status == "completed" and state.steps_done == 80 and state.bad_events == 0
    assert state.events_seen == len(lines) and len(state.recoveries) == 1


def test_keys():
    assert parse_keys("q\x1b[A\x1b[Bp\x1b[5~x") == ["q", "up", "down", "p", "pgup", "x"]
    view = View()
    assert handle_keys(["up", "up", "up", "down"], view, log_lines=50) and view.scroll == 2
    assert handle_keys(["pgup", "pgup", "pgup", "pgup", "pgup", "pgup"], view, 50) and view.scroll == 49  # clamped
    assert handle_keys(["end", "p"], view, 50) and view.scroll == 0 and view.paused
    assert handle_keys(["p"], view, 50) and not view.paused
    assert not handle_keys(["up", "q", "up"], view, 50)
