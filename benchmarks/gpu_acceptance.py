"""GPU acceptance: one command that checks the engine on one GPU, and the same code path on a CPU.

    python benchmarks/gpu_acceptance.py [--device cuda|cpu] [--out PATH] [--only a,b,...]

Written for one H100 (at most 25 minutes, `--device cuda`, bf16, slices of the 1.3B GPT shape, or
of Llama 3.2 1B with `--family llama`) and runnable on a 2-core CPU machine in under 2 minutes
(`--device cpu`, fp32, the `tiny` preset), so that the script itself is tested where no GPU is at hand (tests/benchmarks/test_gpu_acceptance.py).
Writes one JSON file (benchmarks/results/gpu_acceptance.json by default), prints a table, and exits
with 1 if any section failed (a skipped section, with its reason, does not fail the run).

Every section is independent: it runs in a process of its own (a CUDA error that sticks to a
context, an NCCL abort that crashes a process or a hang stays there), bounded by `--section-timeout`;
its error is recorded in the JSON (message and traceback, or a hung process's stacks) and the other
sections still run. The JSON is rewritten after every section. `--only a,c` runs a subset.

a  abort_rebuild   Training through the engine's real `Worker` on a one-rank plan from the planner
                   (engine/from_planner.py), on a real generation over a TCPStore (abort.py's
                   build_generation: NCCL on a GPU, gloo on the CPU). Twice the coordinator's key
                   `gen{g}/failed` arrives at a step's commit point (its last wait): the step must
                   leave with GenerationAborted, pending and not applied (on NCCL the generation's
                   communicators are aborted); then, as elastic_process.run_generation does,
                   recovery.reach_step to the coordinator's resume step, generation g+1 built in the
                   same process, the old one released, the layers kept from memory. The first time a
                   survivor had finished the step (resume at s+1: the pending step is completed with
                   no peer), the second time nobody had (resume at s: it is dropped and replayed).
                   The final parameters and optimizer state must be bitwise those of an identical
                   worker that trained the same steps without a failure (torch.equal on every
                   tensor), and so must every loss. A second uninterrupted run is the control: if it
                   differs from the first, the device is not reproducible and the comparison says
                   nothing about recovery (so the job sets `training.deterministic`, as a recipe
                   can: deterministic kernels, not warn-only, and cuBLAS's fixed workspace; on the
                   first H200 run, warn-only, cuDNN's attention backward made two runs differ).
b  throughput      tokens/s and MFU (6 * params * tokens/s / peak dense bf16 FLOP/s of
                   planning/gpus.py, "unknown" elsewhere) of the engine's step (Worker.train_step on
                   a one-stage plan: Stage forward/backward, abortable waits, per-layer optimizers)
                   against a plain PyTorch loop over the same layers and batches (torch.optim.AdamW
                   defaults), plain + fused AdamW (torch's fused kernel, CUDA or CPU), and plain +
                   fused AdamW + torch.compile (in a child process bounded by `--compile-budget`; a
                   compile that fails or overruns is skipped with its reason). Medians over timed
                   steps after warm-up, synchronised on CUDA; ratios engine / each reference.
c  memory          Peak bytes per step above a baseline taken before the layers exist
                   (oobleck_slurm/peak_memory.py: torch.cuda.max_memory_allocated on a GPU; on a CPU the
                   peak RSS, with glibc returning freed memory to the OS, which needs tensors of
                   >= 64 KiB: a wider model there, `--memory-d-model`), in a fresh process: the
                   engine's worker, the same worker with the pre-step copy the engine used to keep
                   (StepUndo, now replaced by completing pending steps: emulated, `PreStepCopy`), and
                   the plain loop (the overhead of the machinery), against the planner's stage memory
                   (cost.stage_memory, with the estimated profile and one measured here by
                   planning/measure.py profile_model; + parameter
                   and optimizer bytes for the copy). Checked where the probe counts tensors (CUDA):
                   the worker fits the budget the planner plans with (prediction / 0.9).
d  copy_bandwidth  GB/s of GPU -> pinned host, pinned host -> GPU (and pageable), GPU -> GPU on one
                   device (`--copy-mb`, 256 MB on a GPU), and the host's memcpy. On a CPU only the
                   memcpy; the others are skipped ("no GPU").
e  two_ranks_one_gpu  Two processes each build an NCCL group of 2 on cuda:0 through comm.make_group
                   (NCCL before 2.30 refuses: "Duplicate GPU detected"), then once more with
                   NCCL_MULTI_RANK_GPU_ENABLE=1. Passes if every process exits, with an error or not,
                   within `--child-timeout` (a clear error, not a hang); the messages are recorded.
                   Skipped on a CPU ("no GPU").
f  two_stage_pipeline  Two processes, a 2-stage pipeline from the planner through Worker + generation
                   on the job's signed store (NCCL's rendezvous through it), several microbatches
                   (1F1B, where NCCL p2p can deadlock), ~50 MB of activations per microbatch on a
                   GPU; needs 2 GPUs, or one GPU with an NCCL that accepts
                   NCCL_MULTI_RANK_GPU_ENABLE=1 (>= 2.30), else skipped with the reason. On a CPU the
                   same pipeline with tiny shapes twice: on plain gloo (a CPU job's groups) and on
                   gloo under NCCL's ordering rules (OOBLECK_NCCL_ORDER=1, engine/nccl_order.py).
                   Passes if both ranks exit 0 within the bound and the trained state is bitwise that
                   of a one-stage run of the same steps (the engine detaches at every layer boundary,
                   so cutting the layers into stages changes no arithmetic). A hung child's Python
                   stacks are recorded (faulthandler on SIGUSR1 before it is killed).

The environment (torch, CUDA, NCCL, device, memory) is recorded. The `submit` kill drill is not here.
NCCL children get the environment a node agent gives its workers (agent/main.py NCCL_WORKER_ENV).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import faulthandler
import gc
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from oobleck_slurm.engine.abort import AbortableGeneration
    from oobleck_slurm.engine.layout import ExecPlan
    from oobleck_slurm.engine.spec import JobSpec
    from oobleck_slurm.engine.worker import Worker
    from oobleck_slurm.planning import Plan, Profile

# The GPU machine runs this from a copy of the repository, where the package is not installed:
# the oobleck_slurm imports (inside the functions, after this) and the child processes find it here.
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESULTS = Path(__file__).parent / "results" / "gpu_acceptance.json"
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


# ---- settings -----------------------------------------------------------------------------------

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


# ---- shared helpers -----------------------------------------------------------------------------

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


# ---- child processes ----------------------------------------------------------------------------

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
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--_child", kind, str(cfg_path)],
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


def child_main(kind: str, config_path: str) -> int:
    # On SIGUSR1 (sent by run_children before it kills a hung child) every thread's stack goes to
    # stderr: the JSON then says where it hung.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    config = json.loads(Path(config_path).read_text())
    s = Settings(**config["settings"])
    if s.cuda:
        torch.cuda.set_device(int(config.get("cuda_index", 0)))
    else:
        torch.set_num_threads(s.threads)
    result: dict[str, Any]
    if kind == "compiled":
        result = child_compiled(s, config)
    elif kind == "dup_rank":
        result = child_dup_rank(s, config)
    elif kind == "pipeline":
        result = child_pipeline(s, config)
    elif kind == "stage":
        result = child_stage(s, config)
    elif kind == "memory":
        result = child_memory(s, config)
    elif kind == "section":
        result = section_main(config["key"], s).to_json()
    else:
        raise SystemExit(f"unknown child kind {kind!r}")
    Path(config["out"]).write_text(json.dumps(result, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    # As the worker process does: skip the destructors of groups that may be aborted or stuck.
    os._exit(0)


# ---- (a) training, failures, next generations, bitwise ------------------------------------------------

def run_uninterrupted(s: Settings, job: JobSpec, plan: ExecPlan) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    """The reference: every step on generation 0."""
    store = master_store()
    worker, gen = start_worker(s, job, plan, store)
    losses = {}
    while worker.step < job.train.steps:
        r = worker.train_step()
        losses[r.step] = r.loss
    release(gen)
    return snapshot(worker), losses


class FailAtCommit:
    """The coordinator's `gen{g}/failed`, set when the armed worker waits at its step's commit point
    (its first wait once it holds the step as pending: the world all-reduce of the step's metrics).
    Returns once the generation's watch has seen the key (it arrives asynchronously, as from the
    coordinator), so that this very wait raises GenerationAborted."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.gen: Any = None  # the generation the worker waits on (its number and watch)
        self.worker: Any = None
        self.armed = False

    def __call__(self) -> None:
        from oobleck_slurm.protocol import keys

        pending = self.worker.pending if self.worker is not None else None
        if not self.armed or pending is None or pending.step != self.worker.step:
            return
        self.armed = False
        self.store.set(keys.failed(self.gen.number), "gpu_acceptance: a node failed")
        deadline = time.monotonic() + 30
        while not self.gen.watch.failed():
            if time.monotonic() > deadline:
                raise RuntimeError(f"generation {self.gen.number}'s FailureWatch missed its failed key for 30 s")
            time.sleep(0.001)


