"""Replica integrity (engine/integrity.py): the checksum sees every single bit flip, the attribution is
right for every pattern of checksums, and on real gloo groups (ranks as threads) a bit flipped in one
replica's parameter is caught at the next check's commit point, attributed to its rank, and the step
withheld on every rank (state bitwise unchanged); on stages sharded alike, shards are compared."""

from __future__ import annotations

import datetime as dt
import itertools

import pytest
import torch
import torch.distributed as dist
from exec_plans import make_plan
from rank_threads import on_ranks

from oobleck_slurm.engine.abort import AbortableGeneration
from oobleck_slurm.engine.integrity import (
    ReplicaMismatchError,
    TransferCorruptError,
    attribute,
    check_due,
    checksum,
    flip_bit,
    needs_second_read,
    next_check,
    pack,
    unpack,
)
from oobleck_slurm.engine.layout import ExecPlan, PipelineSpec
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.models import gpt_config
from oobleck_slurm.timeouts import JobTimeouts

TIMEOUTS = JobTimeouts(collective_timeout=60.0, step_timeout=300.0)

# ---- the checksum ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_every_single_bit_flip_changes_the_checksum(dtype):
    torch.manual_seed(0)
    tensors = [torch.randn(5, 3).to(dtype), torch.randn(7).to(dtype), torch.tensor(3.0)]
    base = int(checksum(tensors, torch.device("cpu")))
    for which, t in enumerate(tensors):
        for element in range(t.numel()):
            for bit in range(t.element_size() * 8):
                copy = [x.clone() for x in tensors]
                flip_bit(copy[which], element, bit)
                assert int(checksum(copy, torch.device("cpu"))) != base, (which, element, bit)


def test_the_checksum_is_of_the_bits_not_the_values():
    zero, negative_zero = torch.zeros(4), torch.zeros(4)
    negative_zero[1] = -0.0
    assert torch.equal(zero, negative_zero)  # equal as values
    assert int(checksum([zero], torch.device("cpu"))) != int(checksum([negative_zero], torch.device("cpu")))


def test_batching_small_tensors_gives_the_sum_of_every_word():
    torch.manual_seed(1)
    big = torch.randn(5 << 20)  # 20 MB: summed alone; the small ones are concatenated
    tensors = [torch.randn(100), big, torch.randn(7, 3).double(), torch.tensor(4.0), torch.randn(9).half()]
    want = sum(int(t.reshape(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
                   .to(torch.int64).sum()) for t in tensors)
    got = int(checksum(tensors, torch.device("cpu")))
    assert got % 2**64 == want % 2**64


def test_packed_checksums_survive_a_float64_sum_with_zeros():
    values = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 0x1234_5678_9ABC_DEF0, -12345], dtype=torch.int64)
    packed = pack(values) + torch.zeros(2 * len(values), dtype=torch.float64)  # what the other ranks add
    assert unpack(packed.tolist()) == [v % 2**64 for v in values.tolist()]


# ---- the attribution, exhaustively ----------------------------------------------------------------


def reference(values: dict[int, int], again: dict[int, int]) -> tuple[set[int], set[int]]:
    """(attributed, unresolved) by the rule's definition, for one group."""
    if len(set(values.values())) == 1:
        return set(), set()
    for v in set(values.values()):
        holders = {r for r, x in values.items() if x == v}
        if len(holders) * 2 > len(values):
            return set(values) - holders, set()
    unsteady = {r for r in values if again[r] != values[r]}
    return (unsteady, set()) if unsteady else (set(), set(values))


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_attribution_of_every_pattern_of_one_group(n):
    ranks = range(10, 10 + n)
    for pattern in itertools.product(range(n), repeat=n):  # every assignment of checksums to holders
        values = dict(zip(ranks, pattern))
        agains = ([dict(values)] + [{**values, r: 99} for r in ranks] if needs_second_read({(0, 1, 0): values})
                  else [dict(values)])
        for again in agains:  # steady, or one holder reading another value the second time
            verdict = attribute({(0, 1, 0): values}, {(0, 1, 0): again})
            want_attributed, want_unresolved = reference(values, again)
            assert set(verdict.attributed) == want_attributed, (values, again, verdict)
            assert set(verdict.unresolved) == want_unresolved, (values, again, verdict)
            assert verdict.ok == (len(set(pattern)) == 1)
            assert verdict.suspects == tuple(sorted(want_attributed | want_unresolved))


