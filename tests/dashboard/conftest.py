"""Fixtures for the dashboard tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from dash_helpers import LOGS

from oobleck_slurm.protocol.events import events_path


@pytest.fixture
def job_dir(tmp_path):
    """make(name) -> a job folder holding the recorded log `name` as its events.jsonl."""

    def make(name: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(LOGS / f"{name}.jsonl", events_path(folder))
        return folder

    return make
