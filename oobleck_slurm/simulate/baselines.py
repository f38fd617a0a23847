"""The systems Oobleck is compared with, on the same trace, templates and cost model.

Both baselines run *homogeneous* data parallelism: k copies of one pipeline template, k = floor(N / n)
for the template size n that gives the highest throughput on N live nodes (re-planned at every
restart, with the real `instantiate` restricted to one template). Throughput comes from the same
cost model as Oobleck's, so the comparison isolates the fault-tolerance mechanism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from oobleck_slurm.planning import PipelineTemplate, PlanningError, instantiate
from oobleck_slurm.planning.cost import usable_memory
from oobleck_slurm.simulate.core import Ledger, SystemResult, ledger_result
from oobleck_slurm.simulate.scenario import Scenario
from oobleck_slurm.simulate.traces import Trace

# Assumptions for checkpoint-restart when no artifact constants are given (docs/simulator.md):
STORAGE_BPS_PER_DEVICE = 2e9  # each GPU writes (and reads back) its shard at 2 GB/s to the parallel file system
SLURM_DOWN_S = 12.9  # measured on this project's Slurm lab: a killed node was marked DOWN after 12.9 s
RELAUNCH_S = 60.0  # relaunch of every rank + NCCL init: an assumed round minute, not measured here


@dataclass(frozen=True)
class RestartCosts:
    """What a checkpoint and a restart cost, and how often checkpoints are taken."""

    checkpoint_s: float  # training stalls this long per checkpoint
    restart_s: float  # from a failure (or a resize) until training runs again
    interval_steps: int | None = None  # None: Young's interval sqrt(2 C MTBF) for the trace
    source: str = "model"


class _Homogeneous:
    """Best homogeneous data-parallel plan per node count, cached."""

    def __init__(self, scenario: Scenario, templates: tuple[PipelineTemplate, ...]) -> None:
        self.sc = scenario
        self.templates = templates
        self.best = lru_cache(maxsize=None)(self._best)

    def _best(self, nodes: int) -> tuple[float, PipelineTemplate] | None:
        """(step seconds, template) or None when no template fits `nodes`."""
        best = None
        for t in self.templates:
            if t.num_nodes > nodes:
                continue
            try:
                plan = instantiate([t], nodes, 0, self.sc.global_microbatches,
                                   microbatch_size=self.sc.microbatch_size, profile=self.sc.profile)
            except PlanningError:
                continue
            if best is None or plan.step_time_s < best[0]:
                best = (plan.step_time_s, t)
        return best


def default_restart_costs(scenario: Scenario, relaunch_s: float = RELAUNCH_S) -> RestartCosts:
    """Checkpoint = the largest per-device shard of the best full-size plan written at
    STORAGE_BPS_PER_DEVICE; restart = Slurm noticing the node (SLURM_DOWN_S) + relaunch (`relaunch_s`,
    RELAUNCH_S unless given) + reading the shard back."""
    shard = max(scenario.stage_state_bytes(t) for t in scenario.templates)
    ckpt = shard / STORAGE_BPS_PER_DEVICE
    return RestartCosts(ckpt, SLURM_DOWN_S + relaunch_s + ckpt, None,
                        f"model: shard {shard / 2**30:.2f} GiB at {STORAGE_BPS_PER_DEVICE / 1e9:g} GB/s, "
                        f"restart {SLURM_DOWN_S:g} + {relaunch_s:g} s + load")


def young_interval_steps(checkpoint_s: float, mtbf_s: float, step_s: float) -> int:
    """Young (1974): the checkpoint interval sqrt(2 C M) that minimises expected loss, in steps."""
    if not math.isfinite(mtbf_s) or checkpoint_s <= 0:
        return 1000
    return max(1, round(math.sqrt(2 * checkpoint_s * mtbf_s) / step_s))


class _RestartingSystem:
    """Shared event loop: segments to spend (restarts) before training resumes."""

    name = "?"

    def __init__(self, scenario: Scenario, costs: RestartCosts, templates: tuple[PipelineTemplate, ...]) -> None:
        self.sc = scenario
        self.costs = costs
        self.plans = _Homogeneous(scenario, templates)

    def _interval(self, trace: Trace, step_s: float) -> int:
        if self.costs.interval_steps is not None:
            return self.costs.interval_steps
        return young_interval_steps(self.costs.checkpoint_s, trace.mean_time_between_failures(), step_s)

    def _apply_plan(self, ledger: Ledger, nodes: int) -> PipelineTemplate | None:
        best = self.plans.best(nodes)
        ledger.step_s = best[0] if best else None
        return best[1] if best else None


class CheckpointRestart(_RestartingSystem):
    """Varuna-like checkpoint-restart (Athlur et al., EuroSys'22), as the Oobleck artifact simulates it
    (tools/simulator/varuna_simulator.py in SymbioticLab/Oobleck):

    - checkpoints every `interval_steps` (the artifact: every 10 iterations), each stalling training
      for `checkpoint_s` (the artifact: 15.8 s BERT-large, 11.5 s GPT-2, 11.2 s GPT-3 medium, 50 s
      2.7B, 120 s 6.7B);
    - a failure loses the work since the last completed checkpoint and the step in progress, then
      the job restarts (`restart_s`; the artifact: its local + global rendezvous, 76 + 10 s for
      BERT-large ... 701 + 10 s for 6.7B) on the live nodes, re-planning the data-parallel width;
    - a join: the job checkpoints at the next step boundary and restarts wider (no work lost);
    - a failure during a restart restarts it.
    """

    name = "checkpoint"

    def run(self, trace: Trace) -> SystemResult:
        live = list(trace.initial_nodes)
        best = self.plans.best(len(live))
        if best is None:
            raise PlanningError(f"no homogeneous plan fits {len(live)} nodes")
        K = self._interval(trace, best[0])
        ledger = Ledger(self.sc.batch_samples, K, self.costs.checkpoint_s)
        ledger.set_horizon(trace.horizon_s)
        self._apply_plan(ledger, len(live))
        initial_rate = self.sc.batch_samples / best[0]
        restart_until = -1.0
        restarts = failures = joins = 0
        events = [e for e in trace.events if e.time < trace.horizon_s]
        for e in events:
            self._advance(ledger, e.time, restart_until)
            if e.kind == "fail":
                failures += 1
                live.remove(e.node)
                ledger.roll_back()
            else:
                joins += 1
                live.append(e.node)
                if ledger.t >= restart_until and ledger.step_s is not None:
                    ledger.finish_step()
                    self._force_checkpoint(ledger)
            restarts += 1
            restart_until = ledger.t + self.costs.restart_s
            self._apply_plan(ledger, len(live))
        self._advance(ledger, trace.horizon_s, restart_until)
        return ledger_result(self.name, ledger, trace.horizon_s, failures, joins,
                             initial_samples_per_s=initial_rate,
                             details={"checkpoint_interval_steps": K, "checkpoint_s": self.costs.checkpoint_s,
                                      "restart_s": self.costs.restart_s, "restarts": restarts,
                                      "costs_source": self.costs.source})

    @staticmethod
    def _force_checkpoint(ledger: Ledger) -> None:
        ledger.spend("checkpointing", ledger.checkpoint_s)
        ledger._checkpoint_done()

    @staticmethod
    def _advance(ledger: Ledger, t: float, restart_until: float) -> None:
        if ledger.t < restart_until:
            ledger.spend("recovering", min(t, restart_until) - ledger.t)
        if ledger.t < t:
            if ledger.step_s is None:
                ledger.spend("idle", t - ledger.t)
            else:
                ledger.train(t - ledger.t)


def redundant_template(scenario: Scenario, t: PipelineTemplate) -> PipelineTemplate | None:
    """Template `t` with Bamboo's redundant computation: every stage also holds its successor's layers
    (the last stage: the first's) and runs their forward pass (eager redundant forward), so its time
    per microbatch grows by that forward and its memory by that state. None if it no longer fits."""
    if t.num_stages == 1:
        return t
    layers = scenario.profile.layers
    limit = usable_memory(scenario.profile)
    stages = []
    for i, s in enumerate(t.stages):
        nxt = t.stages[(i + 1) % t.num_stages]
        extra_time = sum(layer.forward_s for layer in layers[nxt.start:nxt.stop]) / s.devices
        extra_mem = sum(layer.state_bytes for layer in layers[nxt.start:nxt.stop]) / s.devices
        if s.memory_bytes + extra_mem > limit:
            return None
        stages.append(replace(s, time_s=s.time_s + extra_time, memory_bytes=s.memory_bytes + extra_mem))
    times = [s.time_s for s in stages]
    T = sum(times) + (t.num_microbatches - 1) * max(times)
    return replace(t, stages=tuple(stages), iteration_time_s=T)


class Redundancy(_RestartingSystem):
    """Bamboo-like redundant computation (Thorpe et al., NSDI'23), following the Oobleck artifact's
    model of it (tools/simulator/bamboo_simulator.py in SymbioticLab/Oobleck):

    - every node also holds its pipeline successor's layers and computes their forward pass, so each
      step is slower (`redundant_template`); the throughput share lost is counted as `redundant` time,
      and a model whose doubled state fits no template cannot run (the artifact's "OOM");
    - a failure whose layers survive on the predecessor loses only the step in progress; the job then
      reconfigures (`restart_s`; the artifact: 76 + 30 s for BERT-large ... 450 + 30 s for 6.7B);
    - losing two neighbours of one pipeline before the reconfiguration completes loses a layer's
      every copy: roll back to the last checkpoint (same cadence and cost as checkpoint-restart);
    - a join: reconfigure to use it (`restart_s`, no work lost).
    """

    name = "redundancy"

    def __init__(self, scenario: Scenario, costs: RestartCosts) -> None:
        red = tuple(r for r in (redundant_template(scenario, t) for t in scenario.templates) if r is not None)
        super().__init__(scenario, costs, red)
        self.plain = _Homogeneous(scenario, scenario.templates)

    def _share(self, nodes: int) -> float:
        red, plain = self.plans.best(nodes), self.plain.best(nodes)
        return plain[0] / red[0] if red and plain else 1.0

    def run(self, trace: Trace) -> SystemResult:
        live = list(trace.initial_nodes)
        best = self.plans.best(len(live))
        if best is None:
            ledger = Ledger(self.sc.batch_samples)
            ledger.spend("idle", trace.horizon_s)
            return ledger_result(self.name, ledger, trace.horizon_s, trace.failures, 0,
                                 notes=["OOM: the model with its successor's redundant copy fits no template"],
                                 details={"oom": True})
        K = self._interval(trace, best[0])
        ledger = Ledger(self.sc.batch_samples, K, self.costs.checkpoint_s)
        ledger.set_horizon(trace.horizon_s)
        template = self._apply_plan(ledger, len(live))
        ledger.useful_share = self._share(len(live))
        initial_rate = self.sc.batch_samples / best[0]
        restart_until = -1.0
        window: list[str] = []
        where: dict[str, tuple[int, int, int]] = {}
        failures = joins = fatal = 0

        def layout(nodes: list[str], t: PipelineTemplate | None) -> dict[str, tuple[int, int, int]]:
            if t is None:
                return {}
            n = t.num_nodes
            return {node: (i // n, i % n, n) for i, node in enumerate(nodes[: (len(nodes) // n) * n])}

        where = layout(live, template)
        for e in (e for e in trace.events if e.time < trace.horizon_s):
            CheckpointRestart._advance(ledger, e.time, restart_until)
            if ledger.t >= restart_until:  # the previous reconfiguration is complete
                window = []
                where = layout(live, template)
            if e.kind == "fail":
                failures += 1
                live.remove(e.node)
                window.append(e.node)
                if self._fatal(window, where):
                    fatal += 1
                    ledger.roll_back()
                else:
                    ledger.interrupt("replayed")
            else:
                joins += 1
                live.append(e.node)
                if ledger.t >= restart_until:
                    ledger.finish_step()
            restart_until = ledger.t + self.costs.restart_s
            template = self._apply_plan(ledger, len(live))
            ledger.useful_share = self._share(len(live))
        CheckpointRestart._advance(ledger, trace.horizon_s, restart_until)
        return ledger_result(self.name, ledger, trace.horizon_s, failures, joins, fallbacks=fatal,
                             initial_samples_per_s=initial_rate,
                             details={"checkpoint_interval_steps": K, "restart_s": self.costs.restart_s,
                                      "redundant_share": 1 - self._share(len(trace.initial_nodes)),
                                      "costs_source": self.costs.source})

    @staticmethod
    def _fatal(window: list[str], where: dict[str, tuple[int, int, int]]) -> bool:
        """Two lost nodes adjacent in one pipeline (circularly): a layer lost both its copies."""
        spots = {(where[n][0], where[n][1]) for n in window if n in where}
        for n in window:
            if n not in where:
                continue
            p, k, depth = where[n]
            if depth > 1 and (p, (k + 1) % depth) in spots and (k + 1) % depth != k:
                return True
        return False
