"""One rank of test_wide_transients.py, in a fresh process: what a worker of a wide stage holds beyond
its state while it evaluates, writes a checkpoint's layers and adopts a new plan from memory.

    python tests/engine/wide_transients.py CONFIG_JSON   ->  one JSON line on stdout

CONFIG: the GPT (`gpt`), `optimizer`, `precision`, `microbatch_size`, `microbatches`, `eval_samples`,
the plans (`plans`, JSON: the first adopted from the seed, the second, if any, from memory with
`transfers`), this worker's `rank`, the `world` size, the `port` of the test's TCPStore and the `out`
folder. The worker is the engine's `Worker` on real gloo groups (under NCCL's ordering rules: the
suite's OOBLECK_NCCL_ORDER is inherited). It trains one step (the optimizer state then exists), then
measures with oobleck_slurm/peak_memory.py (start it with `peak_memory.MALLOC_ENV` so that its RSS
follows the live tensors), each phase's peak set against what it held just before:
- `evaluate`: `Worker.evaluate()`;
- `payload`: `Worker.layer_payload(i)` of each layer it holds, in order (as a checkpoint gathers them);
  the whole layers it gets are saved to `out/layers<rank>.pt` (the test's reference evaluation);
- `adopt`: the adopt of the second plan, then one step on it.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from oobleck_slurm.engine.abort import AbortableGeneration
from oobleck_slurm.engine.layout import ExecPlan
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.models import GPTConfig
from oobleck_slurm.peak_memory import PeakMemory, malloc_configured, warm_up
from oobleck_slurm.timeouts import JobTimeouts

TIMEOUTS = JobTimeouts(collective_timeout=180.0, step_timeout=300.0, connect_timeout=300.0, store_timeout=300.0)


def job_spec(c: dict) -> JobSpec:
    return JobSpec(
        model=ModelSpec(GPTConfig(**c["gpt"])),
        data=DataSpec("random", num_samples=256, seed=1, holdout=c["eval_samples"]),
        optim=OptimSpec(c["optimizer"], lr=1e-3, weight_decay=0.1),
        train=TrainSpec(steps=4, microbatch_size=c["microbatch_size"], num_microbatches=c["microbatches"],
                        seed=0, grad_clip=1.0, precision=c["precision"], eval_interval=1,
                        eval_samples=c["eval_samples"]),
    )


def held_bytes(worker: Worker) -> int:
    """The bytes of the worker's state now: each distinct storage its layers, shards and optimizers use."""
    seen: dict[int, int] = {}

    def add(t: object) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()

    for layer in worker.layers.values():
        for t in [*layer.parameters(), *layer.buffers()]:
            add(t)
            add(t.grad)
    for sharded in worker.shards.values():
        for t in (sharded.shard, sharded.grad_shard, sharded.full, sharded.grad_full):
            add(t)
    for opt in worker.optimizers.values():
        for state in opt.state.values():
            for t in state.values():
                add(t)
    for t in worker.grads.values():
        add(t)
    return sum(seen.values())


def main(c: dict) -> dict:
    torch.set_num_threads(1)
    job = job_spec(c)
    plans = [ExecPlan.from_json(p) for p in c["plans"]]
    rank, world, out = c["rank"], c["world"], Path(c["out"])
    store = dist.TCPStore("127.0.0.1", c["port"], is_master=False, timeout=dt.timedelta(seconds=300))
    worker = Worker(job, rank)
    gen = AbortableGeneration(store, 0, rank, world, plans[0], TIMEOUTS)
    warm_up()
    probe = PeakMemory()
    worker.adopt(plans[0], gen)
    worker.train_step()
    report: dict = {"probe": probe.method, "malloc_configured": malloc_configured()}

    def measure(name: str, run):  # noqa: ANN001, ANN202 - a local helper
        before, state = probe.now(), held_bytes(worker)
        probe.start()
        result = run()
        report[name] = {"before": before, "state": state, "peak": probe.peak(), "after": probe.now()}
        return result

    if "evaluate" in c["phases"]:
        loss, samples = measure("evaluate", worker.evaluate)
        report["evaluate"].update(loss=loss, samples=samples)
    if "payload" in c["phases"]:
        whole, peaks = {}, []
        for i in sorted(worker.layers):
            payload = measure("payload", lambda i=i: worker.layer_payload(i))
            entry = dict(report.pop("payload"), layer=i)
            if payload is not None:
                entry["bytes"] = sum(t.numel() * t.element_size() for t in payload.values())
                whole[worker.keys[i]] = {k: v for k, v in payload.items() if k.startswith("param.")}
            if i in worker.shards:
                entry["full_bytes"] = worker.shards[i].nbytes
            peaks.append(entry)
            del payload
        report["payload"] = peaks
        torch.save(whole, out / f"layers{rank}.pt")
    if "adopt" in c["phases"]:
        gen1 = AbortableGeneration(store, 1, rank, world, plans[1], TIMEOUTS)
        measure("adopt", lambda: worker.adopt(plans[1], gen1, "memory", [tuple(t) for t in c["transfers"]]))
        report["adopt"]["state_after"] = held_bytes(worker)
        gen1.align()
        report["adopt"]["loss_after"] = worker.train_step().loss  # the new holdings train
        gen = gen1
    gen.wait(gen.world.barrier())  # no rank leaves while a peer may still need a group
    return report


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
    sys.stdout.flush()