def run_with_failures(s: Settings, job: JobSpec, plan: ExecPlan,
                      ) -> tuple[dict[str, torch.Tensor], dict[int, list[float]], dict[str, Any]]:
    """The same steps through two failures at the commit point, each followed by the next generation
    built in this process as elastic_process.run_generation builds it (recovery.reach_step to the
    coordinator's resume step, build_generation, release of the old generation, adopt from memory).

    1. Step k fails at its commit point on generation 0 (NCCL: the generation's communicators are
       aborted). Some survivor completed it (resume step k + 1): the worker completes its pending
       step k without any peer, and generation 1 goes on at k + 1.
    2. Step k + 2 fails the same way on generation 1, and no survivor completed it (resume step k + 2):
       the pending step is dropped and generation 2 replays k + 2.
    """
    from oobleck_slurm.engine.abort import GenerationAborted, build_generation
    from oobleck_slurm.engine.recovery import can_complete, reach_step

    store = master_store()
    fail = FailAtCommit(store)
    worker, fail.gen = start_worker(s, job, plan, store, on_wait=fail)
    fail.worker = worker
    losses: dict[int, list[float]] = {}
    events: dict[str, Any] = {}

    def train() -> None:
        r = worker.train_step()
        losses.setdefault(r.step, []).append(r.loss)

    def fail_step(name: str) -> None:
        step = worker.step
        fail.armed = True
        t0 = time.perf_counter()
        try:
            train()
            ev: dict[str, Any] = {"raised": False}
        except GenerationAborted as e:
            ev = {"raised": True, "message": str(e)}
        ev.update(step=step, seconds=time.perf_counter() - t0, step_after=worker.step,
                  pending=worker.pending.step if worker.pending is not None else None,
                  completable=can_complete(worker))
        events[name] = ev

    def next_generation(resume: int) -> None:
        old = fail.gen
        step_before = worker.step
        completed = reach_step(worker, resume)
        t0 = time.perf_counter()
        new = build_generation(store, old.number + 1, 0, 1, plan, s.timeouts(), job.backend, fail, s.torch_device)
        t1 = time.perf_counter()
        release(old)  # every member has left the old generation (elastic_process does the same)
        worker.adopt(plan, new, "memory", [])
        fail.gen = new
        events[f"generation_{new.number}"] = {
            "resume_step": resume, "step_before": step_before, "completed_pending_step": completed,
            "step_after": worker.step, "groups_s": t1 - t0, "release_and_adopt_s": time.perf_counter() - t1}

    k = 1
    while worker.step < k:
        train()
    fail_step("failure_1")
    next_generation(k + 1)  # a survivor finished step k: complete it here
    train()  # step k + 1
    fail_step("failure_2")
    next_generation(k + 2)  # nobody finished step k + 2: replay it
    while worker.step < job.train.steps:
        train()
    release(fail.gen)
    return snapshot(worker), losses, events


def section_abort_rebuild(s: Settings, rec: Record) -> None:
    job = s.job(steps=max(5, s.steps), deterministic=True)
    plan, _profile, _plan = planned(s, job, 1)
    rec.results["config"] = {"model": dataclasses.asdict(job.model.config), "steps": job.train.steps,
                             "microbatch_size": job.train.microbatch_size,
                             "microbatches": job.train.num_microbatches, "precision": job.train.precision,
                             "backend": job.backend, "plan": plan.to_json()}
    with reproducible(s) as nondeterministic:
        reference, ref_losses = run_uninterrupted(s, job, plan)
        free_device_memory()
        control, _ = run_uninterrupted(s, job, plan)
        free_device_memory()
        recovered, losses, events = run_with_failures(s, job, plan)
        free_device_memory()
    rec.results["nondeterminism_warnings"] = nondeterministic
    rec.results["events"] = events
    control_cmp = compare(reference, control)
    rec.results["control_vs_reference"] = control_cmp
    rec.check("control_run_reproducible", control_cmp["equal"],
              "two uninterrupted runs differ: the device is not bitwise reproducible here, so the recovery "
              "comparison says nothing either way" if not control_cmp["equal"] else "")
    for name in ("failure_1", "failure_2"):
        ev = events[name]
        rec.check(f"{name}_aborted_at_commit", ev["raised"] and ev["step_after"] == ev["step"]
                  and ev["pending"] == ev["step"] and ev["completable"],
                  f"expected GenerationAborted with step {ev['step']} pending and not applied, got {ev}")
    g1, g2 = events["generation_1"], events["generation_2"]
    rec.check("pending_step_completed", g1["completed_pending_step"] and g1["step_after"] == g1["resume_step"],
              f"generation 1: {g1}")
    rec.check("pending_step_dropped_and_replayed", not g2["completed_pending_step"]
              and g2["step_after"] == g2["resume_step"] and len(losses.get(g2["resume_step"], [])) == 1,
              f"generation 2: {g2}")
    final = compare(reference, recovered)
    rec.results["recovered_vs_reference"] = final
    rec.check("state_bitwise_equal", final["equal"],
              f"{final['differing']} of {final['tensors']} tensors differ (max |diff| {final['max_abs_diff']:.3g}), "
              f"e.g. {final['differing_names'][:3]}; missing {final['missing_names'][:3]}")
    loss_ok = all(v == ref_losses.get(step) for step, vs in losses.items() for v in vs)
    rec.results["losses"] = {"reference": ref_losses, "recovered": losses}
    rec.check("losses_equal_reference", loss_ok, "a step's loss differs from the uninterrupted run's")
    rec.summary = (f"{job.train.steps} steps, 2 failures at the commit point (step completed / replayed), "
                   f"generations rebuilt in {g1['groups_s']:.2f} / {g2['groups_s']:.2f} s; {final['tensors']} "
                   f"tensors {'bitwise equal' if final['equal'] else 'DIFFER'}")


# ---- (b) throughput ----------------------------------------------------------------------------------

def engine_times(s: Settings, job: JobSpec, plan: ExecPlan) -> list[float]:
    """Wall seconds of each Worker.train_step (synchronised on CUDA)."""
    store = master_store()
    worker, gen = start_worker(s, job, plan, store)
    times = []
    for _ in range(job.train.steps):
        sync(s.torch_device)
        t0 = time.perf_counter()
        worker.train_step()
        sync(s.torch_device)
        times.append(time.perf_counter() - t0)
    release(gen)
    return times


def plain_model(job: JobSpec, device: torch.device) -> torch.nn.Sequential:
    """The same layers, initialised as the engine initialises them, as one module."""
    cfg = job.model.config
    return torch.nn.Sequential(*cfg.build_layers(job.train.seed, 0, cfg.num_layers)).to(device, job.train.param_dtype)


def plain_optimizer(job: JobSpec, model: torch.nn.Module, device: torch.device, fused: bool) -> torch.optim.Optimizer:
    kw: dict[str, Any] = {}
    if fused:
        kw = {"fused": True}  # torch's fused AdamW kernel, on CUDA and on the CPU
    return torch.optim.AdamW(model.parameters(), lr=job.optim.lr, weight_decay=job.optim.weight_decay, **kw)


def plain_step(job: JobSpec, model: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
               opt: torch.optim.Optimizer, batches: Any, step: int, device: torch.device) -> None:
    """One step of the plain loop: the step's microbatches accumulated (loss / M), clip, AdamW."""
    from oobleck_slurm.models.loss import lm_loss

    t = job.train
    opt.zero_grad()
    for m in range(t.num_microbatches):
        x, y = (v.to(device) for v in batches.microbatch(step, m))
        with (torch.autocast(device.type, dtype=torch.bfloat16) if t.precision == "bf16" else contextlib.nullcontext()):
            loss = lm_loss(forward(x), y) / t.num_microbatches
        loss.backward()
    if t.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
    opt.step()


def step_batches(job: JobSpec) -> Any:
    from oobleck_slurm.engine.batches import StepBatches, open_dataset

    t = job.train
    return StepBatches(open_dataset(job.data, job.model.seq_len, job.model.vocab_size),
                       t.global_batch_size, t.microbatch_size, t.seed)


def plain_times(job: JobSpec, device: torch.device, fused: bool, compiled: bool) -> list[float]:
    model = plain_model(job, device)
    forward: Callable[[torch.Tensor], torch.Tensor] = torch.compile(model) if compiled else model
    opt = plain_optimizer(job, model, device, fused)
    batches = step_batches(job)
    times = []
    for step in range(job.train.steps):
        sync(device)
        t0 = time.perf_counter()
        plain_step(job, model, forward, opt, batches, step, device)
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def child_compiled(s: Settings, config: dict[str, Any]) -> dict[str, Any]:
    from oobleck_slurm.engine.spec import JobSpec

    job = JobSpec.from_json(config["job"])
    return {"step_s": plain_times(job, s.torch_device, fused=True, compiled=True)}


