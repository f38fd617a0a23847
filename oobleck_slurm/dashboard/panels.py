"""The dashboard's panels: each a rich renderable built from a `DashboardState` (no I/O).

Panels whose content depends on the space they get (the node grid, the sparkline, the events list)
are renderables that read their size from rich's render options, so the layout decides the space and
the panel fills it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from oobleck_slurm.dashboard.sparkline import FAILURE_MARK, RECOVERING_MARK, RESUMED_MARK, sparkline
from oobleck_slurm.dashboard.state import DashboardState, LogLine, NodeView, PipelineView

NODE_STYLE = {"healthy": "green", "suspect": "yellow", "lost": "red", "joining": "cyan", "spare": "bright_black"}
NODE_ICON = {"healthy": "●", "suspect": "▲", "lost": "✗", "joining": "◐", "spare": "○"}
STATUS_STYLE = {"running": "bold green", "recovering": "bold yellow", "waiting": "dim",
                "completed": "bold blue", "finished": "bold blue", "failed": "bold red", "cancelled": "bold red"}
KIND_STYLE = {"failure": "bold red", "node_lost": "red", "fault_injected": "red", "refused": "yellow", "store_rejected": "yellow", "checkpoint_fallback": "bold red", "resumed": "bold green",
              "node_joined": "cyan", "replacement_requested": "cyan", "health_check": "cyan", "preflight": "cyan",
              "plan": "magenta", "job_started": "blue", "job_finished": "blue", "checkpoint": "blue",
              "node": "yellow", "faulty_node": "bold red", "straggler": "yellow"}
# Short labels keep the events panel's kind column narrow at 100 columns.
KIND_LABEL = {"job_started": "job started", "node_lost": "node lost", "agents_ready": "agents ready",
              "fault_injected": "drill", "checkpoint_requested": "ckpt request", "preempt_notice": "preemption",
              "slurm_unreachable": "slurm down?", "done": "done", "job_finished": "job finished", "replacement_requested": "replace req",
              "node_joined": "node joined", "health_check": "health check", "group_rebuild": "group rebuild",
              "state_copy": "state copy", "checkpoint_fallback": "ckpt fallback", "slurm_job": "slurm job",
              "faulty_node": "faulty node"}
WAITING = "waiting for events"
HIGH_SCORE = 3.0  # a node's metrics score shown in yellow from here (the detector flags at 4.5 by default)


@dataclass
class View:
    """What the viewer chose, not what the job did: kept apart from `DashboardState`."""

    scroll: int = 0  # events panel: lines scrolled up from the newest
    paused: bool = False
    keys: bool = True  # show the key help in the footer
    now: float | None = None  # wall clock, to show how stale the log is (None: do not show)


def duration(seconds: float | None) -> str:
    """`3.20s`, `2m05s`, `1h02m`, `3d04h`: short enough for a header cell."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.2f}s" if seconds < 10 else f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    return f"{hours // 24}d{hours % 24:02d}h"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def header(state: DashboardState, view: View) -> Panel:
    status = state.status.upper() + (" (PAUSED)" if view.paused else "")
    # Status first: long job ids must not push it off a 100-column screen.
    top = Text(no_wrap=True, overflow="ellipsis")
    top.append(status, STATUS_STYLE.get(state.status, "bold"))
    top.append("  job ", "dim").append(state.job_id or "-", "bold")
    top.append("  backend ", "dim").append(state.backend or "-")
    top.append("  recipe ", "dim").append(state.recipe or "-")
    top.append("  gen ", "dim").append(_num(state.generation, "d"))
    top.append("  slurm ", "dim").append(_slurm(state))

    bottom = Text(no_wrap=True, overflow="ellipsis")
    total = state.total_steps
    done = state.steps_done
    bottom.append("step ", "dim").append(f"{_num(done, 'd')}/{_num(total, 'd')}", "bold")
    if done is not None and total:
        filled = min(10, round(10 * done / total))
        bottom.append(" ").append("━" * filled, "green").append("━" * (10 - filled), "bright_black")
    bottom.append("  loss ", "dim").append(_num(state.loss, ".4f"), "bold")
    if state.evals:
        bottom.append("  eval ", "dim").append(_num(state.eval_loss, ".4f"), "bold")
    bottom.append("  samples/s ", "dim").append(_num(state.samples_per_s, ".1f"), "bold")
    if state.tokens_per_s_per_device is not None:
        bottom.append("  tokens/s/device ", "dim").append(_num(state.tokens_per_s_per_device, ",.0f"), "bold")
    if state.mfu is not None:
        bottom.append("  MFU ", "dim").append(f"{state.mfu:.1%}", "bold")
    bottom.append("  elapsed ", "dim").append(duration(state.elapsed))
    failures = [r for r in state.recoveries if r.trigger == "failure"]
    if failures:
        # An open recovery counts up to the newest event.
        lost = sum(r.seconds if r.done and r.seconds is not None else (state.t_last or r.t_start) - r.t_start
                   for r in failures)
        bottom.append("  failures ", "dim").append(f"{len(failures)}", "bold red")
        bottom.append(" recovering ", "dim").append(duration(lost), "yellow")
    if view.now is not None and state.t_last is not None and state.t_end is None and view.now - state.t_last > 10:
        bottom.append(f"  last event {duration(view.now - state.t_last)} ago", "yellow")
    return Panel(Group(top, bottom), title="oobleck-slurm", title_align="left", border_style="blue")


