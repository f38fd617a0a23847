"""The health check of a node before it joins: can a fresh process there run a collective with a peer,
and is it as fast as the fleet (the pre-flight measurement)?

A node that comes back (or a replacement Slurm just gave us) is not trusted blindly: its agent runs
`python -m oobleck_slurm.agent.preflight HOST PORT PREFIX TIMEOUT JOB_DIR [THREADS DEVICE DEVICES]`
(imports torch, builds a gloo group of two on the job's store, signed with the job folder's secret,
and all-reduces) while the supervisor is the other member (`health_peer`). Both check the sum.

With THREADS DEVICE DEVICES (the pre-flight check, docs/detection.md "Pre-flight checks") it then
measures, and prints its figures as one line `preflight {json}` (detection/preflight.py names them):

  link       LINK_ROUNDS round trips of LINK_BYTES each way with the supervisor over the same gloo
             group: the bandwidth of the node's TCP path to the supervisor (not the RDMA fabric that
             NCCL uses between nodes: nothing here measures that)
  matmul     on each of the node's DEVICES devices at once, MATMUL_REPS timed repetitions of about
             MATMUL_REP_S each: GPU a bf16 GEMM of GPU_MATMUL_N (CUDA events); CPU an fp32 matmul of
             CPU_MATMUL_N on THREADS threads (a worker's). The best repetition counts (a passing
             burst of load elsewhere is not the node's fault); the node's figure is its slowest device
  allreduce  on a node with >= 2 GPUs: NCCL all-reduce of ALLREDUCE_BYTES over its GPUs from this one
             process (torch.cuda.nccl), bus bandwidth as nccl-tests defines it (x 2(n-1)/n)

The supervisor judges the figures (detection/preflight.py); the node's worker starts only if admitted.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:  # torch is imported only where a check runs: the agent's module import stays light
    from torch.distributed import Store

HEALTH_VALUE = 1.0 + 2.0**-20  # not a round number: a garbled reduction does not pass by luck
FIGURES_LINE = "preflight "  # the child's stdout line that carries its figures (JSON after it)
# Sized for well under a second in all (measured: docs/detection.md), and a slowed node (the `slow`
# drill stops it 60 ms out of every 90) cannot pass a repetition between two of its pauses.
LINK_BYTES = 8 << 20
LINK_ROUNDS = 3
MATMUL_REP_S = 0.1
MATMUL_REPS = 3
CPU_MATMUL_N = 256
GPU_MATMUL_N = 8192
ALLREDUCE_BYTES = 64 << 20
ALLREDUCE_REPS = 5


def _allreduce(store: Store, prefix: str, rank: int, timeout_s: float, link: bool = False) -> tuple[float, float | None]:
    """The checked sum and, with `link`, the best link bandwidth in MiB/s (both ranks run the rounds)."""
    import torch

    from oobleck_slurm.engine.comm import make_group

    timeout = dt.timedelta(seconds=timeout_s)
    pg = make_group(store, prefix, rank, 2, timeout, "gloo", timeout)
    t = torch.full((1024,), HEALTH_VALUE, dtype=torch.float64)
    pg.allreduce([t]).wait(timeout)
    if not link:
        return float(t[0]), None
    buf = torch.zeros(LINK_BYTES // 4, dtype=torch.float32)
    best = math.inf
    for _ in range(LINK_ROUNDS):  # a round trip: the supervisor's send, then the node's
        t0 = time.perf_counter()
        if rank == 0:
            pg.send([buf], 1, 0).wait(timeout)
            pg.recv([buf], 1, 0).wait(timeout)
        else:
            pg.recv([buf], 0, 0).wait(timeout)
            pg.send([buf], 0, 0).wait(timeout)
        best = min(best, time.perf_counter() - t0)
    return float(t[0]), 2 * LINK_BYTES / best / 2**20


def health_peer(store: Store, prefix: str, timeout_s: float, link: bool = False) -> bool:
    """The supervisor's side (rank 0); True when the sum is right. With `link`, it also serves the
    node's link measurement (the node times it)."""
    return _allreduce(store, prefix, 0, timeout_s, link)[0] == 2 * HEALTH_VALUE


def runqueue_waits(all_threads: bool = True) -> dict[str, int]:
    """Each thread of this process (else only the calling one): the nanoseconds it spent runnable but
    waiting for a CPU (Linux's schedstat; empty where there is none)."""
    waits = {}
    try:
        for task in Path("/proc/self/task").iterdir() if all_threads else [Path("/proc/thread-self")]:
            try:
                waits[task.name] = int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue
    except OSError:
        pass
    return waits


def waited_s(before: dict[str, int], after: dict[str, int]) -> float:
    """The longest run-queue wait of a thread seen in both readings, between them (the process's
    other threads sleep: a mean would dilute the computing threads' wait)."""
    return max((after[t] - before[t] for t in after if t in before), default=0) / 1e9


