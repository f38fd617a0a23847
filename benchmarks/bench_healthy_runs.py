"""False alarms on healthy jobs: the embedded default (5 local virtual nodes, heterogeneous pipelines of 3
and 2 nodes), its drill left out, run RUNS times with live detection as shipped but for `detection.evict: true` (the default reports
only; eviction is what a false alarm would cost), stragglers rebalanced. Counts machines flagged from
their metrics (every such flag evicts a healthy node), straggler decisions, and runs that did not end
cleanly.

    python benchmarks/bench_healthy_runs.py [--runs 10] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from _jobs import default_recipe_dict, run_job

REPO = Path(__file__).resolve().parents[1]


def fmt(value: float | None, width: int = 9) -> str:
    return f"{'-' if value is None else f'{value:.2f}':>{width}}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--cache", type=Path, default=REPO / "templates_cache")
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "bench_healthy_runs.json")
    args = parser.parse_args()
    if args.runs < 1 or args.steps < 1:
        parser.error("--runs and --steps must be >= 1")
    work = Path(tempfile.mkdtemp(prefix="bench-healthy-"))  # kept: a flagged run's folder explains it
    rows = []
    t0 = time.time()
    print(f"{'run':>3}  {'exit':>4}  {'wall s':>7}  {'flagged':>7}  {'evicted':>7}  {'straggler':>9}  "
          f"{'max score':>9}  {'max slowdown':>12}  job")
    for i in range(args.runs):
        d = default_recipe_dict(steps=args.steps)
        d.setdefault("detection", {})["evict"] = True  # measure what eviction would do (default: report)
        try:
            run = run_job(d, work / f"run{i + 1}", args.cache, estimate=None)  # as `submit` plans it
            exit_code, events, wall, job = run.exit_code, run.events, run.wall_s, str(run.job.path)
        except SystemExit as e:  # the job failed: counted, its folder named
            exit_code, events, wall, job = 1, [], float("nan"), str(e).splitlines()[0]
        flagged = [e for e in events if e["kind"] == "faulty_node"]
        health = [e for e in events if e["kind"] == "health"]
        row = {"run": i + 1, "exit": exit_code, "wall_s": round(wall, 1), "flagged": len(flagged),
               "max_score": max((s for e in health for s in e["scores"].values()), default=None),
               "max_slowdown": max((s for e in health for s in e["slowdowns"].values()), default=None),
               "evicted": sum(1 for e in flagged if e.get("action") == "evict"),
               "stragglers": [{"action": e["action"], "nodes": e["nodes"]} for e in events if e["kind"] == "straggler"],
               "flags": [{"node": e["node"], "metrics": e.get("metrics"), "score": e.get("score")} for e in flagged],
               "job": job}
        rows.append(row)
        print(f"{i + 1:>3}  {exit_code:>4}  {wall:>7.1f}  {row['flagged']:>7}  {row['evicted']:>7}  "
              f"{len(row['stragglers']):>9}  {fmt(row['max_score'])}  {fmt(row['max_slowdown'], 12)}  {job}", flush=True)
    walls = [r["wall_s"] for r in rows if r["exit"] == 0]
    summary = {"runs": len(rows), "clean_exits": sum(1 for r in rows if r["exit"] == 0),
               "runs_with_a_flag": sum(1 for r in rows if r["flagged"]),
               "evictions": sum(r["evicted"] for r in rows),
               "straggler_decisions": sum(len(r["stragglers"]) for r in rows),
               "max_score": max((r["max_score"] for r in rows if r["max_score"] is not None), default=None),
               "max_slowdown": max((r["max_slowdown"] for r in rows if r["max_slowdown"] is not None), default=None),
               "wall_s_median": statistics.median(walls) if walls else None}
    print(f"\n{summary['clean_exits']}/{summary['runs']} runs ended cleanly; {summary['evictions']} eviction(s), "
          f"{summary['runs_with_a_flag']} run(s) with a flagged machine, {summary['straggler_decisions']} straggler "
          f"decision(s); highest score {summary['max_score']} (threshold 4.5), highest slowdown "
          f"{summary['max_slowdown']} (threshold 1.3); median wall {summary['wall_s_median']} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                 "load": os.getloadavg()},
                                     "seconds": time.time() - t0, "summary": summary, "runs": rows}, indent=1))
    print(f"wrote {args.json} ({time.time() - t0:.0f} s)")
    return 0 if summary["clean_exits"] == len(rows) and summary["evictions"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
