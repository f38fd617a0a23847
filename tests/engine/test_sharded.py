"""Stages wider than one worker (ZeRO-3 sharded inside the stage: engine/shard.py) train exactly: per-step
losses and final parameters equal the single-process fp64 reference. Hand-made plans on 2 nodes x 4
workers (8 real processes, real gloo groups under NCCL's ordering rules), mixing widths 1, 2 and 4 so
that replicas of a layer hold it in different shards. With AdamW and with CAME (its row/column statistics
reduced inside the stage, optim/came_sharded.py), through plan changes and checkpoints between widths."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from reference import train_reference

from oobleck_slurm.engine.layout import ExecPlan, PipelineSpec
from oobleck_slurm.engine.shard import factored_moves, slice_moves, vector_spans
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.models import gpt_config
from oobleck_slurm.protocol import keys
from oobleck_slurm.supervisor.warm import WarmProcess, WarmServer

pytestmark = pytest.mark.slow
RUN = Path(__file__).resolve().parents[1] / "sharded_run.py"
JOB_TIMEOUT_S = 400.0  # 8 processes on 2 shared cores
WORLD = 8
POLL_S = 0.05  # how often the test looks for the killed processes' exits


def tiny_job(steps: int = 3) -> JobSpec:
    return JobSpec(
        model=ModelSpec(gpt_config("tiny")),  # 6 layers
        data=DataSpec("random", num_samples=512, seed=1),
        optim=OptimSpec("adamw", lr=3e-3, weight_decay=0.1),
        train=TrainSpec(steps=steps, microbatch_size=4, num_microbatches=4, seed=0, grad_clip=0.5,
                        warmup_steps=2, precision="fp64"),
    )


def came_job(steps: int = 3) -> JobSpec:
    """tiny_job with CAME (its default betas and eps, as the reference's whole-layer CAME)."""
    return dataclasses.replace(tiny_job(steps), optim=OptimSpec("came", lr=3e-3, weight_decay=0.1))


# node 0 = ranks 0-3, node 1 = ranks 4-7; wide stages kept (parameters gathered once per step) or
# resharded (gathered around each use, gradients scattered each microbatch): both modes in each plan
WIDE_AND_MIXED = ExecPlan(6, 4, (PipelineSpec((0,), (0, 6), 0, 2, (4,), (True,)),
                                 PipelineSpec((4, 6, 7), (0, 3, 5, 6), 2, 2, (2, 1, 1))))
TWO_WIDE_AND_NARROW = ExecPlan(6, 4, (PipelineSpec((0, 2), (0, 3, 6), 0, 3, (2, 2), (False, True)),
                                      PipelineSpec((4, 5, 6, 7), (0, 2, 3, 5, 6), 3, 1)))
ALONE = ExecPlan(6, 4, (PipelineSpec((4,), (0, 6), 0, 4, (4,)),))  # one resharded 4-wide stage on node 1


@pytest.fixture(scope="module")
def warm() -> Iterator[WarmServer]:
    """The ranks are forked from one warm server (supervisor/warm.py), as an agent forks its workers:
    torch and the engine are imported once for the module, not once per rank (8 per test)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(RUN.parent), os.environ.get("PYTHONPATH", "")])}
    server = WarmServer(env=env)
    try:
        assert server.ready.wait(JOB_TIMEOUT_S) and server.alive()
        yield server
    finally:
        server.close()


def run_plans(warm: WarmServer, tmp_path: Path, job: JobSpec, plans: list[tuple[int, ExecPlan]],
              kill: dict | None = None, checkpoints: tuple[int, ...] = (), ordered: str = "1") -> tuple[dict[int, float], dict]:
    """Run `plans` [(first step, plan)] on 8 worker processes. With `kill` {"ranks", "step", "wait"}
    those ranks kill -9 themselves inside that step of the first plan; this process then plays the
    coordinator: it sets the failed key once they are gone, collects the survivors' steps and names
    the step to resume at (recovery.py), and the survivors go on with the second plan. The plans
    numbered in `checkpoints` start from a checkpoint the plan before writes (sharded_run.py). `ordered`
    "0": plain gloo instead of NCCL's ordering rules (gloo's own way of reduce-scattering, comm.py)."""
    (tmp_path / "job.json").write_text(job.to_json())
    entries = [{"step": s, "plan": p.to_json(), "checkpoint": k in checkpoints} for k, (s, p) in enumerate(plans)]
    if kill is not None:
        entries[0]["kill"] = kill
        entries[1]["world"] = WORLD - len(kill["ranks"])
    (tmp_path / "plans.json").write_text(json.dumps(entries))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OOBLECK_NCCL_ORDER": ordered}
    logs = [tmp_path / f"rank{r}.log" for r in range(WORLD)]
    procs = [warm.spawn(RUN.stem, [str(tmp_path), str(store.port), str(r), str(WORLD)], env, str(logs[r]))
             for r in range(WORLD)]
    try:
        if kill is not None:
            coordinate(store, procs, kill)
        for p in procs:
            p.wait(timeout=JOB_TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outputs = [log.read_text(errors="replace") if log.exists() else "" for log in logs]
    codes = [p.returncode for p in procs]
    expected = [-9 if kill and r in kill["ranks"] else 0 for r in range(WORLD)]
    assert codes == expected, "\n".join(f"--- rank {r} ({c}) ---\n{o[-3000:]}" for r, (c, o) in enumerate(zip(codes, outputs)))
    losses = {int(k): v for k, v in json.loads((tmp_path / "losses.json").read_text()).items()}
    layers: dict = {}
    for r in range(WORLD):
        if (tmp_path / f"layers{r}.pt").exists():
            layers.update(torch.load(tmp_path / f"layers{r}.pt"))
    return losses, layers


def assert_replicas_agree(tmp_path: Path, rtol: float = 1e-5) -> int:
    """The whole layers every replica gathered at the end (sharded_run.py) agree, parameters and optimizer
    state (CAME's row/column statistics included), whatever their widths; returns the layers compared."""
    replicas: dict[str, list[dict[str, torch.Tensor]]] = {}
    for r in range(WORLD):
        if (tmp_path / f"replicas{r}.pt").exists():
            for (key, _), payload in torch.load(tmp_path / f"replicas{r}.pt").items():
                replicas.setdefault(key, []).append(payload)
    compared = 0
    for key, payloads in replicas.items():
        first = payloads[0]
        for other in payloads[1:]:
            assert sorted(other) == sorted(first), key
            for name, t in first.items():
                err = float((other[name].double() - t.double()).abs().max() / t.double().abs().max().clamp_min(1e-300))
                assert err <= rtol, f"{key} {name}: replicas differ by {err:.2e}"
            compared += 1
    return compared


def coordinate(store: dist.TCPStore, procs: list[WarmProcess], kill: dict) -> None:
    """The coordinator's part of a failure of generation 0 (module doc of run_plans)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while any(procs[r].poll() is None for r in kill["ranks"]):  # detection: the processes' exits
        assert time.monotonic() < deadline, "the ranks to kill are still alive"
        time.sleep(POLL_S)
    store.set(keys.failed(0), "{}")
    survivors = [r for r in range(WORLD) if r not in kill["ranks"]]
    store.wait([f"report/0/{r}" for r in survivors], dt.timedelta(seconds=JOB_TIMEOUT_S))
    reports = [store.get(f"report/0/{r}").decode().split() for r in survivors]
    steps = [int(step) for step, _ in reports]
    # some survivor applied the interrupted step: the others hold it pending and complete it
    assert max(steps) - min(steps) <= 1 and all(int(ok) for step, ok in reports if int(step) < max(steps))
    store.set("resume/0", str(max(steps)))


def assert_exact(job: JobSpec, losses: dict[int, float], layers: dict, rtol: float = 1e-5) -> None:
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
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-6  # training moved: the comparison can fail


# bucket_mb 0.7 (the tiny model's layers are 0.16, 0.38 x 4 and 0.13 MB in fp64): the kept 4-wide
# stage gathers [0] [1 2] [3 4] [5] and reduce-scatters [5 4 3] [2 1] [0], while the other pipeline's
# stages reduce each layer alone; by default each collective takes all the stage's layers but the first.
# Under NCCL's ordering rules the stages reduce-scatter as on NCCL; on plain gloo ("0") by an all-reduce
# in place (comm.SCATTER_BY_ALLREDUCE), what a CPU job runs
@pytest.mark.parametrize(("plan", "bucket_mb", "ordered"),
                         [(WIDE_AND_MIXED, 25.0, "1"), (WIDE_AND_MIXED, 0.7, "1"), (TWO_WIDE_AND_NARROW, 25.0, "1"),
                          (WIDE_AND_MIXED, 0.7, "0")],
                         ids=["w4+w2-1-1", "w4+w2-1-1-buckets", "w2-2+w1x4", "w4+w2-1-1-buckets-plain-gloo"])
def test_sharded_stages_match_the_reference(warm, tmp_path, plan, bucket_mb, ordered):
    job = dataclasses.replace(tiny_job(), train=dataclasses.replace(tiny_job().train, bucket_mb=bucket_mb))
    losses, layers = run_plans(warm, tmp_path, job, [(0, plan)], ordered=ordered)
    assert_exact(job, losses, layers)


def test_a_pipelines_only_stage_wider_than_its_microbatch_folds_microbatches(warm, tmp_path):
    # microbatches of 2 samples: node 0's only stage of 4 ranks computes 2 microbatches a pass, a sample
    # on each rank; its 3 microbatches end with a pass of 1, on ranks 1 and 3 alone (0 and 2 skip it
    # and reduce behind their first pass), beside a pipeline of widths 2, 1, 1. Then node 1 alone folds
    # all 5 microbatches: layers copied into it from both pipelines' shards. Last, node 0's stage gets
    # 1 microbatch, less than a pass: ranks 0 and 2 have no sample in the step and still gather and
    # reduce-scatter with the others
    train = dataclasses.replace(tiny_job().train, steps=5, microbatch_size=2, num_microbatches=5)
    job = dataclasses.replace(tiny_job(), train=train)
    folded = ExecPlan(6, 5, (PipelineSpec((0,), (0, 6), 0, 3, (4,), (True,)),
                             PipelineSpec((4, 6, 7), (0, 3, 5, 6), 3, 2, (2, 1, 1))))
    alone = ExecPlan(6, 5, (PipelineSpec((4,), (0, 6), 0, 5, (4,), (True,)),))
    short = ExecPlan(6, 5, (PipelineSpec((0,), (0, 6), 0, 1, (4,), (True,)),
                            PipelineSpec((4, 6, 7), (0, 3, 5, 6), 1, 4, (2, 1, 1))))
    losses, layers = run_plans(warm, tmp_path, job, [(0, folded), (2, alone), (4, short)])
    assert_exact(job, losses, layers)


@pytest.mark.parametrize("make_job", [tiny_job, came_job], ids=["adamw", "came"])
def test_plan_changes_between_widths_copy_named_slices_exactly(warm, tmp_path, make_job):
    # widths 4 | 2,1,1  ->  2,2 | 1,1,1,1  ->  1 stage of 4 on node 1 alone, node 0 spare: shards
    # re-cut on the same node, layers sent across nodes, and a width-1 layer re-sharded. CAME: first
    # moments move as part ranges, vectors' second moments as their elements of them, row/column
    # statistics whole
    job = make_job(steps=4)
    losses, layers = run_plans(warm, tmp_path, job, [(0, WIDE_AND_MIXED), (1, TWO_WIDE_AND_NARROW), (3, ALONE)])
    assert_exact(job, losses, layers)


def test_kill_9_of_a_node_mid_step_regroups_the_survivors_at_another_width(warm, tmp_path):
    # node 1 (ranks 4-7: a stage of 2 and two of 1) is killed inside step 2, in its third wait; node 0
    # (the 4-wide replica) goes on alone as two stages of 2: shards re-cut, the step completed or replayed
    job = tiny_job(steps=4)
    halves = ExecPlan(6, 4, (PipelineSpec((0, 2), (0, 3, 6), 0, 4, (2, 2), (True, False)),))
    losses, layers = run_plans(warm, tmp_path, job, [(0, WIDE_AND_MIXED), (2, halves)],
                               kill={"ranks": [4, 5, 6, 7], "step": 2, "wait": 3})
    assert_exact(job, losses, layers)


def test_came_statistics_come_whole_from_the_replica_of_the_shard():
    # layer 0 held at width 4 on ranks 0-3 and at width 1 on rank 4 (test_logic's slice_moves case)
    held = {0: {0: (4, 0)}, 1: {0: (4, 1)}, 2: {0: (4, 2)}, 3: {0: (4, 3)}, 4: {0: (1, 0)}}
    moves = slice_moves([((0, 1), range(0, 1)), ((6,), range(0, 1))], held, [(0, 4, 6)])
    # ranks 0 and 1 re-cut their own replica: they keep their statistics; rank 6 gets rank 4's
    assert factored_moves(moves, held) == [(0, 0, 0), (0, 1, 1), (0, 4, 6)]
    # a vector's second moment moves as its elements of a range, a matrix's has none
    assert vector_spans([(4, 3), (3,), (2, 2), (5,)], 10, 20) == [(12, 15), (19, 20)]


def test_came_on_sharded_stages_matches_the_reference(warm, tmp_path):
    job = came_job()
    losses, layers = run_plans(warm, tmp_path, job, [(0, WIDE_AND_MIXED)])
    assert_exact(job, losses, layers)
    # each layer has a replica at width 4 and one at width 2 or 1: gathered whole, their CAME state agrees
    assert any(name.endswith(".exp_avg_sq_row") for name in layers["block.00"])
    assert assert_replicas_agree(tmp_path) == 6


def test_came_checkpoints_are_whole_layers_between_widths(warm, tmp_path):
    # a 4-wide stage writes whole-layer files that stages of 1 and 2 read (step 1); stages of 1 write the
    # next, which a stage of 4 reads (step 3)
    job = came_job(steps=4)
    narrow_first = ExecPlan(6, 4, (PipelineSpec((4, 5, 6, 7), (0, 2, 3, 5, 6), 0, 2),
                                   PipelineSpec((0, 2), (0, 3, 6), 2, 2, (2, 2), (True, False))))
    losses, layers = run_plans(warm, tmp_path, job, [(0, WIDE_AND_MIXED), (1, narrow_first), (3, ALONE)], checkpoints=(1, 2))
    assert_exact(job, losses, layers)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step1", "step3"]
