"""What the dashboard and the report show, as a pure reducer over the job's events.

`DashboardState.apply(event)` folds one record of `events.jsonl` (see README.md for the vocabulary)
into plain dataclasses. No I/O and no rendering here, so the same state drives the live dashboard,
the static report and the tests. A producer bug (a missing or mistyped field) must never take the
dashboard down: fields are read with tolerant accessors and a record that still fails is counted in
`bad_events` and otherwise ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

NODE_STATES = ("healthy", "suspect", "lost", "joining", "spare")
PHASES = ("detection", "replan", "group_rebuild", "state_copy", "replay")
# Kept in the events panel; a long run must not grow memory without bound.
MAX_LOG_LINES = 500


@dataclass
class NodeView:
    name: str
    state: str = "healthy"
    heartbeat_age: float | None = None
    cpu: float | None = None
    gpu: float | None = None
    slurm_state: str | None = None
    cause: str | None = None  # why it was lost
    workers: list[str] = field(default_factory=list)  # each worker process's state (one per device)
    health_score: float | None = None  # the metrics detector's score (robust z of its worst metric)
    health_metric: str | None = None  # the metric behind that score
    slowdown: float | None = None  # compute time over its peers' (stragglers)
    straggler: str | None = None  # what was done about it: rebalance, evict, report
    flagged: str | None = None  # the metrics detector flagged it: what was done (evict, report)


@dataclass
class StageView:
    layers: tuple[int, int] | None
    node: str | None
    rank: int | None


@dataclass
class PipelineView:
    id: Any
    nodes: list[str]
    stages: list[StageView]
    microbatches: int | None
    time: float | None = None  # last step's time of this pipeline, from `step` events


@dataclass
class StepPoint:
    t: float
    step: int | None
    loss: float | None
    samples_per_s: float | None
    step_time: float | None = None


@dataclass
class Recovery:
    """One reconfiguration: after a `failure`, or to fold in a joined node (`trigger` = "join")."""

    trigger: str  # "failure", "reform" (collective errors, nobody lost), or "join" / "replan"
    t_start: float  # when the failure happened (detection time subtracted) or the first phase began
    generation: int | None = None
    nodes: list[str] = field(default_factory=list)
    cause: str | None = None
    step: int | None = None  # the interrupted step
    phases: dict[str, float] = field(default_factory=dict)  # in arrival order
    state_bytes: int | None = None
    t_end: float | None = None  # `resumed` time; None while recovering
    total_seconds: float | None = None
    resumed_generation: int | None = None

    @property
    def done(self) -> bool:
        return self.t_end is not None

    @property
    def seconds(self) -> float | None:
        """The whole recovery: the producer's total if given, else resume time minus start."""
        if self.total_seconds is not None:
            return self.total_seconds
        return None if self.t_end is None else self.t_end - self.t_start


@dataclass
class LogLine:
    """One line of the events panel: when, what, how long it took (if it has a duration)."""

    t: float
    kind: str
    text: str
    seconds: float | None = None


@dataclass
class Checkpoint:
    t: float
    step: int | None
    seconds: float | None
    path: str | None


