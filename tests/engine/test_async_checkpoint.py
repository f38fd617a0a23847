"""Periodic checkpoints copied off the training path (checkpoint.LayerCopier, Worker.snapshot): the file
written while training went on holds the checkpoint step's state bit for bit, because the next update
waited for the copy (Worker.settle_copies); a copy that fails is a failed write, reported, and training
goes on."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from exec_plans import make_plan
from torch import nn

from oobleck_slurm.engine.abort import AbortableGeneration
from oobleck_slurm.engine.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    LayerCopier,
    layer_file,
    layer_payload,
    live_tensors,
    read_layer_file,
)
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.models import gpt_config
from oobleck_slurm.timeouts import JobTimeouts

TIMEOUTS = JobTimeouts(collective_timeout=60.0, step_timeout=300.0)
ONE = make_plan(6, [[0, 6]], [4])
CONDITION_S = 60.0  # a condition not met by then is a failure


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + CONDITION_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def job() -> JobSpec:
    return JobSpec(model=ModelSpec(gpt_config("tiny")), data=DataSpec("random", num_samples=256, seed=1),
                   optim=OptimSpec("adamw", lr=1e-3, weight_decay=0.1),
                   train=TrainSpec(steps=8, microbatch_size=2, num_microbatches=4, seed=0, precision="fp64"))


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_update_waits_for_the_copy_and_the_file_holds_the_checkpoint_step(tmp_path) -> None:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))
    store = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=dt.timedelta(seconds=30))
    worker = Worker(job(), 0)
    worker.adopt(ONE, AbortableGeneration(store, 0, 0, 1, ONE, TIMEOUTS))
    for _ in range(2):
        worker.train_step()
    step = worker.step
    # what a synchronous checkpoint of this step holds
    expected = {worker.keys[i]: layer_payload(worker.layers[i], worker.optimizers[i]) for i in sorted(worker.layers)}
    copying = threading.Event()
    worker.copier.before_copy = lambda key: copying.wait()  # the copies wait until the test lets them
    writer = CheckpointWriter(tmp_path)
    for i in sorted(worker.layers):
        snapshot = worker.snapshot(i)
        assert snapshot is not None
        writer.submit(step, worker.keys[i], snapshot)
    trainer = threading.Thread(target=worker.train_step, daemon=True)
    trainer.start()  # the next step's forward and backward read the parameters while no copy is made
    wait_for(lambda: worker.copier.fence_waiting() or not trainer.is_alive(), "the next step reaches its update")
    assert trainer.is_alive(), "the update ran before the checkpoint's copy was made"
    now = {worker.keys[i]: layer_payload(worker.layers[i], worker.optimizers[i]) for i in sorted(worker.layers)}
    assert all(equal(now[k], expected[k]) for k in expected)  # nothing written in place yet
    copying.set()
    trainer.join(CONDITION_S)
    assert not trainer.is_alive()
    writer.flush([step])
    assert worker.step == step + 1 and worker.copy_wait_s > 0.0
    for key, want in expected.items():
        assert equal(read_layer_file(layer_file(tmp_path, step, key), step), want), key
    moved = {worker.keys[i]: layer_payload(worker.layers[i], worker.optimizers[i]) for i in sorted(worker.layers)}
    assert not any(equal(moved[k], expected[k]) for k in expected)  # training went on: every layer updated


def test_a_fence_waits_only_for_the_layers_asked_and_not_after_their_copy() -> None:
    copying = threading.Event()
    copier = LayerCopier(torch.device("cpu"), before_copy=lambda key: copying.wait() if key == "a" else None)
    layer = nn.Linear(4, 4)
    opt = torch.optim.AdamW(layer.parameters())
    snapshot = copier.copy("a", live_tensors(layer, opt))
    assert copier.fence(["b"]) == 0.0  # no copy of "b" pending: no wait, while "a"'s is held
    assert not snapshot.copied.is_set()
    copying.set()
    assert copier.fence() >= 0.0
    assert snapshot.copied.is_set() and equal(snapshot.tensors(), layer_payload(layer, opt))
    assert copier.fence(["a"]) == 0.0  # fenced once: nothing pending any more


def test_a_failed_copy_is_reported_as_a_failed_write_and_training_goes_on(tmp_path) -> None:
    def refuse(key: str) -> None:
        if key == "bad":
            raise OSError("no memory for the copy")

    copier = LayerCopier(torch.device("cpu"), before_copy=refuse)
    reported: list[tuple[int, str]] = []
    writer = CheckpointWriter(tmp_path, on_error=lambda step, err: reported.append((step, str(err))))
    layer = nn.Linear(4, 4)
    opt = torch.optim.AdamW(layer.parameters())
    writer.submit(2, "bad", copier.copy("bad", live_tensors(layer, opt)))
    copier.fence()  # the update is not stopped by the failure
    writer.flush(())  # a periodic checkpoint's failure is reported, not raised
    assert reported == [(2, "no memory for the copy")]
    assert not layer_file(tmp_path, 2, "bad").exists()
    writer.submit(4, "good", copier.copy("good", live_tensors(layer, opt)))
    writer.flush([4])  # the next checkpoint is written as usual
    assert equal(read_layer_file(layer_file(tmp_path, 4, "good"), 4), layer_payload(layer, opt))
    writer.submit(6, "bad", copier.copy("bad", live_tensors(layer, opt)))
    with pytest.raises(CheckpointError, match="step 6"):  # a checkpoint waited on fails its caller
        writer.flush([6])
