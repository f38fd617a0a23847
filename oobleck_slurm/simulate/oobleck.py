"""Oobleck (this project) in the simulator: the REAL `reconfigure` at every membership change.

At each failure the simulator calls `planning.reconfigure.reconfigure` on the current plan, exactly as
the coordinator does, with the layer sizes (parameters + optimizer state) so the returned transfers
are the real copies. It then charges the calibrated recovery time (`Calibration.recovery_s`) for the
largest number of bytes one device sends or receives, and trains on at the new plan's predicted step
time (the cost model: slowest pipeline for its share of the batch + the cross-pipeline all-reduce that
its last backward does not hide).
When `reconfigure` raises RecoveryImpossible (a layer lost every replica, or fewer than f + 1
pipelines fit), and only then, the run falls back to its last checkpoint: work since then is lost,
the job restarts (`Calibration.restart_s`) on a fresh `instantiate` of the live nodes.

Speed: a shape cache. Pipelines are kept in a canonical order (largest template first, as
`instantiate` orders them); pipeline order changes no step time and no copy size. Before a call,
a lost node's pipeline is swapped to the front of the run of pipelines with the same template.
The outcome of `reconfigure` depends on the node ids only through their positions (which pipeline,
which place in it, which spare, which newcomer), so it is cached under (templates in order, spares,
lost positions, newcomers, f) and replayed on other ids by position. The plan is exactly what a
direct call returns on the canonically ordered plan; `plan_copies` breaks ties between equally
loaded holders by node name, so on a cache hit the sender of a copy may differ from a direct call's
(the bytes moved do not). `tests/simulate/test_simulate.py` compares cached and direct runs.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Sequence
from typing import Any

from oobleck_slurm.planning.instantiate import PipelinePlan, Plan, distribute_batch, exposed_sync_time, instantiate
from oobleck_slurm.planning.reconfigure import RecoveryImpossible, plan_holders, reconfigure
from oobleck_slurm.planning.templates import PipelineTemplate, PlanningError
from oobleck_slurm.simulate.calibration import Calibration
from oobleck_slurm.simulate.core import Ledger, SystemResult, ledger_result
from oobleck_slurm.simulate.scenario import SNAPSHOT_BPS, Scenario
from oobleck_slurm.simulate.traces import Trace, TraceEvent

Pipes = list[tuple[PipelineTemplate, tuple[str, ...]]]


class _Outcome:
    """A cached reconfiguration, by position."""

    __slots__ = ("pipes", "spares", "rules", "step_s", "copy_bytes", "bytes", "impossible")

    def __init__(self) -> None:
        self.pipes: list[tuple[Any, ...]] = []
        self.spares: tuple[tuple[Any, ...], ...] = ()
        self.rules: tuple[str, ...] = ()
        self.step_s = 0.0
        self.copy_bytes = 0.0
        self.bytes = 0
        self.impossible: RecoveryImpossible | None = None


class OobleckSystem:
    name = "oobleck"

    def __init__(self, scenario: Scenario, calibration: Calibration, *, use_cache: bool = True) -> None:
        self.sc = scenario
        self.cal = calibration
        self.use_cache = use_cache
        order = sorted(range(len(scenario.templates)),
                       key=lambda i: (-scenario.templates[i].num_nodes, scenario.templates[i].bottleneck_s, i))
        self.rank = {id(scenario.templates[i]): r for r, i in enumerate(order)}
        self.cache: dict[tuple, _Outcome] = {}
        self.calls = 0  # real reconfigure calls (cache misses)
        self.hits = 0
        self._sync: dict[tuple, float] = {}
        self.reconfigure_log: list[dict[str, Any]] = []  # (time, rules, bytes) or fallback reason

    # -- plan helpers ------------------------------------------------------------------------------
    def _canonical(self, pipes: Pipes) -> Pipes:
        return sorted(pipes, key=lambda p: self.rank[id(p[0])])

    def _make_plan(self, pipes: Pipes, spares: Sequence[str]) -> Plan:
        shares = distribute_batch([t for t, _ in pipes], self.sc.global_microbatches)
        out, first = [], 0
        for (t, nodes), nb in zip(pipes, shares):
            out.append(PipelinePlan(t, tuple(nodes), nb, first))
            first += nb
        return Plan(tuple(out), tuple(spares), self.sc.global_microbatches, self.sc.microbatch_size, 0.0)

    def sync_s(self, pipes: Pipes) -> float:
        """The exposed cross-pipeline all-reduce, as `instantiate` predicts it: it depends on the
        pipelines' templates and microbatch counts, so on the multiset of templates."""
        key = tuple(sorted(collections.Counter(self.rank[id(t)] for t, _ in pipes).items()))
        if key not in self._sync:
            self._sync[key] = exposed_sync_time(self.sc.profile, self._make_plan(pipes, ()).pipelines)
        return self._sync[key]

    def _checkpoint_s(self, pipes: Pipes, step_s: float) -> float:
        state = max((self.sc.stage_state_bytes(t) for t in {id(t): t for t, _ in pipes}.values()), default=0.0)
        return max(self.cal.checkpoint_steps * step_s, state / SNAPSHOT_BPS)

    def fresh_plan(self, nodes: Sequence[str]) -> tuple[Pipes, list[str], float, int] | None:
        """instantiate on `nodes` with the largest f <= the scenario's that fits; None if none fits."""
        for f in range(self.sc.f, -1, -1):
            try:
                plan = instantiate(self.sc.templates, list(nodes), f, self.sc.global_microbatches,
                                   microbatch_size=self.sc.microbatch_size, profile=self.sc.profile)
            except PlanningError:
                continue
            # Planned on names, every node is a str (NodeId also allows positions).
            pipes = self._canonical([(p.template, tuple(str(x) for x in p.nodes)) for p in plan.pipelines])
            return pipes, [str(x) for x in plan.spare_nodes], plan.step_time_s, f
        return None

    # -- one reconfiguration -------------------------------------------------------------------------
    def _outcome_from(self, r: Any, pipes: Pipes, spares: list[str], joined: list[str]) -> _Outcome:
        ref: dict[str, tuple[Any, ...]] = {}
        for i, (_, nodes) in enumerate(pipes):
            for k, n in enumerate(nodes):
                ref[n] = ("p", i, k)
        for j, n in enumerate(spares):
            ref[n] = ("s", j)
        for j, n in enumerate(joined):
            ref[n] = ("j", j)
        out = _Outcome()
        new = self._canonical([(p.template, tuple(p.nodes)) for p in r.plan.pipelines])
        for t, nodes in new:
            first = ref[nodes[0]]
            if first[0] == "p" and first[2] == 0 and pipes[first[1]][1] == nodes:
                out.pipes.append(("keep", first[1], t))
            else:
                out.pipes.append(("new", t, tuple(ref[n] for n in nodes)))
        out.spares = tuple(ref[n] for n in r.plan.spare_nodes)
        out.rules = r.rules
        out.step_s = r.predicted_step_s + self.sync_s(new)
        send: dict[Any, int] = {}
        recv: dict[Any, int] = {}
        for tr in r.transfers:
            send[tr.src] = send.get(tr.src, 0) + tr.bytes
            recv[tr.dst] = recv.get(tr.dst, 0) + tr.bytes
        out.copy_bytes = float(max(max(send.values(), default=0), max(recv.values(), default=0)))
        out.bytes = r.bytes
        return out

    @staticmethod
    def _apply(out: _Outcome, pipes: Pipes, spares: list[str], joined: list[str]) -> tuple[Pipes, list[str]]:
        def resolve(x: tuple[Any, ...]) -> str:
            if x[0] == "p":
                return pipes[x[1]][1][x[2]]
            return spares[x[1]] if x[0] == "s" else joined[x[1]]

        new = [(e[2], pipes[e[1]][1]) if e[0] == "keep" else (e[1], tuple(resolve(x) for x in e[2]))
               for e in out.pipes]
        return new, [resolve(x) for x in out.spares]

    def step(self, pipes: Pipes, spares: list[str], lost: list[str], joined: list[str], f: int,
             holders: dict | None = None) -> tuple[_Outcome, Pipes, list[str]]:
        """Reconfigure (cached when exact); returns the outcome and the new pipes and spares."""
        pipes = list(pipes)
        spares = list(spares)
        lost_desc: list[tuple[Any, ...]] = []
        sig = [self.rank[id(t)] for t, _ in pipes]
        lost_set = set(lost)
        for node in lost:
            if node in spares:
                continue
            i = next(i for i, (_, nodes) in enumerate(pipes) if node in nodes)
            if len(lost) == 1:  # canonical: the first pipeline with this template
                j = bisect.bisect_left(sig, sig[i])
                pipes[i], pipes[j] = pipes[j], pipes[i]
                i = j
            lost_desc.append(("p", i, pipes[i][1].index(node)))
        lost_spares = [n for n in spares if n in lost_set]
        spares = lost_spares + [n for n in spares if n not in lost_set]  # canonical: lost spares first
        lost_desc += [("s", j) for j in range(len(lost_spares))]
        key = (tuple(sig), len(spares), tuple(sorted(lost_desc)), len(joined), f)
        out = self.cache.get(key) if (self.use_cache and holders is None) else None
        if out is None:
            self.calls += 1
            plan = self._make_plan(pipes, spares)
            out = _Outcome()
            try:
                r = reconfigure(plan, lost, joined, self.sc.templates, f, holders=holders,
                                layer_bytes=self.sc.layer_bytes)
                out = self._outcome_from(r, pipes, spares, joined)
            except RecoveryImpossible as err:
                out.impossible = err
            if self.use_cache and holders is None:
                self.cache[key] = out
        else:
            self.hits += 1
        if out.impossible is not None:
            return out, pipes, spares
        new_pipes, new_spares = self._apply(out, pipes, spares, joined)
        return out, new_pipes, new_spares

    # -- the run ----------------------------------------------------------------------------------------
    def run(self, trace: Trace) -> SystemResult:
        sc, cal = self.sc, self.cal
        ledger = Ledger(sc.batch_samples, sc.checkpoint_interval, 0.0)
        ledger.set_horizon(trace.horizon_s)
        start = self.fresh_plan(trace.initial_nodes)
        notes: list[str] = []
        if start is None:
            raise PlanningError(f"the model fits on no plan over the {len(trace.initial_nodes)} initial nodes")
        pipes, spares, step_s, f = start
        if f < sc.f:
            notes.append(f"the initial {len(trace.initial_nodes)} nodes survive only f={f} (asked {sc.f})")
        initial_rate = sc.batch_samples / step_s
        ledger.step_s = step_s
        ledger.checkpoint_s = self._checkpoint_s(pipes, ledger.step_s)
        idle_nodes: list[str] = []  # live nodes while no plan fits (after a fallback)
        pending: list[list[Any]] = []  # [category, seconds] still to spend before training resumes
        before: tuple[Pipes, list[str]] | None = None  # membership before the recovery in progress
        failures = joins = fallbacks = 0

        def advance(t: float) -> None:
            while ledger.t < t - 1e-12:
                if pending:
                    cat, sec = pending[0]
                    use = min(sec, t - ledger.t)
                    ledger.spend(cat, use)
                    if use >= sec - 1e-12:
                        pending.pop(0)
                    else:
                        pending[0][1] = sec - use
                elif ledger.step_s is None:
                    ledger.spend("idle", t - ledger.t)
                else:
                    ledger.train(t - ledger.t)

        def fallback(live: list[str], reason: str, t: float) -> None:
            nonlocal pipes, spares, f, fallbacks, idle_nodes
            fallbacks += 1
            ledger.roll_back()
            pending.clear()
            fresh = self.fresh_plan(live)
            self.reconfigure_log.append({"t": t, "fallback": reason, "live": len(live)})
            if fresh is None:
                pipes, spares, idle_nodes = [], [], list(live)
                ledger.step_s = None
                notes.append(f"t={t:.0f}s: {len(live)} live nodes hold no plan; idle until nodes join")
                return
            pipes, spares, step, f = fresh
            idle_nodes = []
            ledger.step_s = step
            ledger.checkpoint_s = self._checkpoint_s(pipes, ledger.step_s)
            pending.append(["fallback", cal.restart_s])

        events = list(trace.events)
        i = 0
        while i < len(events) and events[i].time < trace.horizon_s:
            t = events[i].time
            group: list[TraceEvent] = []
            while i < len(events) and events[i].time == t:
                group.append(events[i])
                i += 1
            lost = [e.node for e in group if e.kind == "fail"]
            joined = [e.node for e in group if e.kind == "join"]
            failures += len(lost)
            joins += len(joined)
            advance(t)
            if ledger.step_s is None:  # idle after a fallback: try again with the newcomers
                live = [n for n in idle_nodes if n not in lost] + joined
                idle_nodes = live
                if joined:
                    fresh = self.fresh_plan(live)
                    if fresh is not None:
                        pipes, spares, step, f = fresh
                        idle_nodes = []
                        ledger.step_s = step
                        ledger.checkpoint_s = self._checkpoint_s(pipes, ledger.step_s)
                        pending.append(["fallback", cal.restart_s])
                continue
            if pending and pending[0][0] == "fallback":  # a fallback restart in progress: restart it
                live = [n for _, nodes in pipes for n in nodes] + spares
                fallback([n for n in live if n not in lost] + joined, "failure during a restart", t)
                continue
            holders = None
            if pending and before is not None and lost:  # a recovery cut short: copies did not finish
                alive = {n for _, nodes in pipes for n in nodes} | set(spares)
                alive -= set(lost)
                holders = {d: ls for d, ls in plan_holders(self._make_plan(*before)).items() if d[0] in alive}
            elif lost:
                ledger.interrupt("replayed")
            elif joined and not pending:
                ledger.finish_step()  # a join is folded in at a step boundary
            if not pending:
                before = None
            prev = before if holders is not None else (pipes, spares) if lost else None
            out, new_pipes, new_spares = self.step(pipes, spares, lost, joined, f, holders)
            if out.impossible is not None:
                live = [n for _, nodes in pipes for n in nodes if n not in lost] + \
                       [n for n in spares if n not in lost] + joined
                fallback(live, f"{out.impossible.kind}: {out.impossible}", ledger.t)
                before = None
                continue
            before = prev
            pipes, spares = new_pipes, new_spares
            ledger.step_s = out.step_s
            ledger.checkpoint_s = self._checkpoint_s(pipes, ledger.step_s)
            pending.clear()
            pending.append(["recovering", cal.recovery_s(out.copy_bytes, sc.link_Bps, out.step_s, join=not lost)])
            self.reconfigure_log.append({"t": ledger.t, "rules": list(out.rules), "bytes": out.bytes,
                                         "pipelines": len(pipes), "step_s": out.step_s})
        advance(trace.horizon_s)
        return ledger_result(
            self.name, ledger, trace.horizon_s, failures, joins, fallbacks=fallbacks,
            initial_samples_per_s=initial_rate, notes=notes,
            details={"reconfigure_calls": self.calls, "cache_hits": self.hits,
                     "final_pipelines": len(pipes), "final_f": f},
        )