def _slurm(state: DashboardState) -> str:
    if state.slurm_job_id is None:
        return "-" if state.backend != "slurm" else "?"
    return f"{state.slurm_job_id} {state.slurm_state or '?'}"


class NodeGrid:
    """One two-line cell per node, as many columns as fit."""

    def __init__(self, state: DashboardState) -> None:
        self.nodes = list(state.nodes.values())

    @staticmethod
    def cell_width(nodes: list[NodeView]) -> int:
        health = 14 if any(n.health_score is not None for n in nodes) else 0  # room for " z1.2 rss_gib"
        return max([25 + health] + [len(n.name) + 16 for n in nodes])

    @classmethod
    def rows_needed(cls, nodes: list[NodeView], inner_width: int) -> int:
        cols = max(1, (inner_width + 1) // (cls.cell_width(nodes) + 1))
        return 2 * math.ceil(len(nodes) / cols) if nodes else 1

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if not self.nodes:
            yield Text(WAITING, "dim")
            return
        width = self.cell_width(self.nodes)
        cols = max(1, (options.max_width + 1) // (width + 1))
        grid = Table.grid(padding=(0, 1))
        for _ in range(cols):
            grid.add_column(width=width, no_wrap=True)
        cells = [_node_cell(n) for n in self.nodes]
        for i in range(0, len(cells), cols):
            row = cells[i:i + cols]
            grid.add_row(*row, *[""] * (cols - len(row)))
        yield grid


def _node_cell(node: NodeView) -> Text:
    style = NODE_STYLE.get(node.state, "white")
    cell = Text(no_wrap=True, overflow="ellipsis")
    cell.append(f"{NODE_ICON.get(node.state, '?')} ", style).append(node.name, "bold").append(f" {node.state}", style)
    if node.slurm_state and node.slurm_state not in ("ALLOCATED", "MIXED"):
        cell.append(f" {node.slurm_state}", "yellow")
    if node.flagged and node.state != "lost":  # flagged from its metrics, only reported (evict: false)
        cell.append(" flagged", "bold red")
    if node.straggler:  # a straggler mark: how much slower it computes, and what was done
        factor = f" x{node.slowdown:.1f}" if node.slowdown is not None else ""
        cell.append(f" slow{factor} {node.straggler}", "yellow" if node.straggler != "evict" else "red")
    gpu = f" gpu {node.gpu:.0f}%" if node.gpu is not None else ""
    cpu = f" cpu {node.cpu:.0f}%" if node.cpu is not None else ""
    age = f"hb {_age(node.heartbeat_age)}"
    if node.workers:  # a node runs one worker per device; a stopped or gone one stalls the node
        up = sum(w not in ("stopped", "tracing-stop", "gone", "zombie", "dead") for w in node.workers)
        cpu += f" {up}/{len(node.workers)}w"
    if node.state == "lost" and node.cause:
        cell.append(f"\n  {node.cause}", "red")
    else:
        cell.append(f"\n  {age}{cpu}{gpu}", "dim" if node.state == "spare" else "")
        if node.health_score is not None:  # the metrics detector's score and the metric behind it
            metric = f" {node.health_metric.rsplit('.', 1)[-1]}" if node.health_metric else ""
            cell.append(f" z{node.health_score:.1f}{metric}", "yellow" if node.health_score >= HIGH_SCORE else "dim")
    return cell


def _age(seconds: float | None) -> str:
    """Heartbeat age in at most 4 characters where it matters (`0.5s`, `12s`), so two cells fit."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    return f"{seconds:.0f}s" if seconds < 60 else duration(seconds)


def nodes_panel(state: DashboardState) -> Panel:
    counts = {s: sum(1 for n in state.nodes.values() if n.state == s) for s in NODE_STYLE}
    title = " ".join(f"[{NODE_STYLE[s]}]{c} {s}[/]" for s, c in counts.items() if c)
    return Panel(NodeGrid(state), title=f"nodes {title}".strip(), title_align="left", border_style="green")


def pipelines_panel(state: DashboardState) -> Panel:
    if not state.pipelines:
        body: Text | Group = Text(WAITING if not state.has_events else "no plan yet", "dim")
    else:
        body = Group(*[_pipeline_lines(p) for p in state.pipelines])
    # The plan's reason is event text (a node name, an error): a panel title is markup, so escape it.
    title = f"pipelines gen {_num(state.generation, 'd')} ({escape(state.plan_reason or '-')})"
    return Panel(body, title=title, title_align="left", border_style="magenta")


def _pipeline_lines(p: PipelineView) -> Text:
    text = Text(overflow="fold")
    text.append(f"P{p.id}", "bold magenta")
    text.append(f" {_plural(len(p.stages), 'stage')}", "bold").append(f" on {_plural(len(p.nodes), 'node')}")
    text.append(f"  mb {_num(p.microbatches, 'd')}")
    if p.time is not None:
        text.append(f"  {duration(p.time)}/step", "dim")
    text.append("\n  ")
    for i, stage in enumerate(p.stages):
        if i:
            text.append(" │ ", "dim")
        layers = f"L{stage.layers[0]}-{stage.layers[1] - 1}" if stage.layers else "L?"
        text.append(stage.node or "?").append(f" {layers}", "cyan")
        if stage.width > 1:  # sharded over several workers of the node
            text.append(f" x{stage.width}", "yellow")
    return text


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class Throughput:
    """The sparkline row and the marker row, sized to the panel."""

    def __init__(self, state: DashboardState) -> None:
        self.state = state

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if not self.state.history:
            yield Text(WAITING, "dim")
            return
        rows = max(1, (options.height or 2) - 1)
        lines, marks = sparkline(self.state, options.max_width, rows)
        yield from lines
        yield marks


def throughput_panel(state: DashboardState) -> Panel:
    values = [p.samples_per_s for p in state.history if p.samples_per_s is not None]
    peak = f" peak {max(values):.1f}" if values else ""
    failures = sum(1 for r in state.recoveries if r.trigger == "failure")
    title = (f"throughput samples/s{peak}   [bold red]{FAILURE_MARK}[/] failure ({failures})  "
             f"[yellow]{RECOVERING_MARK}[/] recovering  [bold green]{RESUMED_MARK}[/] resumed")
    return Panel(Throughput(state), title=title, title_align="left", border_style="cyan")


class EventList:
    """The newest events that fit, moved up by `scroll` lines."""

    def __init__(self, state: DashboardState, scroll: int) -> None:
        self.state = state
        self.scroll = scroll

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = self.state.log
        if not lines:
            yield Text(WAITING, "dim")
            return
        rows = max(1, (options.height or 10))
        end = max(rows, len(lines) - self.scroll) if len(lines) > rows else len(lines)
        shown = lines[max(0, end - rows):end]
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True, style="dim")
        grid.add_column(no_wrap=True, width=14)
        grid.add_column(no_wrap=True, justify="right", width=7)
        grid.add_column(no_wrap=True, overflow="ellipsis", ratio=1)
        for line in shown:
            grid.add_row(*_event_row(self.state, line))
        yield grid


def _event_row(state: DashboardState, line: LogLine) -> tuple[Text, Text, Text, Text]:
    offset = line.t - state.t_start if state.t_start is not None else 0.0
    sign = "-" if offset < 0 else "+"
    minutes, secs = divmod(int(abs(offset)), 60)
    when = Text(f"{sign}{minutes:02d}:{secs:02d}")
    kind = Text(KIND_LABEL.get(line.kind, line.kind), KIND_STYLE.get(line.kind, "yellow" if line.seconds is not None else ""))
    took = Text(duration(line.seconds) if line.seconds is not None else "", "bold")
    return when, kind, took, Text(line.text)


def events_panel(state: DashboardState, view: View) -> Panel:
    title = "events"
    if view.scroll:
        title += f" (scrolled up {view.scroll})"
    return Panel(EventList(state, view.scroll), title=title, title_align="left", border_style="yellow")


def footer(state: DashboardState, view: View) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis", style="dim")
    if view.keys:
        text.append("q quit  p pause  ↑/↓ scroll events  ")
    text.append(f"{state.events_seen} events")
    if state.unknown_events:
        text.append(f", {state.unknown_events} of unknown kinds")
    if state.bad_events:
        text.append(f", {state.bad_events} malformed", "yellow")
    return text
