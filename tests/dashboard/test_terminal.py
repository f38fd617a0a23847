"""The real command in a real terminal (tmux): it draws, follows the log, pauses, and quits on q."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dash_helpers import LOGS

from oobleck_slurm import cli
from oobleck_slurm.protocol.events import events_path

REPO = Path(__file__).resolve().parents[2]
# Until `dashboard` is in cli.COMMANDS, run the command module through the same argparse wiring.
DIRECT = ("import argparse, sys; from oobleck_slurm.commands import dashboard as d; "
          "p = argparse.ArgumentParser(); d.add_parser(p.add_subparsers()); sys.exit(d.run(p.parse_args()))")


@pytest.fixture(scope="module")
def tmux() -> str:
    """tmux, installed from Debian if missing (CI runs as root on a fresh Debian 12)."""
    if shutil.which("tmux") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "install", "-y", "-q", "tmux"], env=env, capture_output=True, check=False)
        if shutil.which("tmux") is None:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
            subprocess.run(["apt-get", "install", "-y", "-q", "tmux"], env=env, capture_output=True, check=False)
    path = shutil.which("tmux")
    if path is None:
        # tests/run_all.sh installs tmux; a missing tmux is a broken setup, not a reason to skip.
        pytest.fail("tmux is not installed and could not be installed with apt-get (run tests/run_all.sh)")
    return path


class Tmux:
    def __init__(self, tmux: str, socket: str) -> None:
        self.base = [tmux, "-L", socket, "-f", "/dev/null"]

    def __call__(self, *args: str) -> str:
        return subprocess.run([*self.base, *args], capture_output=True, text=True, check=False).stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "dash")

    def wait_for(self, text: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if text in screen:
                return screen
            time.sleep(0.1)
        raise AssertionError(f"{text!r} not on the screen:\n{self.screen()}")


def test_dashboard_in_tmux(tmux, tmp_path):
    lines = (LOGS / "failure.jsonl").read_text().splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if '"kind":"node_lost"' in line)
    log = events_path(tmp_path)
    log.write_text("".join(lines[:cut]))
    done = tmp_path / "exit_code"
    if "dashboard" in cli.COMMANDS:
        command = [sys.executable, "-m", "oobleck_slurm", "dashboard", str(tmp_path), "--refresh", "0.1"]
    else:
        command = [sys.executable, "-c", DIRECT, "dashboard", str(tmp_path), "--refresh", "0.1"]
    # pytest exports COLUMNS/LINES for its own output; the dashboard must size itself from the pane.
    shell = "env -u COLUMNS -u LINES " + " ".join(f"'{part}'" for part in command) + f"; echo $? > '{done}'; sleep 30"
    term = Tmux(tmux, f"oobleck-test-{os.getpid()}")
    term("new-session", "-d", "-s", "dash", "-x", "100", "-y", "30", "-c", str(REPO), shell)
    try:
        screen = term.wait_for("RUNNING")
        assert "job dash-failure-" in screen and "q quit" in screen, screen
        assert "╭─ nodes 4 healthy" in screen and "● node3 healthy" in screen, screen

        with open(log, "a") as f:  # the job goes on: the failure and the recovery arrive
            f.write("".join(lines[cut:]))
        screen = term.wait_for("COMPLETED")
        assert "node3 lost (process_exit) at step" in screen and "✗ node3 lost" in screen
        assert "failures 1 recovering" in screen and "step 80/80" in screen

        term("send-keys", "-t", "dash", "p")
        term.wait_for("(PAUSED)")
        term("send-keys", "-t", "dash", "Up")
        term.wait_for("scrolled up 1")

        term("send-keys", "-t", "dash", "q")
        deadline = time.monotonic() + 10
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert done.exists(), f"q did not end the dashboard:\n{term.screen()}"
        assert done.read_text().strip() == "0"
        assert "completed, step 80/80, 1 failure(s)" in term.screen()
    finally:
        term("kill-server")
