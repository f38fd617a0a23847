"""What the pre-flight check adds to a job's start (local backend, docs/detection.md "Pre-flight
checks"): a tiny GPT on 4 nodes, RUNS times with `detection.preflight` on and off, alternating; each
run's time from `agents_ready` to the first step, and with the check, each member's check and the last
start verdict after `agents_ready`.

    python benchmarks/bench_preflight.py [--runs 3] [--out bench_preflight.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _jobs import median, recipe_dict, run_job


def one_run(root: Path, cache: Path, enabled: bool) -> dict[str, float | list[float]]:
    d = recipe_dict(size="tiny", nodes=4, steps=2, global_batch=16, microbatch=2, f=1)
    d["detection"] = {"preflight": {"enabled": enabled}}
    run = run_job(d, root, cache)
    ready = run.kind("agents_ready")[0]["t"]
    first = next(e["t"] for e in run.kind("step") if e["step"] == 0)
    start = [e for e in run.kind("preflight") if e["at"] == "start"]
    return {"ready_to_first_step_s": first - ready,
            "last_verdict_s": max((e["t"] for e in start), default=ready) - ready,
            "checks_s": [e["seconds"] for e in start],
            "matmul_gflops": [e["figures"].get("matmul_gflops", 0.0) for e in start]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_preflight-"))
    runs: dict[str, list[dict[str, float | list[float]]]] = {"on": [], "off": []}
    for i in range(args.runs):
        for enabled in (True, False):
            runs["on" if enabled else "off"].append(one_run(root / f"{i}-{enabled}", root / "cache", enabled))
    summary = {k: median([float(r["ready_to_first_step_s"]) for r in v]) for k, v in runs.items()}  # type: ignore[arg-type]
    result = {"runs": runs, "median_ready_to_first_step_s": summary,
              "added_s": (summary["on"] or 0.0) - (summary["off"] or 0.0)}
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
