"""Reads off the critical path (engine/prefetch.py, engine/batches.py `Reads`, `StepBatches.read`): a rank
reads only its own slices of its microbatches, the same samples as slicing the whole microbatch; a read
made ahead is used only for the step, plan and slices it was made for; the reader's exception is raised
in the training thread with its message; the thread stops. The worker trains the same bits with reading
ahead on and off, through a plan change, and on the reference's trajectory."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from reference import train_reference
from three_ranks import HANG_S, train_three_ranks

from oobleck_slurm.data.tokens import TokenFileMeta, meta_to_json, sidecar_path
from oobleck_slurm.engine.batches import Reads, StepBatches, open_dataset
from oobleck_slurm.engine.from_recipe import job_from_recipe
from oobleck_slurm.engine.layout import ExecPlan, PipelineSpec
from oobleck_slurm.engine.prefetch import Prefetcher
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.models import gpt_config
from oobleck_slurm.recipe import RecipeError, load_recipe

SEQ = 8
B = 4  # microbatch size
MICROBATCHES = 12


def token_file(path: Path, num_tokens: int, offset: int) -> str:
    """A flat token file (ids offset, offset + 1, ... mod 256) with its sidecar."""
    (np.arange(offset, offset + num_tokens) % 256).astype("<u2").tofile(path)
    sidecar_path(path).write_text(meta_to_json(TokenFileMeta("uint16", 256, "byte", num_tokens, f"{offset:064x}")))
    return str(path)


@pytest.fixture
def batches(tmp_path: Path) -> StepBatches:
    """Two weighted sources, one a glob of two files: every read path (sources, streams, windows)."""
    a = token_file(tmp_path / "a.bin", 900, 0)
    token_file(tmp_path / "b0.bin", 500, 7)
    token_file(tmp_path / "b1.bin", 650, 13)
    spec = DataSpec("tokens", sources=((a, 0.6), (str(tmp_path / "b*.bin"), 0.4)))
    return StepBatches(open_dataset(spec, SEQ, 256), B * MICROBATCHES, B, seed=3)


def whole_microbatches_sliced(batches: StepBatches, reads: Reads) -> list[torch.Tensor]:
    """The former read: each whole microbatch, then this rank's rows of it, as windows."""
    out = []
    for slices in reads.passes:
        rows = [torch.cat([x[lo:hi], y[lo:hi, -1:]], dim=1)
                for m, lo, hi in slices for x, y in [batches.microbatch(reads.step, m)]]
        out.append(torch.cat(rows) if rows else torch.empty(0, SEQ + 1, dtype=torch.int64))
    return out


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# A pipeline's stage of width 1, 2 and 4 (every rank a slice of each microbatch), and one of 8 on
# microbatches of 4 (folded: each pass 2 microbatches, each rank one sample of one of them).
PLANS = [
    ExecPlan(6, MICROBATCHES, (PipelineSpec((0, 1), (0, 3, 6), 0, 5), PipelineSpec((2,), (0, 6), 5, 7))),
    ExecPlan(6, MICROBATCHES, (PipelineSpec((0, 2), (0, 3, 6), 0, 9, (2, 4)), PipelineSpec((6,), (0, 6), 9, 3))),
    ExecPlan(6, MICROBATCHES, (PipelineSpec((0,), (0, 6), 0, 12, (8,), (True,)),)),
]


@pytest.mark.parametrize("plan", PLANS, ids=["narrow", "wide", "folded"])
def test_each_rank_reads_only_its_slices_and_they_are_the_whole_microbatchs_rows(batches, plan):
    for step in (0, 1, 7, 40):  # 40: past the end of the smaller source's first pass
        for rank in plan.ranks:
            role = plan.role(rank)
            assert role is not None
            reads = Reads.of(step, plan, role, B)
            got = batches.read(reads)
            assert equal(got, whole_microbatches_sliced(batches, reads))
            assert sum(len(w) for w in got) == role.mb_count * B // role.width  # its share, no more


def test_union_of_a_wide_stages_reads_is_each_microbatch_once(batches):
    plan = PLANS[1]
    stage = plan.pipelines[0].stage_ranks(1)  # width 4, microbatches 0-8
    rows = [batches.read(Reads.of(5, plan, plan.role(r), B)) for r in stage]  # type: ignore[arg-type]
    for m in range(9):
        x, y = batches.microbatch(5, m)
        whole = torch.cat([w[m] for w in rows])  # rank j holds rows [j, j+1) of each microbatch of 4
        assert torch.equal(whole[:, :-1], x) and torch.equal(whole[:, 1:], y)


