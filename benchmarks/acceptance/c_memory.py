"""Section (c) memory: peak bytes per step of the engine's worker, of the same worker with the old
pre-step copy, and of the plain loop, each in a fresh process, against the planner's stage memory.

In full: the package's docstring (the command's --help).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from acceptance.harness import (
    Record,
    Settings,
    child_env,
    estimate_gpu,
    free_device_memory,
    last_error_line,
    master_store,
    planned,
    run_children,
    sync,
)
from acceptance.references import plain_model, plain_optimizer, plain_step, step_batches

if TYPE_CHECKING:
    from oobleck_slurm.engine.layout import ExecPlan
    from oobleck_slurm.engine.spec import JobSpec
    from oobleck_slurm.engine.worker import Worker


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
