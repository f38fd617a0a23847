"""What a run's time went to: training, recovering from failures, folding in nodes, checkpoints.

Derived from a `DashboardState`, for the report's plots and summary.
"""

from __future__ import annotations

from oobleck_slurm.dashboard.state import DashboardState

# Report order and colours (matplotlib names), shared by the plots and the HTML table.
CATEGORIES = {
    "training": "tab:green",
    "recovering": "tab:red",
    "reconfiguring": "tab:blue",  # growing the job after a node joined
    "checkpointing": "tab:purple",
    "startup": "tab:gray",  # start of the job to the first step's start
}


def time_split(state: DashboardState) -> dict[str, float]:
    """Seconds per category; they add up to the elapsed time (training is what is left)."""
    split = dict.fromkeys(CATEGORIES, 0.0)
    total = state.elapsed or 0.0
    if state.t_start is None or total <= 0:
        return split
    end = state.t_start + total
    for rec in state.recoveries:
        stop = min(rec.t_end if rec.t_end is not None else end, end)
        seconds = max(0.0, stop - max(rec.t_start, state.t_start))
        # A restart from a checkpoint recovers from the failure whose change fell back to it.
        split["recovering" if rec.trigger in ("failure", "restart") else "reconfiguring"] += seconds
    split["checkpointing"] = sum(cp.seconds or 0.0 for cp in state.checkpoints)
    if state.history:
        first = state.history[0]
        split["startup"] = max(0.0, first.t - (first.step_time or 0.0) - state.t_start)
    split["training"] = max(0.0, total - sum(v for k, v in split.items() if k != "training"))
    return split


def useful_fraction(state: DashboardState) -> float | None:
    """Share of the elapsed time spent training; None before anything happened."""
    split = time_split(state)
    total = sum(split.values())
    return split["training"] / total if total > 0 else None