def cpu_matmul_gflops(threads: int) -> float:
    """The best of MATMUL_REPS repetitions of fp32 matmuls on `threads` threads, GFLOP/s.

    A repetition's time is its wall time less what its threads waited for a CPU (schedstat): other
    processes on the machine (the local backend's virtual nodes share one, the tests share it with
    more) take CPUs from it, which says nothing of the node; time off the CPU for any other reason (a
    stopped process, the `slow` drill; a throttled or broken core computes less per second) counts."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(CPU_MATMUL_N, CPU_MATMUL_N), torch.randn(CPU_MATMUL_N, CPU_MATMUL_N)
    out = torch.empty_like(a)
    torch.mm(a, b, out=out)  # warm up (allocations, the BLAS's threads)
    best = 0.0
    for _ in range(MATMUL_REPS):
        # One thread: the matmul runs on this one (the waits of the process's others are not its own)
        count, t0, waits = 0, time.perf_counter(), runqueue_waits(threads > 1)
        while (elapsed := time.perf_counter() - t0) < MATMUL_REP_S:
            torch.mm(a, b, out=out)
            count += 1
        busy = max(elapsed - waited_s(waits, runqueue_waits(threads > 1)), elapsed / 100)  # bounds a bad reading
        best = max(best, count * 2 * CPU_MATMUL_N**3 / busy)
    return best / 1e9


def gpu_matmul_gflops(devices: int) -> list[float]:
    """Each of the first `devices` GPUs' best bf16 GEMM throughput, GFLOP/s, measured at once."""
    import torch

    n, flops = GPU_MATMUL_N, 2 * GPU_MATMUL_N**3
    mats = [(torch.randn(n, n, dtype=torch.bfloat16, device=f"cuda:{d}"),
             torch.randn(n, n, dtype=torch.bfloat16, device=f"cuda:{d}")) for d in range(devices)]
    counts = []
    for d, (a, b) in enumerate(mats):  # calibrate: how many GEMMs make a repetition of MATMUL_REP_S
        with torch.cuda.device(d):
            torch.mm(a, b)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.mm(a, b)
            end.record()
            end.synchronize()
            counts.append(max(1, round(MATMUL_REP_S * 1e3 / max(start.elapsed_time(end), 1e-3))))
    best = [0.0] * devices
    for _ in range(MATMUL_REPS):
        events = []
        for d, (a, b) in enumerate(mats):  # every device's repetition queued before any is awaited
            with torch.cuda.device(d):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(counts[d]):
                    torch.mm(a, b)
                end.record()
                events.append((start, end))
        for d, (start, end) in enumerate(events):
            end.synchronize()
            best[d] = max(best[d], counts[d] * flops / (start.elapsed_time(end) / 1e3))
    return [b / 1e9 for b in best]


def nccl_allreduce_gib_s(devices: int) -> float:
    """Bus bandwidth of an in-process NCCL all-reduce over the first `devices` GPUs, GiB/s (best of
    ALLREDUCE_REPS)."""
    import torch
    import torch.cuda.nccl as nccl

    tensors = [torch.ones(ALLREDUCE_BYTES // 2, dtype=torch.bfloat16, device=f"cuda:{d}") for d in range(devices)]
    nccl.all_reduce(tensors)  # warm up: NCCL's communicator is built here
    for d in range(devices):
        torch.cuda.synchronize(d)
    best = math.inf
    for _ in range(ALLREDUCE_REPS):
        t0 = time.perf_counter()
        nccl.all_reduce(tensors)
        for d in range(devices):
            torch.cuda.synchronize(d)
        best = min(best, time.perf_counter() - t0)
    return ALLREDUCE_BYTES * 2 * (devices - 1) / devices / best / 2**30


def measure(threads: int, device: str, devices: int, link_mib_s: float | None) -> dict[str, float]:
    """The node's figures (detection/preflight.py names them)."""
    from oobleck_slurm.detection.preflight import ALLREDUCE, LINK, MATMUL

    figures: dict[str, float] = {} if link_mib_s is None else {LINK: link_mib_s}
    if device == "cuda":
        figures[MATMUL] = min(gpu_matmul_gflops(devices))
        if devices >= 2:
            figures[ALLREDUCE] = nccl_allreduce_gib_s(devices)
    else:
        figures[MATMUL] = cpu_matmul_gflops(threads)
    return figures


def parse_figures(output: str) -> tuple[dict[str, float], str]:
    """The figures a check printed (empty if none) and the rest of its output."""
    figures: dict[str, float] = {}
    rest = []
    for line in output.splitlines():
        if line.startswith(FIGURES_LINE):
            try:
                data = json.loads(line[len(FIGURES_LINE):])
            except ValueError:
                data = None
            if isinstance(data, dict):
                figures = {str(k): float(v) for k, v in data.items() if isinstance(v, int | float)}
                continue
        rest.append(line)
    return figures, "\n".join(rest)


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    """The check; its verdict is the exit code, its figures and failure go to `out` (stdout)."""
    args = sys.argv[1:] if argv is None else argv
    out = out if out is not None else sys.stdout
    if len(args) not in (5, 8):
        print("usage: python -m oobleck_slurm.agent.preflight HOST PORT PREFIX TIMEOUT JOB_DIR [THREADS DEVICE DEVICES]",
              file=sys.stderr)
        return 2
    import torch

    from oobleck_slurm.cluster.jobdir import load_secret
    from oobleck_slurm.protocol.events import EventLog, events_path
    from oobleck_slurm.protocol.signed_store import connect

    torch.set_num_threads(1)
    host, port, prefix, timeout_s, job_dir = args[0], int(args[1]), args[2], float(args[3]), args[4]
    try:
        store = connect(host, port, dt.timedelta(seconds=timeout_s), load_secret(job_dir),
                        EventLog(events_path(job_dir)), f"health check {prefix}")
        value, link = _allreduce(store, prefix, 1, timeout_s, link=len(args) == 8)
        figures = measure(int(args[5]), args[6], int(args[7]), link) if len(args) == 8 else None
    except Exception as err:  # noqa: BLE001 - the verdict is the exit code; the message is the detail
        print(f"health check failed: {type(err).__name__}: {err}", file=out)
        return 1
    if value != 2 * HEALTH_VALUE:
        print(f"health check failed: all-reduce gave {value!r}, expected {2 * HEALTH_VALUE!r}", file=out)
        return 1
    if figures is not None:
        print(FIGURES_LINE + json.dumps(figures), file=out)
    print("ok", file=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
