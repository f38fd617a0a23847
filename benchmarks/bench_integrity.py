"""The replica-integrity check's cost (engine/integrity.py), per step, against the step's time.

    python benchmarks/bench_integrity.py [--presets tiny mini 100m] [--steps 6] [--rounds 3] [--reads 20]

Two data-parallel workers (two one-stage pipelines: every layer held twice) as threads of this process
on a real gloo world (one torch thread each), the tiny GPT's recipe shape (16 samples a step in
microbatches of 2, AdamW, fp32). For each preset:

- `checksum_s`: the median time of one worker's checksums of everything it holds (parameters and
  AdamW's two moments and step counters of every layer), the check's own work, timed alone;
- `step_off_s`, `step_on_s`: median step times with `integrity_interval` 0 and with a check every
  step (`integrity_max_cost` 0), in alternating blocks of `--steps` steps (`--rounds` blocks each): the
  check's whole cost, its payload riding on the metrics all-reduce included (2 float64 per held layer
  and rank, and one per rank for its time); on a busy machine this A/B is noisy;
- `checksum_pct`: checksum_s / step_off_s: a check's cost per checked step;
- `default_every`: the spacing the default (`integrity_interval` 1, `integrity_max_cost` 0.01) chose
  over `--default-steps` steps (steps per check), and `default_pct` = checksum_pct / default_every.

Prints a table and writes benchmarks/results/bench_integrity.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from rank_threads import on_ranks  # noqa: E402 - the tests' thread harness: ranks as threads

from oobleck_slurm.engine.abort import AbortableGeneration  # noqa: E402
from oobleck_slurm.engine.layout import ExecPlan, PipelineSpec  # noqa: E402
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec  # noqa: E402
from oobleck_slurm.engine.worker import Worker  # noqa: E402
from oobleck_slurm.models import gpt_config  # noqa: E402
from oobleck_slurm.timeouts import JobTimeouts  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bench_integrity.json"
TIMEOUTS = JobTimeouts(collective_timeout=600.0, step_timeout=1200.0)


def measure(preset: str, steps: int, rounds: int, reads: int, default_steps: int) -> dict[str, Any]:
    cfg = gpt_config(preset)
    layers = len(ModelSpec(cfg).keys())
    plan = ExecPlan(layers, 8, (PipelineSpec((0,), (0, layers), 0, 4), PipelineSpec((1,), (0, layers), 4, 4)))
    base = JobSpec(model=ModelSpec(cfg), data=DataSpec("random", num_samples=4096, seed=1),
                   optim=OptimSpec("adamw", lr=1e-3, weight_decay=0.1),
                   train=TrainSpec(steps=10**6, microbatch_size=2, num_microbatches=8, seed=0))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
    off: list[float] = []
    on: list[float] = []
    sums: list[float] = []
    params = [0]
    checks = [0]

    def rank(r: int) -> None:
        torch.set_num_threads(1)
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=dt.timedelta(seconds=60))
        worker = Worker(base, r)
        worker.adopt(plan, AbortableGeneration(client, 0, r, 2, plan, TIMEOUTS))
        worker.train_step()  # warm-up (and a step to check from)
        for _ in range(rounds):
            for interval, out in ((0, off), (1, on)):
                worker.job = replace(base, train=replace(base.train, integrity_interval=interval, integrity_max_cost=0.0))
                for _ in range(steps):
                    t = worker.train_step().seconds
                    if r == 0:
                        out.append(t)
        worker.job = base  # the defaults: a check every step unless it costs more than 1% of one
        worker.next_check = 0
        for _ in range(default_steps):
            if r == 0 and worker.next_check <= worker.step:
                checks[0] += 1
            worker.train_step()
        if r == 0 and worker.role is not None:
            params[0] = sum(p.numel() for layer in worker.layers.values() for p in layer.parameters())
            for _ in range(reads):
                t0 = time.perf_counter()
                worker._checksums(worker.role)
                sums.append(time.perf_counter() - t0)

    on_ranks(2, rank, join_s=3600.0)
    step_off, step_on, checksum_s = statistics.median(off), statistics.median(on), statistics.median(sums)
    return {"preset": preset, "layers": layers, "params": params[0], "state_bytes": params[0] * 4 * 3,
            "checksum_s": checksum_s, "step_off_s": step_off, "step_on_s": step_on,
            "checksum_pct": 100 * checksum_s / step_off, "ab_pct": 100 * (step_on - step_off) / step_off,
            "default_every": default_steps / max(1, checks[0]),
            "default_pct": 100 * checksum_s / step_off * max(1, checks[0]) / default_steps,
            "payload_bytes_per_rank": 2 * 8 * layers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "mini"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reads", type=int, default=20)
    parser.add_argument("--default-steps", type=int, default=30)
    args = parser.parse_args()
    print(f"{'preset':8} {'params':>10} {'checksum ms':>12} {'step ms':>9} {'checksum %':>11} {'A/B on-off %':>13} "
          f"{'default: steps/check':>21} {'default %':>10}", flush=True)
    rows = []
    for preset in args.presets:
        rows.append(row := measure(preset, args.steps, args.rounds, args.reads, args.default_steps))
        print(f"{row['preset']:8} {row['params']:>10} {1e3 * row['checksum_s']:>12.3f} {1e3 * row['step_off_s']:>9.1f} "
              f"{row['checksum_pct']:>11.2f} {row['ab_pct']:>13.1f} {row['default_every']:>21.1f} {row['default_pct']:>10.2f}",
              flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
