"""Waiting on a job folder's event log, shared by the supervisor tests."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from oobleck_slurm.events import read_events


def wait_for(job: Path, what: str, check, timeout: float = 180.0):  # noqa: ANN001, ANN201
    """Poll `job`'s events until `check(events)` is truthy; fail with the last events after `timeout`."""
    deadline = time.monotonic() + timeout
    while not (found := check(read_events(job / "events.jsonl"))):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not seen within {timeout}s: {read_events(job / 'events.jsonl')[-10:]}")
        time.sleep(0.1)
    return found
