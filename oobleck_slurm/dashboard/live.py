"""`run_dashboard`: tail a job's event log into a `DashboardState` and show it, live or once.

Works the same during the run, after it (the whole log is read at start) and on a copied folder:
the log is all it needs. Keys in live mode: q quits, p pauses (events are kept and applied on
resume), arrows / PgUp / PgDn / Home / End scroll the events panel.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from rich.console import Console

from oobleck_slurm.cluster.slurm import job_state
from oobleck_slurm.dashboard.keys import KeyReader
from oobleck_slurm.dashboard.panels import View
from oobleck_slurm.dashboard.render import Dashboard
from oobleck_slurm.dashboard.state import DashboardState
from oobleck_slurm.protocol.events import EventTail, events_path

SLURM_POLL_S = 10.0  # squeue is a controller RPC; do not hammer it
SLURM_TIMEOUT_S = 5.0  # a slow controller must not freeze the screen for longer
PAGE = 10


def load_state(job_dir: str | os.PathLike[str]) -> DashboardState:
    """The state after every complete event in the job's log (empty if there is no log yet)."""
    return DashboardState().apply_all(EventTail(events_path(job_dir)).poll())


def run_dashboard(
    job_dir: str | os.PathLike[str],
    live: bool = True,
    *,
    console: Console | None = None,
    refresh_s: float = 0.5,
    exit_when_done: bool = False,
    keys: bool | None = None,
) -> DashboardState:
    """Show the dashboard for `job_dir`; returns the final state.

    live=False prints one frame of the log as it is now. live=True redraws every `refresh_s` until
    q (or Ctrl-C), or, with `exit_when_done` (what `submit` wants), until `job_finished` arrives.
    keys=None reads keys when stdin is a terminal.
    """
    console = console or Console()
    tail = EventTail(events_path(job_dir))
    state = DashboardState()
    if not live:
        state.apply_all(tail.poll())
        console.print(Dashboard(state, View(keys=False)), height=max(30, console.height))
        return state

    with KeyReader(keys) as reader:
        view = View(keys=reader.active, now=time.time())
        pending: list[dict] = []
        last_slurm_poll = 0.0
        from rich.live import Live

        screen = console.is_terminal
        with Live(Dashboard(state, view), console=console, screen=screen, auto_refresh=False,
                  redirect_stdout=False, redirect_stderr=False) as display:
            try:
                while True:
                    pending.extend(tail.poll())
                    if not view.paused:
                        state.apply_all(pending)
                        pending.clear()
                    now = time.time()
                    if now - last_slurm_poll > SLURM_POLL_S and _wants_slurm_state(state):
                        last_slurm_poll = now
                        _poll_slurm(state, now)
                    view.now = now
                    display.update(Dashboard(state, view), refresh=True)
                    if exit_when_done and state.t_end is not None and not pending:
                        break
                    if not handle_keys(reader.read(refresh_s), view, len(state.log)):
                        break
            except KeyboardInterrupt:
                pass
    return state


def handle_keys(keys: list[str], view: View, log_lines: int) -> bool:
    """Apply key presses to the view; False when the user asked to quit."""
    for key in keys:
        if key in ("q", "Q"):
            return False
        if key in ("p", "P", " "):
            view.paused = not view.paused
        elif key == "up":
            view.scroll += 1
        elif key == "down":
            view.scroll -= 1
        elif key == "pgup":
            view.scroll += PAGE
        elif key == "pgdn":
            view.scroll -= PAGE
        elif key == "home":
            view.scroll = log_lines
        elif key == "end":
            view.scroll = 0
        view.scroll = max(0, min(view.scroll, max(0, log_lines - 1)))
    return True


def _wants_slurm_state(state: DashboardState) -> bool:
    return state.slurm_job_id is not None and state.t_end is None


def _poll_slurm(state: DashboardState, now: float) -> None:
    current = job_state(str(state.slurm_job_id), timeout=SLURM_TIMEOUT_S)
    if current is not None:
        # Through the reducer, like any event, so the state stays a fold over events.
        state.apply({"t": now, "kind": "slurm_job", "slurm_job_id": state.slurm_job_id, "state": current})


def job_summary(state: DashboardState, job_dir: Path) -> str:
    """One line for the terminal after the live screen closes."""
    failures = sum(1 for r in state.recoveries if r.trigger == "failure")
    step = f"step {state.steps_done}/{state.total_steps}" if state.step is not None else "no steps yet"
    return f"job {state.job_id or job_dir.name}: {state.status}, {step}, {failures} failure(s); events in {events_path(job_dir)}"
