"""The report's PNG plots, drawn with matplotlib's Agg backend (no display needed).

matplotlib is imported inside `load_pyplot` so the dashboard itself never needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from oobleck_slurm.dashboard.costs import CATEGORIES, time_split
from oobleck_slurm.dashboard.state import PHASES, DashboardState, Recovery
from oobleck_slurm.errors import BadInputError

if TYPE_CHECKING:  # matplotlib is loaded only when a report is drawn
    from matplotlib.axes import Axes

PHASE_COLOURS = dict(zip(PHASES, ("tab:red", "tab:orange", "tab:olive", "tab:blue", "tab:purple")))
OTHER_PHASE = "other"  # the part of a recovery's total no phase event accounts for


class MissingMatplotlib(BadInputError, RuntimeError):
    """matplotlib is not installed (the `dashboard` extra): install it and run again."""


def load_pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise MissingMatplotlib("the report needs matplotlib: pip install 'matplotlib>=3.7'") from err
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def recovery_label(i: int, rec: Recovery) -> str:
    end = " (interrupted)" if rec.interrupted else ""
    if rec.trigger == "failure":
        return (f"#{i + 1} {', '.join(rec.nodes) or '?'} ({rec.cause or '?'}) step "
                f"{rec.step if rec.step is not None else '?'}{end}")
    return f"#{i + 1} {rec.trigger} gen {rec.resumed_generation if rec.resumed_generation is not None else '?'}{end}"


def recovery_phases(rec: Recovery) -> dict[str, float]:
    """Phase seconds, plus `other` for the rest of the total (waiting, messaging) if any."""
    phases = {k: rec.phases[k] for k in PHASES if k in rec.phases}
    phases.update({k: v for k, v in rec.phases.items() if k not in phases})
    total = rec.seconds
    if total is not None and total - sum(phases.values()) > 0.01:
        phases[OTHER_PHASE] = total - sum(phases.values())
    return phases


def _bands(ax: Axes, state: DashboardState) -> None:
    t0 = state.t_start or 0.0
    end = (state.t_end or state.t_last or t0) - t0
    for rec in state.recoveries:
        stop = (rec.t_end - t0) if rec.t_end is not None else end
        failure = rec.trigger == "failure"
        ax.axvspan(rec.t_start - t0, stop, color="tab:red" if failure else "tab:blue", alpha=0.2, lw=0,
                   label="recovery" if failure else "reconfiguration")
        if failure:
            ax.axvline(rec.t_start - t0, color="tab:red", lw=1)
    for cp in state.checkpoints:
        ax.axvline(cp.t - t0, color="tab:purple", lw=0.8, ls=":", label="checkpoint")


def _dedup_legend(ax: Axes) -> None:
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    if seen:
        ax.legend(seen.values(), seen.keys(), loc="best", fontsize=8)


def _broken_at_recoveries(state: DashboardState, points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points relative to the start, with a gap (NaN) wherever a recovery separates two steps:
    a straight line across a recovery would pretend training went on there."""
    t0 = state.t_start or 0.0
    out: list[tuple[float, float]] = []
    for i, (t, value) in enumerate(points):
        if i and any(points[i - 1][0] <= rec.t_start < t for rec in state.recoveries):
            out.append((t - t0, float("nan")))
        out.append((t - t0, value))
    return out


def plot_training(state: DashboardState, path: Path) -> Path:
    """Loss (and the validation loss) and samples/s against time since the start, with recovery bands."""
    plt = load_pyplot()
    fig, (ax_loss, ax_tput) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    loss = _broken_at_recoveries(state, [(p.t, p.loss) for p in state.history if p.loss is not None])
    tput = _broken_at_recoveries(state, [(p.t, p.samples_per_s) for p in state.history if p.samples_per_s is not None])
    if loss:
        ax_loss.plot(*zip(*loss), color="tab:green", lw=1.5, label="loss")
    if state.evals:
        evals = _broken_at_recoveries(state, sorted(state.evals.values()))
        ax_loss.plot(*zip(*evals), color="tab:orange", lw=1, marker="o", ms=4, label="eval loss")
    if tput:
        ax_tput.plot(*zip(*tput), color="tab:cyan", lw=1.5, marker=".", ms=3, label="samples/s")
    for ax in (ax_loss, ax_tput):
        _bands(ax, state)
        ax.grid(alpha=0.3)
        _dedup_legend(ax)
    ax_loss.set_ylabel("loss")
    ax_tput.set_ylabel("samples/s")
    ax_tput.set_ylim(bottom=0)
    ax_tput.set_xlabel("seconds since job start")
    ax_loss.set_title(f"job {state.job_id or '?'}: training")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_recoveries(state: DashboardState, path: Path) -> Path:
    """One stacked bar per recovery: the seconds of each phase."""
    plt = load_pyplot()
    recs = state.recoveries
    height = 2.0 + 0.5 * max(1, len(recs))
    fig, ax = plt.subplots(figsize=(10, height))
    if not recs:
        ax.text(0.5, 0.5, "no failures or reconfigurations", ha="center", va="center", fontsize=14)
        ax.set_axis_off()
    else:
        for i, rec in enumerate(recs):
            left = 0.0
            for phase, seconds in recovery_phases(rec).items():
                ax.barh(i, seconds, left=left, color=PHASE_COLOURS.get(phase, "tab:gray"), label=phase,
                        edgecolor="white")
                left += seconds
            total = rec.seconds if rec.seconds is not None else left
            ax.text(left, i, f" {total:.2f}s", va="center", fontsize=9)
        ax.set_yticks(range(len(recs)), [recovery_label(i, r) for i, r in enumerate(recs)], fontsize=9)
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        ax.set_xlim(right=ax.get_xlim()[1] * 1.12)
        handles, labels = ax.get_legend_handles_labels()
        seen = dict(zip(labels, handles))
        fig.legend(seen.values(), seen.keys(), loc="lower center", ncol=len(seen), fontsize=8, frameon=False)
    ax.set_title("recovery time by phase")
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))  # room for the legend below
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_time_split(state: DashboardState, path: Path) -> Path:
    """One horizontal bar of the elapsed time: training vs recovering vs the rest."""
    plt = load_pyplot()
    split = time_split(state)
    total = sum(split.values()) or 1.0
    fig, ax = plt.subplots(figsize=(10, 2.2))
    left = 0.0
    for name, seconds in split.items():
        if seconds <= 0:
            continue
        ax.barh(0, seconds, left=left, color=CATEGORIES[name], label=f"{name} {seconds:.1f}s ({seconds / total:.0%})")
        left += seconds
    ax.set_yticks([])
    ax.set_title("where the time went (seconds)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=5, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
