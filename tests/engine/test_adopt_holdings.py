"""A memory adopt reads what every rank holds *now* (one world all-reduce per adopt), never a table left
over from an earlier adopt: two workers (threads of this process) on real gloo groups go through a
width-1 plan change and then a change to a stage two ranks wide, whose shards must be cut from the
layers each rank holds after the first change."""

from __future__ import annotations

import datetime as dt
import threading

import torch
import torch.distributed as dist

from oobleck_slurm.engine.abort import AbortableGeneration
from oobleck_slurm.engine.layout import ExecPlan, PipelineSpec
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.models import gpt_config
from oobleck_slurm.protocol import keys
from oobleck_slurm.timeouts import JobTimeouts

# A failing rank sets the generation's failed key, so its peer leaves at once: these only bound a bug.
TIMEOUTS = JobTimeouts(collective_timeout=60.0, step_timeout=120.0)
JOIN_S = 180.0

SPLIT = ExecPlan(6, 8, (PipelineSpec((0, 1), (0, 3, 6), 0, 8),))  # rank 0: layers 0-2, rank 1: 3-5
SWAPPED = ExecPlan(6, 8, (PipelineSpec((1, 0), (0, 3, 6), 0, 8),))  # rank 1: layers 0-2, rank 0: 3-5
SWAP = [(3, 1, 0), (4, 1, 0), (5, 1, 0), (0, 0, 1), (1, 0, 1), (2, 0, 1)]
WIDE = ExecPlan(6, 8, (PipelineSpec((0,), (0, 6), 0, 8, (2,)),))  # one stage on ranks 0-1, sharded
TO_WIDE = [(0, 1, 0), (1, 1, 0), (2, 1, 0)]  # the coordinator's senders: rank 0 lacks layers 0-2


def tiny_job() -> JobSpec:
    return JobSpec(
        model=ModelSpec(gpt_config("tiny")),  # 6 layers
        data=DataSpec("random", num_samples=512, seed=1),
        optim=OptimSpec("adamw", lr=3e-3, weight_decay=0.1),
        train=TrainSpec(steps=4, microbatch_size=2, num_microbatches=8, seed=0, grad_clip=0.5,
                        warmup_steps=2, precision="fp64"),
    )


def test_a_sharded_adopt_after_a_width_1_adopt_uses_the_current_holdings():
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))
    before: dict[str, dict[str, torch.Tensor]] = {}  # every layer's parameters before the sharded adopt
    gathered: dict[str, dict[str, torch.Tensor]] = {}  # the wide stage's whole layers after it (rank 0)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=dt.timedelta(seconds=30))
        g = 0
        try:
            worker = Worker(tiny_job(), r)
            worker.adopt(SPLIT, AbortableGeneration(client, 0, r, 2, SPLIT, TIMEOUTS))
            worker.train_step()  # the state is no longer the seed's: a copy must bring it
            g = 1
            worker.adopt(SWAPPED, AbortableGeneration(client, 1, r, 2, SWAPPED, TIMEOUTS), "memory", SWAP)
            worker.train_step()
            before.update(worker.layer_state())
            g = 2
            worker.adopt(WIDE, AbortableGeneration(client, 2, r, 2, WIDE, TIMEOUTS), "memory", TO_WIDE)
            for i in range(6):  # both ranks gather every layer, in order; rank 0 gets it whole
                payload = worker.layer_payload(i)
                if payload is not None:
                    gathered[worker.keys[i]] = {k[len("param."):]: v for k, v in payload.items()
                                                if k.startswith("param.")}
            worker.train_step()  # and the sharded stage trains
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            client.set(keys.failed(g), "{}")  # the peer leaves the generation instead of waiting on us

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads)
    assert not errors, [f"{type(e).__name__}: {e}" for e in errors]
    assert sorted(gathered) == sorted(before)
    for key, params in before.items():
        for name, value in params.items():
            assert torch.equal(gathered[key][name], value), (key, name)
