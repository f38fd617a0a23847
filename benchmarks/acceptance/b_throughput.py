"""Section (b) throughput: tokens/s and MFU of the engine's step against a plain PyTorch loop (plain,
fused AdamW, fused AdamW + torch.compile in a child process).

In full: the package's docstring (the command's --help).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from acceptance.harness import (
    Record,
    Settings,
    child_env,
    free_device_memory,
    last_error_line,
    master_store,
    median,
    peak_flops,
    planned,
    release,
    run_children,
    start_worker,
    sync,
)
from acceptance.references import plain_model, plain_optimizer, plain_step, step_batches

if TYPE_CHECKING:
    from oobleck_slurm.engine.layout import ExecPlan
    from oobleck_slurm.engine.spec import JobSpec


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
