"""Section (a) abort_rebuild: training through the engine's Worker on a one-rank plan; twice a
generation aborted at a step's commit point and the next one built in the same process; the final
state and every loss bitwise those of an uninterrupted run.

In full: the package's docstring (the command's --help).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from acceptance.harness import (
    Record,
    Settings,
    compare,
    free_device_memory,
    master_store,
    planned,
    release,
    reproducible,
    snapshot,
    start_worker,
)
from acceptance.references import run_uninterrupted

if TYPE_CHECKING:
    from oobleck_slurm.engine.layout import ExecPlan
    from oobleck_slurm.engine.spec import JobSpec


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
