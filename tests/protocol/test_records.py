"""The store's typed records: every JSON value a process writes to the job's store is read back as its
type, checked field by field; a value that is not one names the key and the field."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

from oobleck_slurm.protocol import keys, records
from oobleck_slurm.protocol.records import (
    CheckpointRef,
    Failed,
    FirstStep,
    GenerationConfig,
    LastStep,
    Rebuilt,
    StepCompute,
    StepResult,
    WorkerError,
    WorkerReport,
)
from oobleck_slurm.protocol.wire import ProtocolError

RESULT = StepResult(step=3, loss=2.5, grad_norm=0.5, lr=1e-3, seconds=0.25, pipeline_seconds=(0.2, 0.21),
                    compute_seconds=(0.1, 0.11, 0.12), peak_memory=())
EXAMPLES: list[tuple[records.Record, tuple]] = [
    (GenerationConfig(generation=2, members=("node1", "node3"), plan={"num_layers": 6}, transfers=((1, 0, 2),),
                      resume_step=7, source="memory"), (2,)),
    (GenerationConfig(generation=3, stop=True, save=CheckpointRef(root="/ckpt", step=9)), (3,)),
    (GenerationConfig(generation=1, source="checkpoint", checkpoint=CheckpointRef(root="/ckpt", step=4)), (1,)),
    (Failed(lost=("node2",), joined=(), cause="process_exit"), (1,)),
    (WorkerReport(step=4, layers=(0, 1, 2), completable=True,
                  last_step=LastStep(result=RESULT, generation=1, global_batch_size=16)), (1, "node1:0")),
    (WorkerReport(step=0), (0, "node2:1")),
    (Rebuilt(groups_s=0.1, copy_s=0.2, bytes=1024, t=1.5e9), (1, "node1:0")),
    (StepCompute(step=5, compute_seconds=(0.1, 0.2)), (1,)),
    (FirstStep(step=5, t=1.5e9), (1,)),
    (WorkerError(step=5, error="RuntimeError: Connection closed by peer", t=1.5e9), (1, "node1:0")),
]


@pytest.mark.parametrize(("record", "args"), EXAMPLES, ids=[f"{type(r).__name__}-{i}" for i, (r, _) in enumerate(EXAMPLES)])
def test_every_record_reads_back_as_written(record: records.Record, args: tuple) -> None:
    store = dist.HashStore()
    assert records.get_if(store, type(record), *args) is None
    records.put(store, record, *args)
    assert records.get(store, type(record), *args) == record


def test_a_diverged_loss_is_a_value_not_a_broken_peer() -> None:
    store = dist.HashStore()
    nan = StepResult(step=1, loss=math.nan, grad_norm=math.inf, lr=1e-3, seconds=0.1)
    records.put(store, WorkerReport(step=2, layers=(0,), last_step=LastStep(result=nan, generation=0,
                                                                             global_batch_size=8)), 0, "n:0")
    got = records.get(store, WorkerReport, 0, "n:0")
    assert got.last_step is not None and math.isnan(got.last_step.result.loss)


@pytest.mark.parametrize(("raw", "words"), [
    ("not json", "store key 'gen1/report/n:0': not JSON"),
    ('{"step": "4"}', "store key 'gen1/report/n:0': field 'step' must be an integer, got a string"),
    ('{"layers": [1]}', "missing field 'step'"),
    ('{"step": 4, "colour": 1}', "unknown field 'colour'"),
    ('{"step": 4, "last_step": {"result": {}, "generation": 0, "global_batch_size": 8}}',
     "field 'last_step': field 'result': missing field 'step'"),
    ('[1, 2]', "must be a JSON object, got a list"),
])
def test_a_value_that_is_not_its_record_names_the_key_and_field(raw: str, words: str) -> None:
    store = dist.HashStore()
    store.set(keys.report(1, "n:0"), raw)
    with pytest.raises(ProtocolError) as err:
        records.get(store, WorkerReport, 1, "n:0")
    assert words in str(err.value)


def test_plain_integer_keys() -> None:
    store = dist.HashStore()
    assert records.get_int(store, keys.CURRENT_GEN) is None
    store.set(keys.CURRENT_GEN, "4")
    assert records.get_int(store, keys.CURRENT_GEN) == 4
    store.set(keys.progress(4), "x")
    with pytest.raises(ProtocolError, match="gen4/progress"):
        records.get_int(store, keys.progress(4))
