"""One worker process of a hand-planned job (tests/engine/test_sharded.py): `python sharded_run.py
OUT_DIR PORT RANK WORLD`. It reads OUT_DIR/job.json (a JobSpec) and OUT_DIR/plans.json (one ExecPlan per
generation, with the step each one starts at), trains through them on real gloo groups built on the
test's store, and writes its per-step losses (rank 0) and the layers it gathers whole (first pipeline)
to OUT_DIR."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from oobleck_slurm.engine.abort import build_generation
from oobleck_slurm.engine.layout import ExecPlan
from oobleck_slurm.engine.spec import JobSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.protocol.timeouts import JobTimeouts

# generous: the machine is shared, and nothing here should time out
TIMEOUTS = JobTimeouts(collective_timeout=120.0, step_timeout=300.0, connect_timeout=300.0, store_timeout=300.0)


def coordinator_transfers(old: ExecPlan, new: ExecPlan) -> list[tuple[int, int, int]]:
    """What the coordinator sends: (layer, src, dst) for each new stage's first rank that holds none of
    the layer (every rank of an old stage reports its layers), from the first old holder."""
    out = []
    for p in new.pipelines:
        for s in range(p.num_stages):
            for layer in p.stage_layers(s):
                if not any(p.ranks[s] in ranks for ranks in old.holder_stages(layer)):
                    out.append((layer, old.holder_stages(layer)[0][-1], p.ranks[s]))
    return out


def main(out: Path, port: int, rank: int, world: int) -> None:
    torch.set_num_threads(1)
    job = JobSpec.from_json((out / "job.json").read_text())
    plans = json.loads((out / "plans.json").read_text())
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUTS.td("store_timeout"))
    worker = Worker(job, rank)
    losses: dict[int, float] = {}
    old: ExecPlan | None = None
    for g, entry in enumerate(plans):
        plan = ExecPlan.from_json(entry["plan"])
        gen = build_generation(store, g, rank, world, plan, TIMEOUTS)
        if old is None:
            worker.adopt(plan, gen, "seed")
        else:  # a plan change: layers from their holders' memory, copies named as the coordinator names them
            worker.adopt(plan, gen, "memory", coordinator_transfers(old, plan))
        old = plan
        stop = plans[g + 1]["step"] if g + 1 < len(plans) else job.train.steps
        while worker.step < stop:
            result = worker.train_step()
            losses[result.step] = result.loss
    payloads = {worker.keys[i]: p for i in sorted(worker.layers) if rank in plan.holder_stages(i)[0]
                and (p := worker.layer_payload(i)) is not None}
    torch.save(payloads, out / f"layers{rank}.pt")
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))
    gen.wait(gen.world.barrier())


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
