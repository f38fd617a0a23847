"""One worker process of a hand-planned job (tests/plan_runs.py): `python sharded_run.py
OUT_DIR PORT RANK WORLD`, or forked with that argv by a warm server (the test's, as an agent's forks
its workers: torch is imported once, not once per rank). It reads OUT_DIR/job.json (a JobSpec) and OUT_DIR/plans.json (one ExecPlan per
generation, with the step each one starts at), trains through them on real gloo groups built on the
test's store, and writes its per-step losses (rank 0) and the layers it gathers whole (first pipeline)
to OUT_DIR (rank 0's step seconds: seconds.json; with training.eval_interval, the final validation loss:
eval.json), and every replica's gathered layers (`replicas<rank>.pt`, by (layer key, rank)). A generation
may name a node's ranks to lose (`kill`): they kill -9 themselves at a wait of a step (`step`, `wait`),
or the production fault hooks (engine/faults.py FaultHooks, node `node<rank // 4>`, worker `rank % 4`)
carry out its `faults`; the test then plays the coordinator (the failed key, the survivors' reports, the
step to resume at: tests/plan_runs.py). A generation marked
`checkpoint` starts from a checkpoint that the first pipeline of the one before writes to OUT_DIR/ckpt
when it stops (whole-layer files, gathered from wide stages)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from oobleck_slurm.engine.abort import GenerationAborted, build_generation
from oobleck_slurm.engine.checkpoint import save_layer
from oobleck_slurm.engine.comm import is_collective_error
from oobleck_slurm.engine.faults import FaultHooks
from oobleck_slurm.engine.layout import ExecPlan
from oobleck_slurm.engine.recovery import can_complete, reach_step
from oobleck_slurm.engine.spec import JobSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.protocol import keys
from oobleck_slurm.timeouts import JobTimeouts

# generous: the machine is shared, and nothing here should time out
TIMEOUTS = JobTimeouts(collective_timeout=120.0, step_timeout=300.0, connect_timeout=300.0, store_timeout=300.0)
WORKERS_PER_NODE = 4  # node n is ranks 4n .. 4n + 3


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


def gathered(worker: Worker, plan: ExecPlan, rank: int) -> tuple[dict, dict]:
    """The whole layers this rank gets from `layer_payload` (every rank of a stage calls it for its layers in
    the same order; a wide stage's first rank gets them): the first pipeline's by key, all by (key, rank)."""
    first, every = {}, {}
    for i in sorted(worker.layers):
        payload = worker.layer_payload(i)
        if payload is not None:
            every[(worker.keys[i], rank)] = payload
            if rank in plan.holder_stages(i)[0]:
                first[worker.keys[i]] = payload
    return first, every


def main(argv: list[str]) -> None:
    """`OUT_DIR PORT RANK WORLD`: as a script, or forked by the test's warm server (agent/warm.py)."""
    out, port, rank, world = Path(argv[0]), int(argv[1]), int(argv[2]), int(argv[3])
    torch.set_num_threads(1)
    job = JobSpec.from_json((out / "job.json").read_text())
    plans = json.loads((out / "plans.json").read_text())
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUTS.td("store_timeout"))
    worker = Worker(job, rank)
    store.set(f"pid/{rank}", str(os.getpid()))
    losses: dict[int, float] = {}
    seconds: dict[int, float] = {}  # each step's wall time (rank 0), for timing a plan
    old: ExecPlan | None = None
    node, local = f"node{rank // WORKERS_PER_NODE}", rank % WORKERS_PER_NODE
    for g, entry in enumerate(plans):
        plan = ExecPlan.from_json(entry["plan"])
        world = entry.get("world", world)
        kill = entry.get("kill")
        waits = [0]
        faults = FaultHooks(kill.get("faults", []) if kill else [], store, node, local, TIMEOUTS)
        faults.generation = g
        worker.before_update, worker.before_scatter = faults.before_update, faults.before_scatter
        reported = [-1]

        def on_wait(kill: dict | None = kill, waits: list[int] = waits, faults: FaultHooks = faults,
                    reported: list[int] = reported) -> None:
            """The production hooks (faults, and the step progress a fault's "after" reads, written as
            the worker writes it: at a step's first wait), or a node's loss: its first rank, at wait number
            kill["wait"] of step kill["step"], kills -9 every worker of the node (itself last): they fail
            together."""
            faults.before_wait(worker.step)
            if reported[0] != worker.step:
                store.set(keys.worker_step(keys.worker_id(node, local)), str(worker.step))
                reported[0] = worker.step
            if kill and "wait" in kill and rank == kill["ranks"][0] and worker.step == kill["step"]:
                waits[0] += 1
                if waits[0] == kill["wait"]:
                    for r in kill["ranks"][1:]:
                        os.kill(int(store.get(f"pid/{r}")), signal.SIGKILL)
                    os.kill(os.getpid(), signal.SIGKILL)

        gen = build_generation(store, g, rank, world, plan, TIMEOUTS, on_wait=on_wait)
        if old is None:
            worker.adopt(plan, gen, "seed")
        elif entry.get("checkpoint"):
            worker.adopt(plan, gen, "checkpoint", checkpoint=(str(out / "ckpt"), entry["step"]))
        else:  # a plan change: layers from their holders' memory, copies named as the coordinator names them
            worker.adopt(plan, gen, "memory", coordinator_transfers(old, plan))
        old = plan
        gen.align()
        stop = plans[g + 1]["step"] if g + 1 < len(plans) and not kill else job.train.steps
        try:
            while worker.step < stop:
                faults.at_step_start(worker.step)
                result = worker.train_step()
                faults.at_step_end()
                losses[result.step] = result.loss
                seconds[result.step] = result.seconds
        except Exception as e:
            if not kill or not (isinstance(e, GenerationAborted) or is_collective_error(e)):
                raise
            store.wait([keys.failed(g)])  # the test saw the node's processes exit
            store.set(f"report/{g}/{rank}", f"{worker.step} {int(can_complete(worker))}")
            reach_step(worker, int(store.get(f"resume/{g}")))
        if g + 1 < len(plans) and plans[g + 1].get("checkpoint"):
            for key, payload in gathered(worker, plan, rank)[0].items():
                save_layer(out / "ckpt", worker.step, key, payload)
            gen.wait(gen.world.barrier())  # every file written before any rank reads
    if job.train.eval_interval:  # the final validation loss (every rank takes part)
        loss, _ = worker.evaluate()
        if rank == 0:
            (out / "eval.json").write_text(json.dumps(loss))
    payloads, replicas = gathered(worker, plan, rank)
    torch.save(payloads, out / f"layers{rank}.pt")
    torch.save(replicas, out / f"replicas{rank}.pt")
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))
        (out / "seconds.json").write_text(json.dumps(seconds))
    gen.wait(gen.world.barrier())


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    # as the real worker does (elastic_process.main): the failed generation's groups still hold stuck
    # gloo operations whose threads must not be joined by the interpreter's exit
    os._exit(0)
