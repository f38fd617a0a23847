"""Terminal dashboard and static run report, both built from the job's event log.

See docs/events.md for the event vocabulary (the contract with the producers).

    state       DashboardState.apply(event): the pure reducer over events
    panels      the panels (rich renderables) and the viewer's View (scroll, pause)
    render      Dashboard: the panels laid out for the terminal's size
    sparkline   throughput over time with failures and recoveries marked
    live        run_dashboard(job_dir, live=True): tail the log, redraw, keys
    keys        single keys in cbreak mode
    slurm       the Slurm job state from squeue/sacct
    costs       where the time went (training, recovering, ...)
    plots       report PNGs (matplotlib, imported lazily)
    report      write_report(job_dir, out_dir): index.html + PNGs
"""

from oobleck_slurm.dashboard.live import load_state, run_dashboard
from oobleck_slurm.dashboard.state import DashboardState

__all__ = ["DashboardState", "load_state", "run_dashboard"]
