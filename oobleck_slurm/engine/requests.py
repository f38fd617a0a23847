"""Requests to every worker of a running job through its folder: profiler traces and hang dumps.

A command or the supervisor writes a small JSON file into the job folder (atomically: a whole file or
none); each worker's `RequestWatcher` thread looks at the files every `request_poll` seconds. Nothing
is on the training path: the training loop reads an attribute the thread sets.

    trace_request.json  {"id": n, "start": a, "stop": b}: every worker traces steps [a, b) with
                        torch.profiler and writes traces/<n>/<worker>-rank<r>.json (Chrome trace format,
                        chrome://tracing or Perfetto). `profile-steps JOB --steps N` places a and b
                        (commands/profile_steps.py).
    dump_request.json   {"id": n, "reason": "..."}: every worker writes, at once and from the watcher
                        thread (the training thread may be stuck), dumps/<n>/<worker>.stacks.txt (every
                        thread's Python stack, faulthandler) and flight_recorder/rank_<r> (torch's
                        flight recorder, when the process records: `FLIGHT_RECORDER_ENV`), then
                        <worker>.done.
                        The supervisor writes it on a hang verdict and waits for the .done files
                        (`request_dumps`) before it stops the hung node.
    corrupt_request.json {"id": n, "workers": [...]}: a drill (`kill-node --how corrupt`): the named
                        worker flips one bit of a parameter at its next step's start, as the "corrupt"
                        fault does (engine/faults.py), for the replicas' checksums to find.

The flight recorder: torch keeps the last `TORCH_FR_BUFFER_SIZE` collectives and p2p operations of
every process group (NCCL, and gloo since torch 2.7), read with `_dump_fr_trace` (a pickle; torch's
`torch.distributed.flight_recorder` analyser reads a folder of them). The variable must be set before
the process groups are built: the worker sets it at start (`enable_flight_recorder`).
"""

from __future__ import annotations

import faulthandler
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oobleck_slurm.cluster.jobdir import CORRUPT_REQUEST_FILE, DUMP_REQUEST_FILE, DUMPS_DIR, TRACE_REQUEST_FILE

FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"  # torch < 2.7 read TORCH_NCCL_TRACE_BUFFER_SIZE (set too)
LEGACY_FLIGHT_RECORDER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
FLIGHT_RECORDER_DIR = "flight_recorder"  # in a dump's folder: rank_<r>, one per rank


def file_stem(worker: str) -> str:
    """A worker id ("node2:0") as a file name part ("node2-0")."""
    return worker.replace(":", "-")


def write_request(path: Path, **fields: Any) -> int:
    """Write a request with the next id (one more than the file's last); returns the id."""
    try:
        last = int(json.loads(path.read_text()).get("id", 0))
    except (FileNotFoundError, ValueError, AttributeError):
        last = 0
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"id": last + 1, **fields}))
    os.replace(tmp, path)
    return last + 1