def test_attribution_over_several_groups_adds_up():
    sums = {(0, 1, 0): {0: 5, 1: 5, 2: 6}, (1, 1, 0): {0: 7, 1: 7, 2: 7}, (2, 2, 1): {3: 1, 4: 2}}
    assert needs_second_read(sums)
    verdict = attribute(sums, {(2, 2, 1): {3: 1, 4: 2}})
    assert verdict.attributed == (2,) and verdict.unresolved == (3, 4)
    assert verdict.groups == ((0, 1, 0), (2, 2, 1)) and "layer 0" in verdict.detail and "shard 1 of 2" in verdict.detail
    assert attribute({(0, 1, 0): {0: 1, 1: 1}}).ok and not needs_second_read({(0, 1, 0): {0: 1, 1: 1}})


# ---- on real process groups ------------------------------------------------------------------------


def tiny_job(steps: int, interval: int = 1) -> JobSpec:
    return JobSpec(model=ModelSpec(gpt_config("tiny")), data=DataSpec("random", num_samples=256, seed=1),
                   optim=OptimSpec("adamw", lr=3e-3, weight_decay=0.1),
                   train=TrainSpec(steps=steps, microbatch_size=2, num_microbatches=6, seed=0,
                                   integrity_interval=interval, integrity_max_cost=0.0))  # no cost bound: as asked


def whole_state(worker: Worker) -> dict[int, list[torch.Tensor]]:
    return {i: [t.detach().clone() for t in worker.holding_tensors(i)] for i in sorted(worker.layers)}


def run_until_mismatch(plan: ExecPlan, world: int, flip: tuple[int, int, int], steps: int = 4,
                       interval: int = 1) -> list[tuple[int, ReplicaMismatchError | None, bool]]:
    """Train `plan` on `world` ranks; rank flip[0] flips one bit of its layer flip[1]'s first parameter
    at the start of step flip[2]. Per rank: (steps completed, the mismatch raised, state unchanged by
    the step that raised)."""
    job = tiny_job(steps, interval)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))

    def rank(r: int) -> tuple[int, ReplicaMismatchError | None, bool]:
        torch.set_num_threads(1)
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=dt.timedelta(seconds=30))
        worker = Worker(job, r)
        worker.adopt(plan, AbortableGeneration(client, 0, r, world, plan, TIMEOUTS))
        while worker.step < steps:
            if (r, worker.step) == (flip[0], flip[2]):
                flip_bit(worker.holding_tensors(flip[1])[0], 3, 20)
            before = whole_state(worker)
            try:
                worker.train_step()
            except ReplicaMismatchError as err:
                after = whole_state(worker)
                same = all(torch.equal(a, b) for i in before for a, b in zip(before[i], after[i]))
                return worker.step, err, same and worker.pending is None
        return worker.step, None, False

    return on_ranks(world, rank)


def test_a_bit_flip_in_one_of_three_replicas_is_attributed_to_its_rank_at_the_next_check():
    plan = make_plan(6, [[0, 6], [0, 3, 6], [0, 2, 6]], [2, 2, 2])  # heterogeneous: 3 holders of each layer
    results = run_until_mismatch(plan, 5, flip=(4, 4, 2))  # rank 4 holds layers 2-5 (pipeline 2, stage 1)
    for step, err, unchanged in results:
        assert step == 2 and err is not None, results  # caught at step 2's commit point, on every rank
        assert err.verdict.attributed == (4,) and err.verdict.unresolved == ()
        assert err.verdict.groups == ((4, 1, 0),)
        assert unchanged  # the step withheld everywhere: it is replayed after the eviction


def test_with_two_replicas_a_steady_mismatch_makes_both_holders_suspects():
    plan = make_plan(6, [[0, 6], [0, 6]], [3, 3])
    results = run_until_mismatch(plan, 2, flip=(0, 1, 1))
    for step, err, unchanged in results:
        assert step == 1 and err is not None and unchanged
        assert err.verdict.attributed == () and err.verdict.unresolved == (0, 1)


def test_the_interval_is_kept_and_a_flip_between_checks_is_caught_at_the_next_one():
    plan = make_plan(6, [[0, 6], [0, 6], [0, 6]], [2, 2, 2])
    results = run_until_mismatch(plan, 3, flip=(2, 0, 2), steps=6, interval=3)  # checks at steps 1, 4
    assert [(s, e.verdict.attributed if e else None) for s, e, _ in results] == [(4, (2,))] * 3


