"""A second failure during a recovery, repeated: two nodes of a live 6-node f=2 local job killed 1-76 ms
apart, ROUNDS times in one job (the replacements join between rounds). Counts stalls (no resume within
45 s, far below the 120 s reconfiguration timeout a stall would wait for), fallbacks and evictions of
healthy nodes; reports the time from the first kill to training resumed.

    python benchmarks/bench_second_failure.py [--rounds 20]

The drill itself is tests/second_failure.py (the suite runs two rounds of it).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def tests_module(stem: str) -> ModuleType:
    """tests/{stem}.py (tests/ is not a package: it goes on the path, as pytest puts it)."""
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    return importlib.import_module(stem)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--cache", type=Path, default=REPO / "templates_cache")
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "bench_second_failure.json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    drill, jobs = tests_module("second_failure"), tests_module("job_events")
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="bench-second-failure-"))  # kept: its job folder explains a failure
    rounds = []
    t0 = time.time()
    with jobs.running_job(work, drill.FAULT_TOLERANCE, args.cache, nodes=drill.NODES) as job:
        if not drill.wait_full(job):
            print(f"the job did not start on every node: see {job}", file=sys.stderr)
            return 1
        for i in range(args.rounds):
            result = drill.kill_two(job, rng)
            rounds.append(result)
            joined = result.ok and drill.wait_full(job)
            print(f"round {i + 1:>2}: {'/'.join(result.nodes):<9} gap {result.gap_ms:5.1f} ms  "
                  f"{'ok' if result.ok else 'FAILED'}  resumed "
                  f"{'-' if result.resumed_s is None else f'{result.resumed_s:.2f} s'}  recoveries {result.recoveries}"
                  f"{'' if joined or not result.ok else '  (replacements did not join)'}  {result.detail[:200]}",
                  flush=True)
            if not joined:
                break
    ok = [r for r in rounds if r.ok]
    resumed = [r.resumed_s for r in ok if r.resumed_s is not None]
    summary = {"rounds": len(rounds), "ok": len(ok), "stalls_or_failures": len(rounds) - len(ok),
               "interrupted_recoveries": sum(1 for r in ok if r.recoveries > 1),
               "resumed_s_median": statistics.median(resumed) if resumed else None,
               "resumed_s_max": max(resumed) if resumed else None}
    print(f"\n{summary['ok']}/{summary['rounds']} rounds recovered without a stall; "
          f"{summary['interrupted_recoveries']} with the second loss interrupting the first recovery; "
          f"resumed after a median {summary['resumed_s_median']} s (max {summary['resumed_s_max']} s)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                                     "seconds": time.time() - t0, "job": str(job), "summary": summary,
                                     "rounds": [r.to_json() for r in rounds]}, indent=1))
    print(f"wrote {args.json} ({time.time() - t0:.0f} s)")
    return 0 if len(ok) == args.rounds else 1


if __name__ == "__main__":
    raise SystemExit(main())