def section_throughput(s: Settings, rec: Record) -> None:
    job = s.job(steps=s.warmup + s.timed)
    plan, _profile, _plan = planned(s, job, 1)
    params = job.model.config.num_params
    cfg = job.model.config  # the first layer's parameters: the embedding (with GPT's positions)
    embedding = cfg.embedding_params if hasattr(cfg, "embedding_params") else math.prod(cfg.layer_shapes()[0][0])
    tokens = job.train.global_batch_size * job.model.seq_len
    gpu, peak = peak_flops(s)
    fused = "fused=True"
    rec.results["config"] = {"model": dataclasses.asdict(job.model.config), "parameters": params,
                             "tokens_per_step": tokens, "warmup_steps": s.warmup, "timed_steps": s.timed,
                             "precision": s.precision, "threads": torch.get_num_threads(),
                             "peak_gpu": gpu, "peak_flops": peak,
                             "peak_note": None if peak else "unknown: no GPU, or one not in planning/gpus.py"}
    runs: dict[str, dict[str, Any]] = {}

    def record(name: str, times: list[float], what: str) -> None:
        med = median(times[s.warmup:])
        row: dict[str, Any] = {"what": what, "step_s": times, "median_step_s": med, "tokens_per_s": tokens / med}
        # MFU = 6 * params * tokens/s / peak: all parameters, as the usual formula; the embedding tables
        # do no matmul, so the figure without them is given too.
        row["mfu"] = 6 * params * tokens / med / peak if peak else None
        row["mfu_without_embedding"] = 6 * (params - embedding) * tokens / med / peak if peak else None
        runs[name] = row

    record("engine", engine_times(s, job, plan),
           "Worker.train_step on a one-stage plan: Stage forward/backward, abortable waits, per-layer AdamW")
    free_device_memory()
    record("plain", plain_times(job, s.torch_device, fused=False, compiled=False), "nn.Sequential, AdamW defaults")
    free_device_memory()
    record("plain_fused", plain_times(job, s.torch_device, fused=True, compiled=False), f"nn.Sequential, AdamW {fused}")
    free_device_memory()
    compiled_note = None
    if s.compile_budget_s <= 0:
        compiled_note = "skipped: --compile-budget 0"
    else:
        with tempfile.TemporaryDirectory(prefix="gpu_acceptance_compile_") as tmp:
            (run,) = run_children("compiled", [{"settings": dataclasses.asdict(s), "job": job.to_json()}],
                                  child_env(s), s.compile_budget_s, Path(tmp))
        if run.returncode is None:
            compiled_note = (f"skipped: torch.compile did not finish {s.timed + s.warmup} steps within "
                             f"--compile-budget {s.compile_budget_s:g} s")
        elif run.returncode != 0 or run.result is None:
            compiled_note = f"skipped: torch.compile failed (exit {run.returncode}): {last_error_line(run.stderr_tail)}"
        else:
            record("plain_fused_compiled", run.result["step_s"], f"nn.Sequential under torch.compile, AdamW {fused}")
            runs["plain_fused_compiled"]["first_step_s_with_compile"] = run.result["step_s"][0]
    rec.results["compiled"] = compiled_note or "measured"
    rec.results["runs"] = runs
    ratios = {f"engine_over_{name}": runs["engine"]["tokens_per_s"] / r["tokens_per_s"]
              for name, r in runs.items() if name != "engine"}
    rec.results["ratios_tokens_per_s"] = ratios
    for name, r in runs.items():
        rec.check(f"{name}_measured", r["median_step_s"] > 0 and math.isfinite(r["median_step_s"]))
    mfu = runs["engine"]["mfu"]
    rec.summary = (f"engine {runs['engine']['tokens_per_s']:.0f} tok/s"
                   + (f", MFU {mfu:.3f}" if mfu is not None else ", MFU unknown (no peak FLOP/s)")
                   + f"; engine/plain {ratios['engine_over_plain']:.2f}"
                   + f", engine/fused {ratios['engine_over_plain_fused']:.2f}"
                   + (f", engine/compiled {ratios['engine_over_plain_fused_compiled']:.2f}"
                      if "engine_over_plain_fused_compiled" in ratios else f"; compiled {compiled_note}"))


def last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln[:400]
    return lines[-1][:400] if lines else "(no output)"


# ---- (c) memory ------------------------------------------------------------------------------------