def test_shards_of_stages_sharded_alike_are_compared():
    # three pipelines of one stage of two ranks each: layer 2's shard 1 is held by ranks 1, 3 and 5
    plan = ExecPlan(6, 6, tuple(PipelineSpec((2 * p,), (0, 6), 2 * p, 2, widths=(2,)) for p in range(3)))
    results = run_until_mismatch(plan, 6, flip=(5, 2, 1))
    for step, err, unchanged in results:
        assert step == 1 and err is not None and unchanged
        assert err.verdict.attributed == (5,) and err.verdict.groups == ((2, 2, 1),)


# ---- recovery copies are verified --------------------------------------------------------------------

TWO = make_plan(6, [[0, 6], [0, 6]], [3, 3])  # ranks 0 and 1 hold every layer; rank 2 is a spare
MOVED = make_plan(6, [[0, 6], [0, 6]], [3, 3], first_rank=1)  # ranks 1 and 2: rank 2 receives every layer


def adopt_with_corrupt_sender(corrupt: set[int], transfers: list[tuple[int, int, int]]):
    """Ranks 0-2 train TWO for a step, then adopt MOVED, the ranks in `corrupt` sending corrupted
    copies; then one more step (its integrity check compares rank 2's copies with rank 1's). Per rank:
    the error raised (or None), its refetches, and its state."""
    job = tiny_job(steps=2)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))

    def rank(r: int):
        torch.set_num_threads(1)
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=dt.timedelta(seconds=30))
        worker = Worker(job, r)
        worker.adopt(TWO, AbortableGeneration(client, 0, r, 3, TWO, TIMEOUTS))
        worker.train_step()
        worker.corrupt_sends = r in corrupt
        try:
            worker.adopt(MOVED, AbortableGeneration(client, 1, r, 3, MOVED, TIMEOUTS), "memory", transfers)
        except Exception as err:  # noqa: BLE001 - what each rank raised is the result
            return err, worker.refetches, None
        worker.train_step()  # raises ReplicaMismatchError if a corrupted copy had been kept
        return None, worker.refetches, whole_state(worker)

    return on_ranks(3, rank)


def test_a_corrupted_recovery_copy_is_fetched_again_from_another_holder():
    transfers = [(i, 0, 2) for i in range(6)]  # rank 0's copies arrive corrupted; rank 1 holds them too
    results = adopt_with_corrupt_sender({0}, transfers)
    for err, refetches, _ in results:
        assert err is None, err
        assert refetches == [(i, 0, 2, 1) for i in range(6)]  # every rank knows, in the same order
    ours, theirs = results[2][2], results[1][2]
    assert ours is not None and theirs is not None  # and the step after the copy found the replicas equal
    assert all(torch.equal(a, b) for i in ours for a, b in zip(ours[i], theirs[i]))


def test_a_corrupted_copy_with_no_other_holder_left_is_an_error_naming_the_layer():
    transfers = [(i, 0, 2) for i in range(6)]
    results = adopt_with_corrupt_sender({0, 1}, transfers)  # the other holder sends corrupted copies too
    for err, _, _ in results:
        assert isinstance(err, TransferCorruptError) and "layer 0 copied to rank 2" in str(err), err


def test_checks_are_spaced_out_to_their_cost_budget():
    assert next_check(5, 1, 0.01, check_s=0.001, step_s=1.0) == 6  # 0.1%: every step
    assert next_check(5, 1, 0.01, check_s=0.05, step_s=1.0) == 10  # 5%: every 5 steps for 1%
    assert next_check(5, 3, 0.01, check_s=0.0, step_s=1.0) == 8  # never closer than the interval
    assert next_check(5, 1, 0.0, check_s=0.5, step_s=1.0) == 6  # no bound
    assert check_due(10, 1, first=10) and not check_due(9, 1, first=10) and not check_due(0, 1)
    assert not any(check_due(s, 0) for s in range(10))


def test_the_recipe_keys_are_checked_by_name(tmp_path):
    from oobleck_slurm.recipe import RecipeError, load_recipe

    for key, value in (("integrity_interval", -1), ("integrity_max_cost", 1.5)):
        path = tmp_path / f"{key}.yaml"
        path.write_text(f"name: t\nfault_tolerance:\n  {key}: {value}\n")
        with pytest.raises(RecipeError, match=f"fault_tolerance.{key}"):
            load_recipe(path)
