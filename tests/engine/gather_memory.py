"""One rank of tests/engine/test_gather_memory.py: `python gather_memory.py PORT RANK WORLD OUT.json`.

It shards a stage of 8 layers of 4 MiB over the WORLD ranks (real gloo, ordered as under NCCL's rules:
one operation at a time), lets the kept stage post every gather at its first forward (shard.StageParams,
buckets [0] [1 2 3] [4 5 6] [7]), uses every layer as a forward does, and writes the peak of the bytes
it held meanwhile (peak_memory.PeakMemory) with the stage's and the largest bucket's gathered bytes.
Started with peak_memory.MALLOC_ENV and MALLOC_PERTURB_, so that every allocation is resident at once
and the peak resident memory is the peak allocated (an untouched buffer would not count otherwise)."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from oobleck_slurm.engine.comm import make_group
from oobleck_slurm.engine.nccl_order import OrderedGroup, Slots
from oobleck_slurm.engine.shard import ShardedLayer, StageParams, bucket_runs
from oobleck_slurm.engine.spec import OptimSpec
from oobleck_slurm.peak_memory import PeakMemory, malloc_configured, trim_heap, warm_up
from oobleck_slurm.timeouts import JobTimeouts

LAYERS = 8
FEATURES = 1024  # a layer: 1024 x 1024 fp32 weights and a bias, 4 MiB
BUCKET_BYTES = 9 * 2**20  # a bucket closes at its third layer; the first layer goes alone


def main(argv: list[str]) -> None:
    port, rank, world, out = int(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    if not malloc_configured():
        raise SystemExit("start this with peak_memory.MALLOC_ENV in the environment")
    torch.set_num_threads(1)
    warm_up()
    timeouts = JobTimeouts()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeouts.td("store_timeout"))
    pg = make_group(store, "stage", rank, world, timeouts.td("step_timeout"), "gloo", timeouts.td("connect_timeout"))
    group = OrderedGroup(pg, "stage", Slots(1))
    torch.manual_seed(0)
    layers = [ShardedLayer(nn.Linear(FEATURES, FEATURES), world, rank, OptimSpec("adamw", lr=1e-3))
              for _ in range(LAYERS)]
    params = StageParams(layers, group, lambda work: work.wait(), keep=True, bucket_bytes=BUCKET_BYTES,
                         scatter_by_allreduce=True)
    group.barrier().wait()  # both ranks measure the same phase
    gc.collect()
    trim_heap()
    probe = PeakMemory()
    probe.start()
    for i in range(LAYERS):  # a forward: the first use posts every gather
        params.before(i, 1)
        params.after(i, 1)
    peak, held = probe.peak(), probe.now()
    whole = [torch.cat([p.detach().reshape(-1) for p in layer.module.parameters()]) for layer in layers]
    params.finish()
    sizes = [layer.nbytes for layer in layers]
    runs = bucket_runs(sizes, BUCKET_BYTES, first_alone=True)
    out.write_text(json.dumps({
        "peak": peak, "held": held, "stage": sum(sizes), "bucket": max(sum(sizes[p] for p in run) for run in runs),
        "checksum": float(sum(w.double().sum() for w in whole)), "method": probe.method}))


if __name__ == "__main__":
    main(sys.argv[1:])
