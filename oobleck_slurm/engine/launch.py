"""Local launch: host the store here (a process that does no training) and run N worker processes.

`run_local` is the engine-level entry (explicit JobSpec and plans); `train_local` takes a recipe.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from oobleck_slurm.engine.batches import open_dataset
from oobleck_slurm.engine.comm import Timeouts
from oobleck_slurm.engine.layout import ExecPlan
from oobleck_slurm.engine.spec import JobSpec, load_factory
from oobleck_slurm.engine.worker import check_supported
from oobleck_slurm.events import EventLog, events_path, read_events

POLL_S = 0.05
LOG_TAIL_CHARS = 4000


class EngineError(RuntimeError):
    """A worker failed or the run timed out; the message carries the worker's log tail."""


@dataclass
class LocalRun:
    job_dir: Path
    steps: list[dict[str, Any]]  # the "step" events
    params: dict[int, dict[str, dict[str, torch.Tensor]]]  # rank -> layer key -> name -> tensor (if saved)
    seconds: float


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except FileNotFoundError:
        return "(no log)"


def run_local(job: JobSpec, plans: ExecPlan | list[tuple[int, ExecPlan]], num_workers: int,
              job_dir: str | os.PathLike[str], timeouts: Timeouts = Timeouts()) -> LocalRun:
    """Train `job` with `num_workers` local worker processes; `plans` is one plan, or
    [(from_step, plan), ...] starting at step 0 (a plan change between steps, on a new generation).
    Blocks until the workers finish; raises EngineError if one fails or the run exceeds timeouts.run.
    """
    job_dir = Path(job_dir)
    (job_dir / "logs").mkdir(parents=True, exist_ok=True)
    segments = [(0, plans)] if isinstance(plans, ExecPlan) else list(plans)
    if not segments or segments[0][0] != 0 or any(a[0] >= b[0] for a, b in zip(segments, segments[1:])):
        raise ValueError(f"plans: need [(from_step, plan), ...] starting at step 0 with increasing steps, "
                         f"got steps {[s for s, _ in segments]}")
    for from_step, plan in segments:
        bad = [r for r in plan.ranks if r >= num_workers]
        if bad:
            raise ValueError(f"plan from step {from_step} uses rank(s) {bad}, but only {num_workers} workers run")
    # Fail here, with a clear message, on what would otherwise fail in every worker.
    check_supported(job)
    if job.model.factory:
        load_factory(job.model.factory)
    open_dataset(job.data, job.model.gpt.seq_len, job.model.gpt.vocab_size)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=dt.timedelta(seconds=timeouts.store))
    (job_dir / "job.json").write_text(job.to_json())
    (job_dir / "launch.json").write_text(json.dumps({
        "host": "127.0.0.1", "port": store.port, "world_size": num_workers,
        "timeouts": asdict(timeouts),
        "segments": [{"from_step": s, "plan": p.to_json()} for s, p in segments],
    }))
    log = EventLog(events_path(job_dir))
    for g, (from_step, plan) in enumerate(segments):
        log.emit("plan", generation=g, from_step=from_step, plan=plan.to_json())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs: list[subprocess.Popen] = []
    logs = []
    t0 = time.time()
    try:
        for rank in range(num_workers):
            f = open(job_dir / "logs" / f"worker{rank}.log", "wb")
            logs.append(f)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "oobleck_slurm.engine.process", str(job_dir), str(rank)],
                stdout=f, stderr=subprocess.STDOUT, env=env,
            ))
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r = failed[0]
                log.emit("failure", rank=r, returncode=codes[r])
                raise EngineError(f"worker {r} exited with code {codes[r]}; its log "
                                  f"({job_dir}/logs/worker{r}.log) ends:\n{_tail(job_dir / 'logs' / f'worker{r}.log')}")
            if all(c == 0 for c in codes):
                break
            if time.time() - t0 > timeouts.run:
                log.emit("failure", reason="run timeout", seconds=timeouts.run)
                raise EngineError(f"local run exceeded its timeout of {timeouts.run} s")
            time.sleep(POLL_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for f in logs:
            f.close()
    seconds = time.time() - t0
    log.emit("done", seconds=seconds)
    log.close()
    params = {}
    for path in sorted((job_dir / "params").glob("rank*.pt")) if (job_dir / "params").exists() else []:
        params[int(path.stem[4:])] = torch.load(path, weights_only=True)  # tensors the workers wrote
    return LocalRun(job_dir, read_events(events_path(job_dir), "step"), params, seconds)
