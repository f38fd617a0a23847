"""The supervisor's loss survived, measured (local backend, docs/failover.md): a tiny GPT on 4 nodes,
the supervisor killed with SIGKILL in steady training (a recipe drill), RUNS times; each run's time
from the kill to the standby's takeover and to training resumed, and the training time lost (the
kill-to-resume gap less the median step, since no step is replayed), side by side with the same job
restarted from its last checkpoint (a requeue: a fresh supervisor, agents and workers, the checkpoint
loaded), and whether every run kept the failure-free trajectory.

    python benchmarks/bench_failover.py [--runs 5] [--out bench_failover.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from _jobs import median, recipe_dict, run_job

REPO = Path(__file__).resolve().parents[1]
KILL_STEP = 6


def one_run(root: Path, cache: Path, steps: int) -> dict[str, float]:
    d = recipe_dict(size="tiny", nodes=4, steps=steps, global_batch=16, microbatch=2, f=1)
    d["drills"] = [{"step": KILL_STEP, "how": "supervisor"}]
    run = run_job(d, root, cache)
    kill = next(e["t"] for e in run.kind("drill") if e["how"] == "supervisor")
    (takeover,) = run.kind("takeover")
    resumed = next(e for e in run.kind("resumed") if e["t"] > kill)
    step_s = median([e["seconds"] for e in run.kind("step") if e["step"] < KILL_STEP]) or 0.0
    losses = run.losses()
    return {"takeover_s": takeover["t"] - kill, "resumed_s": resumed["t"] - kill,
            "lost_s": max(0.0, resumed["t"] - kill - step_s), "lease_age_s": takeover["lease_age"],
            "step_s": step_s, "every_step_once": float(sorted(losses) == list(range(steps)))}


def restart_run(root: Path, cache: Path, steps: int) -> float:
    """Checkpoint-restart of the same job: from the job's start to its first step after a restart that
    loads the checkpoint of KILL_STEP (a second job started from that checkpoint), less the first job."""
    d = recipe_dict(size="tiny", nodes=4, steps=KILL_STEP, global_batch=16, microbatch=2, f=1)
    first = run_job(d, root, cache)
    t0 = time.time()
    again = recipe_dict(size="tiny", nodes=4, steps=steps, global_batch=16, microbatch=2, f=1)
    from _jobs import load
    from jobrun import start_and_wait

    from oobleck_slurm.submission import prepare_job

    job = prepare_job(load(again, root / "recipes"), cache_dir=cache, estimate_gpu="A100-40", job_root=root / "jobs")
    # the requeue: the new job's folder holds the first one's final checkpoint and its requeue marker
    (job.checkpoints).mkdir(parents=True, exist_ok=True)
    import shutil

    shutil.copytree(first.job.checkpoints / f"step{KILL_STEP}", job.checkpoints / f"step{KILL_STEP}")
    job.requeue_marker.write_text("bench")
    run = start_and_wait(job, 600)
    first_step = next(e["t"] for e in run.kind("step"))
    return first_step - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--cache", type=Path, default=REPO / "templates_cache")
    parser.add_argument("--out", type=Path, default=Path("bench_failover.json"))
    args = parser.parse_args()
    runs, restarts = [], []
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
        for i in range(args.runs):
            runs.append(one_run(Path(tmp) / f"run{i}", args.cache, args.steps))
            restarts.append(restart_run(Path(tmp) / f"restart{i}", args.cache, args.steps))
            r = runs[-1]
            print(f"run {i + 1}: takeover {r['takeover_s']:.2f} s, resumed {r['resumed_s']:.2f} s after the kill "
                  f"(lease {r['lease_age_s']:.2f} s old), lost {r['lost_s']:.2f} s; checkpoint-restart "
                  f"{restarts[-1]:.2f} s", flush=True)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    restart = statistics.median(restarts)
    print(f"\n| supervisor killed, tiny GPT, 4 nodes, {args.runs} runs | median | max |")
    print("|---|---|---|")
    for key, label in (("takeover_s", "kill -> standby's takeover"), ("resumed_s", "kill -> training resumed"),
                       ("lost_s", "training time lost")):
        print(f"| {label} | {med[key]:.2f} s | {max(r[key] for r in runs):.2f} s |")
    print(f"| checkpoint-restart, start -> first step | {restart:.2f} s | {max(restarts):.2f} s |")
    print(f"| failover / checkpoint-restart | {med['resumed_s'] / restart:.2f}x | |")
    ok = all(r["every_step_once"] for r in runs)
    print(f"every run trained every step once: {ok}; goal kill -> resumed < 5 s: {med['resumed_s'] < 5}")
    args.out.write_text(json.dumps({"runs": runs, "restarts_s": restarts, "median": med, "restart_median_s": restart,
                                    "host": platform.node()}, indent=2))
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
