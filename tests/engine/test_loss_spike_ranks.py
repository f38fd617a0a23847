"""The loss-spike policy on real gloo groups (ranks as threads, tests/rank_threads.py): a spike forced on
one rank's loss (the "spike" fault's `Worker.loss_factor`) makes every rank skip the step, parameters
and optimizer state bitwise unchanged, the run then the one that skipped the same steps for another
reason; `max_consecutive` spikes in a row give every rank the stop verdict at the same step; a rank
that joins after a recovery receives the policy's state and judges as the survivors do; a checkpoint
carries the state to a resumed job."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable

import torch
import torch.distributed as dist
from exec_plans import make_plan
from rank_threads import on_ranks, worker_state

from oobleck_slurm.engine.abort import AbortableGeneration
from oobleck_slurm.engine.checkpoint import CheckpointWriter, read_data_record
from oobleck_slurm.engine.loss_spike import SpikePolicy, SpikeState
from oobleck_slurm.engine.recovery import reach_step
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.models import gpt_config
from oobleck_slurm.timeouts import JobTimeouts

TIMEOUTS = JobTimeouts(collective_timeout=60.0, step_timeout=300.0)
TWO = make_plan(6, [[0, 6], [0, 6]], [2, 2])  # two pipelines of one stage: data parallel
THREE = make_plan(6, [[0, 6], [0, 6], [0, 6]], [2, 1, 1])
POLICY = SpikePolicy(sigma=3.0, window=4, warmup=3, max_consecutive=2)
SPIKES = (5, 7, 8)  # one alone, then two in a row: the second stops
FACTOR = 1000.0


def job(steps: int) -> JobSpec:
    return JobSpec(model=ModelSpec(gpt_config("tiny")), data=DataSpec("random", num_samples=256, seed=1),
                   optim=OptimSpec("adamw", lr=1e-3, weight_decay=0.1),
                   train=TrainSpec(steps=steps, microbatch_size=2, num_microbatches=4, seed=0, precision="fp64",
                                   loss_spike=POLICY))


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))


def client(master: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=dt.timedelta(seconds=30))


def train(steps: int, poison: Callable[[int, Worker, int], object]) -> tuple[dict[int, list], dict[int, Worker]]:
    """Two data-parallel ranks for `steps` steps; `poison(rank, worker, step)` may disturb a step and
    returns what to undo after it. Per rank: (step, skipped, reason, unchanged, loss, stop verdict)."""
    master = store()
    seen: dict[int, list] = {0: [], 1: []}

    def rank(r: int) -> Worker:
        worker = Worker(job(steps), r)
        worker.adopt(TWO, AbortableGeneration(client(master), 0, r, 2, TWO, TIMEOUTS))
        for step in range(steps):
            before = worker_state(worker)
            undo = poison(r, worker, step)
            result = worker.train_step()
            if callable(undo):
                undo()
            seen[r].append((result.step, result.skipped, result.skip_reason, equal(before, worker_state(worker)),
                            result.loss, worker.spike_stop is not None))
        return worker

    workers = on_ranks(2, rank)
    return seen, dict(enumerate(workers))


def spike_on_rank_1(r: int, worker: Worker, step: int) -> None:
    # rank 1's loss (and so its gradients) jumps at the spike steps: a bad batch on one replica
    worker.loss_factor = (lambda s: FACTOR if s in SPIKES else 1.0) if r == 1 else None


def nan_on_rank_1(r: int, worker: Worker, step: int) -> object:
    # the reference: the same steps skipped by the non-finite guard (a NaN in one gradient element)
    if r != 1 or step not in SPIKES:
        return None
    p = next(worker.layers[3].parameters())
    return p.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("nan"))).remove


def test_a_spike_on_one_rank_makes_every_rank_skip_the_step_unchanged_and_max_consecutive_stops() -> None:
    steps = 9
    seen, workers = train(steps, spike_on_rank_1)
    for r in (0, 1):
        got = seen[r]
        assert [s[0] for s in got] == list(range(steps)) and workers[r].step == steps  # every step consumed
        assert [s[2] for s in got] == ["loss_spike" if s in SPIKES else None for s in range(steps)], got
        assert all(s[3] == (s[0] in SPIKES) for s in got), got  # skipped: bitwise unchanged; else trained
        assert [s[5] for s in got] == [s >= 8 for s in range(steps)]  # the second in a row: stop, on every rank
    assert workers[0].spike == workers[1].spike and workers[0].spike is not None
    assert workers[0].spike.spikes == (7, 8) and len(workers[0].spike.losses) == POLICY.window
    assert equal(worker_state(workers[0]), worker_state(workers[1]))  # the replicas still agree

    # The same run with those steps skipped for another reason (a NaN): every other step's loss and the
    # final state bitwise equal, so a spike skipped is a step skipped, nothing more.
    ref, ref_workers = train(steps, nan_on_rank_1)
    assert [s[2] for s in ref[0]] == ["non_finite" if s in SPIKES else None for s in range(steps)]
    assert [s[4] for s in seen[0] if s[0] not in SPIKES] == [s[4] for s in ref[0] if s[0] not in SPIKES]
    assert equal(worker_state(workers[0]), worker_state(ref_workers[0]))


def test_a_rank_that_joins_receives_the_state_and_judges_as_the_survivors() -> None:
    master = store()
    before = 5  # steps in generation 0: past the warmup, so the window holds losses the newcomer lacks

    def gen0(r: int) -> Worker:
        worker = Worker(job(9), r)
        worker.adopt(TWO, AbortableGeneration(client(master), 0, r, 2, TWO, TIMEOUTS))
        for _ in range(before):
            worker.train_step()
        return worker

    survivors = on_ranks(2, gen0)
    held = survivors[0].spike
    assert held is not None and held.step == before and len(held.losses) == POLICY.warmup + 1
    # the survivors' data cursor as a loss-spike rollback leaves it (3 steps' samples skipped at step 2):
    # the newcomer, started with the job's, receives it with the policy's state
    moved = (2, (2 + 3) * 8)
    for worker in survivors:
        worker.batches.resume_at(*moved)
    newcomer = Worker(job(9), 2)
    assert newcomer.spike == SpikeState() and newcomer.batches.origin == (0, 0)
    workers = [*survivors, newcomer]
    seen: dict[int, list] = {}

    def gen1(r: int) -> None:
        worker = workers[r]
        reach_step(worker, before)  # the newcomer takes the step; its policy state is still the fresh one
        gen = AbortableGeneration(client(master), 1, r, 3, THREE, TIMEOUTS)
        worker.adopt(THREE, gen, "memory", [(layer, 0, 2) for layer in range(6)])
        seen[r] = [worker.spike]
        # the newcomer's loss spikes at step 5: every rank skips it, the survivors by the state it received
        seen[r].append((worker.batches.origin, worker.batches.step_ids(before).tolist(), worker.data_step(before)))
        worker.loss_factor = (lambda s: FACTOR if s == before + 3 else 1.0) if r == 2 else None
        for _ in range(2):
            result = worker.train_step()
            seen[r].append((result.step, result.skip_reason))
        seen[r].append(worker.spike)

    on_ranks(3, gen1)
    assert seen[0][0] == seen[1][0] == seen[2][0] == held  # received: the survivors' state, bit for bit
    assert seen[0][1] == seen[1][1] == seen[2][1] and seen[2][1][0] == moved and seen[2][1][2] == before + 3
    for r in range(3):
        assert seen[r][2:4] == [(5, "loss_spike"), (6, None)], seen[r]
    assert seen[0][4] == seen[1][4] == seen[2][4]


def test_a_checkpoint_carries_the_state_and_one_without_starts_it_fresh(tmp_path) -> None:
    master = store()
    one = make_plan(6, [[0, 6]], [4])

    def run() -> tuple[SpikeState | None, SpikeState | None, SpikeState | None]:
        worker = Worker(job(9), 0)
        worker.adopt(one, AbortableGeneration(client(master), 0, 0, 1, one, TIMEOUTS))
        for _ in range(4):
            worker.train_step()
        writer = CheckpointWriter(tmp_path, worker.data_record)
        for i in sorted(worker.layers):
            writer.submit(worker.step, worker.keys[i], worker.layer_payload(i))
        saved = worker.spike
        worker.train_step()  # the state moves on while the writer's thread may not have written the record
        writer.flush()
        resumed = Worker(job(9), 0)
        resumed.adopt(one, AbortableGeneration(client(master), 1, 0, 1, one, TIMEOUTS), "checkpoint",
                      checkpoint=(str(tmp_path), 4))
        record = read_data_record(tmp_path, 4)
        assert record is not None and "consumed_samples" in record  # the data's record is still there
        del record["loss_spike"]
        (tmp_path / "step4" / "data.json").write_text(json.dumps(record))
        fresh = Worker(job(9), 0)
        fresh.adopt(one, AbortableGeneration(client(master), 2, 0, 1, one, TIMEOUTS), "checkpoint",
                    checkpoint=(str(tmp_path), 4))
        return saved, resumed.spike, fresh.spike

    saved, resumed, fresh = on_ranks(1, lambda _: run())[0]
    assert saved is not None and saved.step == 4 and len(saved.losses) == 4
    assert resumed == saved
    assert fresh == SpikeState(step=4)