class DashboardState:
    """Everything the panels show; build it by `apply`-ing events in log order."""

    def __init__(self) -> None:
        self.job_id: str | None = None
        self.backend: str | None = None
        self.recipe: str | None = None
        self.recipe_path: str | None = None
        self.f: int | None = None
        self.total_steps: int | None = None
        self.slurm_job_id: str | None = None
        self.slurm_state: str | None = None
        self.status = "waiting"  # waiting, running, recovering, finished, failed, ...
        self.exit_code: int | None = None
        self.t_start: float | None = None
        self.t_last: float | None = None
        self.t_end: float | None = None

        self.step: int | None = None
        self.loss: float | None = None
        self.samples_per_s: float | None = None
        self.step_time: float | None = None
        self.history: list[StepPoint] = []

        self.nodes: dict[str, NodeView] = {}
        self.generation: int | None = None
        self.plan_reason: str | None = None
        self.pipelines: list[PipelineView] = []

        self.recoveries: list[Recovery] = []
        self.checkpoints: list[Checkpoint] = []
        self.fallback_reason: str | None = None
        self.log: list[LogLine] = []
        self.events_seen = 0
        self.unknown_events = 0
        self.bad_events = 0

    # -- derived -----------------------------------------------------------------------------

    @property
    def has_events(self) -> bool:
        return self.events_seen > 0

    @property
    def current_recovery(self) -> Recovery | None:
        if self.recoveries and not self.recoveries[-1].done:
            return self.recoveries[-1]
        return None

    @property
    def steps_done(self) -> int | None:
        """Steps finished: `step` is the 0-based index of the last one (as the engine writes it)."""
        return None if self.step is None else self.step + 1

    @property
    def elapsed(self) -> float | None:
        if self.t_start is None:
            return None
        end = self.t_end if self.t_end is not None else self.t_last
        return None if end is None else max(0.0, end - self.t_start)

    # -- the reducer -------------------------------------------------------------------------

    def apply(self, event: dict[str, Any]) -> None:
        """Fold one event in. Never raises: a malformed record is counted in `bad_events`."""
        if not isinstance(event, dict):
            self.bad_events += 1
            return
        t = _num(event.get("t"))
        kind = event.get("kind")
        if t is None or not isinstance(kind, str):
            self.bad_events += 1
            return
        handler = _HANDLERS.get(kind)
        self.events_seen += 1
        if self.t_start is None:
            self.t_start = t
        self.t_last = t if self.t_last is None else max(self.t_last, t)
        if handler is None:
            self.unknown_events += 1
            return
        try:
            handler(self, t, event)
        except (TypeError, ValueError, KeyError, AttributeError, IndexError):
            self.bad_events += 1

    def apply_all(self, events: list[dict[str, Any]]) -> DashboardState:
        for event in events:
            self.apply(event)
        return self

    # -- handlers, one per kind --------------------------------------------------------------

    def _job_started(self, t: float, e: dict) -> None:
        self.t_start = t
        self.job_id = _str(e.get("job_id"))
        self.backend = _str(e.get("backend"))
        self.recipe = _str(e.get("recipe"))
        self.recipe_path = _str(e.get("recipe_path"))
        self.f = _int(e.get("f"))
        self.total_steps = _int(e.get("steps"))
        self.slurm_job_id = _str(e.get("slurm_job_id"))
        self.status = "running"
        for name in _str_list(e.get("nodes")):
            self._node(name)
        for name in _str_list(e.get("spares")):
            self._node(name).state = "spare"
        where = f" on {self.backend}" if self.backend else ""
        self._log(t, "job_started", f"job {self.job_id or '?'} started{where}, {len(self.nodes)} nodes")

    def _job_finished(self, t: float, e: dict) -> None:
        self.t_end = t
        self.status = _str(e.get("status")) or "finished"
        self.exit_code = _int(e.get("exit_code"))
        code = f" (exit {self.exit_code})" if self.exit_code is not None else ""
        self._log(t, "job_finished", f"job {self.status}{code}")

    def _slurm_job(self, t: float, e: dict) -> None:
        self.slurm_job_id = _str(e.get("slurm_job_id")) or self.slurm_job_id
        state = _str(e.get("state"))
        if state and state != self.slurm_state:
            self.slurm_state = state
            self._log(t, "slurm_job", f"Slurm job {self.slurm_job_id or ''} {state}".replace("  ", " "))

    def _plan(self, t: float, e: dict) -> None:
        self.generation = _int(e.get("generation"))
        self.plan_reason = _str(e.get("reason"))
        pipelines = []
        for p in e.get("pipelines") or []:
            if not isinstance(p, dict):
                continue
            stages = [
                StageView(_range(s.get("layers")), _str(s.get("node")), _int(s.get("rank")))
                for s in p.get("stages") or [] if isinstance(s, dict)
            ]
            nodes = _str_list(p.get("nodes")) or _unique(s.node for s in stages if s.node)
            pipelines.append(PipelineView(p.get("id", len(pipelines)), nodes, stages, _int(p.get("microbatches"))))
        self.pipelines = pipelines
        rec = self.current_recovery
        if rec is not None and rec.trigger not in ("failure", "reform"):
            # The supervisor's `replan` phase comes before the plan that says why.
            rec.trigger = "join" if self.plan_reason == "join" else "replan"
        for name in _str_list(e.get("spares")):
            if self._node(name).state != "lost":
                self._node(name).state = "spare"
        in_use = {n for p in pipelines for n in p.nodes}
        for name in in_use:
            node = self._node(name)
            if node.state in ("spare", "joining"):
                node.state = "healthy"
        for node in self.nodes.values():
            # A node outside every pipeline that is not known to be lost waits as a spare.
            if node.name not in in_use and node.state in ("healthy", "joining"):
                node.state = "spare"
        templates = ", ".join(str(len(p.stages) or len(p.nodes)) for p in pipelines)
        self._log(t, "plan", f"plan gen {_fmt(self.generation)} ({self.plan_reason or '?'}): "
                  f"{len(pipelines)} pipelines, stages [{templates}]")

    def _step(self, t: float, e: dict) -> None:
        step = _int(e.get("step"))
        loss = _num(e.get("loss"))
        sps = _num(e.get("samples_per_s"))
        self.step = step if step is not None else self.step
        self.loss = loss if loss is not None else self.loss
        self.samples_per_s = sps if sps is not None else self.samples_per_s
        # The engine writes `seconds` and `pipeline_seconds` (a list by pipeline id); the contract's
        # names are `step_time` and `pipelines`: read either.
        step_time = _num(e.get("step_time", e.get("seconds")))
        self.step_time = step_time if step_time is not None else self.step_time
        self.history.append(StepPoint(t, step, loss, sps, step_time))
        rec = self.current_recovery
        if rec is not None and not rec.phases and rec.trigger == "failure" and t > rec.t_start:
            # A failure that stopped nothing (a joining node died before it was used): training goes on.
            self.recoveries.remove(rec)
        if self.status in ("waiting", "recovering") and self.current_recovery is None:
            self.status = "running"
        times = {}
        for p in e.get("pipelines") or []:
            if isinstance(p, dict):
                times[p.get("id")] = _num(p.get("time"))
        for i, seconds in enumerate(e.get("pipeline_seconds") or []):
            times.setdefault(i, _num(seconds))
        for p in self.pipelines:
            if p.id in times:
                p.time = times[p.id]

    def _node_event(self, t: float, e: dict) -> None:
        name = _str(e.get("node"))
        if not name:
            raise ValueError("node event without a node")
        node = self._node(name)
        state = _str(e.get("state"))
        if state in NODE_STATES and state != node.state:
            if state in ("suspect", "lost") or node.state in ("suspect", "lost"):
                self._log(t, "node", f"{name} {node.state} -> {state}")
            node.state = state
        node.heartbeat_age = _num(e.get("heartbeat_age"))
        node.cpu = _num(e.get("cpu"))
        node.gpu = _num(e.get("gpu"))
        workers = e.get("workers")
        if isinstance(workers, list):
            node.workers = [str(w) for w in workers]
        node.slurm_state = _str(e.get("slurm_state")) or node.slurm_state
        node.cause = _str(e.get("cause")) or (node.cause if node.state == "lost" else None)

    def _failure(self, t: float, e: dict) -> None:
        nodes = _str_list(e.get("nodes"))
        cause, step = _str(e.get("cause")), _int(e.get("step"))
        for name in nodes:
            self._node(name).state = "lost"
            self._node(name).cause = self._node(name).cause or cause
        rec = self.current_recovery
        if rec is not None:
            # A node lost while a recovery runs: the same recovery, now for one more node.
            rec.trigger = "failure"
            rec.nodes += [n for n in nodes if n not in rec.nodes]
            rec.cause = rec.cause or cause
            rec.step = rec.step if rec.step is not None else step
        else:
            rec = Recovery("failure", t, generation=_int(e.get("generation")), nodes=nodes, cause=cause, step=step)
            self.recoveries.append(rec)
        self.status = "recovering"
        where = f" at step {step}" if step is not None else " during recovery" if rec.phases or rec.nodes != nodes else ""
        self._log(t, "failure", f"{', '.join(nodes) or 'node'} lost ({cause or '?'}){where}")

    def _reform(self, t: float, e: dict) -> None:
        step = _int(e.get("step"))
        self.recoveries.append(Recovery("reform", t, generation=_int(e.get("generation")),
                                        cause=_str(e.get("cause")), step=step))
        self.status = "recovering"
        self._log(t, "reform", f"re-forming the same members at step {_fmt(step)} ({_str(e.get('cause')) or '?'})")

    def _phase(self, t: float, e: dict) -> None:
        kind = e["kind"]
        seconds = _num(e.get("seconds"))
        rec = self.current_recovery
        if rec is None:
            # Phases without a failure: a reconfiguration to fold in a joined node (or a replan).
            trigger = "join" if self.plan_reason == "join" else "replan"  # a later `plan` may say otherwise
            rec = Recovery(trigger, t - (seconds or 0.0), generation=self.generation)
            self.recoveries.append(rec)
        if kind == "detection" and seconds is not None:
            rec.t_start = min(rec.t_start, t - seconds)
        if seconds is not None:
            rec.phases[kind] = rec.phases.get(kind, 0.0) + seconds
        if kind == "state_copy":
            rec.state_bytes = _int(e.get("bytes"))
        if rec.trigger == "failure":
            self.status = "recovering"
        detail = {
            "state_copy": _bytes(rec.state_bytes) if rec.state_bytes is not None else "",
            "replay": f"step {_fmt(_int(e.get('step')))}" if e.get("step") is not None else "",
        }.get(kind, "")
        self._log(t, kind, detail, seconds)

    def _resumed(self, t: float, e: dict) -> None:
        rec = self.current_recovery
        if rec is None:
            rec = Recovery("replan", t)
            self.recoveries.append(rec)
        rec.t_end = t
        rec.total_seconds = _num(e.get("total_seconds"))
        rec.resumed_generation = _int(e.get("generation"))
        if self.status == "recovering":
            self.status = "running"
        self._log(t, "resumed", f"at step {_fmt(_int(e.get('step')))}, gen {_fmt(rec.resumed_generation)}",
                  rec.seconds)

    def _replacement_requested(self, t: float, e: dict) -> None:
        name = _str(e.get("node"))
        if name:
            self._node(name).state = "joining"
            self._log(t, "replacement_requested", f"replacement requested: {name}")
        else:
            self._log(t, "replacement_requested", f"replacement requested: Slurm job {_fmt(e.get('slurm_job_id'))}")

    def _node_joined(self, t: float, e: dict) -> None:
        name = _str(e.get("node")) or "?"
        node = self._node(name)
        if node.state in ("lost", "spare"):
            node.state = "joining"
        self._log(t, "node_joined", f"{name} joined", _num(e.get("seconds")))

    def _health_check(self, t: float, e: dict) -> None:
        name = _str(e.get("node")) or "?"
        ok = e.get("ok")
        if ok is False:
            self._node(name).state = "suspect"
        verdict = "ok" if ok is True else "FAILED" if ok is False else "?"
        self._log(t, "health_check", f"{name} {verdict}", _num(e.get("seconds")))

    def _checkpoint(self, t: float, e: dict) -> None:
        if e.get("ok") is False:
            self._log(t, "checkpoint", f"FAILED: {_str(e.get('detail')) or '?'}")
            return
        cp = Checkpoint(t, _int(e.get("step")), _num(e.get("seconds")), _str(e.get("path")))
        self.checkpoints.append(cp)
        self._log(t, "checkpoint", f"step {_fmt(cp.step)}" + (" (on demand)" if e.get("on_demand") else ""), cp.seconds)

    def _node_lost(self, t: float, e: dict) -> None:
        name = _str(e.get("node")) or "?"
        self._node(name).state = "lost"
        self._node(name).cause = _str(e.get("cause"))
        detail = _str(e.get("detail"))
        self._log(t, "node_lost", f"{name}: {_str(e.get('cause')) or '?'}" + (f" ({detail})" if detail else ""),
                  _num(e.get("detection_seconds")))

    def _note(self, t: float, e: dict) -> None:
        """Kinds shown as a line in the events panel and nothing else."""
        kind = e["kind"]
        text = {
            "agents_ready": lambda: f"{len(_str_list(e.get('nodes')))} agents ready",
            "done": lambda: "training done" + (f": {_str(e.get('note'))}" if e.get("note") else ""),
            "fault_injected": lambda: f"drill: {_str(e.get('how')) or '?'} on {_str(e.get('node')) or '?'}",
            "checkpoint_requested": lambda: f"checkpoint requested ({_str(e.get('reason')) or '?'})",
            "preempt_notice": lambda: f"preemption notice from {_str(e.get('node')) or '?'}",
            "slurm_unreachable": lambda: f"Slurm unreachable: {_str(e.get('error')) or '?'}",
            "refused": lambda: f"refused {_str(e.get('peer')) or '?'}: {_str(e.get('reason')) or '?'}",
            "collective_error": lambda: f"collective error on {', '.join(_str_list(e.get('nodes'))) or '?'} at step "
                                        f"{_fmt(_int(e.get('step')))}",
            "drill": lambda: f"scripted drill at step {_fmt(_int(e.get('step')))}: {_str(e.get('how')) or '?'} on "
                             f"{_str(e.get('node')) or '?'}",
            "run_complete": lambda: f"run complete: {_str(e.get('note')) or ''}",
        }[kind]()
        self._log(t, kind, text, _num(e.get("seconds")) if kind == "agents_ready" else None)

    # -- detection (supervisor/health_monitor.py): scores, flagged machines, stragglers

    def _health(self, t: float, e: dict) -> None:
        scores, metrics, slow = (_dict(e.get(k)) for k in ("scores", "metrics", "slowdowns"))
        for name, node in self.nodes.items():
            if name in scores or name in slow:
                node.health_score = _num(scores.get(name))
                node.health_metric = _str(metrics.get(name))
                node.slowdown = _num(slow.get(name))

    def _faulty_node(self, t: float, e: dict) -> None:
        name = _str(e.get("node")) or "?"
        action = _str(e.get("action")) or "?"
        self._node(name).flagged = action
        self._log(t, "faulty_node", f"{name} flagged ({action}): {_str(e.get('detail')) or '?'}")

    def _straggler(self, t: float, e: dict) -> None:
        action = _str(e.get("action")) or "?"
        slow = _dict(e.get("nodes"))
        if action == "rebalance":
            for node in self.nodes.values():  # a rebalance names every slow node: the others are back to normal
                if node.straggler == "rebalance" and node.name not in slow:
                    node.straggler = None
        for name, factor in slow.items():
            node = self._node(str(name))
            node.straggler, node.slowdown = action, _num(factor) or node.slowdown
        named = ", ".join(f"{n} x{f:.2f}" if _num(f) is not None else str(n) for n, f in slow.items())
        self._log(t, "straggler", f"{action}: {named or 'no straggler left'}")

    def _checkpoint_fallback(self, t: float, e: dict) -> None:
        self.fallback_reason = _str(e.get("reason")) or "?"
        self._log(t, "checkpoint_fallback", f"falling back to checkpoint: {self.fallback_reason}")

    # -- helpers -----------------------------------------------------------------------------

    def _node(self, name: str) -> NodeView:
        if name not in self.nodes:
            self.nodes[name] = NodeView(name)
        return self.nodes[name]

    def _log(self, t: float, kind: str, text: str, seconds: float | None = None) -> None:
        self.log.append(LogLine(t, kind, text, seconds))
        if len(self.log) > MAX_LOG_LINES:
            del self.log[: len(self.log) - MAX_LOG_LINES]


