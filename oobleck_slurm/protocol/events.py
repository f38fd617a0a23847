"""The job's event log: one JSON object per line in `<job_dir>/events.jsonl`.

Shared by the engine (per-step metrics), the supervisor (plans, failures, recoveries) and the
dashboard (which tails it). Every record has `t` (unix time, float seconds) and `kind` (e.g. "step",
"plan", "failure", "resumed", "done"); the other fields depend on the kind, as `event_schema.py`
defines: `emit` refuses a kind or field it does not know, and `event_schema.read_event` turns a
record read here into its typed event.

Several processes may append to one log: each record is written with a single `write` on a file
opened in append mode and flushed at once, so lines do not interleave and a reader sees whole
records as soon as they are written. A reader may still meet a partly written last line (a writer
mid-write or killed): it is skipped, never an error.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oobleck_slurm.cluster.jobdir import EVENTS_FILE
from oobleck_slurm.protocol.event_schema import check_event


def events_path(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / EVENTS_FILE


class EventLog:
    """Appends events to a JSONL file; one flushed line per event."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Unbuffered binary append: one os-level write per record.
        self._file = open(self.path, "ab", buffering=0)
        # Called before each write: a supervisor's fencing check (it leaves the process if a standby
        # took over), so that a primary thawed after a takeover writes nothing into the job's log.
        self.fence: Callable[[], None] = lambda: None

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Write one event and return it. `t` defaults to now; `fields` must be JSON-serialisable and be
        the kind's fields in the schema (else ValueError naming the kind and the field)."""
        check_event(kind, fields)
        self.fence()
        record = {"t": fields.pop("t", time.time()), "kind": kind, **fields}
        line = json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n"
        self._file.write(line.encode())
        return record

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_lines(text: str) -> list[dict[str, Any]]:
    """Records in `text`; an incomplete or malformed line (e.g. a partly written last one) is skipped."""
    records = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "kind" in record and "t" in record:
            records.append(record)
    return records


def read_events(path: str | os.PathLike[str], kind: str | None = None) -> list[dict[str, Any]]:
    """All complete records of the log at `path` (of one `kind` if given); [] if it does not exist."""
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return []
    records = parse_lines(text)
    return [r for r in records if r["kind"] == kind] if kind else records


class EventTail:
    """Incremental reader for a growing log (the dashboard): `poll()` returns records new since last call.

    Keeps a partial last line until its newline arrives, so a record is returned once and whole.
    """

    def __init__(self, path: str | os.PathLike[str], offset: int = 0) -> None:
        self.path = Path(path)
        self._offset = offset  # bytes read so far; `offset`: start there (a whole record's end)
        self._partial = b""

    @property
    def offset(self) -> int:
        """Bytes of the log returned so far, as whole records (what a later reader may start from)."""
        return self._offset - len(self._partial)

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        complete, _, self._partial = data.rpartition(b"\n")
        return parse_lines(complete.decode(errors="replace"))
