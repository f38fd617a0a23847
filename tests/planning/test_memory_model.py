"""The planner's memory model against the bytes an engine worker really holds at its step's peak.

For each case the planner's prediction for a stage (`template_from_stages` -> `cost.stage_memory`, on the
profile `profile_model` measures, what `submit` plans with) is set against the peak of a real `Worker`
running that stage on a gloo Generation, measured on the CPU with oobleck_slurm/peak_memory.py in a fresh
process whose glibc returns freed memory to the OS (worker_memory.py). They agree within 10%: parameters,
gradients and optimizer state in the parameters' dtype (fp32 master weights under bf16, fp64 for fp64),
the activations of the microbatches in flight (1F1B: 2 on the first of 2 stages) with the bf16 weight
copies autocast keeps, the stage outputs and boundary gradients, one layer's workspace. What the model
leaves to the budget's 10% headroom is what the process holds besides, measured here as 1-5%: Python
objects, the framework's buffers (on the CPU under bf16, oneDNN's cached primitives: ~11 MB, hence a wider
model for that case).

Would fail: a planner that counted bf16 parameters at 2 bytes (20 -> 12 bytes per parameter predicted),
or dropped the microbatches in flight; an engine that kept a copy of the state for fault tolerance
(+12 bytes per parameter with AdamW) or a flat copy of the gradients (+4).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from oobleck_slurm.engine.layout import ExecPlan, PipelineSpec
from oobleck_slurm.peak_memory import MALLOC_ENV
from oobleck_slurm.planning import cost
from oobleck_slurm.planning.profile import profile_from_dict
from oobleck_slurm.planning.templates import template_from_stages

HELPER = Path(__file__).with_name("worker_memory.py")
TOLERANCE = 0.10
NARROW = {"n_layer": 4, "d_model": 256, "n_head": 4, "seq_len": 128, "vocab_size": 256}  # 3.3M parameters
WIDE = {"n_layer": 4, "d_model": 512, "n_head": 8, "seq_len": 128, "vocab_size": 256}  # 12.8M parameters
# name: (model, precision, optimizer, stage bounds, microbatches); microbatches of 2 sequences
CASES: dict[str, tuple[dict[str, int], str, str, list[int], int]] = {
    "fp32-adamw": (NARROW, "fp32", "adamw", [0, 6], 2),
    "fp64-adamw": (NARROW, "fp64", "adamw", [0, 6], 2),
    "fp32-came": (NARROW, "fp32", "came", [0, 6], 2),
    "bf16-adamw": (WIDE, "bf16", "adamw", [0, 6], 2),
    "fp32-adamw-2-stages": (NARROW, "fp32", "adamw", [0, 3, 6], 4),
}
STAGES = [(name, stage) for name, case in CASES.items() for stage in range(len(case[3]) - 1)]


def config(name: str) -> dict[str, Any]:
    gpt, precision, optimizer, bounds, microbatches = CASES[name]
    plan = ExecPlan(gpt["n_layer"] + 2, microbatches,
                    (PipelineSpec(tuple(range(len(bounds) - 1)), tuple(bounds), 0, microbatches),))
    return {"gpt": gpt, "precision": precision, "optimizer": optimizer, "microbatch_size": 2,
            "microbatches": microbatches, "steps": 2, "plan": plan.to_json()}


def run(mode: str, arg: Any) -> Any:
    # MALLOC_ENV: RSS follows the live tensors. The suite's OOBLECK_NCCL_ORDER (conftest) is inherited.
    env = dict(os.environ, OMP_NUM_THREADS="1", **MALLOC_ENV)
    done = subprocess.run([sys.executable, str(HELPER), mode, json.dumps(arg)], capture_output=True, text=True,
                          env=env, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def workers(name: str) -> list[dict[str, Any]]:
    """Every stage's worker of case `name`, one process each, on a store hosted here."""
    c = config(name)
    ranks = len(c["plan"]["pipelines"][0]["ranks"])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
    with ThreadPoolExecutor(ranks) as pool:
        return list(pool.map(lambda r: run("worker", {**c, "rank": r, "world": ranks, "port": store.port}),
                             range(ranks)))


@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    """The profiles (one process) and every case's workers (one process per stage), two at a time."""
    names = list(CASES)
    models = sorted({model_key(n) for n in names})
    with ThreadPoolExecutor(2) as pool:
        profiles = pool.submit(run, "profile", [json.loads(m) for m in models])
        results = dict(zip(names, pool.map(workers, names)))
    by_model = dict(zip(models, profiles.result()))
    return {"workers": results, "profiles": {n: by_model[model_key(n)] for n in names}}


def model_key(name: str) -> str:
    """What a case's profile depends on (not its plan): cases that share it share one measurement."""
    return json.dumps({k: v for k, v in config(name).items() if k not in ("plan", "microbatches", "steps")},
                      sort_keys=True)


@pytest.mark.parametrize("name, stage", STAGES, ids=[f"{n}-stage{s}" for n, s in STAGES])
def test_planner_memory_of_a_stage_matches_what_its_worker_holds(measured, name, stage):
    gpt, precision, optimizer, bounds, microbatches = CASES[name]
    profile = profile_from_dict(measured["profiles"][name])
    stages = len(bounds) - 1
    template = template_from_stages(profile, stages, [(bounds[i], bounds[i + 1], i, 1) for i in range(stages)],
                                    microbatches)
    predicted = template.stages[stage].memory_bytes
    worker = measured["workers"][name][stage]
    assert worker["probe"] == "clear_refs" and worker["malloc_configured"]
    held = worker["peaks"][-1]  # the second step: the first one creates the optimizer state
    terms = cost.stage_memory_terms(profile, bounds[stage], bounds[stage + 1], 1,
                                    cost.in_flight(microbatches, stages - stage))
    per_param = {k: round(v / worker["params"], 2) for k, v in terms.items()}
    assert abs(held / predicted - 1) <= TOLERANCE, (
        f"{name} stage {stage}: held / predicted = {held / predicted:.3f}; the worker holds {held / 2**20:.1f} MiB ({held / worker['params']:.2f} B/param) at "
        f"its step's peak, the planner predicts {predicted / 2**20:.1f} MiB ({predicted / worker['params']:.2f} "
        f"B/param: {per_param}); flat gradients: {worker['flat_gradients']}")


def test_the_probe_sees_each_phase_peak_and_not_an_earlier_one():
    """64 MiB allocated and freed, then 32 MiB: the second phase's peak is 32 MiB (the kernel's peak RSS
    was reset, and glibc gave the 64 MiB back), and what is held falls back once it is freed."""
    code = (
        "import json, torch\n"
        "from oobleck_slurm.peak_memory import PeakMemory, warm_up\n"
        "warm_up(); probe = PeakMemory()\n"
        "probe.start(); a = torch.ones(64 << 18); del a; first = probe.peak()\n"
        "probe.start(); b = torch.ones(32 << 18); second, held = probe.peak(), probe.now(); del b\n"
        "print(json.dumps([probe.method, first, second, held, probe.now()]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **MALLOC_ENV))
    assert done.returncode == 0, done.stderr[-2000:]
    method, first, second, held, after = json.loads(done.stdout.splitlines()[-1])
    mib = 2**20
    assert method == "clear_refs"
    assert abs(first - 64 * mib) < 2 * mib and abs(second - 32 * mib) < 2 * mib and abs(held - 32 * mib) < 2 * mib
    assert abs(after) < 2 * mib
