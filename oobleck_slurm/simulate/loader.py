"""The simulator's only I/O: reading trace CSV files and job event logs.

Trace CSV (header required):

    time,event,node
    0,join,node31        # times in seconds from the start; event is fail or join
    600,fail,node5

Nodes not named by any event before their first `fail` are initial nodes; `initial` (a count or
names) may add more. Every problem is reported as `FILE:LINE: what is wrong`.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Any

from oobleck_slurm.protocol.events import EVENTS_FILE, parse_lines
from oobleck_slurm.simulate.traces import EVENT_KINDS, Trace, TraceError, TraceEvent, build_trace, node_names

HEADER = ("time", "event", "node")


def read_trace_csv(path: str | os.PathLike[str], *, initial_nodes: int | None = None,
                   horizon_s: float | None = None) -> Trace:
    """Parse a trace file; initial nodes are those that fail before ever joining, plus `node1..nodeK`
    up to `initial_nodes` when given (so a file may list failures only)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise TraceError(f"{path}: cannot read: {err}") from None
    rows = list(csv.reader(text.splitlines()))
    # Line numbers: csv.reader on splitlines keeps one row per line for this simple format.
    numbered = [(i + 1, row) for i, row in enumerate(rows) if row and not (len(row) == 1 and not row[0].strip())
                and not row[0].lstrip().startswith("#")]
    if not numbered:
        raise TraceError(f"{path}:1: empty trace; expected the header 'time,event,node'")
    line, header = numbered[0]
    if tuple(h.strip().lower() for h in header) != HEADER:
        raise TraceError(f"{path}:{line}: header must be 'time,event,node', got {','.join(header)!r}")
    events: list[TraceEvent] = []
    seen: set[str] = set()
    initial: list[str] = []
    present: set[str] = set()
    last_time = -math.inf
    for line, row in numbered[1:]:
        if len(row) != 3:
            raise TraceError(f"{path}:{line}: expected 3 fields (time,event,node), got {len(row)}")
        raw_time, kind, node = (x.strip() for x in row)
        try:
            t = float(raw_time)
        except ValueError:
            raise TraceError(f"{path}:{line}: time {raw_time!r} is not a number of seconds") from None
        if not math.isfinite(t) or t < 0:
            raise TraceError(f"{path}:{line}: time must be a finite number >= 0, got {raw_time!r}")
        if t < last_time:
            raise TraceError(f"{path}:{line}: time {raw_time} goes back in time (previous line: {last_time:g}); "
                             f"sort the trace by time")
        last_time = t
        kind = kind.lower()
        if kind not in EVENT_KINDS:
            raise TraceError(f"{path}:{line}: event {row[1].strip()!r} is not one of {', '.join(EVENT_KINDS)}")
        if not node:
            raise TraceError(f"{path}:{line}: empty node name")
        if kind == "fail":
            if node not in present:
                if node in seen:
                    raise TraceError(f"{path}:{line}: node {node!r} fails again without having joined")
                initial.append(node)
            present.discard(node)
        else:
            if node in present:
                raise TraceError(f"{path}:{line}: node {node!r} joins but is already present")
            present.add(node)
        seen.add(node)
        events.append(TraceEvent(t, kind, node))
    if initial_nodes is not None:
        extra = [n for n in node_names(initial_nodes) if n not in seen and n not in initial]
        initial += extra[:max(0, initial_nodes - len(initial))]
    if not initial and not any(e.kind == "join" and e.time == 0 for e in events):
        raise TraceError(f"{path}: no initial nodes: give --nodes N, or list nodes with time 0 joins")
    # time-0 joins are initial members, not reconfigurations
    initial += [e.node for e in events if e.kind == "join" and e.time == 0]
    events = [e for e in events if not (e.kind == "join" and e.time == 0)]
    if horizon_s is not None and horizon_s <= 0:
        raise TraceError(f"{path}: the horizon must be > 0")
    return build_trace(initial, events, horizon_s, str(path))


def job_events(job: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Records of a job folder's events.jsonl (or of a .jsonl file given directly)."""
    path = Path(job)
    log = path if path.suffix == ".jsonl" or path.is_file() else path / EVENTS_FILE
    try:
        records = parse_lines(log.read_text(errors="replace"))
    except FileNotFoundError:
        raise TraceError(f"{log}: no event log (expected a job folder with {EVENTS_FILE})") from None
    if not records:
        raise TraceError(f"{log}: no readable events")
    return records
