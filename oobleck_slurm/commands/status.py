"""`status JOB`: where a job stands: its Slurm job, nodes, plan, progress, and every recovery with the
duration of each phase (from the event log; the supervisor and Slurm are asked when reachable)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from oobleck_slurm.commands.common import console, fail
from oobleck_slurm.exit_codes import EXIT_OK

PHASES = ("detection", "replan", "group_rebuild", "state_copy", "replay", "resumed")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="a job's state, nodes, plan and recoveries with timings")
    parser.add_argument("job", help="job folder, or a job id under --job-root")
    parser.add_argument("--job-root", type=Path, default=Path("jobs"), help="where job ids are looked up (default: jobs)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's state from its event log (pure)."""
    out: dict[str, Any] = {"state": "pending", "recoveries": [], "nodes": {}, "replacements": []}
    recovery: dict[str, Any] | None = None
    for e in events:
        kind = e["kind"]
        if kind == "job_started":
            out.update(state="running", started=e["t"], backend=e.get("backend"), slurm_job_id=e.get("slurm_job_id"))
            if e.get("resumed_from"):
                out["resumed_from"] = e["resumed_from"]
        elif kind == "checkpoint":  # the newest written, and every failed write (a disk that stays full shows)
            if e.get("ok") is False:
                failed = out.setdefault("checkpoint_failures", [])
                failed.append({k: e.get(k) for k in ("step", "worker", "detail") if e.get(k) is not None})
            elif e.get("step") is not None:
                out["checkpoint"] = {"step": e["step"], "path": e.get("path")}
        elif kind == "plan":
            out["plan"] = {"generation": e["generation"], "pipelines": [p["nodes"] for p in e["pipelines"]]}
        elif kind == "step":
            out["step"], out["loss"], out["generation"] = e["step"], e.get("loss"), e.get("generation")
        elif kind == "node":
            out["nodes"][e["node"]] = {k: e.get(k) for k in ("slurm_node", "state", "cause", "heartbeat_age", "cpu",
                                                                "workers") if e.get(k) is not None}
        elif kind == "node_lost":
            recovery = {"nodes": [e["node"]], "cause": e["cause"], "detail": e.get("detail"),
                        "detection_s": e.get("detection_seconds")}
            out["recoveries"].append(recovery)
        elif kind == "failure" and recovery is None:
            recovery = {"nodes": e["nodes"], "cause": e.get("cause")}
            out["recoveries"].append(recovery)
        elif kind in PHASES and recovery is not None:
            recovery[kind] = e.get("total_seconds" if kind == "resumed" else "seconds")
            if kind == "resumed":
                recovery["resumed_step"] = e.get("step")
                recovery = None
        elif kind in ("replacement_requested", "health_check", "node_joined"):
            out["replacements"].append({"kind": kind, **{k: v for k, v in e.items() if k not in ("t", "kind")}})
        elif kind == "job_finished":
            out.update(state=e["status"], exit_code=e.get("exit_code"), error=e.get("error"))
            for node in out["nodes"].values():  # the last samples were taken while it ran: not now
                if node.get("state") not in ("lost", "evicted"):
                    node["state"] = "ended"
                node.pop("workers", None)
    return out


def run(args: argparse.Namespace) -> int:
    from oobleck_slurm.cluster.jobdir import JobNotFound, find_job
    from oobleck_slurm.protocol.events import events_path, read_events
    from oobleck_slurm.supervisor.client import SupervisorUnreachable, live_status

    try:
        job = find_job(args.job, args.job_root)
    except JobNotFound as err:
        return fail(str(err))
    summary = summarize(read_events(events_path(job.path)))
    meta = job.meta()
    summary["job_id"], summary["folder"] = job.job_id, str(job.path)
    summary["slurm_job_id"] = summary.get("slurm_job_id") or meta.get("slurm_job_id")
    if summary["slurm_job_id"]:
        summary["slurm_state"] = _slurm_state(str(summary["slurm_job_id"]))
    if summary["state"] == "running":
        try:
            summary["supervisor"] = live_status(job.path).to_dict()
        except SupervisorUnreachable as err:
            summary["supervisor"] = f"unreachable: {err}"
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return EXIT_OK
    _print(summary)
    return EXIT_OK


def _slurm_state(job_id: str) -> str:
    from oobleck_slurm.cluster.slurm import SlurmError, accounting

    try:
        return accounting(job_id) or "unknown"
    except SlurmError as err:
        return f"unknown ({err})"


def _print(s: dict[str, Any]) -> None:
    # Everything here comes from the job folder (event text, error messages, node names): escaped.
    console.print(f"job [bold]{escape(str(s['job_id']))}[/] ({escape(str(s.get('backend') or '?'))}): "
                  f"[bold]{escape(str(s['state']))}[/]"
                  + (f", exit {s['exit_code']}" if s.get("exit_code") is not None else ""), highlight=False)
    console.print(f"folder: {escape(str(s['folder']))}", highlight=False)
    if s.get("slurm_job_id"):
        console.print(f"slurm job {escape(str(s['slurm_job_id']))}: {escape(str(s.get('slurm_state', '?')))}",
                      highlight=False)
    if s.get("error"):
        console.print(f"[red]error:[/] {escape(str(s['error']))}", highlight=False)
    if "step" in s:
        console.print(f"step {s['step']} (generation {s.get('generation')}), loss {s.get('loss', float('nan')):.4f}",
                      highlight=False)
    if s.get("resumed_from"):
        console.print(f"started from the checkpoint {escape(str(s['resumed_from']))}", highlight=False)
    if s.get("checkpoint"):
        console.print(f"newest checkpoint: step {s['checkpoint']['step']} ({escape(str(s['checkpoint']['path']))})",
                      highlight=False)
    if failed := s.get("checkpoint_failures"):
        last = failed[-1]
        console.print(f"[yellow]{len(failed)} checkpoint write(s) failed[/], the last at step {last.get('step')} "
                      f"({escape(str(last.get('worker')))}: {escape(str(last.get('detail')))})", highlight=False)
    if "plan" in s:
        pipes = "  ".join("[" + ",".join(p) + "]" for p in s["plan"]["pipelines"])
        console.print(f"plan (generation {s['plan']['generation']}): {escape(pipes)}", highlight=False)
    if s["nodes"]:
        table = Table("node", "slurm node", "state", "workers", "cause", title="nodes")
        for node, n in sorted(s["nodes"].items()):
            workers = n.get("workers") or []  # each worker process's state, one per device
            table.add_row(escape(node), escape(str(n.get("slurm_node", ""))), str(n.get("state", "")),
                          escape(f"{len(workers)}: {', '.join(workers)}" if workers else ""),
                          escape(str(n.get("cause", ""))))
        console.print(table)
    if s["recoveries"]:
        table = Table("nodes", "cause", *(p + " s" for p in PHASES), "resumed at", title="recoveries")
        for r in s["recoveries"]:
            cells = [f"{r[p]:.3f}" if isinstance(r.get(p), (int, float)) else "" for p in PHASES]
            if r.get("detection_s") is not None:
                cells[0] = f"{r['detection_s']:.3f}"
            table.add_row(escape(",".join(map(str, r["nodes"]))), escape(str(r.get("cause"))), *cells,
                          escape(str(r.get("resumed_step", ""))))
        console.print(table)
    for rep in s["replacements"]:
        fields = " ".join(f"{k}={v}" for k, v in rep.items() if k not in ("kind", "detail"))
        console.print(f"{rep['kind']}: {fields}", markup=False, highlight=False)
