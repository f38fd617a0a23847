"""Waiting on a job folder's event log, shared by the supervisor tests."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from oobleck_slurm.protocol.events import EventTail, read_events
from oobleck_slurm.recipe import load_recipe
from oobleck_slurm.submission import prepare_job, start_local

REPO = Path(__file__).resolve().parents[1]
_FOLLOWED: dict[Path, tuple[EventTail, list[dict[str, Any]]]] = {}


def events_so_far(path: Path) -> list[dict[str, Any]]:
    """A running job's event log (`path`) so far, read incrementally: the tests' waits look at it up to
    100 times a second for minutes, and parsing the whole log each time cost seconds of CPU a test."""
    tail, seen = _FOLLOWED.setdefault(Path(path), (EventTail(path), []))
    seen.extend(tail.poll())
    return list(seen)


def dump_stacks(job: Path, settle_s: float = 5.0) -> str:
    """For a test that gives up on a job: ask its supervisor and agents (processes on this machine, by
    the pids their events name) for every thread's stack (oobleck_slurm/stack_dumps.py), and return
    what their logs gained, so that a hang seen once in CI says where it was."""
    from oobleck_slurm.stack_dumps import STACK_DUMP_SIGNAL

    events = read_events(job / "events.jsonl")
    pids = {e["pid"] for e in events if e["kind"] == "job_started" and e.get("pid")}
    pids |= {e["agent_pid"] for e in events if e["kind"] == "node" and e.get("agent_pid")}
    logs = [p for p in job.rglob("*") if p.is_file() and (p.suffix in (".err", ".log"))]
    sizes = {p: p.stat().st_size for p in logs}
    signalled = []
    for pid in sorted(pids):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, STACK_DUMP_SIGNAL)
            signalled.append(pid)
    deadline = time.monotonic() + settle_s  # the dumps are written from the signal handlers, at once
    while time.monotonic() < deadline and not any(p.stat().st_size > sizes[p] for p in logs):
        time.sleep(0.1)
    time.sleep(0.5)  # the other processes' dumps
    grown = [f"--- {p.relative_to(job)} (stacks)\n{p.read_bytes()[sizes[p]:].decode(errors='replace')[-6000:]}"
             for p in logs if p.stat().st_size > sizes[p]]
    return f"stacks of pids {signalled}:\n" + "\n".join(grown)


@contextlib.contextmanager
def running_job(tmp_path: Path, fault_tolerance: str, cache: Path,
                faults: list[dict[str, Any]] | None = None, nodes: int = 4, sections: str = "",
                precision: str | None = None) -> Iterator[Path]:
    """local-tiny on `nodes` virtual nodes with endless steps and these `fault_tolerance:` lines (YAML,
    indented), and more top-level `sections` (YAML), started as `submit` starts it; stopped at the end
    (frozen processes thawed first, so that they can die). fp64 `precision`: its losses can be compared
    with the reference's within 1e-5 (assert_trained_on_the_reference)."""
    recipe = tmp_path / "r.yaml"
    training = "  steps: 100000\n" + (f"  precision: {precision}\n" if precision else "")
    recipe.write_text(f"extends: {REPO / 'recipes' / 'local-tiny.yaml'}\ncluster:\n  nodes: {nodes}\n"
                      f"training:\n{training}fault_tolerance:\n{fault_tolerance}{sections}")
    handle = prepare_job(load_recipe(recipe), cache_dir=cache, estimate_gpu="A100-40", job_root=tmp_path / "jobs",
                         faults=faults)
    sup = start_local(handle)
    try:
        yield handle.path
    finally:
        children = psutil.Process(sup.pid).children(recursive=True)
        for p in children:
            try:
                p.resume()
            except psutil.Error:
                pass
        sup.terminate()
        sup.wait(30)
        psutil.wait_procs(children, timeout=10)  # agents see the supervisor gone and end their workers
        # What the orderly stop left (a standby that took over from a supervisor slowed by the load, whose
        # agents are no children of the first; a node frozen by a drill): the job's whole session, which
        # would otherwise spin or wait on through the rest of the suite.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sup.pid, signal.SIGKILL)


def wait_for(job: Path, what: str, check, timeout: float = 180.0):  # noqa: ANN001, ANN201
    """Poll `job`'s events until `check(events)` is truthy; fail with the last events after `timeout`."""
    deadline = time.monotonic() + timeout
    while not (found := check(events_so_far(job / "events.jsonl"))):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not seen within {timeout}s: {read_events(job / 'events.jsonl')[-10:]}")
        time.sleep(0.1)
    return found


def assert_trained_on_the_reference(job: Path, rtol: float = 1e-5) -> None:
    """Every step a running job reported so far (0..last, none missing; a replayed step's last report
    counts) has the loss of the failure-free single-process run of its recipe (tests/reference.py)."""
    from reference import train_reference

    from oobleck_slurm.engine.spec import JobSpec

    losses = {e["step"]: e["loss"] for e in read_events(job / "events.jsonl", "step")}
    steps = max(losses) + 1
    assert sorted(losses) == list(range(steps)), "a step was skipped"
    ref, _ = train_reference(JobSpec.from_json((job / "job.json").read_text()), steps=steps)
    bad = [(s, losses[s], r) for s, r in enumerate(ref) if abs(losses[s] - r) > rtol * abs(r)]
    assert not bad, f"losses off the failure-free trajectory (step, job, reference): {bad[:5]}"
