"""Hand-planned jobs on real worker processes (tests/sharded_run.py), forked from a warm server as an
agent forks its workers, on real gloo groups under NCCL's ordering rules: `run_plans` trains a JobSpec
through a list of ExecPlans and returns rank 0's losses and the layers gathered whole. Used by
tests/engine/test_sharded.py (8 workers on 2 nodes) and test_random_layers.py."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from jobrun import assert_tensors_match
from reference import reference_optimizer_state, train_reference

from oobleck_slurm.agent.warm import WarmProcess, WarmServer
from oobleck_slurm.engine.layout import ExecPlan
from oobleck_slurm.engine.spec import JobSpec
from oobleck_slurm.protocol import keys

RUN = Path(__file__).resolve().parent / "sharded_run.py"
JOB_TIMEOUT_S = 400.0  # 8 processes on 2 shared cores
WORLD = 8
POLL_S = 0.05  # how often the test looks for the killed processes' exits


def warm_server() -> Iterator[WarmServer]:
    """The ranks are forked from one warm server (agent/warm.py), as an agent forks its workers:
    torch and the engine are imported once for a test module, not once per rank (for a module fixture)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(RUN.parent), os.environ.get("PYTHONPATH", "")])}
    server = WarmServer(env=env)
    try:
        assert server.ready.wait(JOB_TIMEOUT_S) and server.alive()
        yield server
    finally:
        server.close()


def run_plans(warm: WarmServer, tmp_path: Path, job: JobSpec, plans: list[tuple[int, ExecPlan]],
              kill: dict | None = None, checkpoints: tuple[int, ...] = (),
              world: int = WORLD, reports: dict[int, tuple[int, bool]] | None = None, ordered: str = "1"
              ) -> tuple[dict[int, float], dict]:
    """Run `plans` [(first step, plan)] on `world` worker processes. With `kill` {"ranks", "step", "wait"}
    those ranks kill -9 themselves inside that step of the first plan; with `kill` {"ranks", "faults"}
    the production fault hooks strike (engine/faults.py) and, once one of the ranks died, this process
    kills the others, as their node's agent does. It then plays the coordinator: it sets the failed key
    once they are gone, collects the survivors' steps (into `reports`: rank -> (step, pending)) and
    names the step to resume at (recovery.py), and the survivors go on with the second plan. The plans
    numbered in `checkpoints` start from a checkpoint the plan before writes (sharded_run.py). `ordered`
    "0": plain gloo instead of NCCL's ordering rules (gloo's own way of reduce-scattering, comm.py)."""
    (tmp_path / "job.json").write_text(job.to_json())
    entries = [{"step": s, "plan": p.to_json(), "checkpoint": k in checkpoints} for k, (s, p) in enumerate(plans)]
    if kill is not None:
        entries[0]["kill"] = kill
        entries[1]["world"] = world - len(kill["ranks"])
    (tmp_path / "plans.json").write_text(json.dumps(entries))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OOBLECK_NCCL_ORDER": ordered}
    logs = [tmp_path / f"rank{r}.log" for r in range(world)]
    procs = [warm.spawn(RUN.stem, [str(tmp_path), str(store.port), str(r), str(world)], env, str(logs[r]))
             for r in range(world)]
    try:
        if kill is not None:
            got = coordinate(store, procs, kill, world)
            if reports is not None:
                reports.update(got)
        for p in procs:
            p.wait(timeout=JOB_TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outputs = [log.read_text(errors="replace") if log.exists() else "" for log in logs]
    codes = [p.returncode for p in procs]
    expected = [-9 if kill and r in kill["ranks"] else 0 for r in range(world)]
    assert codes == expected, "\n".join(f"--- rank {r} ({c}) ---\n{o[-3000:]}" for r, (c, o) in enumerate(zip(codes, outputs)))
    losses = {int(k): v for k, v in json.loads((tmp_path / "losses.json").read_text()).items()}
    layers: dict = {}
    for r in range(world):
        if (tmp_path / f"layers{r}.pt").exists():
            layers.update(torch.load(tmp_path / f"layers{r}.pt"))
    return losses, layers


def coordinate(store: dist.TCPStore, procs: list[WarmProcess], kill: dict, world: int
               ) -> dict[int, tuple[int, bool]]:
    """The coordinator's part of a failure of generation 0 (module doc of run_plans); returns the
    survivors' reports, rank -> (step, whether it holds it pending)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while all(procs[r].poll() is None for r in kill["ranks"]):  # detection: a process's exit
        assert time.monotonic() < deadline, "no rank to kill died"
        time.sleep(POLL_S)
    for r in kill["ranks"]:  # the node's agent kills its other workers
        if procs[r].poll() is None:
            procs[r].kill()
    while any(procs[r].poll() is None for r in kill["ranks"]):
        assert time.monotonic() < deadline, "the ranks to kill are still alive"
        time.sleep(POLL_S)
    store.set(keys.failed(0), "{}")
    survivors = [r for r in range(world) if r not in kill["ranks"]]
    store.wait([f"report/0/{r}" for r in survivors], dt.timedelta(seconds=JOB_TIMEOUT_S))
    reports = {r: tuple(int(v) for v in store.get(f"report/0/{r}").decode().split()) for r in survivors}
    steps = [step for step, _ in reports.values()]
    # some survivor applied the interrupted step: the others hold it pending and complete it
    assert max(steps) - min(steps) <= 1 and all(ok for step, ok in reports.values() if step < max(steps))
    store.set("resume/0", str(max(steps)))
    return {r: (step, bool(ok)) for r, (step, ok) in reports.items()}


def assert_exact(job: JobSpec, losses: dict[int, float], layers: dict, rtol: float = 1e-5,
                 optimizer_state: bool = False) -> None:
    """Losses and the layers gathered whole equal the reference; with `optimizer_state` their
    optimizer state too (step counters, moments, CAME's row/column statistics)."""
    ref_losses, ref_params = train_reference(job)
    assert sorted(losses) == list(range(job.train.steps))
    for step, ref in enumerate(ref_losses):
        assert abs(losses[step] - ref) <= rtol * abs(ref), (step, losses[step], ref)
    assert sorted(layers) == sorted(ref_params)  # every layer gathered whole, once
    for key, ref in ref_params.items():
        for name, p in ref.items():
            got = layers[key][f"param.{name}"]
            err = float((got - p).abs().max() / p.abs().max().clamp_min(1e-12))
            assert err <= rtol, f"{key}.{name}: relative error {err:.2e}"
    if optimizer_state:
        states = {key: {name[len("state."):]: t for name, t in payload.items() if name.startswith("state.")}
                  for key, payload in layers.items()}
        assert_tensors_match(states, reference_optimizer_state(job), rtol)
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-6  # training moved: the comparison can fail
