"""Fuzzing a drill's faults file loader (`load_faults`, engine/faults.py): a checked list or
a ValueError naming the file; and every fault it accepts is one the worker can carry out.

The cases below were bugs found by this fuzzing (deep nesting, non-finite pauses, non-ASCII wait
points, negative steps), fixed in load_faults.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fuzzlib import byte_mutations, fuzz_settings, json_values
from hypothesis import given
from hypothesis import strategies as st

from oobleck_slurm.engine.faults import FAULT_ACTIONS, FAULT_POINTS, load_faults

VALID = [{"node": "node2", "step": 3, "at": "wait:1", "do": "kill"},
         {"node": "node3", "step": 5, "at": "optimizer", "do": "pause", "seconds": 0.5},
         {"node": "node1", "step": 0}]


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fuzz-faults-") as name:
        yield Path(name)


def check_load(path: Path) -> list[dict[str, Any]] | None:
    try:
        faults = load_faults(path)
    except ValueError as err:
        assert str(err).startswith(str(path)), err
        return None
    assert isinstance(faults, list)
    for f in faults:
        assert isinstance(f, dict) and "node" in f and isinstance(f["step"], int)
        at = f.get("at", "start")
        assert at in FAULT_POINTS or (isinstance(at, str) and at.startswith("wait:"))
        assert f.get("do", "kill") in FAULT_ACTIONS
    return faults


entries = st.fixed_dictionaries(
    {"node": st.sampled_from(["node1", "node2", 3]) | json_values(3), "step": st.integers(-5, 50) | json_values(3)},
    optional={"at": st.sampled_from([*FAULT_POINTS, "wait:2", "wait:", "wait:x", "later"]) | json_values(3),
              "do": st.sampled_from([*FAULT_ACTIONS, "explode"]) | json_values(3),
              "seconds": st.floats(allow_nan=False, allow_infinity=False, min_value=-1, max_value=10) | json_values(3)})


@fuzz_settings()
@given(faults=st.lists(entries, max_size=4) | json_values())
def test_generated_fault_lists(folder: Path, faults: Any) -> None:
    path = folder / "faults.json"
    path.write_text(json.dumps(faults))
    check_load(path)


@fuzz_settings(0.5)
@given(data=st.data())
def test_byte_mutations_of_a_faults_file(folder: Path, data: st.DataObject) -> None:
    path = folder / "bytes.json"
    path.write_bytes(data.draw(byte_mutations(json.dumps(VALID).encode())))
    check_load(path)


def test_valid_faults_load(folder: Path) -> None:
    path = folder / "valid.json"
    path.write_text(json.dumps(VALID))
    assert check_load(path) == VALID


def test_directory_and_missing_file(folder: Path) -> None:
    for path in (folder, folder / "missing.json"):
        with pytest.raises(ValueError, match="not a JSON list of faults"):
            load_faults(path)


# ---- bugs found by fuzzing, fixed in load_faults (now engine/faults.py) ---------------------------


def test_deeply_nested_faults_file(folder: Path) -> None:
    path = folder / "deep.json"
    path.write_text("[" * 100_000)
    with pytest.raises(ValueError):
        load_faults(path)


@pytest.mark.parametrize("seconds", ["NaN", "Infinity", "1e400"])
def test_pause_seconds_must_be_finite(folder: Path, seconds: str) -> None:
    path = folder / "pause.json"
    path.write_text(f'[{{"node": "node1", "step": 1, "do": "pause", "seconds": {seconds}}}]')
    with pytest.raises(ValueError):  # what the worker's time.sleep needs: a finite number
        load_faults(path)


@pytest.mark.parametrize("at", ["wait:\u0663", "wait:\u00b2"])
def test_wait_point_needs_ascii_digits(folder: Path, at: str) -> None:
    path = folder / "wait.json"
    path.write_text(json.dumps([{"node": "node1", "step": 1, "at": at}]))
    with pytest.raises(ValueError):
        load_faults(path)


def test_negative_step_is_refused(folder: Path) -> None:
    path = folder / "neg.json"
    path.write_text(json.dumps([{"node": "node1", "step": -1}]))
    with pytest.raises(ValueError):
        load_faults(path)
