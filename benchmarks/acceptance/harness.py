"""What every section of the GPU acceptance run shares: the run's settings, the helpers (stores,
workers, plans, state comparisons, the GPU's name and peak), the child processes (each section, and
each rank of a multi-rank section, runs in a process of its own, started as
`python benchmarks/gpu_acceptance.py --_child KIND CONFIG`), and a section's `Record`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from oobleck_slurm.engine.abort import AbortableGeneration
    from oobleck_slurm.engine.layout import ExecPlan
    from oobleck_slurm.engine.spec import JobSpec
    from oobleck_slurm.engine.worker import Worker
    from oobleck_slurm.planning import Plan, Profile


# The GPU machine runs this from a copy of the repository, where the package is not installed:
# the oobleck_slurm imports (inside the functions, after this) and the child processes find it here.
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# The command's entry point: children are started through it (run_children), as the command was.
ENTRY = REPO / "benchmarks" / "gpu_acceptance.py"

RESULTS = ENTRY.parent / "results" / "gpu_acceptance.json"
SCHEMA = 1
SECTIONS: dict[str, str] = {
    "a": "abort_rebuild",
    "b": "throughput",
    "c": "memory",
    "d": "copy_bandwidth",
    "e": "two_ranks_one_gpu",
    "f": "two_stage_pipeline",
    "g": "wide_stages",
    "h": "job_kill_drill",
}
GPU_ONLY = frozenset({"e"})  # skipped without a GPU, without starting their process (seconds of imports)
# NCCL 2.30 added NCCL_MULTI_RANK_GPU_ENABLE (docs/nccl.md, "Several ranks on one GPU"); 2.30.0 is the
# floor we test for, and a 2.30 release that still refuses shows up as section f's error.
NCCL_MULTI_RANK_MIN = (2, 30, 0)
MULTI_RANK_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}


class Skipped(Exception):
    """A section that cannot run on this machine (no GPU, one GPU and an NCCL without multi-rank
    support); the message is the reason recorded in the JSON."""


@dataclass(frozen=True)
class Settings:
    """Shapes and bounds of one run; the defaults depend on the device (see `settings_from_args`)."""

    device: str  # "cuda" or "cpu"
    precision: str
    family: str  # gpt | llama
    preset: str
    n_layer: int  # transformer blocks of the slice (the preset's shape otherwise)
    microbatch_size: int
    microbatches: int
    steps: int  # (a): steps of each training run
    warmup: int  # (b), (c): steps left out of the medians
    timed: int  # (b): timed steps
    pipe_microbatch_size: int  # (f)
    pipe_microbatches: int
    pipe_steps: int
    memory_d_model: int | None  # (c): a wider model on a CPU (RSS only sees tensors of >= 64 KiB)
    copy_mb: int  # (d)
    compile_budget_s: float
    child_timeout_s: float
    section_timeout_s: float
    threads: int  # CPU: torch threads (1, as each CPU worker of a job)
    gpu: str | None  # GPU name for the peak FLOP/s (default: detected)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    @property
    def backend(self) -> str:
        return "nccl" if self.cuda else "gloo"

    def job(self, steps: int, microbatch_size: int | None = None, microbatches: int | None = None,
            d_model: int | None = None, deterministic: bool = False) -> JobSpec:
        """The job every section trains: a slice of the preset's shape, random tokens (no I/O),
        AdamW, global-norm clipping, warm-up then cosine. `deterministic`: the recipe's
        `training.deterministic`, for the sections that compare runs bitwise (a, f)."""
        from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
        from oobleck_slurm.models import preset

        mbs = microbatch_size or self.microbatch_size
        m = microbatches or self.microbatches
        shape = {"n_layer": self.n_layer, **({"d_model": d_model} if d_model else {})}
        return JobSpec(
            model=ModelSpec(preset(self.family, self.preset, **shape)),
            data=DataSpec("random", num_samples=max(64, 4 * mbs * m), seed=1),
            optim=OptimSpec("adamw", lr=1e-3, weight_decay=0.1),
            train=TrainSpec(steps=steps, microbatch_size=mbs, num_microbatches=m, seed=0, grad_clip=1.0,
                            warmup_steps=1, precision=self.precision, deterministic=deterministic),
            backend=self.backend,
        )

    def timeouts(self) -> Any:
        from oobleck_slurm.timeouts import JobTimeouts

        # A 1.3B-shape step and its group builds take seconds on a GPU; nothing here should wait long
        # (a hang is found by the child timeout, the engine's own timeouts only bound it).
        if self.cuda:
            return JobTimeouts(store_timeout=60.0, connect_timeout=180.0, collective_timeout=120.0, step_timeout=600.0,
                               run_timeout=3600.0)
        return JobTimeouts(store_timeout=60.0, connect_timeout=60.0, collective_timeout=60.0, step_timeout=300.0,
                           run_timeout=3600.0)


def settings_from_args(args: argparse.Namespace) -> Settings:
    cuda = args.device == "cuda"

    def pick(value: Any, on_cuda: Any, on_cpu: Any) -> Any:
        return value if value is not None else (on_cuda if cuda else on_cpu)

    from oobleck_slurm.models import PRESETS

    presets = PRESETS[args.family]
    preset = pick(args.preset, {"gpt": "1.3b", "llama": "3.2-1b"}[args.family], "tiny")
    if preset not in presets:
        raise SystemExit(f"--preset {preset!r}: known {args.family} presets are {', '.join(presets)}")
    return Settings(
        device=args.device,
        precision=pick(args.precision, "bf16", "fp32"),
        family=args.family,
        preset=preset,
        n_layer=pick(args.layers, 4, presets[preset].n_layer),
        microbatch_size=pick(args.microbatch_size, 4, 2),
        microbatches=pick(args.microbatches, 4, 4),
        steps=pick(args.steps, 6, 6),
        warmup=pick(args.warmup, 3, 2),
        timed=pick(args.timed_steps, 20, 5),
        # 3 x 2048 tokens x 2048 x 4 bytes: ~50 MB crosses the stage boundary per microbatch on a GPU.
        pipe_microbatch_size=pick(args.pipe_microbatch_size, 3, 2),
        pipe_microbatches=pick(args.pipe_microbatches, 8, 4),
        pipe_steps=pick(args.pipe_steps, 3, 3),
        # With glibc returning freed memory to the OS (oobleck_slurm/peak_memory.py), RSS follows tensors of
        # >= 64 KiB only: most of `tiny`'s are smaller, so on a CPU section c measures d_model 256.
        memory_d_model=pick(args.memory_d_model, None, 256),
        copy_mb=pick(args.copy_mb, 256, 64),
        # Worst case on a GPU: one section hangs for its whole timeout while the others take their
        # ~8 minutes: still within 25 minutes. The child and compile bounds fit inside a section's.
        compile_budget_s=pick(args.compile_budget, 420.0, 90.0),
        child_timeout_s=pick(args.child_timeout, 240.0, 120.0),
        section_timeout_s=pick(args.section_timeout, 900.0, 300.0),
        threads=pick(args.threads, torch.get_num_threads(), 1),
        gpu=args.gpu,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


_LIVE_STORES: list[dist.TCPStore] = []  # kept for the process's life: generations' watcher threads hold clients


def master_store() -> dist.TCPStore:
    """A TCPStore hosted by this process (the supervisor's role in a job: it never trains)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
    _LIVE_STORES.append(store)
    return store


def release(gen: Any) -> None:
    """Let go of a generation as elastic_process lets go of an old one (`Generation.release`: its groups
    dropped by a reaper thread, NCCL communicators aborted there), not through destructors on this
    thread when the last reference goes."""
    getattr(gen, "release", lambda: None)()


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def start_worker(s: Settings, job: JobSpec, plan: ExecPlan, store: dist.Store, *, number: int = 0, rank: int = 0,
                 world: int = 1, on_wait: Callable[[], None] | None = None,
                 device: torch.device | None = None) -> tuple[Worker, AbortableGeneration]:
    """A Worker on generation `number` built as the worker process builds it (abortable, helper
    thread, NCCL groups connected eagerly on the device), with its layers from the seed."""
    from oobleck_slurm.engine.abort import build_generation
    from oobleck_slurm.engine.worker import Worker

    device = device or s.torch_device
    worker = Worker(job, rank, device)
    gen = build_generation(store, number, rank, world, plan, s.timeouts(), job.backend, on_wait, device)
    worker.adopt(plan, gen, "seed")
    return worker, gen


def snapshot(worker: Worker) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer-state tensor the worker holds, as CPU copies, by layer key."""
    from oobleck_slurm.optim import optimizer_state_tensors

    out: dict[str, torch.Tensor] = {}
    for i in sorted(worker.layers):
        key = worker.keys[i]
        for name, p in worker.layers[i].named_parameters():
            out[f"{key}/param/{name}"] = p.detach().cpu().clone()
        for name, t in optimizer_state_tensors(worker.optimizers[i]).items():
            out[f"{key}/state/{name}"] = t.detach().cpu().clone()
    return out


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Bitwise comparison of two snapshots: the names that differ and the largest difference."""
    differ = [k for k in a if k in b and not torch.equal(a[k], b[k])]
    missing = sorted(set(a) ^ set(b))
    worst = 0.0
    for k in differ:
        worst = max(worst, float((a[k].double() - b[k].double()).abs().max()))
    return {"tensors": len(a), "equal": not differ and not missing, "differing": len(differ),
            "differing_names": differ[:10], "missing_names": missing[:10], "max_abs_diff": worst}


@contextlib.contextmanager
def reproducible(s: Settings) -> Iterator[list[str]]:
    """Around runs compared bitwise, whose jobs set `training.deterministic` (the worker then makes every
    kernel deterministic, as in a job): yields the warnings torch gives about nondeterminism (recorded,
    they would explain a mismatch). The first GPU run, warn-only, found cuDNN's attention backward
    nondeterministic: two uninterrupted runs differed by 5e-3."""
    seen: list[str] = []
    if not s.cuda:
        yield seen
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # once per place that warns
        yield seen
    seen.extend(sorted({str(w.message)[:300] for w in caught if "determinis" in str(w.message)}))


def planned(s: Settings, job: JobSpec, nodes: int) -> tuple[ExecPlan, Profile, Plan]:
    """The planner's plan for `nodes` one-device nodes (estimated profile), as the engine's ExecPlan:
    one pipeline of `nodes` stages (only the template of that size is offered)."""
    from oobleck_slurm.engine.from_planner import exec_plan
    from oobleck_slurm.planning import estimate_profile, explain_infeasible, generate_templates, instantiate

    t = job.train
    profile = estimate_profile(job.model.config, estimate_gpu(s), microbatch_size=t.microbatch_size,
                               dtype=t.precision, optimizer=job.optim.name, devices_per_node=1)
    templates = [x for x in generate_templates(profile, nodes, nodes, num_microbatches=t.num_microbatches)
                 if x.num_nodes == nodes]
    if not templates:
        raise RuntimeError(f"the planner has no {nodes}-node template: "
                           f"{explain_infeasible(profile, t.num_microbatches)}")
    ids = [f"node{i}" for i in range(nodes)]
    plan = instantiate(templates, ids, 0, t.num_microbatches, microbatch_size=t.microbatch_size, profile=profile)
    return exec_plan(plan, ids, 1), profile, plan


def detected_gpu() -> str | None:
    """The planning/gpus.py name of GPU 0 (H200 before H100, A100-80 before A100-40), or None."""
    from oobleck_slurm.planning.gpus import GPUS

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0).upper().replace(" ", "")
    for key in sorted(GPUS, key=len, reverse=True):
        base, _, mem = key.upper().partition("-")
        if base in name and (not mem or f"{mem}GB" in name):
            return key
    for key in GPUS:
        if key.upper().partition("-")[0] in name:
            return key
    return None


