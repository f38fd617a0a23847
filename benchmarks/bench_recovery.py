"""Recovery time: checkpoint-free recovery against checkpoint-restart, on the same failure, through the
production start path (oobleck_slurm.submission: prepare_job + start_local; supervisor, agents and
workers as real processes), figures read from each job's events.jsonl.

    python benchmarks/bench_recovery.py [--model tiny[,100m]] [--steps N] [--kill-step S]
                                        [--replacement none|request] [--json PATH]

Per model: 4 local virtual nodes x 1 worker (gloo, one thread each), fp32, AdamW, and a
`cluster.memory_per_device` found so that the planner makes 2 pipelines of 2 nodes. Worker 0 of
node2 is killed with SIGKILL in the middle of step `--kill-step` (its third wait on a collective,
faults.json). Two jobs, same seed, same plan, same failure, same checkpoint_interval:
- memory:     f=0: the coordinator recovers in memory (abort, re-form groups, copy layers from the
              surviving replicas, replay the step). With `--replacement request` a replacement node
              is then requested and joins.
- checkpoint: f=1: after the loss the 3 live nodes cannot form the 2 pipelines f=1 needs, so the
              coordinator falls back (`checkpoint_fallback`): every worker is stopped and restarted
              from the last complete checkpoint (every `--checkpoint-interval` steps, async) and the
              steps since are redone. f only decides the recovery; the plan before the failure is the
              same (checked).
Recovery time = from the kill to the completion of the interrupted step (both modes); "minus one
step" subtracts the median step before the failure. Memory mode's split (detection, replan, group
rebuild, state copy, replay) is the coordinator's events. Throughput: samples/s (rank 0's step
times; the first step of each generation dropped) before the failure, after recovery (degraded /
after restart) and after the replacement joined: medians, to investigate e.g. the 100m slowdown
after a join that the README quotes.
Warm start (agent/warm.py: workers forked from their agent's warm server): `start->ready` is the
time from an agent being told to start its workers (the Start message) to the slowest worker ready to
join (its log's "ready" line: engine/elastic_process.py), at the job's first start and at a restart on
the same node (checkpoint mode's fallback); for the replacement, `join: start->ready`
and `join: start->training`, from its agent's Start to the first step it trained in (the node_joined
event); `join` is the join's recovery (from the join's replan to that step). The JSON also has the
replacement's health check (join_health_check_s).
Writes benchmarks/results/bench_recovery.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from _jobs import budget_for_span, median, plan_summary, recipe_dict, run_job
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results" / "bench_recovery.json"
SETTINGS = {  # steps, global batch, microbatch size, kill step
    "tiny": (40, 16, 2, 3),
    "100m": (10, 4, 1, 4),
}
# collective timeout (s; the lease, step and reconfiguration timeouts follow it): None = the recipe's
# defaults. 100m's stages compute for seconds on CPU: a 2 s wait on a peer would time out and re-form.
COLLECTIVE_S = {"tiny": None, "100m": 30.0}
KILLED = {"node": "node2", "worker": 0, "at": "wait:3", "do": "kill"}


def phases(run: Any) -> dict[str, Any]:
    """Recovery figures of the first failure, from the job's events."""
    failure, detection = run.first("failure"), run.first("detection")
    if failure is None or detection is None:
        raise SystemExit(f"job {run.job.path}: no failure was recorded (did the fault fire?)")
    t_kill = failure["t"] - detection["seconds"]
    steps = run.kind("step")
    failed = failure.get("step")
    done = next((e for e in steps if e["t"] > failure["t"] and (failed is None or e["step"] >= failed)), None)
    if done is None:
        raise SystemExit(f"job {run.job.path}: no step completed after the failure")
    before = [e["seconds"] for e in steps if e["t"] < failure["t"]][1:]
    step_s = median(before) or 0.0
    out: dict[str, Any] = {
        "failed_step": failed, "recovery_s": done["t"] - t_kill, "step_s_before": step_s,
        "overhead_s": done["t"] - t_kill - step_s, "detection_s": detection["seconds"],
        "fallback": run.first("checkpoint_fallback") is not None,
    }
    for kind in ("replan", "group_rebuild", "state_copy", "replay"):
        e = run.first(kind)
        if e is not None:
            out[f"{kind}_s"] = e["seconds"]
    copy = run.first("state_copy")
    if copy is not None:
        out["state_copy_bytes"] = copy["bytes"]
    resumed = run.first("resumed")
    if resumed is not None:
        out["resumed_total_s"] = resumed["total_seconds"]
    joined = run.first("node_joined")
    starts = worker_starts(run.job.path)
    joiner = f"{joined['node']}:" if joined is not None else None
    first = [s for w, s, t in starts if t < failure["t"] and not (joiner and w.startswith(joiner))]
    if first:
        out["start_to_ready_s"] = max(first)  # the job's first start, its slowest worker
    restart = [s for w, s, t in starts if t > failure["t"] and not (joiner and w.startswith(joiner))]
    if restart:
        out["restart_start_to_ready_s"] = max(restart)  # workers restarted on their node (checkpoint mode)
    if joined is not None:
        out["join_s"] = joined["seconds"]
        check = next((e for e in run.kind("health_check") if e["node"] == joined["node"]), None)
        if check is not None:
            out["join_health_check_s"] = check["seconds"]
        mine = [(s, t) for w, s, t in starts if joiner and w.startswith(joiner)]
        if mine:
            out["join_start_to_ready_s"] = max(s for s, _ in mine)
            out["join_start_to_training_s"] = joined["t"] - min(t for _, t in mine)
    return out


