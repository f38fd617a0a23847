"""The loss-spike policy's cost (training.loss_spike): step time with it off and on, and the decision's.

    python benchmarks/bench_loss_spike.py [--nodes 4] [--size tiny] [--steps 30] [--rounds 2] [--drop 5]
                                          [--paired-steps 60] [--only paired]

With the policy on, every rank reduces the step's loss over the world before the commit point (one
more all-reduce of one float64 per step; engine/worker.py) and judges it (engine/loss_spike.py, pure
Python over the window). Jobs run the way `submit` runs them (benchmarks/_jobs.py: supervisor, agents,
one worker process per node, gloo), data parallel, off and on in alternation `--rounds` times; the
figure is the median of rank 0's per-step seconds (the first `--drop` steps left out), and the
overhead the median over rounds of (on - off) / off. What the policy adds is timed alone too: `judge`
on a full window of 100 losses, and an all-reduce of one float64 over `--nodes` gloo ranks.

Jobs in turn meet whatever else the machine runs between them (on a shared machine, more than the
policy costs), so a paired figure comes first: `--nodes` ranks as threads of one process on real
gloo groups (tests/rank_threads.py, the engine's `Worker` as the jobs run it), data parallel, the
policy off on even steps and on on odd ones (a full window of 100 losses, a sigma no loss reaches:
every step updates), each step's time the slowest rank's, and a control run with it off throughout
(the same figure then measures the machine's noise); the overhead is the median over the odd
steps of (on - off) / off, off the mean of its two neighbours. Writes benchmarks/results/bench_loss_spike.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _jobs import drop_warmup, median, recipe_dict, run_job

from oobleck_slurm.engine.loss_spike import SpikePolicy, SpikeState, judge

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from exec_plans import make_plan  # noqa: E402 - tests/exec_plans.py
from rank_threads import on_ranks  # noqa: E402 - tests/rank_threads.py

ROOT = Path(__file__).resolve().parent.parent


def judge_seconds(window: int = 100, calls: int = 2000) -> float:
    """Seconds per `judge` call with a full window (the policy's steady state)."""
    policy = SpikePolicy(window=window, warmup=window)
    state = SpikeState(step=0, losses=tuple(2.0 + 0.01 * (i % 7) for i in range(window)))
    t0 = time.perf_counter()
    for step in range(calls):
        _, state = judge(policy, state, step, 2.0 + 0.01 * (step % 5))
    return (time.perf_counter() - t0) / calls


def paired(ranks: int, size: str, steps: int, control: bool = False) -> dict[str, float | list[float]]:
    """Step seconds with the policy off (even steps) and on (odd steps) in one run: see the module doc."""
    import torch
    import torch.distributed as dist

    from oobleck_slurm.engine.abort import AbortableGeneration
    from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
    from oobleck_slurm.engine.worker import Worker
    from oobleck_slurm.models import gpt_config
    from oobleck_slurm.timeouts import JobTimeouts

    policy = SpikePolicy(sigma=1e9, window=100, warmup=2, max_consecutive=5)
    window = tuple(2.0 + 0.01 * (i % 7) for i in range(policy.window))
    job = JobSpec(model=ModelSpec(gpt_config(size)), data=DataSpec("random", num_samples=4096, seed=1),
                  optim=OptimSpec("adamw", lr=1e-4), train=TrainSpec(steps=steps, microbatch_size=2,
                                                                    num_microbatches=2 * ranks, loss_spike=policy))
    plan = make_plan(job.model.config.num_layers, [[0, job.model.config.num_layers]] * ranks, [2] * ranks)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
    timeouts = JobTimeouts(collective_timeout=120.0, step_timeout=600.0)
    torch.set_num_threads(1)

    def rank(r: int) -> list[float]:
        store = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=dt.timedelta(seconds=60))
        worker = Worker(job, r)
        worker.adopt(plan, AbortableGeneration(store, 0, r, ranks, plan, timeouts))
        seconds = []
        for step in range(steps):
            on = step % 2 and not control  # the same on every rank; control: off throughout (the noise floor)
            worker.spike = SpikeState(step=step, losses=window) if on else None
            t0 = time.perf_counter()
            worker.train_step()
            seconds.append(time.perf_counter() - t0)
        return seconds

    per_rank = on_ranks(ranks, rank, join_s=3600.0)
    step_s = [max(s) for s in zip(*per_rank, strict=True)][2:]  # the slowest rank's; the first pair warms up
    # each step with the policy on against the mean of its two neighbours (off): a drift cancels
    pairs = [((step_s[i - 1] + step_s[i + 1]) / 2, step_s[i]) for i in range(1, len(step_s) - 1, 2)]
    return {"off_s": statistics.median(off for off, _ in pairs), "on_s": statistics.median(on for _, on in pairs),
            "overhead": statistics.median((on - off) / off for off, on in pairs),
            "pairs": len(pairs), "ranks": ranks, "size": size, "control": control}


def allreduce_seconds(ranks: int, reps: int = 300) -> float:
    """The median seconds of what the policy adds to a step's collectives: an all-reduce of one float64
    over `ranks` gloo ranks (threads of this process), waited for."""
    import torch
    import torch.distributed as dist

    store = dist.HashStore()

    def rank(r: int) -> list[float]:
        group = dist.ProcessGroupGloo(dist.PrefixStore("allreduce", store), r, ranks, dt.timedelta(seconds=120))
        value = torch.zeros(1, dtype=torch.float64)
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            group.allreduce([value]).wait()
            out.append(time.perf_counter() - t0)
        return out

    return statistics.median(max(s) for s in zip(*on_ranks(ranks, rank, join_s=600.0), strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--drop", type=int, default=5)
    ap.add_argument("--paired-steps", type=int, default=60)
    ap.add_argument("--only", choices=["paired"], default=None)
    args = ap.parse_args()
    control = paired(args.nodes, args.size, args.paired_steps, control=True)
    print(f"control (off on every step): {100 * control['overhead']:+.2f}% (median of pairs)", flush=True)
    pair = paired(args.nodes, args.size, args.paired_steps)
    print(f"paired ({args.nodes} gloo ranks as threads, {pair['pairs']} pairs of steps): off {pair['off_s'] * 1000:.1f} ms, "
          f"on {pair['on_s'] * 1000:.1f} ms, overhead {100 * pair['overhead']:+.2f}% (median of pairs)", flush=True)
    result: dict = {"paired": pair, "control": control, "judge_s_window_100": judge_seconds(),
                    "allreduce_s": allreduce_seconds(args.nodes)}
    print(f"one all-reduce of one float64 over {args.nodes} gloo ranks: {result['allreduce_s'] * 1e3:.2f} ms; "
          f"judge with a window of 100: {result['judge_s_window_100'] * 1e6:.1f} us", flush=True)
    out = ROOT / "benchmarks" / "results" / "bench_loss_spike.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.only == "paired":
        out.write_text(json.dumps(result, indent=1))
        return
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
    result["jobs"] = {
        "nodes": args.nodes, "size": args.size, "steps": args.steps, "drop": args.drop, "rounds": args.rounds,
        "median_step_s": medians, "overhead": statistics.median(overheads) if overheads else None,
        "overheads": overheads,
    }
    out.write_text(json.dumps(result, indent=1))
    print(f"jobs' overhead (median of rounds): {100 * (result['jobs']['overhead'] or 0):+.2f}% of step time; "
          f"judge with a window of 100: {result['judge_s_window_100'] * 1e6:.1f} us; {out}")


if __name__ == "__main__":
    main()
