"""The local backend: virtual nodes are worker processes on this machine, and `run_elastic_local`,
which hosts the store, runs the coordinator and returns what the run produced.

The coordinator does not know about processes: `LocalNodes` is its `NodeBackend` (start a node's
worker, report exits, kill -9). A Slurm backend replaces it with agents on real nodes.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from oobleck_slurm.engine.batches import open_dataset
from oobleck_slurm.engine.comm import Timeouts
from oobleck_slurm.engine.spec import JobSpec
from oobleck_slurm.events import EventLog, events_path, read_events
from oobleck_slurm.planning import Plan
from oobleck_slurm.planning.templates import PipelineTemplate
from oobleck_slurm.supervisor.coordinator import Coordinator, CoordinatorConfig, CoordinatorError

LOG_TAIL_CHARS = 3000


class LocalNodes:
    """One `python -m oobleck_slurm.engine.elastic_process` per virtual node."""

    def __init__(self, job_dir: Path) -> None:
        self.job_dir = job_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Any] = {}
        self.started_at: dict[str, float] = {}
        self._new = 0
        (job_dir / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, node: str) -> None:
        if node in self.procs and self.procs[node].poll() is None:
            raise RuntimeError(f"node {node} already runs a worker (pid {self.procs[node].pid})")
        log = open(self.job_dir / "logs" / f"node{node}.log", "ab")
        self.logs[node] = log
        self.procs[node] = subprocess.Popen(
            [sys.executable, "-m", "oobleck_slurm.engine.elastic_process", str(self.job_dir), node],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
        self.started_at[node] = time.time()

    def exited(self) -> dict[str, int]:
        out = {}
        for node, p in list(self.procs.items()):
            code = p.poll()
            if code is not None:
                out[node] = code
                del self.procs[node]
                self.logs.pop(node).close()
        return out

    def stop(self, nodes: Sequence[str]) -> None:
        for node in nodes:
            p = self.procs.pop(node, None)
            if p is not None:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                p.wait()
                self.logs.pop(node).close()

    def kill(self, node: str) -> float:
        """SIGKILL a node's worker now (tests and benchmarks); returns the kill time."""
        t = time.time()
        self.procs[node].send_signal(signal.SIGKILL)
        return t

    def new_node(self) -> str | None:
        self._new += 1
        return f"r{self._new}"

    def close(self) -> None:
        self.stop(list(self.procs))

    def log_tail(self, node: str) -> str:
        try:
            return (self.job_dir / "logs" / f"node{node}.log").read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except FileNotFoundError:
            return "(no log)"


@dataclass
class ElasticRun:
    job_dir: Path
    events: list[dict[str, Any]]
    params: dict[str, dict[str, dict[str, torch.Tensor]]]  # node -> layer key -> name -> tensor
    seconds: float

    def kind(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]

    def losses(self) -> dict[int, float]:
        """The last reported loss of each step (a replayed step reports again)."""
        return {e["step"]: e["loss"] for e in self.kind("step")}


def run_elastic_local(job: JobSpec, plan: Plan, templates: Sequence[PipelineTemplate],
                      job_dir: str | os.PathLike[str], *, f: int, timeouts: Timeouts = Timeouts(),
                      reconfiguration_timeout: float = 60.0, replacement: bool = False,
                      checkpoint_interval: int = 0, mode: str = "memory",
                      layer_bytes: Sequence[int] | None = None, error_grace: float = 3.0) -> ElasticRun:
    """Train `job` on local virtual nodes (one worker process each) under `plan`, recovering from
    failures without checkpoints (mode "memory") or by checkpoint-restart (mode "checkpoint").
    Faults are injected through job.extra["faults"] (see engine/elastic_process.py). A collective
    error that no loss explains within `error_grace` re-forms the members; one that has not left the
    aborted generation within `timeouts.step` is hung (see coordinator.py)."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    if mode not in ("memory", "checkpoint"):
        raise ValueError(f"mode must be 'memory' or 'checkpoint', got {mode!r}")
    if mode == "checkpoint" and checkpoint_interval <= 0:
        raise ValueError("mode 'checkpoint' needs checkpoint_interval >= 1")
    open_dataset(job.data, job.model.gpt.seq_len, job.model.gpt.vocab_size)  # bad data: fail here
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=dt.timedelta(seconds=timeouts.store))
    ckpt_dir = str(job_dir / "checkpoints") if checkpoint_interval > 0 else ""
    (job_dir / "job.json").write_text(job.to_json())
    (job_dir / "elastic.json").write_text(json.dumps({
        "host": "127.0.0.1", "port": store.port, "timeouts": asdict(timeouts),
        "reconfiguration_timeout": reconfiguration_timeout, "checkpoint_interval": checkpoint_interval,
        "checkpoint_dir": ckpt_dir}))
    log = EventLog(events_path(job_dir))
    nodes = LocalNodes(job_dir)
    config = CoordinatorConfig(f=f, reconfiguration_timeout=reconfiguration_timeout, run_timeout=timeouts.run,
                               replacement=replacement, mode=mode, checkpoint_dir=ckpt_dir,
                               error_grace=error_grace, leave_timeout=timeouts.step)
    coord = Coordinator(store, nodes, templates, plan, job.model.keys(), log, config, layer_bytes)
    t0 = time.time()
    try:
        coord.start()
        coord.run()
    except Exception as e:
        tails = "\n".join(f"--- node {n} ---\n{nodes.log_tail(n)}" for n in coord.members)
        raise CoordinatorError(f"{e}\nworker logs end:\n{tails}") from e
    finally:
        nodes.close()
        log.close()
    params = {}
    for path in sorted((job_dir / "params").glob("node*.pt")) if (job_dir / "params").exists() else []:
        params[path.stem[4:]] = torch.load(path, weights_only=True)
    return ElasticRun(job_dir, read_events(events_path(job_dir)), params, time.time() - t0)
