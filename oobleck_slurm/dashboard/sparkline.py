"""Throughput over time as one line of block characters, with failures and recoveries marked below.

The x axis is wall time, not step number, so that a recovery shows as the gap it cost.
"""

from __future__ import annotations

from rich.text import Text

from oobleck_slurm.dashboard.state import DashboardState

BLOCKS = "▁▂▃▄▅▆▇█"
FAILURE_MARK = "✗"
RESUMED_MARK = "▲"
RECOVERING_MARK = "─"


def sparkline(state: DashboardState, width: int, rows: int = 1) -> tuple[list[Text], Text]:
    """(`rows` lines of bars, the marker row), each `width` cells wide, covering the run so far.

    A column between two steps that fall in different columns repeats the earlier value (training
    went on there), except inside a recovery, which stays empty: the gap is what it cost.
    """
    width, rows = max(1, width), max(1, rows)
    blank = [Text(" " * width) for _ in range(rows)], Text(" " * width)
    points = [(p.t, p.samples_per_s) for p in state.history if p.samples_per_s is not None]  # (t, samples/s)
    t0 = state.t_start
    t1 = state.t_end if state.t_end is not None else state.t_last
    if t0 is None or t1 is None or t1 <= t0 or not points:
        return blank
    span = t1 - t0

    def column(t: float) -> int:
        return min(width - 1, max(0, int((t - t0) / span * width)))

    buckets: list[list[float]] = [[] for _ in range(width)]
    for t, rate in points:
        buckets[column(t)].append(rate)
    recovering = [False] * width
    for rec in state.recoveries:
        end = rec.t_end if rec.t_end is not None else t1
        for col in range(column(rec.t_start), column(end)):
            recovering[col] = True
    values: list[float | None] = [sum(b) / len(b) if b else None for b in buckets]
    last_col = column(points[-1][0])
    for col in range(1, last_col):
        if values[col] is None and values[col - 1] is not None and not recovering[col]:
            values[col] = values[col - 1]
    peak = max(rate for _, rate in points) or 1.0

    lines = []
    for k in range(rows):
        base = (rows - 1 - k) * len(BLOCKS)  # eighths below this row
        line = Text()
        for value in values:
            if value is None:
                line.append(" ")
                continue
            eighths = value / peak * rows * len(BLOCKS)
            if k == rows - 1:
                eighths = max(1.0, eighths)  # a running column never looks like a gap
            fill = min(len(BLOCKS), round(eighths - base))
            line.append(BLOCKS[fill - 1] if fill > 0 else " ", style="cyan")
        lines.append(line)

    marks = [(" ", "")] * width
    for col in range(width):
        if recovering[col]:
            marks[col] = (RECOVERING_MARK, "yellow")
    for rec in state.recoveries:
        if rec.trigger == "failure":
            marks[column(rec.t_start)] = (FAILURE_MARK, "bold red")
        if rec.t_end is not None:
            marks[column(rec.t_end)] = (RESUMED_MARK, "bold green")
    row = Text()
    for char, style in marks:
        row.append(char, style=style)
    return lines, row
