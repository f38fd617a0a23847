"""Stages wider than one worker (ZeRO-3 sharded inside the stage: engine/shard.py) train exactly: per-step
losses and final parameters equal the single-process fp64 reference. Hand-made plans on 2 nodes x 4
workers (8 real processes, real gloo groups under NCCL's ordering rules), mixing widths 1, 2 and 4 so
that replicas of a layer hold it in different shards. With AdamW and with CAME (its row/column statistics
reduced inside the stage, optim/came_sharded.py), through plan changes and checkpoints between widths."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from plan_runs import WORLD, assert_exact, run_plans, warm_server

from oobleck_slurm.agent.warm import WarmServer
from oobleck_slurm.engine.layout import ExecPlan, PipelineSpec
from oobleck_slurm.engine.shard import factored_moves, slice_moves, vector_spans
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.models import gpt_config

pytestmark = pytest.mark.slow


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
    yield from warm_server()


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


def test_a_kill_in_a_folded_stages_reduce_scatter_beside_a_sharded_came_step_held_pending(warm, tmp_path):
    """The commit point split on sharded CAME stages, placed by the production fault hooks
    (engine/faults.py). Each node is one pipeline of one 4-wide kept stage folding microbatches of 2.
    Rank 1 is held at step 2's commit wait until the generation fails: it holds step 2 pending (its
    ShardedCAME statistics reduced in the stage, the update not applied). Rank 4 dies in step 3 during
    its stage's reduce-scatter, once ranks 0, 2 and 3 have reached step 3 (they applied step 2); its
    node's other ranks die with it. Rank 1 completes step 2 alone, every survivor goes on at step 3 as
    two 2-wide stages whose shards are re-cut from the ranks that applied step 2 and from rank 1; the
    losses, parameters and optimizer state equal the reference's."""
    train = dataclasses.replace(came_job().train, steps=5, microbatch_size=2, num_microbatches=6)
    job = dataclasses.replace(came_job(), train=train)
    folded = ExecPlan(6, 6, (PipelineSpec((0,), (0, 6), 0, 3, (4,), (True,)),
                             PipelineSpec((4,), (0, 6), 3, 3, (4,), (True,))))
    halves = ExecPlan(6, 6, (PipelineSpec((0, 2), (0, 3, 6), 0, 6, (2, 2), (True, False)),))
    faults = [{"node": "node0", "worker": 1, "step": 2, "at": "wait:last", "do": "hold"},
              {"node": "node1", "worker": 0, "step": 3, "at": "scatter", "after": ["node0:0", "node0:2", "node0:3"]}]
    reports: dict[int, tuple[int, bool]] = {}
    losses, layers = run_plans(warm, tmp_path, job, [(0, folded), (3, halves)],
                               kill={"ranks": [4, 5, 6, 7], "faults": faults}, reports=reports)
    assert reports == {0: (3, False), 1: (2, True), 2: (3, False), 3: (3, False)}
    assert_exact(job, losses, layers, optimizer_state=True)