def read_request(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return value if isinstance(value, dict) and isinstance(value.get("id"), int) else None


@dataclass(frozen=True)
class TraceRequest:
    id: int
    start: int
    stop: int


def enable_flight_recorder(entries: int) -> None:
    """Make torch record the last `entries` collectives of every process group built from now on (0:
    not at all); a value already in the environment (the user's) wins."""
    if entries > 0 and FLIGHT_RECORDER_ENV not in os.environ and LEGACY_FLIGHT_RECORDER_ENV not in os.environ:
        os.environ[FLIGHT_RECORDER_ENV] = str(entries)


def flight_recorder_dump() -> bytes | None:
    """torch's flight recorder as a pickle, or None when this process records nothing (the variable
    unset) or this torch has no recorder."""
    if not int(os.environ.get(FLIGHT_RECORDER_ENV) or os.environ.get(LEGACY_FLIGHT_RECORDER_ENV) or 0):
        return None
    import torch._C._distributed_c10d as c10d

    # torch >= 2.7: `_dump_fr_trace` (NCCL and gloo); before: `_dump_nccl_trace`, CUDA builds only
    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    return bytes(dump()) if dump is not None else None


def dump_worker(folder: Path, worker: str, rank: int | None) -> list[Path]:
    """Write this process's dumps into `folder` (stacks, flight recorder), then its .done marker."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = file_stem(worker)
    written = []
    stacks = folder / f"{stem}.stacks.txt"
    with open(stacks, "w") as f:
        f.write(f"# worker {worker} rank {rank} pid {os.getpid()} at {time.time():.3f}\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    written.append(stacks)
    try:
        trace = flight_recorder_dump()
    except Exception as err:  # a recorder that fails must not keep the other dumps from being used
        (folder / f"{stem}.fr.error").write_text(f"{type(err).__name__}: {err}\n")
        trace = None
    if trace is not None:
        # named as torch's analyser expects: one file per rank, <prefix>_<rank>, alone in its folder
        fr = folder / FLIGHT_RECORDER_DIR / (f"rank_{rank}" if rank is not None else f"rank_{stem}")
        fr.parent.mkdir(exist_ok=True)
        fr.write_bytes(trace)
        written.append(fr)
    (folder / f"{stem}.done").write_text(json.dumps({"rank": rank, "files": [str(p.relative_to(folder))
                                                                            for p in written]}))
    return written


class RequestWatcher:
    """A worker's view of the job folder's requests, kept by a daemon thread: `trace` is the latest
    trace request (the training loop reads it between steps); dump requests are served at once."""

    def __init__(self, job_dir: Path, worker: str, poll: float, rank: Callable[[], int | None],
                 on_dump: Callable[[int, list[Path]], None] | None = None) -> None:
        self.job_dir, self.worker, self.poll, self.rank, self.on_dump = job_dir, worker, poll, rank, on_dump
        self.trace: TraceRequest | None = None
        # requests older than this worker are not for it (a requeued job's folder keeps the last ones)
        self._dumped = self._id(DUMP_REQUEST_FILE)
        self._traced = self._id(TRACE_REQUEST_FILE)
        self._corrupt_seen = self._id(CORRUPT_REQUEST_FILE)
        self._corrupt = threading.Event()  # a corrupt drill for this worker, not yet carried out
        threading.Thread(target=self._run, name="requests", daemon=True).start()

    def _id(self, name: str) -> int:
        request = read_request(self.job_dir / name)
        return request["id"] if request else 0

    def _run(self) -> None:
        while True:
            self.check()
            time.sleep(self.poll)

    def check(self) -> None:
        dump = read_request(self.job_dir / DUMP_REQUEST_FILE)
        if dump is not None and dump["id"] > self._dumped:
            self._dumped = dump["id"]
            written = dump_worker(self.job_dir / DUMPS_DIR / str(dump["id"]), self.worker, self.rank())
            if self.on_dump is not None:
                self.on_dump(dump["id"], written)
        corrupt = read_request(self.job_dir / CORRUPT_REQUEST_FILE)
        if corrupt is not None and corrupt["id"] > self._corrupt_seen:
            self._corrupt_seen = corrupt["id"]
            if self.worker in (corrupt.get("workers") or ()):
                self._corrupt.set()
        trace = read_request(self.job_dir / TRACE_REQUEST_FILE)
        if (trace is not None and trace["id"] > self._traced and isinstance(trace.get("start"), int)
                and isinstance(trace.get("stop"), int)):
            self._traced = trace["id"]
            self.trace = TraceRequest(trace["id"], trace["start"], trace["stop"])


    def take_corrupt(self) -> bool:
        """True once for each corrupt drill addressed to this worker (the training loop asks between
        steps, so the flip lands between an update and the next step's check)."""
        if not self._corrupt.is_set():
            return False
        self._corrupt.clear()
        return True


def request_dumps(job_dir: Path, reason: str, workers: Sequence[str], wait: float,
                  poll: float = 0.05) -> tuple[int, list[str], list[str]]:
    """Ask every worker for its dumps and wait up to `wait` s for `workers`' .done markers; returns
    (request id, workers that dumped, workers that did not)."""
    ident = write_request(job_dir / DUMP_REQUEST_FILE, reason=reason, t=time.time())
    folder = job_dir / DUMPS_DIR / str(ident)
    deadline = time.time() + wait
    while True:
        done = [w for w in workers if (folder / f"{file_stem(w)}.done").exists()]
        if len(done) == len(workers) or time.time() >= deadline:
            return ident, done, [w for w in workers if w not in done]
        time.sleep(poll)


class StepTracer:
    """torch.profiler over the steps of a trace request, on this worker; the trace is written when its
    last step is done or when the worker leaves the generation (a failure cut the window short)."""

    def __init__(self, traces: Path, worker: str, cuda: bool,
                 on_written: Callable[[Path, int, int], None] | None = None) -> None:
        self.traces, self.worker, self.cuda, self.on_written = traces, worker, cuda, on_written
        self._profiler: Any = None
        self._request: TraceRequest | None = None
        self._first = self._steps = 0
        self._done: set[int] = set()

    def before_step(self, step: int, request: TraceRequest | None) -> None:
        if self._profiler is not None or request is None or request.id in self._done:
            return
        if request.start <= step < request.stop:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._profiler = profile(activities=activities)
            self._profiler.start()
            self._request, self._first, self._steps = request, step, 0
        elif step >= request.stop:  # seen too late: nothing of the window is left
            self._done.add(request.id)

    def after_step(self, step: int, rank: int) -> None:
        if self._profiler is None:
            return
        self._steps += 1
        assert self._request is not None
        if step + 1 >= self._request.stop:
            self.finish(rank)

    def finish(self, rank: int) -> Path | None:
        """Stop and write the trace of the steps traced so far (None when none is running)."""
        if self._profiler is None or self._request is None:
            return None
        profiler, request, self._profiler = self._profiler, self._request, None
        self._done.add(request.id)
        profiler.stop()
        folder = self.traces / str(request.id)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{file_stem(self.worker)}-rank{rank}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        profiler.export_chrome_trace(str(tmp))
        os.replace(tmp, path)  # a reader never sees half a trace
        if self.on_written is not None:
            self.on_written(path, self._first, self._first + self._steps)
        return path
