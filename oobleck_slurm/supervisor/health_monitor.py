"""The supervisor's health monitor: Minder-style detection and stragglers, live (see detection/).

`AgentNodes` feeds it and acts on what it returns:

    receive(node, samples)     an agent's batch of metrics (control-plane thread): appended to the job
                               folder's metrics.csv (bounded, rotated: what `detect JOB` reads) and kept
                               for the detector until its time slot is complete
    poll(view, now)            (the watcher thread, every few ms) follows the job's generation and each
                               step's compute-only seconds per rank (`gen{g}/compute`, written by rank 0)
                               in the store observer's latest view (supervisor/observer.py: no store
                               request here), feeds complete time slots to the `MinderDetector` and step
                               timings to the `StragglerWatch`, and returns the nodes to evict; what is
                               only reported, and rebalancing, it records itself
    rebalances()               the pending `Rebalance` decisions (node -> slowdown), for the coordinator
    forget(node)               the node left the job (lost, evicted, stopped)

Judgement is held while the job is not training normally: from a generation's abort (`gen{g}/failed`)
until the next generation's first step, and at the start (generation 0's first step), then for one
denoising window, so that the uneven moments of a recovery (some nodes copy state, others wait) and of
the start never count; also while a checkpoint is being written (from its step until every
layer's file is there), since only one holder of each layer writes it (engine/checkpoint.py); a newly
joined node is not judged for `detection.grace` seconds (the detector's grace); nor is any node for
`grace` seconds after judgement resumes under a new plan, while it learns its new role's normal
(`MinderDetector.relearn`: on heterogeneous pipelines, a role's memory and CPU differ from another's). The first step of each generation is not timed for stragglers (layers just copied,
caches cold). Events: `faulty_node` (a flagged machine: evidence, action), `straggler` (slow nodes,
action), `health` (every HEALTH_EVENT_S: each node's score, the metric behind it, its slowdown).
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from oobleck_slurm.agent.health import SEND_EVERY_S
from oobleck_slurm.detection import DetectorConfig, MetricsWriter, MinderDetector, Straggler, StragglerWatch
from oobleck_slurm.detection.health import Evict, HealthPolicy, Rebalance, Report
from oobleck_slurm.detection.metrics import METRICS_FILE
from oobleck_slurm.engine.checkpoint import LAYER_SUFFIX, step_dir
from oobleck_slurm.engine.layout import ExecPlan
from oobleck_slurm.protocol.events import EventLog
from oobleck_slurm.protocol.records import FirstStep, GenerationConfig, StepCompute
from oobleck_slurm.protocol.wire import ProtocolError
from oobleck_slurm.supervisor.observer import StoreView
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS, JobTimeouts

# The checkpoint folder's poll and how long a checkpoint may hold its judgement are the job's timeouts
# (checkpoint_poll, checkpoint_hold_max: timeouts.py); the store is read by the store observer.
HEALTH_EVENT_S = 5.0  # a `health` event (scores, slowdowns) this often
MAX_METRIC_NAME = 100
MAX_SAMPLES = 100_000  # values in one batch (an agent sends ~20 a second)


def parse_metrics(samples: Any) -> list[tuple[float, str, float]]:
    """The samples of a `metrics` message (protocol/messages.py `Metrics`, built by
    agent_health.metrics_message), checked further: ProtocolError names the field that is wrong."""
    if not isinstance(samples, (list, tuple)) or len(samples) > MAX_SAMPLES:
        raise ProtocolError(f"metrics: 'samples' must be a list of at most {MAX_SAMPLES} [time, metric, value]")
    out = []
    for i, item in enumerate(samples):
        if not (isinstance(item, (list, tuple)) and len(item) == 3):
            raise ProtocolError(f"metrics: samples[{i}] must be [time, metric, value], got {str(item)[:80]}")
        t, metric, value = item
        if not (isinstance(metric, str) and 0 < len(metric) <= MAX_METRIC_NAME):
            raise ProtocolError(f"metrics: samples[{i}]: the metric must be a name of 1-{MAX_METRIC_NAME} characters")
        for what, number in (("time", t), ("value", value)):
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
                raise ProtocolError(f"metrics: samples[{i}]: the {what} must be a finite number, got {number!r}")
        out.append((float(t), metric, float(value)))
    return out


class HealthMonitor:
    def __init__(self, detection: Any, job_dir: Path, log: EventLog, workers_per_node: int = 1,
                 checkpoint_dir: str | None = None, checkpoint_interval: int = 0, total_steps: int | None = None,
                 timeouts: JobTimeouts = DEFAULT_TIMEOUTS) -> None:
        """`detection`: the recipe's `detection:` section (recipe.schema.DetectionConfig); checkpoints
        are written into `checkpoint_dir` every `checkpoint_interval` steps (0: none) and after the
        last of `total_steps` (the trained model)."""
        self.config = DetectorConfig.from_recipe(detection)
        self.timeouts = timeouts
        self.checkpoint_dir, self.checkpoint_interval, self.total_steps = checkpoint_dir, checkpoint_interval, total_steps
        self._checkpoint: tuple[int, float] | None = None  # (step, since) of a checkpoint being written
        self._checkpoint_armed = -1  # the last checkpoint step seen starting
        self._next_look = 0.0
        self._num_layers = 0
        self.log, self.workers_per_node = log, workers_per_node
        self.detector = MinderDetector(self.config)
        self.writer = MetricsWriter(Path(job_dir) / METRICS_FILE, max_bytes=max(4096, int(detection.metrics_max_mb * 2**20)))
        self.watch_stragglers = detection.stragglers != "off"
        self.straggler_window, self.straggler_threshold = detection.straggler_window, detection.straggler_threshold
        # A straggler must stay one for a quarter of a window of steps before it is rebalanced (cheap,
        # undone when it recovers), for half a window before it is evicted or reported: with two busy
        # loops on this 2-core machine a healthy rank once measured 1.38x its peers for a quarter
        # window right after a recovery, and was evicted.
        quarter = max(1, detection.straggler_window // 4)
        self.policy = HealthPolicy(detection.evict, detection.stragglers, detection.straggler_threshold,
                                   confirm=quarter if detection.stragglers == "rebalance" else 2 * quarter)
        self.watch = self._new_watch()
        # A time slot is complete once every agent's batch that may hold it has arrived.
        self.lag = self.config.interval + SEND_EVERY_S + 0.5
        self._pending: dict[int, dict[Hashable, dict[str, float]]] = {}  # slot -> node -> metric -> value
        self._lock = threading.Lock()  # receive() runs in control-plane threads, the rest in the watcher
        self._last_time: dict[str, float] = {}  # node -> its last sample's time, as stored (ms)
        self._rebalances: queue.Queue[Rebalance] = queue.Queue()
        self._gen = -1
        self._ranks: dict[int, tuple[str, Hashable, int]] = {}  # rank -> (node, work, microbatches) in _gen
        self._work: dict[Hashable, list[tuple[int, int, int, int]]] = {}  # node -> its ranks' (layers, microbatches, stages)
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._seen = 0  # the last store view followed (its seq)
        self._next_event = 0.0

    def _new_watch(self) -> StragglerWatch:
        # A rank is judged on a full window only: a few steps' median is noise on a busy machine.
        return StragglerWatch(self.straggler_window, self.straggler_threshold, self.straggler_window)

    # ---- input ------------------------------------------------------------------------------------

    def receive(self, node: str, samples: list[tuple[float, str, float]]) -> None:
        """A batch of `node`'s samples (parse_metrics' output)."""
        by_time: dict[float, dict[str, float]] = {}
        for t, metric, value in samples:
            by_time.setdefault(t, {})[metric] = value
        with self._lock:
            for t, values in sorted(by_time.items()):
                if round(t, 3) <= self._last_time.get(node, -math.inf):
                    continue  # not after the node's last sample (a clock stepped back): the file keeps one per time
                self._last_time[node] = round(t, 3)
                self.writer.write(t, {node: values})
                slot = math.floor(t / self.config.interval + 1e-9)
                self._pending.setdefault(slot, {}).setdefault(node, {}).update(values)

    def forget(self, node: str) -> None:
        with self._lock:
            self.detector.forget(node)
            self.policy.forget(node)
            for sample in self._pending.values():
                sample.pop(node, None)

    def rebalances(self) -> list[Rebalance]:
        """Rebalance decisions not yet taken (each one holds every slow node's factor: the last wins)."""
        out = []
        while True:
            try:
                out.append(self._rebalances.get_nowait())
            except queue.Empty:
                return out

    # ---- the watcher's work -----------------------------------------------------------------------

    def poll(self, view: StoreView, now: float) -> list[Evict]:
        """Advance detection to `now`, with the store observer's latest `view` (followed once per view);
        returns the nodes to evict (reported ones are logged here)."""
        decisions: list[Evict | Report | Rebalance] = []
        with self._lock:
            if view.seq != self._seen and view.generation >= 0:
                self._seen = view.seq
                decisions += self._follow_job(
                    view.generation, view.config if view.generation != self._gen else None, view.first_step,
                    view.failed, view.progress, view.compute if self.watch_stragglers else None, now)
            decisions += self._observe_complete_slots(now)
            if now >= self._next_event:
                self._next_event = now + HEALTH_EVENT_S
                self._health_event()
        evict = []
        for d in decisions:
            if isinstance(d, Rebalance):
                self._rebalances.put(d)
                self.log.emit("straggler", action="rebalance", nodes={str(n): round(f, 3) for n, f in d.slowdown.items()},
                              detail=d.detail, generation=self._gen)
            else:
                self._record(d)
                if isinstance(d, Evict):
                    evict.append(d)
        return evict

    def _record(self, d: Evict | Report) -> None:
        action = "evict" if isinstance(d, Evict) else "report"
        ev = d.evidence
        if d.cause == "straggler":
            self.log.emit("straggler", action=action, nodes={str(d.node): ev.get("slowdown")}, detail=d.detail,
                          generation=self._gen, rank=ev.get("rank"), median_s=ev.get("median_s"),
                          peers_median_s=ev.get("peers_median_s"))
        else:
            self.log.emit("faulty_node", node=str(d.node), action=action, detail=d.detail, metrics=ev.get("metrics"),
                          score=ev.get("score"), since=ev.get("since"))

    def _follow_job(self, gen: int, config: GenerationConfig | None, first: FirstStep | None, failed: bool,
                    progress: int | None, data: StepCompute | None, now: float) -> list[Evict | Report | Rebalance]:
        if config is not None:
            self._new_generation(gen, config)
        if gen != self._gen:
            return []  # its config is not there yet
        if self._first_step is None and first is not None:
            self._first_step = first.step
        if self._first_step is None or failed or self._checkpointing(progress, now):
            self.detector.hold(now + self.config.window)  # starting, recovering, checkpointing: not judged
            return []
        if data is None:
            return []
        if data.step == self._last_step or data.step <= self._first_step:
            return []  # nothing new, or the generation's first step (cold after the copies)
        self._last_step = data.step
        return self._time_step(data.compute_seconds)

    def _checkpointing(self, progress: int | None, now: float) -> bool:
        """Whether a checkpoint is being written: after the step that starts one (the engine writes step
        s+1's after step s when s+1 is a multiple of the interval, or the last step) until its layers
        are all on disk (the checkpoint folder is looked at every `checkpoint_poll`)."""
        if not self.checkpoint_dir or progress is None:
            return False
        periodic = self.checkpoint_interval > 0 and (progress + 1) % self.checkpoint_interval == 0
        if (periodic or progress + 1 == self.total_steps) and progress + 1 != self._checkpoint_armed:
            self._checkpoint, self._next_look, self._checkpoint_armed = (progress + 1, now), now, progress + 1
        if self._checkpoint is None:
            return False
        step, since = self._checkpoint
        if now >= self._next_look:
            self._next_look = now + self.timeouts.checkpoint_poll
            written = len(list(step_dir(self.checkpoint_dir, step).glob(f"*{LAYER_SUFFIX}")))
            if written >= self._num_layers or now - since > self.timeouts.checkpoint_hold_max:
                self._checkpoint = None
        return True

    def _new_generation(self, gen: int, config: GenerationConfig) -> None:
        self._gen, self._first_step, self._last_step = gen, None, None
        self._checkpoint = None  # a recovery's own hold covers what is left of one
        self.watch = self._new_watch()  # ranks are numbered afresh: old timings describe other work
        self._ranks = {}
        if config.stop or config.plan is None:
            self.detector.relearn(list(config.members))
            self._work = {}
            return
        plan, members = ExecPlan.from_json(config.plan), list(config.members)
        self._num_layers = plan.num_layers
        work: dict[Hashable, list[tuple[int, int, int, int]]] = {node: [] for node in members}
        for rank in plan.ranks:
            role = plan.role(rank)
            node = members[rank // self.workers_per_node]
            if role is not None:
                work[node].append((role.layers.start, role.layers.stop, role.mb_count, role.num_stages))
            if role is not None and role.mb_count > 0:
                self._ranks[rank] = (node, (role.layers.start, role.layers.stop), role.mb_count)
        # A node whose work (layers, microbatches, pipeline depth) changed learns its metrics' new
        # normal; one whose work is the same keeps it, so a fault that began under the previous plan
        # (a leak) goes on being measured from the healthy level instead of being learnt as normal.
        changed = [node for node, w in work.items() if self._work.get(node) != sorted(w)]
        self._work = {node: sorted(w) for node, w in work.items()}
        self.detector.relearn(changed)

    def _time_step(self, compute: tuple[float, ...]) -> list[Evict | Report | Rebalance]:
        for rank, (_, work, microbatches) in self._ranks.items():
            seconds = compute[rank] if rank < len(compute) else None
            if seconds is not None and seconds > 0:
                self.watch.report(rank, seconds / microbatches, work=work)
        by_node: dict[Hashable, Straggler] = {}
        for watched, s in self.watch.slowdowns().items():
            node = self._ranks[watched][0]  # type: ignore[index]  # the watch is keyed by the ranks reported above
            if node not in by_node or s.slowdown > by_node[node].slowdown:
                by_node[node] = s
        return list(self.policy.stragglers(by_node, self._gen))

    def _observe_complete_slots(self, now: float) -> list[Evict | Report]:
        out: list[Evict | Report] = []
        interval = self.config.interval
        for slot in sorted(s for s in self._pending if (s + 1) * interval + self.lag <= now):
            sample = self._pending.pop(slot)
            for flag in self.detector.observe(slot * interval, sample):
                out.append(self.policy.flagged(flag, self.config.threshold))
        return out

    def _health_event(self) -> None:
        scores = self.detector.scores()
        if not scores:
            return
        worst = {}
        for node, score in scores.items():
            per_metric = self.detector.metric_scores(node)
            if per_metric and score > 0:
                worst[str(node)] = max(per_metric, key=per_metric.__getitem__)
        slow: dict[str, float] = {}
        for watched, s in self.watch.slowdowns().items():
            node = self._ranks[watched][0]  # type: ignore[index]  # the watch is keyed by the ranks reported above if rank in self._ranks else None
            if node is not None:
                slow[node] = round(max(slow.get(node, 0.0), s.slowdown), 3)
        self.log.emit("health", scores={str(n): round(v, 2) for n, v in scores.items()}, metrics=worst,
                      slowdowns=slow, threshold=self.config.threshold, generation=self._gen)

    def close(self) -> None:
        with self._lock:
            self.writer.close()
