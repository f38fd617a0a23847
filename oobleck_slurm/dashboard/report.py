"""The static run report: `index.html` with PNG plots, from the job's event log alone."""

from __future__ import annotations

import html
import os
from pathlib import Path

from oobleck_slurm.dashboard import plots
from oobleck_slurm.dashboard.costs import time_split, useful_fraction
from oobleck_slurm.dashboard.live import load_state
from oobleck_slurm.dashboard.panels import KIND_LABEL, _num, duration
from oobleck_slurm.dashboard.state import DashboardState
from oobleck_slurm.errors import BadInputError
from oobleck_slurm.protocol.events import events_path

PNGS = {"training": "training.png", "recoveries": "recoveries.png", "time_split": "time_split.png"}


class NoEvents(BadInputError):
    """The job folder has no readable events; the message says why."""


def write_report(job_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write the report into `out_dir` (default `<job_dir>/report`) and return its index.html."""
    job_dir = Path(job_dir)
    log = events_path(job_dir)
    if not log.exists():
        raise NoEvents(f"no event log at {log}")
    state = load_state(job_dir)
    if not state.has_events:
        raise NoEvents(f"no readable events in {log} (empty, or every line is malformed)")
    out = Path(out_dir) if out_dir is not None else job_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots.plot_training(state, out / PNGS["training"])
    plots.plot_recoveries(state, out / PNGS["recoveries"])
    plots.plot_time_split(state, out / PNGS["time_split"])
    index = out / "index.html"
    index.write_text(render_html(state, log))
    return index


def render_html(state: DashboardState, log: Path) -> str:
    e = html.escape
    split = time_split(state)
    useful = useful_fraction(state)
    failures = [r for r in state.recoveries if r.trigger == "failure"]
    rates = [p.samples_per_s for p in state.history if p.samples_per_s is not None]
    per_device = [p.tokens_per_s_per_device for p in state.history if p.tokens_per_s_per_device is not None]
    mfus = [p.mfu for p in state.history if p.mfu is not None]
    summary = [
        ("job", state.job_id or "-"), ("backend", state.backend or "-"),
        ("recipe", f"{state.recipe or '-'} ({state.recipe_path or '-'})"),
        ("status", state.status + (f" (exit {state.exit_code})" if state.exit_code is not None else "")),
        ("steps", f"{_s(state.steps_done)} / {_s(state.total_steps)}"),
        ("final loss", f"{state.loss:.4f}" if state.loss is not None else "-"),
        ("final eval loss", f"{state.eval_loss:.4f} (after {max(state.evals)} steps)" if state.evals else "-"),
        ("mean samples/s", f"{sum(rates) / len(rates):.1f}" if rates else "-"),
        ("mean tokens/s per device", f"{sum(per_device) / len(per_device):,.0f}" if per_device else "-"),
        ("mean MFU", f"{sum(mfus) / len(mfus):.1%}" if mfus else "- (no device peak: a CPU, or set "
                                                               "logging.peak_tflops)"),
        ("elapsed", duration(state.elapsed)),
        ("failures", str(len(failures))),
        ("time recovering", duration(split["recovering"])),
        ("useful (training) time", f"{useful:.1%}" if useful is not None else "-"),
    ]
    if state.slurm_job_id:
        summary.insert(2, ("Slurm job", f"{state.slurm_job_id} {state.slurm_state or ''}"))
    if state.fallback_reason:
        summary.append(("checkpoint fallback", state.fallback_reason))
    rows = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in summary)

    recovery_rows = "".join(
        f"<tr><td>{e(plots.recovery_label(i, r))}</td>"
        + "".join(f"<td>{e(_sec(plots.recovery_phases(r).get(p)))}</td>" for p in (*plots.PHASES, plots.OTHER_PHASE))
        + f"<td><b>{e(_sec(r.seconds))}</b></td></tr>"
        for i, r in enumerate(state.recoveries)
    )
    phase_heads = "".join(f"<th>{e(p)}</th>" for p in (*plots.PHASES, plots.OTHER_PHASE))
    t0 = state.t_start or 0.0
    event_rows = "".join(
        f"<tr><td>+{line.t - t0:.1f}s</td><td>{e(KIND_LABEL.get(line.kind, line.kind))}</td>"
        f"<td>{e(_sec(line.seconds))}</td><td>{e(line.text)}</td></tr>"
        for line in state.log
    )
    recoveries = (f"<table><tr><th>recovery</th>{phase_heads}<th>total</th></tr>{recovery_rows}</table>"
                  if state.recoveries else "<p>No failures or reconfigurations.</p>")
    health = _health_section(state)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>oobleck-slurm report: {e(state.job_id or '?')}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 1100px; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }}
img {{ max-width: 100%; display: block; margin: 1em 0; }}
</style></head><body>
<h1>Run report: {e(state.job_id or '?')}</h1>
<p>From <code>{e(str(log))}</code>: {state.events_seen} events.</p>
<table>{rows}</table>
<h2>Training</h2><img src="{PNGS['training']}" alt="loss and samples/s over time">
<h2>Recoveries</h2><img src="{PNGS['recoveries']}" alt="recovery time by phase">
{recoveries}
{health}
<h2>Where the time went</h2><img src="{PNGS['time_split']}" alt="time split">
<h2>Events</h2><table><tr><th>time</th><th>kind</th><th>took</th><th>what</th></tr>{event_rows}</table>
</body></html>
"""


def _health_section(state: DashboardState) -> str:
    """Faulty machines and stragglers: each node's last metrics score, the metric behind it, its
    compute slowdown and what was done; then every flag and straggler decision."""
    nodes = [n for n in state.nodes.values()
             if n.health_score is not None or n.slowdown is not None or n.straggler or n.flagged]
    if not nodes:
        return ""
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(n.name)}</td><td>{e(n.state)}</td><td>{e(_num(n.health_score, '.2f'))}</td>"
        f"<td>{e(n.health_metric or '-')}</td><td>{e(_num(n.slowdown, '.2f'))}</td><td>{e(n.straggler or '-')}</td></tr>"
        for n in nodes)
    decisions = "".join(f"<li>+{line.t - (state.t_start or line.t):.1f}s {e(KIND_LABEL.get(line.kind, line.kind))}: "
                        f"{e(line.text)}</li>" for line in state.log if line.kind in ("faulty_node", "straggler"))
    return ("<h2>Faulty machines and stragglers</h2><table><tr><th>node</th><th>state</th><th>metrics score</th>"
            "<th>metric behind it</th><th>compute slowdown</th><th>straggler</th></tr>" + rows + "</table>"
            + (f"<ul>{decisions}</ul>" if decisions else "<p>No machine flagged, no straggler.</p>"))


def _s(value: object) -> str:
    return "-" if value is None else str(value)


def _sec(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:.2f}s"
