"""Writes the recorded event logs in tests/dashboard/logs/ (run: python tests/dashboard/make_logs.py).

Written by a deterministic simulation that follows oobleck_slurm/dashboard/README.md, not by the
engine: the engine's launcher (`oobleck_slurm.engine.launch.train_local`) and the supervisor did not
exist when these were recorded. The numbers are shaped like a CPU run of the `mini` GPT (10 layers,
global batch 32): step times near one second, loss decaying from ln(256), heartbeats every 5 s.
Regenerate them from a real run once the supervisor writes these kinds.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from oobleck_slurm.events import EventLog

T0 = 1_760_000_000.0
LAYERS = 10
BATCH = 32
LOGS = Path(__file__).parent / "logs"


def stages(nodes: list[str], rank0: int) -> list[dict]:
    """Contiguous layer ranges, as even as possible, one stage per node."""
    n = len(nodes)
    bounds = [round(i * LAYERS / n) for i in range(n + 1)]
    return [{"layers": [bounds[i], bounds[i + 1]], "node": node, "rank": rank0 + i} for i, node in enumerate(nodes)]


def plan(groups: list[list[str]], microbatches: list[int]) -> list[dict]:
    out, rank = [], 0
    for pid, (nodes, mb) in enumerate(zip(groups, microbatches)):
        out.append({"id": pid, "nodes": nodes, "stages": stages(nodes, rank), "microbatches": mb})
        rank += len(nodes)
    return out


class Run:
    def __init__(self, name: str, nodes: list[str], steps: int, seed: int) -> None:
        LOGS.mkdir(exist_ok=True)
        path = LOGS / f"{name}.jsonl"
        path.unlink(missing_ok=True)
        self.log = EventLog(path)
        self.t = T0
        self.rng = random.Random(seed)
        self.nodes = nodes
        self.lost: set[str] = set()
        self.spares: set[str] = set()
        self.last_beat = T0
        self.log.emit("job_started", t=self.t, job_id=name, backend="local", recipe="local-mini",
                      recipe_path="recipes/local-tiny.yaml", nodes=nodes, f=1, steps=steps)

    def emit(self, kind: str, dt: float = 0.0, **fields) -> None:
        self.t += dt
        self.log.emit(kind, t=round(self.t, 3), **fields)

    def beats(self, every: float = 5.0) -> None:
        if self.t - self.last_beat < every:
            return
        self.last_beat = self.t
        for node in self.nodes:
            if node in self.lost:
                age = self.t - self.lost_at[node]
                self.emit("node", node=node, state="lost", heartbeat_age=round(age, 1), cpu=None, gpu=None,
                          slurm_state="DOWN")
            else:
                self.emit("node", node=node, state="spare" if node in self.spares else "healthy", heartbeat_age=round(self.rng.uniform(0.1, 1.5), 2),
                          cpu=round(self.rng.uniform(80, 99), 1), gpu=None, slurm_state="ALLOCATED")

    def steps(self, first: int, last: int, pipelines: list[dict], ) -> None:
        """Steps first..last under the given plan."""
        for step in range(first, last + 1):
            # 1F1B: (microbatches + stages - 1) slots of one stage's time (its share of the layers).
            times = [(p["microbatches"] + len(p["stages"]) - 1) * LAYERS / len(p["stages"]) * 0.04
                     * self.rng.uniform(0.97, 1.03) for p in pipelines]
            step_time = max(times) + 0.05
            loss = 2.2 + (math.log(256) - 2.2) * math.exp(-step / 18) + self.rng.uniform(-0.03, 0.03)
            self.emit("step", step_time, step=step, loss=round(loss, 4), samples_per_s=round(BATCH / step_time, 2),
                      step_time=round(step_time, 3),
                      pipelines=[{"id": p["id"], "time": round(t, 3), "microbatches": p["microbatches"]}
                                 for p, t in zip(pipelines, times)])
            self.beats()

    def lose(self, node: str) -> None:
        self.lost.add(node)
        self.lost_at = getattr(self, "lost_at", {})
        self.lost_at[node] = self.t

    def finish(self, steps: int) -> None:
        self.emit("checkpoint", 0.8, step=steps, seconds=0.8, path=f"jobs/ckpt/step-{steps:06d}.pt")
        self.emit("job_finished", 0.2, status="completed", exit_code=0)
        self.log.close()


def healthy() -> None:
    nodes = [f"node-{i}" for i in range(4)]
    run = Run("healthy", nodes, steps=40, seed=1)
    p = plan([nodes[:2], nodes[2:]], [4, 4])
    run.emit("plan", 2.4, generation=1, reason="initial", pipelines=p)
    run.steps(1, 40, p)
    run.finish(40)


def failure() -> None:
    nodes = [f"node-{i}" for i in range(5)]
    run = Run("failure", nodes, steps=50, seed=2)
    p = plan([nodes[:3], nodes[3:]], [5, 3])
    run.emit("plan", 2.6, generation=1, reason="initial", pipelines=p)
    run.steps(1, 20, p)
    run.emit("checkpoint", 0.6, step=20, seconds=0.6, path="jobs/ckpt/step-000020.pt")
    run.steps(21, 24, p)
    run.lose("node-2")  # dies during step 25: its heartbeat lease (3 s) expires
    run.emit("node", 2.0, node="node-2", state="suspect", heartbeat_age=2.0, cpu=None, gpu=None)
    run.emit("failure", 1.0, generation=1, nodes=["node-2"], cause="heartbeat", step=25)
    run.emit("detection", 0.0, seconds=3.0)
    run.emit("node", 0.0, node="node-2", state="lost", heartbeat_age=3.0, cpu=None, gpu=None, slurm_state="DOWN")
    p2 = plan([nodes[:2], nodes[3:]], [4, 4])
    run.emit("replan", 0.12, seconds=0.12)
    run.emit("plan", 0.0, generation=2, reason="failure", pipelines=p2)
    run.emit("replacement_requested", 0.01, slurm_job_id="4242")
    run.emit("group_rebuild", 0.8, seconds=0.8)
    run.emit("state_copy", 1.4, seconds=1.4, bytes=48 * 2**20)
    run.emit("replay", 1.1, seconds=1.1, step=25)
    run.emit("resumed", 0.0, step=25, total_seconds=6.43, generation=2)
    run.steps(26, 50, p2)
    run.finish(50)


def join() -> None:
    nodes = [f"node-{i}" for i in range(4)]
    run = Run("join", nodes + ["node-4"], steps=40, seed=3)
    run.spares.add("node-4")
    p = plan([nodes[:2], nodes[2:]], [4, 4])
    run.emit("plan", 2.5, generation=1, reason="initial", pipelines=p)
    run.steps(1, 15, p)
    run.emit("replacement_requested", 0.0, node="node-4")
    run.emit("node_joined", 4.2, node="node-4", seconds=4.2)
    run.spares.discard("node-4")
    run.emit("health_check", 0.6, node="node-4", ok=True, seconds=0.6)
    p2 = plan([nodes[:2] + ["node-4"], nodes[2:]], [5, 3])
    run.emit("plan", 0.1, generation=2, reason="join", pipelines=p2)
    run.emit("group_rebuild", 0.7, seconds=0.7)
    run.emit("state_copy", 0.9, seconds=0.9, bytes=20 * 2**20)
    run.emit("resumed", 0.0, step=16, total_seconds=1.7, generation=2)
    run.steps(16, 40, p2)
    run.finish(40)


if __name__ == "__main__":
    healthy()
    failure()
    join()
    print("wrote", sorted(p.name for p in LOGS.glob("*.jsonl")))