_HANDLERS: dict[str, Callable[[DashboardState, float, dict], None]] = {
    "job_started": DashboardState._job_started,
    "job_finished": DashboardState._job_finished,
    "slurm_job": DashboardState._slurm_job,
    "plan": DashboardState._plan,
    "step": DashboardState._step,
    "node": DashboardState._node_event,
    "failure": DashboardState._failure,
    **{phase: DashboardState._phase for phase in PHASES},
    "resumed": DashboardState._resumed,
    "replacement_requested": DashboardState._replacement_requested,
    "node_joined": DashboardState._node_joined,
    "health_check": DashboardState._health_check,
    "checkpoint": DashboardState._checkpoint,
    "checkpoint_fallback": DashboardState._checkpoint_fallback,
    "node_lost": DashboardState._node_lost,
    "reform": DashboardState._reform,
    "health": DashboardState._health,
    "faulty_node": DashboardState._faulty_node,
    "straggler": DashboardState._straggler,
    **{kind: DashboardState._note for kind in ("agents_ready", "done", "fault_injected", "checkpoint_requested",
                                               "preempt_notice", "slurm_unreachable", "refused",
                                               "collective_error", "drill", "run_complete")},
}


# -- tolerant field access: a wrong type reads as missing ------------------------------------

def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _str(value: Any) -> str | None:
    if value is None or isinstance(value, (dict, list)):
        return None
    return str(value)


def _str_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        return []
    return [str(v) for v in value if isinstance(v, (str, int))]


def _dict(value: Any) -> dict[Any, Any]:
    return value if isinstance(value, dict) else {}


def _range(value: Any) -> tuple[int, int] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        start, stop = _int(value[0]), _int(value[1])
        if start is not None and stop is not None:
            return (start, stop)
    return None


def _unique(items) -> list:
    return list(dict.fromkeys(items))


def _fmt(value: Any) -> str:
    return "-" if value is None else str(value)


def _bytes(n: int | None) -> str:
    """Human size, for the events panel (`384.0 MiB`)."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
