"""Section (h) job_kill_drill: the job as submit runs it (benchmarks/_jobs.py): kill -9 of a rank, recovery
in memory, the spare joins; losses close to an uninterrupted job's.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from acceptance.harness import WIDE_TOLERANCE, Record, Settings, compare, estimate_gpu, ranks_on_gpus

if TYPE_CHECKING:
    pass


class DeviceMemorySampler:
    """The GPU's used memory (total - free, from torch.cuda.mem_get_info: every process's allocations,
    NCCL's buffers and the CUDA contexts included) sampled in a thread, with the time of each sample."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True, name="mem-sampler")

    def _run(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            free, total = torch.cuda.mem_get_info()
            self.samples.append((time.time(), total - free))

    def __enter__(self) -> DeviceMemorySampler:
        if torch.cuda.is_available():
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def peak(self, t0: float = 0.0, t1: float = float("inf")) -> int | None:
        inside = [b for t, b in self.samples if t0 <= t <= t1]
        return max(inside) if inside else None


def job_state(run: Any) -> dict[str, torch.Tensor]:
    """The job's final checkpoint (what the first pipeline wrote at the last step), by file and key."""
    from oobleck_slurm.engine.checkpoint import LAYER_SUFFIX, read_layer_file

    steps = run.spec().train.steps
    out: dict[str, torch.Tensor] = {}
    for path in sorted((run.job.checkpoints / f"step{steps}").glob(f"*{LAYER_SUFFIX}")):
        for k, v in read_layer_file(path, steps).items():
            if isinstance(v, torch.Tensor):
                out[f"{path.name}/{k}"] = v
    return out


def section_job_drill(s: Settings, rec: Record) -> None:
    import _jobs  # benchmarks/_jobs.py: the production start path (prepare_job + start_local)

    nodes, kill_step = 4, 3
    devices, env, name = ranks_on_gpus(s, nodes + 1) if s.cuda else ([0] * (nodes + 1), {}, "gloo")
    os.environ.update(env)  # the job's agents and workers inherit it
    rec.results["ranks"] = name
    mbs = 2  # 16 samples a step: 8 steps stay within the shipped text's windows at a GPU slice's 2048 tokens
    d = _jobs.recipe_dict(size=s.preset, nodes=nodes, steps=8, global_batch=4 * mbs * 2, microbatch=mbs,
                          precision=s.precision, f=0, replacement="spare", gpus_per_node=1 if s.cuda else 0,
                          heartbeat_lease=5.0, step_timeout=120.0, reconfiguration_timeout=300.0)
    d["model"].update(family=s.family, n_layer=s.n_layer)
    d["cluster"]["spare_nodes"] = 1
    d["training"]["deterministic"] = True
    with tempfile.TemporaryDirectory(prefix="gpu_acceptance_job_") as tmp:
        root, cache = Path(tmp), Path(tmp) / "templates_cache"
        estimate = estimate_gpu(s)
        d["cluster"]["memory_per_device"] = _jobs.budget_for_span(d, 2, cache, estimate, root / "budget")
        faults = [{"node": "node2", "step": kill_step, "at": "wait:3", "do": "kill"}]
        from oobleck_slurm.engine.comm import communicators_per_rank
        from oobleck_slurm.engine.from_planner import exec_plan

        first = exec_plan(_jobs.planned(_jobs.load(d, root / "plan"), cache, estimate),
                          [f"node{i + 1}" for i in range(nodes)], 1)
        world = 1 + max(r for p in first.pipelines for r in p.all_ranks)
        rec.results["communicators_per_rank"] = communicators_per_rank(first, world)
        t0 = time.time()
        plain = _jobs.run_job(d, root / "plain", cache, estimate=estimate, timeout=s.child_timeout_s)
        with DeviceMemorySampler() as mem:
            drill = _jobs.run_job(d, root / "drill", cache, estimate=estimate, timeout=s.child_timeout_s, faults=faults)
        a, b = job_state(plain), job_state(drill)
    cmp = compare(a, b)
    plans = drill.kind("plan")
    lost, resumed = drill.kind("node_lost"), drill.kind("resumed")
    out: dict[str, Any] = {
        "recipe": d, "plans": [{"reason": p.get("reason"), "pipelines": [[st["node"] for st in pp["stages"]]
                                                                         for pp in p["pipelines"]],
                                "spares": p.get("spares")} for p in plans],
        "node_lost": lost, "resumed": resumed, "node_joined": drill.kind("node_joined"),
        "losses_uninterrupted": plain.losses(), "losses_drill": drill.losses(), "vs_uninterrupted": cmp,
        "wall_s": {"uninterrupted": plain.wall_s, "drill": drill.wall_s}, "started": t0,
        "peak_memory_allocated_per_rank": {e["step"]: e.get("peak_memory") for e in drill.kind("step")},
        # planning/flops.py: tokens/s per device and MFU against the device's data-sheet peak
        "throughput_uninterrupted": {e["step"]: {k: e.get(k) for k in ("tokens_per_s_per_device", "tflops_per_device",
                                                                      "mfu", "devices")} for e in plain.kind("step")},
    }
    if mem.samples:
        t_kill = min((e.get("t", 0.0) for e in lost), default=None)
        t_back = max((e.get("t", 0.0) for e in resumed), default=None)
        out["device_used_bytes"] = {"before_kill": mem.peak(0.0, t_kill or 0.0),
                                    "recovery": mem.peak(t_kill or 0.0, t_back or 0.0),
                                    "after": mem.peak(t_back or float("inf")), "samples": len(mem.samples)}
        planned_bytes = [st.get("memory_bytes") or 0 for pp in plans[0]["pipelines"] for st in pp["stages"]]
        out["planned_bytes_per_rank"] = planned_bytes
        # What the planner does not count, per rank: CUDA context, NCCL's communicators and buffers, the
        # caching allocator's slack (issue: communicators in the memory budget).
        used = out["device_used_bytes"]
        out["unplanned_bytes_per_rank"] = {k: (used[k] - sum(planned_bytes)) / (nodes + 1) if used.get(k) else None
                                           for k in ("before_kill", "recovery", "after")}
    rec.results.update(out)
    steps = plain.kind("step")
    # on a GPU of the peak table every step has an MFU in (0, 1); on the CPU none (no peak)
    rec.check("step_events_have_mfu", bool(steps) and all(
        (0 < (e.get("mfu") or 0) < 1) if s.cuda else "mfu" not in e for e in steps)
        and all((e.get("tokens_per_s_per_device") or 0) > 0 for e in steps), f"{out['throughput_uninterrupted']}")
    rec.check("node_lost_is_node2", [e["node"] for e in lost] == ["node2"], f"{[(e['node'], e['cause']) for e in lost]}")
    rec.check("recovered_in_memory", not drill.kind("checkpoint_fallback") and bool(resumed),
              f"resumed {resumed}, fallback {drill.kind('checkpoint_fallback')}")
    rec.check("spare_joined", [p.get("reason") for p in plans][-1:] == ["join"] and bool(drill.kind("node_joined")),
              f"plans {out['plans']}")
    rec.check("back_to_the_initial_shape", [len(p) for p in out["plans"][-1]["pipelines"]]
              == [len(p) for p in out["plans"][0]["pipelines"]], f"plans {out['plans']}")
    # The survivors train the degraded steps on another plan (one pipeline sums what two did), so the
    # trajectory equals the uninterrupted one up to the order of a gradient's sum: close, not bitwise
    # (section a is bitwise: one rank, the same plan before and after).
    la, lb = plain.losses(), drill.losses()
    tol = WIDE_TOLERANCE[s.precision]
    rec.check("losses_close", la.keys() == lb.keys() and all(math.isclose(la[k], lb[k], rel_tol=tol) for k in la),
              f"{la} vs {lb}")
    apart = max((float((a[k].double() - b[k].double()).abs().max()) for k in a if k in b and a[k].is_floating_point()),
                default=float("nan"))
    rec.results["max_abs_diff"] = apart
    rec.check("same_final_layers", not cmp["missing_names"], f"missing {cmp['missing_names']}")
    rec.summary = (f"{name}: node2 killed in step {kill_step}, resumed at "
                   f"{[e['step'] for e in resumed]} after {[round(e.get('total_seconds') or 0, 2) for e in resumed]} s; "
                   f"final state {'bitwise equal' if cmp['equal'] else f'within {apart:.2g}'} of the uninterrupted run")
