"""The loss-spike policy's cost (training.loss_spike): step time with it off and on, and the decision's.

    python benchmarks/bench_loss_spike.py [--nodes 4] [--size tiny] [--steps 30] [--rounds 2] [--drop 5]

With the policy on, every rank reduces the step's loss over the world before the commit point (one
more all-reduce of one float64 per step; engine/worker.py) and judges it (engine/loss_spike.py, pure
Python over the window). Jobs run the way `submit` runs them (benchmarks/_jobs.py: supervisor, agents,
one worker process per node, gloo), data parallel, off and on in alternation `--rounds` times; the
figure is the median of rank 0's per-step seconds (the first `--drop` steps left out), and the
overhead the median over rounds of (on - off) / off. The decision alone is timed too: `judge` on a
full window of 100 losses. Writes benchmarks/results/bench_loss_spike.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from _jobs import drop_warmup, median, recipe_dict, run_job

from oobleck_slurm.engine.loss_spike import SpikePolicy, SpikeState, judge

ROOT = Path(__file__).resolve().parent.parent


def judge_seconds(window: int = 100, calls: int = 2000) -> float:
    """Seconds per `judge` call with a full window (the policy's steady state)."""
    policy = SpikePolicy(window=window, warmup=window)
    state = SpikeState(step=0, losses=tuple(2.0 + 0.01 * (i % 7) for i in range(window)))
    t0 = time.perf_counter()
    for step in range(calls):
        _, state = judge(policy, state, step, 2.0 + 0.01 * (step % 5))
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--drop", type=int, default=5)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_loss_spike-"))
    cache = root / "templates_cache"
    medians: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for mode in ("off", "on"):
            d = recipe_dict(size=args.size, nodes=args.nodes, steps=args.steps, global_batch=4 * args.nodes,
                            microbatch=2, name=f"spike-{mode}")
            if mode == "on":  # judged from the third step on: the steps measured all pay for the decision
                d["training"]["loss_spike"] = {"sigma": 6.0, "window": 100, "warmup": 2, "max_consecutive": 5}
            run = run_job(d, root, cache)
            steps = sorted(run.kind("step"), key=lambda e: e["step"])
            seconds = drop_warmup([e["seconds"] for e in steps], args.drop)
            assert mode == "off" or all("loss_threshold" in e for e in steps[2:]), "the policy did not judge"
            medians[mode].append(median(seconds) or 0.0)
            print(f"{mode}: median step {medians[mode][-1] * 1000:.1f} ms", flush=True)
    overheads = [(on - off) / off for off, on in zip(medians["off"], medians["on"], strict=True) if off > 0]
    result = {
        "nodes": args.nodes, "size": args.size, "steps": args.steps, "drop": args.drop, "rounds": args.rounds,
        "median_step_s": medians, "overhead": statistics.median(overheads) if overheads else None,
        "overheads": overheads, "judge_s_window_100": judge_seconds(),
    }
    out = ROOT / "benchmarks" / "results" / "bench_loss_spike.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"overhead (median of rounds): {100 * (result['overhead'] or 0):+.2f}% of step time; "
          f"judge with a window of 100: {result['judge_s_window_100'] * 1e6:.1f} us; {out}")


if __name__ == "__main__":
    main()