class PreStepCopy:
    """The pre-update copy the engine kept for fault tolerance until steps interrupted at their commit
    point were completed instead of undone (recovery.StepUndo, removed): an optimizer pre-hook clones
    the layer's parameters and optimizer state before its update, kept until the next step's. Here
    only to measure what it cost (the planner: + parameter and optimizer bytes)."""

    def __init__(self, worker: Worker) -> None:
        from oobleck_slurm.optim import optimizer_state_tensors

        self.saved: dict[int, tuple[list[torch.Tensor], dict[str, torch.Tensor]]] = {}

        def hook(index: int) -> Callable[..., None]:
            def save(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                self.saved[index] = ([p.detach().clone() for p in worker.layers[index].parameters()],
                                     {n: t.clone() for n, t in optimizer_state_tensors(opt).items()})
            return save

        for index, opt in worker.optimizers.items():
            opt.register_step_pre_hook(hook(index))


class RssPeak:
    """The stand-in for oobleck_slurm/peak_memory.py's PeakMemory where that module is absent (it is the
    probe the planner's memory model is checked with; this keeps section c running without it): peak RSS
    sampled every millisecond on a CPU, torch.cuda.max_memory_allocated on a GPU."""

    def __init__(self, device: torch.device) -> None:
        import psutil

        self.device, self._proc = device, psutil.Process()
        self.method = "cuda" if device.type == "cuda" else "rss sampling (fallback)"
        self.baseline = self._now()
        self._high, self._stop = 0, threading.Event()
        self._thread: threading.Thread | None = None

    def _now(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return int(self._proc.memory_info().rss)

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._high = max(self._high, self._now())

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self.peak()
        self._high, self._stop = self._now(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        return max(self._high, self._now()) - self.baseline

    def now(self) -> int:
        return self._now() - self.baseline


PEAK_MEMORY_MODULES = ("oobleck_slurm.peak_memory", "oobleck_slurm.engine.peak_memory")  # where it has lived


def peak_memory_api() -> tuple[Callable[[torch.device], Any], Callable[[torch.device], None], dict[str, str]]:
    """(probe class, warm-up, environment of a measuring process) from the package's peak_memory module
    (PeakMemory, warm_up, MALLOC_ENV), or the stand-ins (RssPeak, nothing, nothing) without it."""
    import importlib

    for name in PEAK_MEMORY_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        return module.PeakMemory, module.warm_up, dict(module.MALLOC_ENV)
    return RssPeak, lambda device: None, {}


def measure_engine_memory(s: Settings, job: JobSpec, plan: ExecPlan, with_copy: bool) -> dict[str, Any]:
    """Peak bytes of each step of a worker (elastic_process's machinery: abortable generation), above a
    baseline taken once the process, dataset and groups exist and before any layer does."""
    from oobleck_slurm.engine.abort import build_generation
    from oobleck_slurm.engine.worker import Worker

    PeakMemory, warm_up, _ = peak_memory_api()

    store = master_store()
    worker = Worker(job, 0, s.torch_device)
    gen = build_generation(store, 0, 0, 1, plan, s.timeouts(), job.backend, None, s.torch_device)
    warm_up(s.torch_device)
    probe = PeakMemory(s.torch_device)
    worker.adopt(plan, gen, "seed")
    copy = PreStepCopy(worker) if with_copy else None
    peaks, after, reported = [], [], []
    for _ in range(job.train.steps):
        probe.start()
        r = worker.train_step()
        sync(s.torch_device)
        peaks.append(probe.peak())
        after.append(probe.now())
        reported.extend(r.peak_memory)
    del copy
    return {"per_step_bytes": peaks, "peak_bytes": max(peaks), "after_step_bytes": after,
            "worker_reported_peak_memory": reported, "probe": probe.method, "baseline_bytes": probe.baseline}


def measure_plain_memory(s: Settings, job: JobSpec) -> dict[str, Any]:
    PeakMemory, warm_up, _ = peak_memory_api()
    batches = step_batches(job)
    warm_up(s.torch_device)
    probe = PeakMemory(s.torch_device)
    model = plain_model(job, s.torch_device)
    opt = plain_optimizer(job, model, s.torch_device, fused=False)
    peaks, after = [], []
    for step in range(job.train.steps):
        probe.start()
        plain_step(job, model, model, opt, batches, step, s.torch_device)
        sync(s.torch_device)
        peaks.append(probe.peak())
        after.append(probe.now())
    return {"per_step_bytes": peaks, "peak_bytes": max(peaks), "after_step_bytes": after, "probe": probe.method,
            "baseline_bytes": probe.baseline}


def measured_profile_layers(job: JobSpec, links: dict[str, Any]) -> list[Any]:
    """Per-layer profiles measured here by the planner's own measurement (planning/measure.py
    profile_model, the submission's default profile: first GPU or the CPU), without measuring links
    (given: they play no part in memory)."""
    from oobleck_slurm.planning.measure import profile_model

    t = job.train
    profile = profile_model(job.model.config, microbatch_size=t.microbatch_size, dtype=t.precision,
                            optimizer=job.optim.name, devices_per_node=1, repeats=1, links=links)
    return list(profile.layers)


def child_memory(s: Settings, config: dict[str, Any]) -> dict[str, Any]:
    """Section c's measurements, in a fresh process (on a CPU with glibc returning freed memory to the
    OS: oobleck_slurm/peak_memory.py MALLOC_ENV), one after the other, each above its own baseline."""
    from oobleck_slurm.engine.layout import ExecPlan
    from oobleck_slurm.engine.spec import JobSpec

    job = JobSpec.from_json(config["job"])
    plan = ExecPlan.from_json(config["plan"])
    malloc_env = peak_memory_api()[2]
    out: dict[str, Any] = {"malloc_configured": bool(malloc_env) and all(os.environ.get(k) == v
                                                                         for k, v in malloc_env.items())}
    out["engine"] = measure_engine_memory(s, job, plan, with_copy=False)
    free_device_memory()
    out["engine_with_pre_step_copy"] = measure_engine_memory(s, job, plan, with_copy=True)
    free_device_memory()
    out["plain"] = measure_plain_memory(s, job)
    free_device_memory()
    from oobleck_slurm.planning import Link

    links = {name: Link(**v) for name, v in config["links"].items()}
    out["profile_layers"] = [dataclasses.asdict(x) for x in measured_profile_layers(job, links)]
    return out


def section_memory(s: Settings, rec: Record) -> None:
    from oobleck_slurm.planning import LayerProfile, cost
    from oobleck_slurm.planning.cost import USABLE_MEMORY_FRACTION

    job = s.job(steps=max(3, s.warmup + 1), d_model=s.memory_d_model)
    plan, profile, planner_plan = planned(s, job, 1)
    stage = planner_plan.pipelines[0].template.stages[0]
    with tempfile.TemporaryDirectory(prefix="gpu_acceptance_memory_") as tmp:
        (run,) = run_children("memory", [{"settings": dataclasses.asdict(s), "job": job.to_json(),
                                          "plan": plan.to_json(),
                                          "links": {k: dataclasses.asdict(v) for k, v in profile.links.items()}}],
                              child_env(s, {} if s.cuda else peak_memory_api()[2]), s.child_timeout_s, Path(tmp))
    if run.returncode != 0 or run.result is None:
        raise RuntimeError(f"the measuring process exited {run.returncode}: {last_error_line(run.stderr_tail)}\n"
                           f"{run.stderr_tail[-2000:]}")
    m = run.result
    k = cost.in_flight(job.train.num_microbatches, 1)
    measured_profile = dataclasses.replace(profile, layers=tuple(LayerProfile(**x) for x in m.pop("profile_layers")))
    profiles = {"estimate": profile, "measured_profile": measured_profile}
    predicted = {name: cost.stage_memory(p, stage.start, stage.stop, 1, k) for name, p in profiles.items()}
    terms = getattr(cost, "stage_memory_terms", None)  # the terms by name, where the planner has them
    copy = {name: float(sum(x.param_bytes + x.optimizer_bytes for x in p.layers[stage.start:stage.stop]))
            for name, p in profiles.items()}
    exact = s.cuda  # the CUDA allocator counts tensors; RSS (even with MALLOC_ENV) counts pages
    probe = m["engine"]["probe"]
    rec.results["config"] = {"model": dataclasses.asdict(job.model.config), "microbatch_size": job.train.microbatch_size,
                             "microbatches": job.train.num_microbatches, "precision": s.precision,
                             "steps": job.train.steps, "probe": probe, "probe_exact": exact,
                             "malloc_configured": m.pop("malloc_configured"), "estimate_gpu": estimate_gpu(s),
                             "profile_dtype": profile.dtype, "in_flight_microbatches": k,
                             "planner_stage_memory_bytes": stage.memory_bytes}
    rec.results["measured"] = m
    rec.results["predicted_bytes"] = {
        **{f"{name}": v for name, v in predicted.items()},
        **{f"{name}_with_pre_step_copy": v + copy[name] for name, v in predicted.items()},
    }
    if terms is not None:
        rec.results["predicted_terms"] = {name: terms(p, stage.start, stage.stop, 1, k) for name, p in profiles.items()}
    engine, with_copy, plain = (m[x]["peak_bytes"] for x in ("engine", "engine_with_pre_step_copy", "plain"))
    ratios: dict[str, float | None] = {}
    for name, v in predicted.items():
        ratios[f"engine_over_{name}"] = engine / v
        ratios[f"engine_with_pre_step_copy_over_{name}_with_pre_step_copy"] = with_copy / (v + copy[name])
    ratios["engine_over_plain"] = engine / plain if plain > 0 else None
    ratios["engine_with_pre_step_copy_over_plain"] = with_copy / plain if plain > 0 else None
    ratios["measured_copy_over_estimated_copy"] = (with_copy - engine) / copy["estimate"]
    rec.results["ratios"] = ratios
    for name in ("engine", "engine_with_pre_step_copy", "plain"):
        per_step = m[name]["per_step_bytes"]
        rec.check(f"{name}_measured", all(math.isfinite(b) for b in per_step) and m[name]["peak_bytes"] > 0)
    # A plan the planner calls feasible must fit: it plans each device to USABLE_MEMORY_FRACTION of its
    # memory, so the worker's peak may exceed the prediction by at most that margin.
    limit = 1 / USABLE_MEMORY_FRACTION
    for name, v in predicted.items():
        r = engine / v
        check = f"engine_within_{name}_budget"
        if exact:
            rec.check(check, r <= limit, f"measured {r:.2f}x the planner's prediction from the {name} "
                      f"(limit {limit:.2f}x): the planner under-predicts this stage's memory")
        else:
            rec.results.setdefault("not_checked", []).append(
                f"{check}: {r:.2f}x (limit {limit:.2f}x), not checked: {probe} counts pages, not tensors")
    mib = 2**20
    rec.summary = (f"engine {engine / mib:.1f} MiB vs planner {predicted['estimate'] / mib:.1f} (estimate) / "
                   f"{predicted['measured_profile'] / mib:.1f} (measured profile); with the old pre-step copy "
                   f"{with_copy / mib:.1f}; plain {plain / mib:.1f} MiB [{probe}]")


# ---- (d) copy bandwidth --------------------------------------------------------------------------------

def bandwidth(copy: Callable[[], Any], nbytes: int, device: torch.device, reps: int = 10) -> dict[str, float]:
    for _ in range(2):
        copy()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        copy()
        sync(device)
        times.append(time.perf_counter() - t0)
    med = median(times)
    return {"bytes": nbytes, "median_s": med, "GBps": nbytes / med / 1e9}


def section_copy_bandwidth(s: Settings, rec: Record) -> None:
    nbytes = s.copy_mb * 2**20
    src = torch.ones(nbytes, dtype=torch.uint8)
    results: dict[str, Any] = {"cpu_to_cpu": host_memcpy(src)}
    if not s.cuda:
        for name in ("gpu_to_pinned_host", "pinned_host_to_gpu", "gpu_to_pageable_host", "pageable_host_to_gpu",
                     "gpu_to_gpu"):
            results[name] = "skipped: no GPU"
    else:
        results.update(gpu_copies(src, s.torch_device))
        free_device_memory()
    rec.results["copies"] = results
    for name, r in results.items():
        if isinstance(r, dict):
            rec.check(f"{name}_positive", r["GBps"] > 0 and math.isfinite(r["GBps"]))
    rec.summary = ", ".join(f"{k} {v['GBps']:.1f} GB/s" if isinstance(v, dict) else f"{k} skipped"
                            for k, v in results.items() if isinstance(v, dict) or k == "gpu_to_gpu")


def host_memcpy(src: torch.Tensor) -> dict[str, Any]:
    dst = torch.empty_like(src)
    return {**bandwidth(lambda: dst.copy_(src), src.numel(), torch.device("cpu")), "threads": torch.get_num_threads()}


def gpu_copies(host: torch.Tensor, dev: torch.device) -> dict[str, Any]:
    """GPU <-> pinned and pageable host memory, and GPU -> GPU on one device, `host`'s size each."""
    nbytes = host.numel()
    gpu = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    gpu2 = torch.empty_like(gpu)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {
        "gpu_to_pinned_host": bandwidth(lambda: pinned.copy_(gpu, non_blocking=True), nbytes, dev),
        "pinned_host_to_gpu": bandwidth(lambda: gpu.copy_(pinned, non_blocking=True), nbytes, dev),
        "gpu_to_pageable_host": bandwidth(lambda: host.copy_(gpu), nbytes, dev),
        "pageable_host_to_gpu": bandwidth(lambda: gpu.copy_(host), nbytes, dev),
        "gpu_to_gpu": bandwidth(lambda: gpu2.copy_(gpu), nbytes, dev),
    }
    # A device-to-device copy reads and writes every byte: the memory traffic is twice the size.
    out["gpu_to_gpu"]["memory_traffic_GBps"] = 2 * out["gpu_to_gpu"]["GBps"]
    return out


# ---- (e) two ranks on one GPU --------------------------------------------------------------------------

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


def child_dup_rank(s: Settings, config: dict[str, Any]) -> dict[str, Any]:
    """One of two ranks that build an NCCL group of 2 on cuda:0 and all-reduce once."""
    from oobleck_slurm.engine.comm import make_group

    rank = int(config["rank"])
    device = torch.device("cuda", 0)
    store = dist.TCPStore("127.0.0.1", int(config["port"]), is_master=False, timeout=dt.timedelta(seconds=60))
    t0 = time.perf_counter()
    out: dict[str, Any] = {"rank": rank}
    try:
        pg = make_group(store, "dup-rank", rank, 2, dt.timedelta(seconds=30), "nccl", dt.timedelta(seconds=60), device)
        out["group_s"] = time.perf_counter() - t0
        x = torch.ones(1, device=device) * (rank + 1)
        work = pg.allreduce([x])
        deadline = time.monotonic() + 30
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError("the all-reduce did not complete within 30 s")
            time.sleep(0.001)
        work.wait()
        out["allreduce"] = float(x.item())
        out["outcome"] = "success"
    except Exception as e:  # noqa: BLE001 - the error is the measurement
        out["outcome"] = "error"
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
    out["seconds"] = time.perf_counter() - t0
    return out


def dup_rank_probe(s: Settings, extra_env: dict[str, str], folder: Path) -> dict[str, Any]:
    store = master_store()
    env = child_env(s, {"NCCL_DEBUG": "WARN", **extra_env})
    configs = [{"settings": dataclasses.asdict(s), "rank": r, "port": store.port} for r in range(2)]
    runs = run_children("dup_rank", configs, env, s.child_timeout_s, folder)
    hung = [i for i, r in enumerate(runs) if r.returncode is None]
    outcomes = [r.result.get("outcome") if r.result else "no result" for r in runs]
    nccl_lines = sorted({ln.strip()[:300] for r in runs for ln in r.stderr_tail.splitlines()
                         if "Duplicate GPU" in ln or "Multiple Ranks" in ln or "NCCL WARN" in ln
                         or "ncclInvalidUsage" in ln})
    if hung:
        outcome = "hang"
    elif all(o == "success" for o in outcomes):
        outcome = "success"
    else:
        outcome = "error"
    return {
        "env": extra_env, "outcome": outcome, "hung_ranks": hung,
        "exit_codes": [r.returncode for r in runs], "seconds": max(r.seconds for r in runs),
        "ranks": [r.result for r in runs], "nccl_messages": nccl_lines,
        "duplicate_gpu_refused": any("Duplicate GPU" in ln or "Multiple Ranks" in ln for ln in nccl_lines)
        or any("Duplicate GPU" in (r.result or {}).get("error", "") for r in runs),
        "stderr_tails": [r.stderr_tail[-1500:] for r in runs] if outcome != "success" else [],
    }


def section_two_ranks_one_gpu(s: Settings, rec: Record) -> None:
    if not s.cuda:
        raise Skipped("no GPU")
    rec.results["nccl_version"] = nccl_version()
    probes: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_acceptance_dup_") as tmp:
        for name, extra in (("default", {}), ("multi_rank_env", MULTI_RANK_ENV)):
            folder = Path(tmp) / name
            folder.mkdir()
            probes[name] = dup_rank_probe(s, extra, folder)
    rec.results["probes"] = probes
    for name, p in probes.items():
        rec.check(f"{name}_no_hang", p["outcome"] != "hang",
                  f"{p['hung_ranks']} still running after {s.child_timeout_s:g} s: a hang, not a clear error")
    d = probes["default"]
    version = ".".join(map(str, rec.results["nccl_version"] or ()))
    rec.summary = (f"NCCL {version}: {d['outcome']} in {d['seconds']:.1f} s"
                   + (" (Duplicate GPU refused)" if d["duplicate_gpu_refused"] else "")
                   + f"; with NCCL_MULTI_RANK_GPU_ENABLE=1: {probes['multi_rank_env']['outcome']}")


# ---- (f) two-stage pipeline ----------------------------------------------------------------------------

PIPELINE_SECRET = b"acceptance" * 3 + b"!!"  # the two ranks' job secret (32 bytes), as a job folder's


def child_pipeline(s: Settings, config: dict[str, Any]) -> dict[str, Any]:
    """One stage of the 2-stage pipeline: Worker + generation, `steps` steps, then its state."""
    from oobleck_slurm.engine.comm import connect_store
    from oobleck_slurm.engine.layout import ExecPlan
    from oobleck_slurm.engine.spec import JobSpec

    job = JobSpec.from_json(config["job"])
    plan = ExecPlan.from_json(config["plan"])
    rank = int(config["rank"])
    device = torch.device("cuda", int(config["cuda_index"])) if s.cuda else torch.device("cpu")
    # signed as a worker's (protocol/signed_store.py): NCCL's rendezvous goes through the Python store
    store = connect_store("127.0.0.1", int(config["port"]), s.timeouts(), PIPELINE_SECRET, None, f"rank {rank}")
    with reproducible(s) as nondeterministic:
        t0 = time.perf_counter()
        worker, gen = start_worker(s, job, plan, store, rank=rank, world=int(config.get("world", 2)), device=device)
        build_s = time.perf_counter() - t0
        steps = []
        for _ in range(job.train.steps):
            sync(device)
            t0 = time.perf_counter()
            r = worker.train_step()
            sync(device)
            steps.append({"step": r.step, "loss": r.loss, "seconds": time.perf_counter() - t0,
                          "compute_seconds": r.compute_seconds, "peak_memory": r.peak_memory})
        gen.wait(gen.world.barrier())
    torch.save(snapshot(worker), config["state"])
    return {"rank": rank, "device": str(device), "groups_and_layers_s": build_s, "steps": steps,
            "layers": sorted(worker.layers), "nondeterminism_warnings": nondeterministic}


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


def pipeline_variants(s: Settings) -> dict[str, tuple[list[int], dict[str, str]]]:
    """name -> (the CUDA device of each rank, extra environment). Raises Skipped where no second rank
    can run. On a CPU two runs: plain gloo (a CPU job's groups) and gloo under NCCL's ordering rules
    (engine/nccl_order.py: what deadlocks on NCCL deadlocks there too)."""
    if not s.cuda:
        return {"gloo": ([0, 0], {"OOBLECK_NCCL_ORDER": "0"}),
                "gloo_nccl_order": ([0, 0], {"OOBLECK_NCCL_ORDER": "1"})}
    devices, env, name = ranks_on_gpus(s, 2)
    return {name: (devices, env)}


def run_pipeline(s: Settings, job: JobSpec, plan: ExecPlan, devices: list[int], env_extra: dict[str, str],
                 rec: Record, name: str) -> dict[str, torch.Tensor] | None:
    """Every rank of `plan` (one per entry of `devices`) in child processes; checks recorded under
    `name`; the union of their trained states (None if a rank did not deliver it). A wide stage's ranks
    each hold a shard: `snapshot` gathers whole layers on every rank of the stage."""
    store = master_store()
    world = len(devices)
    with tempfile.TemporaryDirectory(prefix="gpu_acceptance_pipe_") as tmp:
        folder = Path(tmp)
        paths = [folder / f"state{r}.pt" for r in range(world)]
        configs: list[dict[str, Any]] = [
            {"settings": dataclasses.asdict(s), "job": job.to_json(), "plan": plan.to_json(), "rank": r,
             "world": world, "port": store.port, "cuda_index": devices[r], "state": str(paths[r])}
            for r in range(world)]
        free_device_memory()
        runs = run_children("pipeline", configs, child_env(s, env_extra), s.child_timeout_s, folder)
        states = [torch.load(path) if path.exists() else None for path in paths]
    out: dict[str, Any] = {"devices": devices, "env": env_extra, "ranks": [
        {"exit_code": r.returncode, "seconds": r.seconds, "result": r.result,
         **({"output_tail": r.stderr_tail[-4000:]} if r.returncode != 0 else {})} for r in runs]}
    rec.results.setdefault("runs", {})[name] = out
    hung = [i for i, r in enumerate(runs) if r.returncode is None]
    rec.check(f"{name}_no_hang", not hung, f"rank(s) {hung} still running after {s.child_timeout_s:g} s (killed; "
              f"their stacks are in results.runs.{name}.ranks[].output_tail)")
    if not hung:
        rec.check(f"{name}_exit_0", all(r.returncode == 0 for r in runs),
                  "; ".join(f"rank {i}: exit {r.returncode}: {last_error_line(r.stderr_tail)}"
                            for i, r in enumerate(runs) if r.returncode != 0))
    first, last = runs[0].result, runs[-1].result
    if first is None or last is None or any(x is None for x in states):
        return None
    losses = [x["loss"] for x in last["steps"]]  # every rank reports the step's loss (the metrics all-reduce)
    step_s = [x["seconds"] for x in first["steps"]]
    out.update(losses=losses, median_step_s=median(step_s[1:] or step_s))
    rec.check(f"{name}_losses_finite", all(math.isfinite(x) for x in losses), f"losses {losses}")
    return {k: v for st in states if st is not None for k, v in st.items()}


def section_two_stage_pipeline(s: Settings, rec: Record) -> None:
    variants = pipeline_variants(s)
    job = s.job(steps=s.pipe_steps, microbatch_size=s.pipe_microbatch_size, microbatches=s.pipe_microbatches,
                deterministic=True)
    plan, _profile, _plan = planned(s, job, 2)
    g = job.model.config
    element = torch.tensor([], dtype=job.train.param_dtype).element_size()
    boundary = job.train.microbatch_size * g.seq_len * g.d_model * element  # what crosses the stage boundary
    rec.results["config"] = {"model": dataclasses.asdict(g), "plan": plan.to_json(), "steps": job.train.steps,
                             "microbatch_size": job.train.microbatch_size,
                             "microbatches": job.train.num_microbatches,
                             "activation_bytes_per_microbatch": boundary, "backend": job.backend}
    states = {name: run_pipeline(s, job, plan, devices, env, rec, name) for name, (devices, env) in variants.items()}
    if any(st is not None for st in states.values()):
        # The engine detaches at every layer boundary: two stages compute what one stage computes.
        with reproducible(s) as nondeterministic:
            one_plan, _, _ = planned(s, job, 1)
            reference, ref_losses = run_uninterrupted(s, job, one_plan)
            free_device_memory()
        rec.results["one_stage_losses"] = [ref_losses[i] for i in sorted(ref_losses)]
        rec.results["reference_nondeterminism_warnings"] = nondeterministic
        for name, st in states.items():
            if st is None:
                continue
            cmp = compare(reference, st)
            rec.results["runs"][name]["vs_one_stage"] = cmp
            rec.check(f"{name}_state_bitwise_equal_to_one_stage", cmp["equal"],
                      f"{cmp['differing']} of {cmp['tensors']} tensors differ (max |diff| {cmp['max_abs_diff']:.3g})")
    runs = rec.results.get("runs", {})
    timing = ", ".join(f"{n} {r['median_step_s']:.3f} s/step" for n, r in runs.items() if "median_step_s" in r)
    rec.summary = (f"2 stages {list(plan.pipelines[0].bounds)}, {job.train.num_microbatches} microbatches of "
                   f"{boundary / 2**20:.2f} MiB activations: " + (timing or "no run completed"))


# ---- (g) wide and folded stages on several NCCL ranks ---------------------------------------------

def whole_layers(worker: Worker) -> dict[str, torch.Tensor]:
    """Every layer whole (parameters, buffers, optimizer state), by layer key: gathered from a wide
    stage's shards (every rank of the stage must call it; its first rank gets the layers)."""
    out: dict[str, torch.Tensor] = {}
    for i in sorted(worker.layers):
        payload = worker.layer_payload(i)
        for name, t in (payload or {}).items():
            if isinstance(t, torch.Tensor):
                out[f"{worker.keys[i]}/{name}"] = t
    return out


def child_stage(s: Settings, config: dict[str, Any]) -> dict[str, Any]:
    """One rank of a hand-set plan (section g): `steps` steps, then its whole layers (a wide stage's
    first rank) to `state`."""
    from oobleck_slurm.engine.comm import connect_store
    from oobleck_slurm.engine.layout import ExecPlan
    from oobleck_slurm.engine.spec import JobSpec

    job = JobSpec.from_json(config["job"])
    plan = ExecPlan.from_json(config["plan"])
    rank, world = int(config["rank"]), int(config["world"])
    device = torch.device("cuda", int(config["cuda_index"])) if s.cuda else torch.device("cpu")
    store = connect_store("127.0.0.1", int(config["port"]), s.timeouts(), PIPELINE_SECRET, None, f"rank {rank}")
    with reproducible(s) as nondeterministic:
        worker, gen = start_worker(s, job, plan, store, rank=rank, world=world, device=device)
        losses = [worker.train_step().loss for _ in range(job.train.steps)]
        state = whole_layers(worker)
        gen.wait(gen.world.barrier())
    torch.save(state, config["state"])
    peak = torch.cuda.max_memory_allocated(device) if s.cuda else None
    return {"rank": rank, "losses": losses, "peak_memory_allocated": peak, "nondeterminism_warnings": nondeterministic}


def wide_plans(s: Settings, one: ExecPlan) -> dict[str, tuple[ExecPlan, int]]:
    """name -> (a one-pipeline plan whose only stage spans 4 ranks, its microbatch size): kept (gathered
    once a step), resharded (ZeRO-3: gathered around each use) and folded (microbatches of 2 on 4 ranks:
    2 microbatches a pass, planning.cost.stage_fold)."""
    from oobleck_slurm.engine.layout import ExecPlan, PipelineSpec

    n, m = one.num_layers, one.num_microbatches
    def stage(keep: bool) -> ExecPlan:
        return ExecPlan(n, m, (PipelineSpec((0,), (0, n), 0, m, (4,), (keep,)),))
    return {"kept_4_wide": (stage(True), 4), "resharded_4_wide": (stage(False), 4), "folded_4_wide": (stage(True), 2)}


def section_wide_stages(s: Settings, rec: Record) -> None:
    devices, env, name = ranks_on_gpus(s, 4) if s.cuda else ([0] * 4, {"OOBLECK_NCCL_ORDER": "1"}, "gloo_nccl_order")
    rec.results["ranks"] = name
    runs: dict[str, Any] = {}
    for variant, (plan, mbs) in wide_plans(s, planned(s, s.job(steps=1), 1)[0]).items():
        job = s.job(steps=s.pipe_steps, microbatch_size=mbs, microbatches=4, deterministic=True)
        one_plan, _, _ = planned(s, job, 1)
        with reproducible(s):
            store = master_store()
            ref_worker, ref_gen = start_worker(s, job, one_plan, store)
            initial = whole_layers(ref_worker)
            ref_losses = [ref_worker.train_step().loss for _ in range(job.train.steps)]
            reference = whole_layers(ref_worker)
            release(ref_gen)
            del ref_worker
            free_device_memory()
        with tempfile.TemporaryDirectory(prefix="gpu_acceptance_wide_") as tmp:
            folder, store = Path(tmp), master_store()
            paths = [folder / f"state{r}.pt" for r in range(4)]
            configs = [{"settings": dataclasses.asdict(s), "job": job.to_json(), "plan": plan.to_json(), "rank": r,
                        "world": 4, "port": store.port, "cuda_index": devices[r], "state": str(paths[r])}
                       for r in range(4)]
            children = run_children("stage", configs, child_env(s, env), s.child_timeout_s, folder)
            state = torch.load(paths[0]) if paths[0].exists() else None
        out: dict[str, Any] = {"microbatch_size": mbs, "plan": plan.to_json(), "one_rank_losses": ref_losses,
                               "ranks": [{"exit_code": c.returncode, "seconds": c.seconds, "result": c.result,
                                          **({"output_tail": c.stderr_tail[-3000:]} if c.returncode != 0 else {})}
                                         for c in children]}
        runs[variant] = out
        rec.check(f"{variant}_exit_0", all(c.returncode == 0 for c in children),
                  "; ".join(f"rank {i}: exit {c.returncode}: {last_error_line(c.stderr_tail)}"
                            for i, c in enumerate(children) if c.returncode != 0))
        if state is None or children[0].result is None:
            continue
        cmp = compare(reference, state)
        # A stage of 4 ranks sums each gradient in another order than one rank (4 partial sums, then the
        # reduce-scatter): not bitwise, so the check is that the two runs moved the model the same way:
        # the difference between them is small against the update itself.
        moved = sum(float((reference[k].double() - initial[k].double()).norm() ** 2) for k in reference
                    if k in initial and reference[k].is_floating_point()) ** 0.5
        apart = sum(float((reference[k].double() - state[k].double()).norm() ** 2) for k in reference
                    if k in state and reference[k].is_floating_point()) ** 0.5
        losses = children[0].result["losses"]
        out.update(vs_one_rank=cmp, update_norm=moved, difference_norm=apart, losses=losses,
                   relative_difference=apart / moved if moved else None)
        rec.check(f"{variant}_same_layers", not cmp["missing_names"], f"missing {cmp['missing_names']}")
        rec.check(f"{variant}_close_to_one_rank", moved > 0 and apart / moved < WIDE_TOLERANCE[s.precision],
                  f"|wide - one rank| / |update| = {apart / moved if moved else float('nan'):.3g} "
                  f"(bitwise: {cmp['equal']}, max |diff| {cmp['max_abs_diff']:.3g})")
        rec.check(f"{variant}_losses_close", all(math.isclose(a, b, rel_tol=WIDE_TOLERANCE[s.precision])
                                                 for a, b in zip(losses, ref_losses, strict=True)),
                  f"{losses} vs one rank {ref_losses}")
    rec.results["runs"] = runs
    rec.summary = ", ".join(f"{v}: {r['relative_difference']:.2g} of the update apart from one rank"
                            for v, r in runs.items() if r.get("relative_difference") is not None) or "no run completed"


# How far a wide stage's trained model may be from one rank's, relative to the update (section g):
# the order of a gradient's sum differs, so fp32 rounding (and bf16's, larger) accumulates over the steps.
WIDE_TOLERANCE = {"fp32": 1e-3, "fp64": 1e-9, "bf16": 5e-2}


# ---- (h) the job as submit runs it: kill -9 of a rank, the spare joins ----------------------------------

class DeviceMemorySampler:
    """The GPU's used memory (total - free, from torch.cuda.mem_get_info: every process's allocations,
    NCCL's buffers and the CUDA contexts included) sampled in a thread, with the time of each sample."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True, name="mem-sampler")

    def _run(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            free, total = torch.cuda.mem_get_info()
            self.samples.append((time.time(), total - free))

    def __enter__(self) -> DeviceMemorySampler:
        if torch.cuda.is_available():
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def peak(self, t0: float = 0.0, t1: float = float("inf")) -> int | None:
        inside = [b for t, b in self.samples if t0 <= t <= t1]
        return max(inside) if inside else None


def job_state(run: Any) -> dict[str, torch.Tensor]:
    """The job's final checkpoint (what the first pipeline wrote at the last step), by file and key."""
    from oobleck_slurm.engine.checkpoint import LAYER_SUFFIX, read_layer_file

    steps = run.spec().train.steps
    out: dict[str, torch.Tensor] = {}
    for path in sorted((run.job.checkpoints / f"step{steps}").glob(f"*{LAYER_SUFFIX}")):
        for k, v in read_layer_file(path, steps).items():
            if isinstance(v, torch.Tensor):
                out[f"{path.name}/{k}"] = v
    return out


def section_job_drill(s: Settings, rec: Record) -> None:
    import _jobs  # benchmarks/_jobs.py: the production start path (prepare_job + start_local)

    nodes, kill_step = 4, 3
    devices, env, name = ranks_on_gpus(s, nodes + 1) if s.cuda else ([0] * (nodes + 1), {}, "gloo")
    os.environ.update(env)  # the job's agents and workers inherit it
    rec.results["ranks"] = name
    mbs = 2  # 16 samples a step: 8 steps stay within the shipped text's windows at a GPU slice's 2048 tokens
    d = _jobs.recipe_dict(size=s.preset, nodes=nodes, steps=8, global_batch=4 * mbs * 2, microbatch=mbs,
                          precision=s.precision, f=0, replacement="spare", gpus_per_node=1 if s.cuda else 0,
                          heartbeat_lease=5.0, step_timeout=120.0, reconfiguration_timeout=300.0)
    d["model"].update(family=s.family, n_layer=s.n_layer)
    d["cluster"]["spare_nodes"] = 1
    d["training"]["deterministic"] = True
    with tempfile.TemporaryDirectory(prefix="gpu_acceptance_job_") as tmp:
        root, cache = Path(tmp), Path(tmp) / "templates_cache"
        estimate = estimate_gpu(s)
        d["cluster"]["memory_per_device"] = _jobs.budget_for_span(d, 2, cache, estimate, root / "budget")
        faults = [{"node": "node2", "step": kill_step, "at": "wait:3", "do": "kill"}]
        from oobleck_slurm.engine.comm import communicators_per_rank
        from oobleck_slurm.engine.from_planner import exec_plan

        first = exec_plan(_jobs.planned(_jobs.load(d, root / "plan"), cache, estimate),
                          [f"node{i + 1}" for i in range(nodes)], 1)
        world = 1 + max(r for p in first.pipelines for r in p.all_ranks)
        rec.results["communicators_per_rank"] = communicators_per_rank(first, world)
        t0 = time.time()
        plain = _jobs.run_job(d, root / "plain", cache, estimate=estimate, timeout=s.child_timeout_s)
        with DeviceMemorySampler() as mem:
            drill = _jobs.run_job(d, root / "drill", cache, estimate=estimate, timeout=s.child_timeout_s, faults=faults)
        a, b = job_state(plain), job_state(drill)
    cmp = compare(a, b)
    plans = drill.kind("plan")
    lost, resumed = drill.kind("node_lost"), drill.kind("resumed")
    out: dict[str, Any] = {
        "recipe": d, "plans": [{"reason": p.get("reason"), "pipelines": [[st["node"] for st in pp["stages"]]
                                                                         for pp in p["pipelines"]],
                                "spares": p.get("spares")} for p in plans],
        "node_lost": lost, "resumed": resumed, "node_joined": drill.kind("node_joined"),
        "losses_uninterrupted": plain.losses(), "losses_drill": drill.losses(), "vs_uninterrupted": cmp,
        "wall_s": {"uninterrupted": plain.wall_s, "drill": drill.wall_s}, "started": t0,
        "peak_memory_allocated_per_rank": {e["step"]: e.get("peak_memory") for e in drill.kind("step")},
    }
    if mem.samples:
        t_kill = min((e.get("t", 0.0) for e in lost), default=None)
        t_back = max((e.get("t", 0.0) for e in resumed), default=None)
        out["device_used_bytes"] = {"before_kill": mem.peak(0.0, t_kill or 0.0),
                                    "recovery": mem.peak(t_kill or 0.0, t_back or 0.0),
                                    "after": mem.peak(t_back or float("inf")), "samples": len(mem.samples)}
        planned_bytes = [st.get("memory_bytes") or 0 for pp in plans[0]["pipelines"] for st in pp["stages"]]
        out["planned_bytes_per_rank"] = planned_bytes
        # What the planner does not count, per rank: CUDA context, NCCL's communicators and buffers, the
        # caching allocator's slack (issue: communicators in the memory budget).
        used = out["device_used_bytes"]
        out["unplanned_bytes_per_rank"] = {k: (used[k] - sum(planned_bytes)) / (nodes + 1) if used.get(k) else None
                                           for k in ("before_kill", "recovery", "after")}
    rec.results.update(out)
    rec.check("node_lost_is_node2", [e["node"] for e in lost] == ["node2"], f"{[(e['node'], e['cause']) for e in lost]}")
    rec.check("recovered_in_memory", not drill.kind("checkpoint_fallback") and bool(resumed),
              f"resumed {resumed}, fallback {drill.kind('checkpoint_fallback')}")
    rec.check("spare_joined", [p.get("reason") for p in plans][-1:] == ["join"] and bool(drill.kind("node_joined")),
              f"plans {out['plans']}")
    rec.check("back_to_the_initial_shape", [len(p) for p in out["plans"][-1]["pipelines"]]
              == [len(p) for p in out["plans"][0]["pipelines"]], f"plans {out['plans']}")
    # The survivors train the degraded steps on another plan (one pipeline sums what two did), so the
    # trajectory equals the uninterrupted one up to the order of a gradient's sum: close, not bitwise
    # (section a is bitwise: one rank, the same plan before and after).
    la, lb = plain.losses(), drill.losses()
    tol = WIDE_TOLERANCE[s.precision]
    rec.check("losses_close", la.keys() == lb.keys() and all(math.isclose(la[k], lb[k], rel_tol=tol) for k in la),
              f"{la} vs {lb}")
    apart = max((float((a[k].double() - b[k].double()).abs().max()) for k in a if k in b and a[k].is_floating_point()),
                default=float("nan"))
    rec.results["max_abs_diff"] = apart
    rec.check("same_final_layers", not cmp["missing_names"], f"missing {cmp['missing_names']}")
    rec.summary = (f"{name}: node2 killed in step {kill_step}, resumed at "
                   f"{[e['step'] for e in resumed]} after {[round(e.get('total_seconds') or 0, 2) for e in resumed]} s; "
                   f"final state {'bitwise equal' if cmp['equal'] else f'within {apart:.2g}'} of the uninterrupted run")


# ---- running the sections ------------------------------------------------------------------------

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


RUNNERS: dict[str, Callable[[Settings, Record], None]] = {
    "a": section_abort_rebuild,
    "b": section_throughput,
    "c": section_memory,
    "d": section_copy_bandwidth,
    "e": section_two_ranks_one_gpu,
    "f": section_two_stage_pipeline,
    "g": section_wide_stages,
    "h": section_job_drill,
}


def section_main(key: str, s: Settings) -> Record:
    """Run section `key` here (in its own process, see run_section): errors become the record's."""
    rec = Record(key, SECTIONS[key])
    t0 = time.perf_counter()
    try:
        RUNNERS[key](s, rec)
    except Skipped as e:
        rec.status, rec.reason = "skipped", str(e)
    except Exception as e:  # noqa: BLE001 - recorded; the other sections still run
        rec.status = "failed"
        rec.error = f"{type(e).__name__}: {e}"
        rec.traceback = traceback.format_exc()
    rec.seconds = time.perf_counter() - t0
    return rec


def section_env(s: Settings, key: str) -> dict[str, str]:
    """The sections that compare runs bitwise (a, f) get cuBLAS's deterministic workspace from their
    process's start, as `training.deterministic` gives a worker: there the planner may run matrix
    products on the GPU (a measured profile) before the first worker exists, and cuBLAS reads the
    setting once (so section b's timings keep the default)."""
    from oobleck_slurm.engine.worker import CUBLAS_DETERMINISTIC_WORKSPACE

    if s.cuda and key in ("a", "f", "g") and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        return {"CUBLAS_WORKSPACE_CONFIG": CUBLAS_DETERMINISTIC_WORKSPACE}
    return {}


def run_section(key: str, s: Settings, console: Console) -> Record:
    """Section `key` in a process of its own, so that nothing one section does to its process (a CUDA
    error that sticks to the context, an NCCL abort that crashes it, a hang) reaches the others;
    bounded by `--section-timeout` (a hung section's stacks are recorded, then it is killed)."""
    console.print(f"[bold]({key}) {SECTIONS[key]}[/] ...")
    t0 = time.perf_counter()
    if key in GPU_ONLY and not s.cuda:
        rec = Record(key, SECTIONS[key], status="skipped", reason="no GPU", seconds=time.perf_counter() - t0)
        console.print(f"    [yellow]skipped[/]: {rec.reason}")
        return rec
    with tempfile.TemporaryDirectory(prefix=f"gpu_acceptance_{key}_") as tmp:
        (run,) = run_children("section", [{"settings": dataclasses.asdict(s), "key": key}],
                              child_env(s, section_env(s, key)), s.section_timeout_s, Path(tmp))
    if run.result is not None and run.returncode == 0:
        rec = Record(**run.result)
        rec.seconds = time.perf_counter() - t0  # with the process's start (imports, CUDA context)
    else:
        rec = Record(key, SECTIONS[key], status="failed", seconds=time.perf_counter() - t0)
        rec.error = (f"the section's process did not finish within --section-timeout {s.section_timeout_s:g} s "
                     "(killed; its stacks are in results.output_tail)" if run.returncode is None
                     else f"the section's process exited {run.returncode} without a result: "
                          f"{last_error_line(run.stderr_tail)}")
        rec.results["output_tail"] = run.stderr_tail
    colour = {"passed": "green", "failed": "red", "skipped": "yellow"}[rec.status]
    bad = [n for n, c in rec.checks.items() if not c["passed"]]
    console.print(f"    [{colour}]{rec.status}[/] in {rec.seconds:.1f} s: "
                  f"{escape(rec.error or rec.reason or rec.summary or '')}"
                  + (f" [red]failed checks: {escape(', '.join(bad))}[/]" if bad else ""))
    return rec


def environment(s: Settings) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "host": socket.gethostname(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(), "cuda_build": torch.version.cuda,
        "nccl": ".".join(map(str, nccl_version() or ())) or None,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),  # sections a, f: ":4096:8" if unset
    }
    try:
        import psutil

        env["host_memory_bytes"] = int(psutil.virtual_memory().total)
    except ImportError:
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device_count=torch.cuda.device_count(), device_name=props.name,
                   device_memory_bytes=int(props.total_memory), compute_capability=f"{props.major}.{props.minor}",
                   multiprocessors=props.multi_processor_count, planner_gpu=detected_gpu())
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001 - the driver version is a nicety
            pass
    name, peak = peak_flops(s)
    env.update(peak_bf16_gpu=name, peak_bf16_flops=peak)
    return env


def print_tables(console: Console, records: list[Record]) -> None:
    table = Table(title="GPU acceptance")
    for col in ("section", "status", "s", "figures / reason"):
        table.add_column(col, overflow="fold")
    colours = {"passed": "green", "failed": "red", "skipped": "yellow"}
    for r in records:
        text = r.summary if r.status != "skipped" else r.reason
        if r.status == "failed":
            bad = [f"{n}: {c.get('message', 'failed')}" for n, c in r.checks.items() if not c["passed"]]
            text = "; ".join(([r.error] if r.error else []) + bad) or text
        table.add_row(f"({r.key}) {r.name}", f"[{colours[r.status]}]{r.status}[/]", f"{r.seconds:.1f}",
                      escape(text or ""))
    console.print(table)
    b = next((r for r in records if r.key == "b" and "runs" in r.results), None)
    if b is not None:
        t = Table(title="(b) throughput (median step after warm-up)")
        for col in ("run", "median step s", "tokens/s", "MFU", "engine / this"):
            t.add_column(col)
        for name, row in b.results["runs"].items():
            ratio = b.results["ratios_tokens_per_s"].get(f"engine_over_{name}")
            t.add_row(name, f"{row['median_step_s']:.4f}", f"{row['tokens_per_s']:.0f}",
                      f"{row['mfu']:.3f}" if row["mfu"] is not None else "unknown",
                      f"{ratio:.3f}" if ratio is not None else "")
        console.print(t)
    c = next((r for r in records if r.key == "c" and "measured" in r.results), None)
    if c is not None:
        t = Table(title=f"(c) peak memory per step, MiB ({c.results['config']['probe']})")
        t.add_column("what")
        t.add_column("MiB")
        for name, m in c.results["measured"].items():
            t.add_row(f"measured {name}", f"{m['peak_bytes'] / 2**20:.1f}")
        for name, v in c.results["predicted_bytes"].items():
            t.add_row(f"planner {name}", f"{v / 2**20:.1f}")
        console.print(t)


def main(argv: list[str] | None = None) -> int:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=str(RESULTS), help="the JSON file to write")
    ap.add_argument("--only", default=None, help="comma-separated sections, e.g. a,c (default: all)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                    help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--family", choices=["gpt", "llama"], default="gpt", help="model family (default gpt)")
    ap.add_argument("--preset", default=None,
                    help="the family's shape (default: gpt 1.3b or llama 3.2-1b on CUDA, tiny on the CPU)")
    ap.add_argument("--layers", type=int, default=None, help="transformer blocks of the slice (default: 4 on CUDA)")
    ap.add_argument("--microbatch-size", type=int, default=None)
    ap.add_argument("--microbatches", type=int, default=None, help="microbatches per step")
    ap.add_argument("--steps", type=int, default=None, help="(a) steps per training run (>= 5)")
    ap.add_argument("--warmup", type=int, default=None, help="(b) steps left out of the medians")
    ap.add_argument("--timed-steps", type=int, default=None, help="(b) timed steps")
    ap.add_argument("--pipe-microbatch-size", type=int, default=None, help="(f) default 3 on CUDA: ~50 MB activations")
    ap.add_argument("--pipe-microbatches", type=int, default=None)
    ap.add_argument("--pipe-steps", type=int, default=None)
    ap.add_argument("--memory-d-model", type=int, default=None,
                    help="(c) d_model of the measured model (default: the preset's on CUDA, 256 on the CPU)")
    ap.add_argument("--copy-mb", type=int, default=None, help="(d) MiB per copy (default 256 on CUDA, 64 on the CPU)")
    ap.add_argument("--compile-budget", type=float, default=None,
                    help="(b) seconds for the torch.compile run, compile included (0: skip it)")
    ap.add_argument("--child-timeout", type=float, default=None,
                    help="(c), (e), (f) seconds before a section's child processes count as hung")
    ap.add_argument("--section-timeout", type=float, default=None,
                    help="seconds before a section's process counts as hung (default 900 on CUDA, 300 on the CPU)")
    ap.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default 1, as a CPU worker)")
    ap.add_argument("--gpu", default=None, help="GPU name in planning/gpus.py for the peak FLOP/s (default: detected)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda: CUDA is not available (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
                 "use --device cpu")
    only = list(SECTIONS) if args.only is None else [x.strip() for x in args.only.split(",") if x.strip()]
    if unknown := [x for x in only if x not in SECTIONS]:
        ap.error(f"--only: unknown section(s) {unknown}; sections: "
                 + ", ".join(f"{k}={v}" for k, v in SECTIONS.items()))
    s = settings_from_args(args)
    if not s.cuda:
        torch.set_num_threads(s.threads)
    # This process only starts the sections (each in a process of its own, with the environment a node
    # agent gives its workers: child_env) and writes what they report.
    console = Console(width=None if sys.stdout.isatty() else 160)
    started = time.perf_counter()
    out: dict[str, Any] = {"schema": SCHEMA, "command": [sys.executable, *sys.argv],
                           "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                           "settings": dataclasses.asdict(s), "environment": environment(s)}
    e = out["environment"]
    console.print(f"[bold]GPU acceptance[/] on {escape(str(e.get('device_name', 'CPU')))}: torch {e['torch']}, "
                  f"CUDA {e['cuda_build']}, NCCL {e['nccl']}; {s.family} {s.preset} x {s.n_layer} blocks, {s.precision}")
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    records: list[Record] = []
    out["sections"] = {}
    for key in only:  # the file is rewritten after each section: an interrupted run keeps what it did
        out["running"] = key
        path.write_text(json.dumps(out, indent=2, default=str))
        records.append(run_section(key, s, console))
        out["sections"][key] = records[-1].to_json()
    del out["running"]
    out["wall_s"] = time.perf_counter() - started
    out["passed"] = all(r.status != "failed" for r in records)
    path.write_text(json.dumps(out, indent=2, default=str))
    print_tables(console, records)
    verdict = "[green]passed[/]" if out["passed"] else "[red]FAILED[/]"
    console.print(f"{verdict} in {out['wall_s']:.1f} s; wrote {escape(str(path))}")
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--_child":
        raise SystemExit(child_main(sys.argv[2], sys.argv[3]))
    raise SystemExit(main())