def estimate_gpu(s: Settings) -> str:
    """The GPU the planner's estimated profile uses: the known one, else H100. The memory terms of an
    estimate do not depend on the GPU (only its times do), so the CPU run plans with H100 too."""
    return s.gpu or (detected_gpu() if s.cuda else None) or "H100"


def peak_flops(s: Settings) -> tuple[str | None, float | None]:
    """(GPU name, peak dense bf16 FLOP/s) from planning/gpus.py; (None, None) where unknown (CPU)."""
    from oobleck_slurm.planning.gpus import gpu_spec

    if not s.cuda:
        return None, None
    name = s.gpu or detected_gpu()
    if name is None:
        return None, None
    spec = gpu_spec(name)
    return spec.name, spec.bf16_tflops * 1e12


def child_env(s: Settings, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A child's environment: the package on the path, one thread per CPU worker, and on GPUs the NCCL
    settings a node agent gives its workers (agent/main.py)."""
    from oobleck_slurm.agent.main import NCCL_WORKER_ENV

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if s.cuda:
        env.update(NCCL_WORKER_ENV)
    else:
        env["OMP_NUM_THREADS"] = str(s.threads)
    env.update(extra or {})
    return env


@dataclass
class ChildRun:
    returncode: int | None  # None: killed at the deadline
    seconds: float
    stderr_tail: str
    result: dict[str, Any] | None


def run_children(kind: str, configs: list[dict[str, Any]], env: dict[str, str], timeout_s: float,
                 folder: Path) -> list[ChildRun]:
    """Start `python gpu_acceptance.py --_child KIND CONFIG` once per config, wait for all of them at
    most `timeout_s` (then kill those left), and read each one's result file.

    A section's process ("section") leads a process group of its own, and the processes it starts
    stay in that group: once it is done, or killed, the whole group is killed, so that no rank it
    started (a hung NCCL rank holding the GPU) outlives it, even if it crashed."""
    own_group = kind == "section"
    procs = []
    t0 = time.monotonic()
    for i, config in enumerate(configs):
        cfg_path = folder / f"{kind}-{i}.json"
        config = {**config, "out": str(folder / f"{kind}-{i}.out.json")}
        cfg_path.write_text(json.dumps(config))
        err = (folder / f"{kind}-{i}.stderr").open("wb")
        proc = subprocess.Popen([sys.executable, str(ENTRY), "--_child", kind, str(cfg_path)],
                                env=env, stdout=err, stderr=subprocess.STDOUT, cwd=str(REPO),
                                start_new_session=own_group)
        procs.append((proc, err, config))
    runs = []
    for proc, err, config in procs:
        remaining = max(0.0, timeout_s - (time.monotonic() - t0))
        try:
            rc: int | None = proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            # A hang: first the child's Python stacks (faulthandler, see child_main) into its output.
            proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2)
            proc.kill()
            proc.wait()
            rc = None
        if own_group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        err.close()
        seconds = time.monotonic() - t0
        tail = Path(err.name).read_text(errors="replace")[-8000:]
        out = Path(config["out"])
        result = json.loads(out.read_text()) if out.exists() else None
        runs.append(ChildRun(rc, seconds, tail, result))
    return runs


def last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln[:400]
    return lines[-1][:400] if lines else "(no output)"


def nccl_version() -> tuple[int, ...] | None:
    if not torch.cuda.is_available():
        return None
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without NCCL
        return None
    # torch reports the NCCL it was built with (2.28.9 for 2.11 on the first H200 run, under an
    # LD_PRELOAD of 2.30.7): ask the library this process loaded (the preloaded one answers first).
    try:
        import ctypes

        loaded = ctypes.c_int()
        if ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(loaded)) == 0:
            v = loaded.value
    except OSError:
        pass
    if isinstance(v, tuple):
        return tuple(int(x) for x in v)
    # Older torch: one integer, major * 1000 + minor * 100 + patch before NCCL 2.9, major * 10000 + ... since.
    return (v // 10000, v // 100 % 100, v % 100) if v >= 10000 else (v // 1000, v // 100 % 10, v % 100)


PIPELINE_SECRET = b"acceptance" * 3 + b"!!"  # the two ranks' job secret (32 bytes), as a job folder's


def ranks_on_gpus(s: Settings, ranks: int) -> tuple[list[int], dict[str, str], str]:
    """(the CUDA device of each of `ranks` ranks, extra environment, a name) for a multi-rank run: a GPU
    each where there are enough, else all on cuda:0 with NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30;
    benchmarks/nccl/build.sh builds one for a torch wheel with an older NCCL), else Skipped."""
    n = torch.cuda.device_count()
    if n >= ranks:
        return list(range(ranks)), {}, f"nccl_{ranks}_gpus"
    v = nccl_version()
    if v is not None and v >= NCCL_MULTI_RANK_MIN:
        return [0] * ranks, dict(MULTI_RANK_ENV), f"nccl_{ranks}_ranks_on_1_gpu"
    raise Skipped(f"{n} GPU(s) and NCCL {'.'.join(map(str, v or ()))}: NCCL refuses several ranks on one device "
                  f"before {'.'.join(map(str, NCCL_MULTI_RANK_MIN))} (build one with benchmarks/nccl/build.sh and "
                  f"run with LD_PRELOAD=.nccl/lib/libnccl.so.2); {ranks} ranks need {ranks} GPUs here")


# How far a wide stage's trained model may be from one rank's, relative to the update (section g):
# the order of a gradient's sum differs, so fp32 rounding (and bf16's, larger) accumulates over the steps.
WIDE_TOLERANCE = {"fp32": 1e-3, "fp64": 1e-9, "bf16": 5e-2}


@dataclass
class Record:
    """One section's outcome: checks (name -> passed, with a message when not), results, summary."""

    key: str
    name: str
    status: str = "passed"
    reason: str | None = None
    error: str | None = None
    traceback: str | None = None
    seconds: float = 0.0
    summary: str = ""
    checks: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    results: dict[str, Any] = dataclasses.field(default_factory=dict)

    def check(self, name: str, ok: bool, message: str = "") -> None:
        self.checks[name] = {"passed": bool(ok), **({"message": message} if not ok and message else {})}
        if not ok:
            self.status = "failed"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