class CountingReader:
    """StepBatches.read, recording each key it is called with."""

    def __init__(self, batches: StepBatches) -> None:
        self.batches, self.keys = batches, []  # type: ignore[var-annotated]

    def __call__(self, reads: Reads) -> list[torch.Tensor]:
        self.keys.append(reads)
        return self.batches.read(reads)


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """fn() in a thread; fails the test if it has not returned within `seconds` (a hang)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} did not return within {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_reads_made_ahead_are_the_synchronous_reads_over_many_steps_and_plan_changes(batches):
    reader = CountingReader(batches)
    reads = Prefetcher(reader)
    plan_at = {0: PLANS[0], 9: PLANS[1], 17: PLANS[2], 30: PLANS[0]}
    plan, rank, misses = PLANS[0], 0, 0
    for step in range(40):
        if step in plan_at:  # a re-plan: this rank's microbatches and slices change
            plan, rank, misses = plan_at[step], (rank + 1) % len(plan_at[step].ranks), misses + 1
        key = Reads.of(step, plan, plan.role(plan.ranks[rank]), B)  # type: ignore[arg-type]
        got = within(HANG_S, lambda key=key: reads.take(key))
        reads.ahead(replace(key, step=step + 1))
        assert equal(got, whole_microbatches_sliced(batches, key)), step
    # the first step of each plan was read in the training thread, every other one ahead
    assert (reads.misses, reads.hits) == (misses, 40 - misses)
    assert reads.stop(HANG_S) and not reads.running


def test_a_read_made_for_another_plan_is_never_used_even_with_the_same_slices(batches):
    reader = CountingReader(batches)
    reads = Prefetcher(reader)
    other = ExecPlan(6, MICROBATCHES, (PipelineSpec((0, 1), (0, 3, 6), 0, 5), PipelineSpec((2, 3), (0, 2, 6), 5, 7)))
    old, new = Reads.of(4, PLANS[0], PLANS[0].role(0), B), Reads.of(4, other, other.role(0), B)  # type: ignore[arg-type]
    assert old.passes == new.passes and old != new  # rank 0 reads the same rows in both plans
    reads.ahead(old)
    within(HANG_S, lambda: reads.take(new))
    # read again, for the new plan (the read made ahead for the old one may end before or after it)
    assert reads.misses == 1 and reader.keys.count(new) == 1
    reads.ahead(replace(new, step=5))
    within(HANG_S, lambda: reads.take(replace(new, step=6)))  # another step: a miss too
    assert reads.misses == 2 and reads.hits == 0
    reads.stop(HANG_S)


def test_the_readers_exception_is_raised_by_the_take_of_its_key_with_its_message(batches):
    def read(step: int) -> int:
        if step == 3:
            raise OSError(f"shard-0000{step}.bin: Input/output error")
        return step

    reads: Prefetcher[int, int] = Prefetcher(read)
    reads.ahead(3)
    with pytest.raises(OSError, match=r"^shard-00003.bin: Input/output error$"):
        within(HANG_S, lambda: reads.take(3))
    reads.ahead(4)  # the thread goes on after a failed read
    assert within(HANG_S, lambda: reads.take(4)) == 4 and reads.hits == 2
    reads.stop(HANG_S)

    def setup() -> None:
        raise RuntimeError("no such CUDA device")

    broken: Prefetcher[int, int] = Prefetcher(read, setup=setup)
    broken.ahead(5)
    with pytest.raises(RuntimeError, match="no such CUDA device"):
        within(HANG_S, lambda: broken.take(5))
    broken.ahead(6)  # no thread left: the take reads for itself
    assert within(HANG_S, lambda: broken.take(6)) == 6


def test_stop_ends_the_thread_also_in_a_read_and_takes_then_read_for_themselves():
    entered, release = threading.Event(), threading.Event()

    def read(step: int) -> int:
        if step == 2 and not release.is_set():
            entered.set()
            release.wait(HANG_S)
        return step

    reads: Prefetcher[int, int] = Prefetcher(read)
    reads.ahead(1)
    assert within(HANG_S, lambda: reads.take(1)) == 1 and reads.running
    reads.ahead(2)
    assert entered.wait(HANG_S)  # the thread is in the read, blocked
    assert not reads.stop(0.05)  # the read it is in goes on ...
    release.set()
    assert within(HANG_S, lambda: reads.take(2)) == 2 and reads.misses == 1  # ... but is not used
    assert reads.stop(HANG_S) and not reads.running
    reads.ahead(3)  # stopped: nothing starts
    assert not reads.running and within(HANG_S, lambda: reads.take(3)) == 3


# ---- the worker --------------------------------------------------------------------------------------

def tiny_job(prefetch: bool, steps: int = 6) -> JobSpec:
    return JobSpec(
        model=ModelSpec(gpt_config("tiny")),  # 6 layers
        data=DataSpec("random", num_samples=512, seed=1, prefetch=prefetch),
        optim=OptimSpec("adamw", lr=3e-3, weight_decay=0.1),
        train=TrainSpec(steps=steps, microbatch_size=2, num_microbatches=8, seed=0, grad_clip=0.5,
                        warmup_steps=2, precision="fp64"),
    )


@pytest.mark.slow
def test_the_worker_trains_the_same_bits_reading_ahead_or_not_through_a_replan():
    ahead, now = train_three_ranks(tiny_job(prefetch=True)), train_three_ranks(tiny_job(prefetch=False))
    assert ahead.middle_reads == now.middle_reads == 0  # the middle stage of the first plan read nothing
    assert ahead.losses == now.losses  # bit for bit
    reference, _ = train_reference(tiny_job(True))
    assert ahead.losses == pytest.approx(reference, rel=1e-9)
    # after the re-plan: each reading rank read its first step itself, the other two ahead; all stopped
    assert ahead.readers == {0: (2, 1, True), 1: (2, 1, True), 2: (2, 1, True)}
    assert now.readers == {0: (0, 3, True), 1: (0, 3, True), 2: (0, 3, True)}
    assert len(ahead.waits) == 6 and all(isinstance(w, float) and w >= 0 for w in ahead.waits)


def test_the_recipe_key_turns_reading_ahead_off_and_is_validated(tmp_path):
    assert load_recipe().data.prefetch and job_from_recipe(load_recipe(), "t.bin").data.prefetch  # default on
    off = tmp_path / "off.yaml"
    off.write_text("data:\n  prefetch: false\n")
    assert job_from_recipe(load_recipe(off), "t.bin").data.prefetch is False
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  prefetch: sometimes\n")
    with pytest.raises(RecipeError, match="data.prefetch: expected true or false"):
        load_recipe(bad)
