"""A drill's faults.json is checked before any worker starts: each bad entry is named with its key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oobleck_slurm.engine.faults import load_faults


@pytest.mark.parametrize("faults, message", [
    ({"node": 1}, "must be a JSON list"),
    ([{"step": 2}], "fault 0: needs 'node' and an integer 'step'"),
    ([{"node": 1, "step": 2, "at": "middle"}], "fault 0: 'at' must be one of"),
    ([{"node": 1, "step": 2}, {"node": 1, "step": 3, "do": "explode"}], "fault 1: 'do' must be one of"),
    ([{"node": 1, "step": 2, "do": "pause"}], "fault 0: 'pause' needs 'seconds' > 0, got None"),
    ([{"node": 1, "step": 2, "do": "pause", "seconds": -1}], "'pause' needs 'seconds' > 0, got -1"),
    ([{"node": 1, "step": 2, "after": "node2"}], "fault 0: 'after' must be a list of workers"),
    ([{"node": 1, "step": 2, "do": "spike"}], "fault 0: 'spike' needs the 'step' and a finite 'factor', got None"),
    ([{"node": 1, "generation": 1, "do": "spike", "factor": 9}], "'spike' needs the 'step'"),
    ([{"node": 1, "step": 2, "do": "spike", "factor": "big"}], "'spike' needs the 'step' and a finite 'factor'"),
    ([{"node": 1, "step": 2, "after": ["node2:x"]}], "fault 0: 'after' must be a list of workers"),
])
def test_bad_faults_are_named(tmp_path: Path, faults, message: str) -> None:
    path = tmp_path / "faults.json"
    path.write_text(json.dumps(faults))
    with pytest.raises(ValueError, match=message) as err:
        load_faults(path)
    assert str(path) in str(err.value)


def test_garbled_file_and_good_faults(tmp_path: Path) -> None:
    path = tmp_path / "faults.json"
    path.write_text("[{")
    with pytest.raises(ValueError, match="not a JSON list of faults"):
        load_faults(path)
    good = [{"node": "node3", "step": 4, "at": "wait:2", "do": "hang"}, {"node": 1, "step": 2, "do": "pause", "seconds": 1.5},
            {"node": "node1", "step": 2, "at": "wait:last", "do": "hold"},
            {"node": "node2", "step": 3, "at": "scatter", "after": ["node3", "node4:1"]},
            {"node": "node2", "step": 5, "do": "spike", "factor": 100.0}]
    path.write_text(json.dumps(good))
    assert load_faults(path) == good