READY_LINE = re.compile(r"worker (\S+): ready ([0-9.]+) s after its agent's start at ([0-9.]+)")


def worker_starts(job_dir: Path) -> list[tuple[str, float, float]]:
    """Every start of a worker: (its name, seconds from its agent's Start to ready, the Start's time),
    from the line its main writes in its log (engine/elastic_process.py)."""
    return [(m.group(1), float(m.group(2)), float(m.group(3)))
            for log in sorted((job_dir / "logs").glob("worker-*")) for m in READY_LINE.finditer(log.read_text(errors="replace"))]


def throughput(run: Any, fallback: bool) -> dict[str, Any]:
    """Median samples/s per phase, by time: before the failure, after recovery (until a join's plan),
    after the join. The first step of each generation is dropped (it warms up: new groups, a replay);
    a re-form at the start (a collective timeout on a loaded machine) is a generation like any other."""
    failure = run.first("failure")
    join = next((p for p in run.kind("plan") if p["reason"] == "join"), None)
    t_fail = failure["t"] if failure else float("inf")
    t_join = join["t"] if join else float("inf")
    seen: set[int] = set()
    phases_: dict[str, list[float]] = {}
    after = "after_restart" if fallback else "degraded"
    for e in run.kind("step"):
        if e["generation"] not in seen:
            seen.add(e["generation"])
            continue
        label = "before" if e["t"] < t_fail else after if e["t"] < t_join else "after_join"
        phases_.setdefault(label, []).append(e["samples_per_s"])
    out: dict[str, Any] = {}
    for label, values in phases_.items():
        out[label] = median(values)
        out[f"{label}_steps"] = len(values)
    out["reforms"] = len(run.kind("reform"))
    return out


def bench(model: str, args: argparse.Namespace, root: Path, console: Console) -> dict[str, Any]:
    steps, gbs, mbs, kill_step = SETTINGS[model]
    steps = args.steps or steps
    kill_step = args.kill_step if args.kill_step is not None else kill_step
    cache = root / "templates_cache"
    collective = args.collective_timeout or COLLECTIVE_S[model]
    timeouts = {} if collective is None else {
        "collective_timeout": collective, "heartbeat_lease": max(3.0, 1.5 * collective),
        "step_timeout": max(60.0, 10 * collective), "reconfiguration_timeout": max(120.0, 20 * collective)}
    base = recipe_dict(size=model, nodes=4, steps=steps, global_batch=gbs, microbatch=mbs, f=1,
                       checkpoint_interval=args.checkpoint_interval, name=f"rec-{model}", **timeouts)
    memory = budget_for_span(base, 2, cache, args.estimate, root / "recipes", fs=[0, 1])
    fault = {**KILLED, "step": kill_step}
    from oobleck_slurm.models import gpt_config
    from oobleck_slurm.models.gpt.model import build_layers

    cfg = gpt_config(model)
    params = sum(p.numel() for layer in build_layers(cfg, 0) for p in layer.parameters())
    result: dict[str, Any] = {"model": model, "parameters": params, "steps": steps, "kill_step": kill_step,
                              "global_batch": gbs, "microbatch": mbs, "memory_per_device": memory,
                              "checkpoint_interval": args.checkpoint_interval, "replacement": args.replacement,
                              "fault": fault, "timeouts": timeouts}
    for mode, f, replacement in (("memory", 0, args.replacement), ("checkpoint", 1, "none")):
        if mode not in args.modes:
            continue
        d = {**base, "cluster": {**base["cluster"], "memory_per_device": memory},
             "fault_tolerance": {**base["fault_tolerance"], "f": f, "replacement": replacement}}
        console.print(f"  {model} {mode}: f={f}, replacement {replacement}, memory_per_device {memory} ...")
        run = run_job(d, root, cache, faults=[fault], estimate=args.estimate, timeout=args.timeout)
        ph = phases(run)
        if mode == "memory" and ph["fallback"]:
            raise SystemExit(f"job {run.job.path}: memory mode fell back to a checkpoint: "
                             f"{run.first('checkpoint_fallback')}")
        if mode == "checkpoint" and not ph["fallback"]:
            raise SystemExit(f"job {run.job.path}: checkpoint mode recovered in memory (no checkpoint_fallback)")
        plans = run.kind("plan")
        result[mode] = {**ph, "throughput": throughput(run, ph["fallback"]), "wall_s": run.wall_s,
                        "plan_before": plan_summary(plans[0]), "plan_after": [plan_summary(p) for p in plans[1:]],
                        "job": str(run.job.path)}
        if mode == "checkpoint":
            cks = [e for e in run.kind("checkpoint") if e.get("seconds") is not None]
            result[mode]["checkpoint_write_s"] = max((e["seconds"] for e in cks), default=None)
        console.print(f"  {model} {mode}: recovery {ph['recovery_s']:.2f} s (job {run.wall_s:.0f} s)")
    if "memory" not in result or "checkpoint" not in result:
        return result
    if result["memory"]["plan_before"] != result["checkpoint"]["plan_before"]:
        console.print(f"[yellow]warning[/]: the plans before the failure differ: "
                      f"{result['memory']['plan_before']} vs {result['checkpoint']['plan_before']}")
    result["speedup"] = result["checkpoint"]["recovery_s"] / result["memory"]["recovery_s"]
    return result


def fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def print_tables(results: list[dict[str, Any]], console: Console) -> None:
    t = Table(title="recovery from a SIGKILL mid-step (seconds)")
    for col in ("model", "params", "mode", "recovery (minus one step)", "detection", "replan", "group rebuild",
                "state copy (MB)", "replay", "resumed total", "start->ready (first; restart)", "join",
                "join: start->ready", "join: start->training"):
        t.add_column(col)
    for r in results:
        for mode in [x for x in ("memory", "checkpoint") if x in r]:
            m = r[mode]
            copy = f"{fmt(m.get('state_copy_s'))} ({m.get('state_copy_bytes', 0) / 1e6:.1f})" if mode == "memory" else "-"
            t.add_row(r["model"], f"{r['parameters'] / 1e6:.1f}M", mode,
                      f"{m['recovery_s']:.2f} ({m['overhead_s']:.2f})", fmt(m.get("detection_s")),
                      fmt(m.get("replan_s")), fmt(m.get("group_rebuild_s")), copy, fmt(m.get("replay_s")),
                      fmt(m.get("resumed_total_s"), ".2f"), f"{fmt(m.get('start_to_ready_s'), '.2f')}; {fmt(m.get('restart_start_to_ready_s'), '.2f')}",
                      fmt(m.get("join_s"), ".2f"), fmt(m.get("join_start_to_ready_s"), ".2f"),
                      fmt(m.get("join_start_to_training_s"), ".2f"))
        if "speedup" in r:
            t.add_row(r["model"], "", "ratio", f"checkpoint-restart / memory = {r['speedup']:.1f}x", *[""] * 10)
    console.print(t)
    t2 = Table(title="samples/s, medians (first step of each generation dropped; steps counted)")
    for col in ("model", "mode", "before failure", "after recovery", "after join", "plan before", "plan after"):
        t2.add_column(col)
    for r in results:
        for mode in [x for x in ("memory", "checkpoint") if x in r]:
            m, tp = r[mode], r[mode]["throughput"]
            after = "after_restart" if mode == "checkpoint" else "degraded"
            cell = lambda k, tp=tp: f"{fmt(tp.get(k), '.2f')} ({tp.get(k + '_steps', 0)})"  # noqa: E731
            t2.add_row(r["model"], mode, cell("before"), cell(after),
                       cell("after_join") if "after_join" in tp else "-",
                       m["plan_before"], "\n".join(m["plan_after"]))
    console.print(t2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", default="tiny", help="comma-separated: tiny, 100m (default tiny)")
    ap.add_argument("--steps", type=int, default=None, help="steps per job (default: tiny 40, 100m 10)")
    ap.add_argument("--kill-step", type=int, default=None, help="step in which node2 is killed (default: tiny 3, 100m 4)")
    ap.add_argument("--modes", default="memory,checkpoint", help="which jobs to run (comma-separated)")
    ap.add_argument("--checkpoint-interval", type=int, default=2, help="steps between checkpoints (both jobs)")
    ap.add_argument("--replacement", choices=["none", "request"], default="none",
                    help="memory mode: request a replacement node after the failure (throughput after the join)")
    ap.add_argument("--collective-timeout", type=float, default=None,
                    help="fault_tolerance.collective_timeout in s (default: tiny the recipe's 2 s, 100m 30 s)")
    ap.add_argument("--estimate", default="A100-40",
                    help="plan with this GPU's estimated profile (the same plans on every machine)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per job before it is killed")
    ap.add_argument("--keep-jobs", action="store_true", help="keep the job folders (paths in the JSON)")
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args()
    models = [m for m in args.model.split(",") if m]
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or set(args.modes) - {"memory", "checkpoint"}:
        ap.error("--modes: memory and/or checkpoint")
    for m in models:
        if m not in SETTINGS:
            ap.error(f"--model {m}: one of {', '.join(SETTINGS)}")
    if args.checkpoint_interval < 1:
        ap.error("--checkpoint-interval must be >= 1 (the checkpoint-restart job restarts from one)")
    console = Console(width=None if sys.stdout.isatty() else 200)
    root = Path(tempfile.mkdtemp(prefix="bench_recovery_"))
    try:
        results = [bench(m, args, root, console) for m in models]
    finally:
        if not args.keep_jobs:
            shutil.rmtree(root, ignore_errors=True)
    print_tables(results, console)
    out = {"machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()},
           "results": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
