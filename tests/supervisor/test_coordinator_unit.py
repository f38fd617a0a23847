"""`Coordinator` unit tests: its store protocol and events, in seconds, with no process started.

The coordinator runs in a thread against an in-memory store (`torch.distributed.HashStore`), a fake
`NodeBackend` (`FakeNodes`: the test says when a node is lost, stopped or offered as a replacement), a
real `EventLog` and real plans from the planner (a synthetic profile: 6 layers, 2 to 6 node
templates; 6 nodes, f = 1: three pipelines of two nodes). Simulated workers (`SimWorker`, one thread
per node) play the workers' side of the store protocol as engine/elastic_process.py does, writing the
same JSON values: `worker/{w}/ready`; wait for `gen{g}/config`; skip a generation they are not a
member of; `reach_step` to the resume step; `gen{g}/rebuilt/{w}`; per step (rank 0)
`gen{g}/progress`, `gen{g}/compute`, `gen{g}/first_step` and the `step` event; on `gen{g}/failed`
`gen{g}/report/{w}` with step, layers, completable and last_step; on a collective error
`gen{g}/error/{w}` and `gen{g}/errors`. Their steps advance only as far as the test allows
(`SimCluster.step_limit`), so that every failure strikes at a known step.

Covered:
- a steady run: generation 0 publishes the plan; the run ends (`done`) when every member finished;
- a node lost mid-run: `gen0/failed`, survivors' reports, generation 1 without it, with the copies of
  the layers it held and the resume step the largest reported; events failure, detection, replan,
  plan, group_rebuild, state_copy, replay, resumed in that order;
- survivors at different steps (rank 0 holds its step pending): resume at the largest, the step that
  rank 0 did not log is logged by the coordinator, every step exactly once;
- a second loss while the reports are collected joins the same change;
- a second loss during the rebuild supersedes the unfinished recovery;
- a replacement node: started after a loss, folded in by a `join` change once it is ready;
- too many nodes lost, no checkpoint: CannotContinue (a CoordinatorError) naming both causes;
- too many nodes lost, a complete checkpoint: every live node restarts from it (a generation skipped);
- a worker that never reports after an abort: lost after the reconfiguration timeout;
- collective errors with no loss: the same members re-form after the heartbeat lease; a member that
  does not leave within the step timeout is lost as hung.
Timeouts are the job's (`CoordinatorConfig.timeouts`), made tiny where a scenario waits for one.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from planning_helpers import make_profile

from oobleck_slurm.engine.layout import ExecPlan
from oobleck_slurm.planning import Plan, generate_templates, instantiate
from oobleck_slurm.planning.reconfigure import stage_devices
from oobleck_slurm.planning.templates import PipelineTemplate
from oobleck_slurm.protocol import keys
from oobleck_slurm.protocol.events import EventLog, read_events
from oobleck_slurm.supervisor.coordinator import CannotContinue, Coordinator, CoordinatorConfig, CoordinatorError
from oobleck_slurm.supervisor.membership import Loss, LossCause
from oobleck_slurm.supervisor.observer import StoreObserver
from oobleck_slurm.timeouts import JobTimeouts

NODES = [f"n{i}" for i in range(6)]
NUM_LAYERS = 6
MICROBATCHES = 8  # of a step; microbatch size 1, so also the global batch size
F = 1
DEADLINE_S = 10.0  # a condition the test waits for: far above what it takes (on a loaded machine too)
WORKER_WAIT_S = 30.0  # a simulated worker's longest wait: a broken test ends with an error, not a hang
POLL_S = 0.002  # how often a simulated worker or the test looks at the store
LAYER_BYTES = 1000  # what a copied layer counts in the `rebuilt` record's bytes


# ---- the plan --------------------------------------------------------------------------------------

@functools.cache
def templates() -> tuple[PipelineTemplate, ...]:
    """Templates for 2 to 6 nodes: the model (6 equal layers) needs two nodes' memory."""
    profile = make_profile([0.03] * NUM_LAYERS, memory=(6000 * 0.6 + 2000) / 0.9, state=[1000] * NUM_LAYERS,
                           out=[100] * NUM_LAYERS)
    found = tuple(generate_templates(profile, len(NODES), num_microbatches=MICROBATCHES))
    assert min(t.num_nodes for t in found) == 2
    return found


def initial_plan() -> Plan:
    plan = instantiate(templates(), NODES, F, MICROBATCHES)
    # The scenarios below assume it: three pipelines of two nodes, each node one stage of 3 layers.
    assert [len(p.nodes) for p in plan.pipelines] == [2, 2, 2] and not plan.spare_nodes
    return plan


def coordinator_config(**settings: Any) -> CoordinatorConfig:
    """The coordinator's config for a test job: `settings` are CoordinatorConfig's fields or the job's
    timeouts (timeouts.py: reconfiguration_timeout, heartbeat_lease, step_timeout, ...)."""
    timeout_names = {f.name for f in fields(JobTimeouts)}
    timeouts = {name: value for name, value in settings.items() if name in timeout_names}
    others = {name: value for name, value in settings.items() if name not in timeout_names}
    return CoordinatorConfig(f=F, timeouts=JobTimeouts(**{"run_timeout": 30.0, **timeouts}), **others)


# ---- waiting ---------------------------------------------------------------------------------------

def wait_until(condition: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(POLL_S)


# ---- simulated workers -------------------------------------------------------------------------------

class _Killed(Exception):
    """The worker's process was killed (a loss, or the coordinator's `stop`): it writes nothing more."""


class _Aborted(Exception):
    """`gen{g}/failed` was seen in an abortable wait (engine/abort.py's GenerationAborted)."""


class _CollectiveError(Exception):
    """A collective failed with no abort key (a gloo error: engine/comm.py's is_collective_error)."""


class StepMismatchError(RuntimeError):
    """The resume step cannot be reached (engine/recovery.py): a coordinator bug if it happens."""


@dataclass
class WorkerScript:
    """How a node's simulated worker misbehaves (by default it does not)."""

    stall_at_commit: int | None = None  # holds this step pending; its commit all-reduce never returns
    collective_error_at: int | None = None  # this step's first collective fails, once (a transient error)
    hang_on_abort: bool = False  # never leaves an aborted generation: no report until it is killed


def step_result(step: int, world_size: int, num_pipelines: int) -> dict[str, Any]:
    """`dataclasses.asdict(StepResult)`: a step's figures as the worker keeps them (`last_step`)."""
    return {"step": step, "loss": 2.0 - 0.01 * step, "grad_norm": 1.0, "lr": 1e-3, "seconds": 0.01,
            "pipeline_seconds": [0.01] * num_pipelines, "compute_seconds": [0.005] * world_size,
            "peak_memory": []}


def step_event(result: dict[str, Any], generation: int, global_batch_size: int) -> dict[str, Any]:
    """`StepResult.event`: the `step` event rank 0 writes."""
    return {**result, "samples_per_s": global_batch_size / result["seconds"], "generation": generation}


class SimWorker:
    """Worker 0 of a node (one worker per node), following the coordinator through the store as
    ElasticWorker.run does; its layers are a set of layer indices, its steps take no time."""

    def __init__(self, cluster: SimCluster, node: str, script: WorkerScript) -> None:
        self.cluster, self.node, self.script = cluster, node, script
        self.store = cluster.store
        self.name = keys.worker_id(node, 0)
        self.step = 0
        self.pending: int | None = None  # the step held pending (every collective done, not applied)
        self.layers: set[int] = set()
        self.rank = -1
        self.last_step: dict[str, Any] | None = None
        self.error_fired = False
        self.waiting_at: str = ""  # what it waits for now (tests wait for a worker to be idle at a step)
        self.killed = threading.Event()
        self.thread = threading.Thread(target=self._main, name=f"sim-{node}", daemon=True)

    # ---- waits: killable; abortable inside a generation ---------------------------------------

    def _wait(self, ready: Callable[[], bool], what: str, abort_generation: int | None = None,
              timeout: float = WORKER_WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        self.waiting_at = what
        try:
            while True:
                if self.killed.is_set():
                    raise _Killed()
                if ready():
                    return
                if abort_generation is not None and self.store.check([keys.failed(abort_generation)]):
                    raise _Aborted()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: no {what} within {timeout} s")
                time.sleep(POLL_S)
        finally:
            self.waiting_at = ""

    def _wait_key(self, key: str) -> None:
        self._wait(lambda: self.store.check([key]), key)

    def _may_start(self, step: int) -> bool:
        return step < self.cluster.step_limit

    # ---- the generation loop (ElasticWorker.run) ---------------------------------------------

    def _main(self) -> None:
        try:
            self._run()
        except _Killed:
            return
        except Exception as e:  # noqa: BLE001 - a real worker exits non-zero: its node is lost
            self.cluster.crashed(self, e)
        else:
            self.cluster.exited_cleanly(self)

    def _run(self) -> None:
        self.store.set(keys.worker_ready(self.name), repr(time.time()))
        g = int(self.store.get(keys.CURRENT_GEN))
        while True:
            self._wait_key(keys.config(g))
            cfg = json.loads(self.store.get(keys.config(g)))
            if cfg.get("stop"):
                return  # (`save`, an on-demand checkpoint, is not simulated: these jobs have no checkpoints)
            if self.node not in cfg["members"]:
                g += 1
                continue
            try:
                self._run_generation(g, cfg)
                return
            except _CollectiveError as e:
                self._report_error(g, e)
                self._wait_key(keys.failed(g))
            except _Aborted:
                pass
            if self.script.hang_on_abort:
                self._wait(lambda: False, "nothing (hung inside a step)", timeout=60.0)
            self._wait(lambda: self.node not in self.cluster.held_reports, "the test to release its report")
            self.store.set(keys.report(g, self.name), json.dumps(
                {"step": self.step, "layers": sorted(self.layers),
                 "completable": self.pending is not None and self.pending == self.step,
                 "last_step": self.last_step}))
            g += 1

    def _report_error(self, g: int, error: BaseException) -> None:
        self.store.set(keys.error(g, self.name), json.dumps(
            {"step": self.step, "error": f"{type(error).__name__}: {error}", "t": time.time()}))
        self.store.add(keys.errors(g), 1)

    def _reach_step(self, target: int) -> None:
        """engine/recovery.py's reach_step: complete the pending step if it is the one before `target`."""
        if not self.layers:
            self.step, self.pending = target, None
        elif self.step == target:
            self.pending = None  # nobody applied it: it is replayed
        elif self.step + 1 == target and self.pending == self.step:
            self.step, self.pending = target, None
        else:
            raise StepMismatchError(f"{self.name} at step {self.step} (pending {self.pending}) cannot reach {target}")

    def _adopt(self, plan: ExecPlan, cfg: dict[str, Any]) -> int:
        """Worker.adopt: the new stage's layers from the seed, or from their holders by the transfers."""
        role = plan.role(self.rank)
        needed = set(role.layers) if role else set()
        if cfg["source"] == "seed":
            self.layers = set(needed)
            return 0
        if cfg["source"] == "checkpoint":  # a restarted worker loads its stage from the checkpoint
            self.layers, self.step = set(needed), int(cfg["checkpoint"]["step"])
            return len(needed) * LAYER_BYTES
        if cfg["source"] != "memory":
            raise ValueError(f"source {cfg['source']!r} is not one of the worker's")
        transfers = [tuple(t) for t in cfg.get("transfers", [])]
        for layer, src, _ in transfers:  # run_transfers: a sender must hold what it sends
            if src == self.rank and layer not in self.layers:
                raise RuntimeError(f"{self.name} (rank {src}) must send layer {layer} but holds {sorted(self.layers)}")
        incoming = {layer for layer, _, dst in transfers if dst == self.rank}
        self.layers = (self.layers | incoming) & needed
        if missing := needed - self.layers:
            raise RuntimeError(f"rank {self.rank} lacks layer(s) {sorted(missing)} after adopting the plan")
        return len(incoming) * LAYER_BYTES

    def _run_generation(self, g: int, cfg: dict[str, Any]) -> None:
        plan = ExecPlan.from_json(cfg["plan"])
        members = cfg["members"]
        self.rank = members.index(self.node)
        self._reach_step(int(cfg["resume_step"]))
        t0 = time.perf_counter()
        # build_generation: a rendezvous of every member, abortable; a test can hold it.
        self._wait(lambda: g not in self.cluster.held_rebuilds, f"the groups of generation {g}", g)
        t1 = time.perf_counter()
        received = self._adopt(plan, cfg)
        self.store.set(keys.rebuilt(g, self.name), json.dumps(
            {"groups_s": t1 - t0, "copy_s": time.perf_counter() - t1, "bytes": received, "t": time.time()}))
        first = True
        while self.step < self.cluster.total_steps:
            s = self.step
            if self.script.collective_error_at == s and not self.error_fired:
                self.error_fired = True
                raise _CollectiveError(f"simulated gloo error in step {s}")
            # Its collectives wait for its peers: the test sets how far the peers go.
            self._wait(functools.partial(self._may_start, s), f"step {s}", g)
            if plan.role(self.rank) is not None:  # a spare holds no step pending
                self.pending = s
            if self.script.stall_at_commit == s:
                self._wait(lambda: False, f"the commit all-reduce of step {s}", g)
            self.step, self.pending = s + 1, None
            result = step_result(s, len(members), len(plan.pipelines))
            self.last_step = {"result": result, "generation": g, "global_batch_size": MICROBATCHES}
            if self.rank == 0:
                self.cluster.log.emit("step", **step_event(result, g, MICROBATCHES))
                self.store.set(keys.progress(g), str(s))
                self.store.set(keys.step_compute(g), json.dumps({"step": s, "compute_seconds": result["compute_seconds"]}))
                if first:
                    self.store.set(keys.first_step(g), json.dumps({"step": s, "t": time.time()}))
            first = False
            if self.store.check([keys.failed(g)]):  # a join (or a failure seen between steps): leave now
                raise _Aborted()


class SimCluster:
    """The simulated workers of every node the backend started, and the test's controls over them."""

    def __init__(self, store: dist.Store, log: EventLog, total_steps: int, scripts: dict[str, WorkerScript]) -> None:
        self.store, self.log, self.total_steps, self.scripts = store, log, total_steps, scripts
        self.step_limit = 0  # workers may start step s only if s < step_limit
        self.held_reports: set[str] = set()  # nodes whose report waits for the test
        self.held_rebuilds: set[int] = set()  # generations whose group rendezvous waits for the test
        self.workers: dict[str, SimWorker] = {}
        self.errors: list[str] = []  # workers that crashed (a real one exits non-zero)
        self.on_exit: Callable[[str, Loss | None], None] = lambda node, loss: None

    def launch(self, node: str) -> None:
        worker = SimWorker(self, node, self.scripts.get(node, WorkerScript()))
        self.workers[node] = worker
        worker.thread.start()

    def kill(self, node: str) -> None:
        worker = self.workers.get(node)
        if worker is not None:
            worker.killed.set()
            worker.thread.join(timeout=DEADLINE_S)

    def crashed(self, worker: SimWorker, error: BaseException) -> None:
        self.errors.append(f"{worker.name}: {type(error).__name__}: {error}")
        self.on_exit(worker.node, Loss(worker.node, LossCause.PROCESS_EXIT, "worker exited with code 1", time.time()))

    def exited_cleanly(self, worker: SimWorker) -> None:
        self.on_exit(worker.node, None)

    def idle_at(self, nodes: Sequence[str], step: int) -> bool:
        """Every worker of `nodes` waits to start `step` (its peers have finished the ones before)."""
        return all(self.workers[n].step == step and self.workers[n].waiting_at == f"step {step}" for n in nodes)

    def close(self) -> None:
        for node in list(self.workers):
            self.kill(node)


# ---- the fake backend ----------------------------------------------------------------------------------

class BackendClosed(Exception):
    """The test is over: raised into the coordinator's loop so that its thread ends."""


class FakeNodes:
    """A NodeBackend whose nodes are SimCluster's threads. `lose` plays a detection path (AgentNodes
    reports a loss once, first cause wins); `stop` kills and reports no exit, as AgentNodes does."""

    def __init__(self, cluster: SimCluster, replacements: Sequence[str] = ()) -> None:
        self.cluster = cluster
        self._lock = threading.Lock()
        self._exits: dict[str, Loss | None] = {}
        self._replacements = list(replacements)
        self.started: list[str] = []
        self.stopped: list[list[str]] = []
        self.closed = False
        cluster.on_exit = self._exit

    # NodeBackend
    def start(self, node: str) -> None:
        self.started.append(node)
        self.cluster.launch(node)

    def exited(self) -> dict[str, Loss | None]:
        if self.closed:
            raise BackendClosed()
        with self._lock:
            out, self._exits = self._exits, {}
        return out

    def stop(self, nodes: Sequence[str]) -> None:
        self.stopped.append(list(nodes))
        for node in nodes:
            self.cluster.kill(node)

    def new_node(self) -> str | None:
        return self._replacements.pop(0) if self._replacements else None

    def rebalances(self) -> list[Any]:
        return []

    # the test's controls
    def lose(self, *nodes: str, cause: LossCause = LossCause.PROCESS_EXIT) -> None:
        """Kill the nodes' workers, record the fault time as a drill does, then report every loss at once."""
        t = time.time()
        for node in nodes:
            self.cluster.store.set(keys.fault_time(node), repr(t))
            self.cluster.kill(node)
        with self._lock:
            for node in nodes:
                self._exits.setdefault(node, Loss(node, cause, "simulated loss", time.time()))

    def _exit(self, node: str, loss: Loss | None) -> None:
        with self._lock:
            self._exits.setdefault(node, loss)


# ---- one job: coordinator, backend, workers --------------------------------------------------------------

@dataclass
class Job:
    store: dist.Store
    cluster: SimCluster
    backend: FakeNodes
    coordinator: Coordinator
    log_path: Path
    plan: Plan
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self, step_limit: int) -> None:
        """Publish generation 0, start every member, run the coordinator's loop in a thread."""
        self.cluster.step_limit = step_limit
        self.coordinator.start()
        self.thread = threading.Thread(target=self._run, name="coordinator", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.coordinator.run()
        except BaseException as e:  # noqa: BLE001 - handed to the test by `wait_done`
            self.error = e
        finally:
            self.finished.set()

    def wait_done(self) -> None:
        """Wait until `run()` returned; re-raise what it raised."""
        assert self.finished.wait(DEADLINE_S), f"the coordinator did not end (phase {self.coordinator.phase})"
        if self.error is not None:
            raise self.error

    def run_to_end(self) -> None:
        """Let a recovery in progress complete its first step and be seen to, then train to the end."""
        # A change being carried out sets its recovery before leaving the collecting phase.
        wait_until(lambda: self.coordinator.phase != "collecting", "the change to be published")
        recovery = self.coordinator.recovery
        if recovery is not None:
            # Finishing at once could end the run before the coordinator saw the recovery's rebuilt
            # and first step: `run()` returns on the members' exits (Finish) without a last look at
            # the store, and the recovery's group_rebuild ... resumed events are never written.
            self.cluster.step_limit = max(self.cluster.step_limit, recovery.step + 1)
            wait_until(lambda: self.coordinator.recovery is None, f"recovery {recovery.id} to resume")
        self.cluster.step_limit = self.cluster.total_steps
        self.wait_done()
        assert self.cluster.errors == []

    def has(self, key: str) -> bool:
        return self.store.check([key])

    def value(self, key: str) -> Any:
        wait_until(lambda: self.has(key), key)
        return json.loads(self.store.get(key))

    def idle_at(self, nodes: Sequence[str], step: int) -> None:
        wait_until(lambda: self.cluster.idle_at(nodes, step), f"{list(nodes)} to wait at step {step}")

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return read_events(self.log_path, kind)

    def recovery_kinds(self, recovery: int) -> list[str]:
        return [e["kind"] for e in self.events() if e.get("recovery") == recovery]

    def reported_layers(self, g: int, nodes: Sequence[str]) -> dict[str, set[int]]:
        return {n: set(self.value(keys.report(g, keys.worker_id(n, 0)))["layers"]) for n in nodes}


@pytest.fixture
def make_job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []
    logs: list[EventLog] = []
    observers: list[StoreObserver] = []

    def make(total_steps: int = 6, scripts: dict[str, WorkerScript] | None = None,
             replacements: Sequence[str] = (), **settings: Any) -> Job:
        store = dist.HashStore()
        log_path = tmp_path / f"job{len(jobs)}" / "events.jsonl"
        coordinator_log, workers_log = EventLog(log_path), EventLog(log_path)  # two writers, as in a job
        logs.extend([coordinator_log, workers_log])
        cluster = SimCluster(store, workers_log, total_steps, scripts or {})
        backend = FakeNodes(cluster, replacements)
        plan = initial_plan()
        config = coordinator_config(**settings)
        observer = StoreObserver(store, config.timeouts)  # its thread shares the HashStore
        observers.append(observer)
        coordinator = Coordinator(store, backend, templates(), plan, [f"layer{i}" for i in range(NUM_LAYERS)],
                                  coordinator_log, config, observer, total_steps=total_steps)
        observer.start()
        job = Job(store, cluster, backend, coordinator, log_path, plan)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.backend.closed = True  # the coordinator's next `exited()` raises: its thread ends
        # ... before the workers are killed: a coordinator still starting nodes (a test that ends as soon
        # as a generation is published) would start one whose thread `close` then finds unstarted.
        if job.thread is not None:
            job.thread.join(timeout=DEADLINE_S)
        job.cluster.close()
    for observer in observers:
        observer.close()
    for log in logs:
        log.close()


# ---- checks shared by the scenarios --------------------------------------------------------------------

def assert_copies_supply_what_each_stage_lacks(cfg: dict[str, Any], held: dict[str, set[int]]) -> set[tuple[int, str]]:
    """The transfers of a memory recovery bring every member exactly the layers of its new stage that it
    does not hold, each from a member that reported it; returns the copies as (layer, receiving node)."""
    members, plan = cfg["members"], ExecPlan.from_json(cfg["plan"])
    lacking = set()
    for rank, node in enumerate(members):
        role = plan.role(rank)
        if role is not None:
            lacking |= {(layer, node) for layer in role.layers if layer not in held.get(node, set())}
    copies = {(layer, members[dst]) for layer, _, dst in cfg["transfers"]}
    assert copies == lacking
    for layer, src, _ in cfg["transfers"]:
        assert layer in held[members[src]], f"layer {layer} copied from {members[src]}, which does not hold it"
    return copies


def in_order(kinds: list[str], expected: Sequence[str]) -> bool:
    """`expected` is a subsequence of `kinds`."""
    it = iter(kinds)
    return all(kind in it for kind in expected)


RECOVERY_EVENTS = ["failure", "detection", "replan", "plan", "group_rebuild", "state_copy", "replay", "resumed"]


# ---- the scenarios ------------------------------------------------------------------------------------

def test_steady_run_publishes_the_plan_and_ends_when_every_member_finished(make_job: Callable[..., Job]) -> None:
    job = make_job(total_steps=4)
    job.start(step_limit=4)
    cfg0 = job.value(keys.config(0))
    job.run_to_end()

    assert cfg0["generation"] == 0 and cfg0["members"] == NODES
    assert (cfg0["source"], cfg0["resume_step"], cfg0["transfers"]) == ("seed", 0, [])
    # The published ExecPlan is the planner's plan: one rank per stage, in the members' order.
    expected = [{"ranks": [NODES.index(str(dev[0])) for dev, _ in stage_devices(p)],
                 "bounds": [0] + [layers.stop for _, layers in stage_devices(p)],
                 "mb_start": p.first_microbatch, "mb_count": p.microbatches} for p in job.plan.pipelines]
    assert cfg0["plan"] == {"num_layers": NUM_LAYERS, "num_microbatches": MICROBATCHES, "pipelines": expected}
    assert job.store.get(keys.CURRENT_GEN) == b"0"

    assert job.backend.started == NODES and job.backend.stopped == []
    assert job.coordinator.finished == set(NODES)
    kinds = [e["kind"] for e in job.events() if e["kind"] != "step"]
    assert kinds == ["plan", "done"]
    plan_event, done = job.events("plan")[0], job.events("done")[0]
    assert (plan_event["generation"], plan_event["reason"]) == (0, "initial")
    assert [p["nodes"] for p in plan_event["pipelines"]] == [list(p.nodes) for p in job.plan.pipelines]
    assert done["generation"] == 0
    assert [e["step"] for e in job.events("step")] == [0, 1, 2, 3]
    assert not job.has(keys.failed(0)) and not job.has(keys.config(1))


def test_a_node_lost_mid_run_is_recovered_in_memory(make_job: Callable[..., Job]) -> None:
    job = make_job(total_steps=6)
    job.start(step_limit=3)
    survivors = [n for n in NODES if n != "n1"]
    job.idle_at(NODES, 3)
    n1_role = ExecPlan.from_json(job.value(keys.config(0))["plan"]).role(NODES.index("n1"))
    assert n1_role is not None
    n1_layers = set(n1_role.layers)

    job.backend.lose("n1", cause=LossCause.HEARTBEAT)
    cfg1 = job.value(keys.config(1))

    assert job.value(keys.failed(0)) == {"lost": ["n1"], "joined": [], "cause": "heartbeat"}
    reports = {n: job.value(keys.report(0, keys.worker_id(n, 0))) for n in survivors}
    assert {r["step"] for r in reports.values()} == {3}
    assert cfg1["generation"] == 1 and sorted(cfg1["members"]) == survivors
    assert cfg1["source"] == "memory" and cfg1["resume_step"] == max(r["step"] for r in reports.values())
    copies = assert_copies_supply_what_each_stage_lacks(cfg1, {n: set(r["layers"]) for n, r in reports.items()})
    assert {layer for layer, _ in copies} & n1_layers, "the lost node's layers are copied from their replicas"
    wait_until(lambda: job.store.get(keys.CURRENT_GEN) == b"1", "current_gen to be 1")  # set after the config

    job.run_to_end()
    assert in_order(job.recovery_kinds(1), RECOVERY_EVENTS)
    failure = job.events("failure")[0]
    assert (failure["nodes"], failure["cause"], failure["step"], failure["generation"]) == (["n1"], "heartbeat", 3, 0)
    assert job.events("detection")[0]["known_kill_time"] is True
    plans = job.events("plan")
    assert [(p["generation"], p["reason"]) for p in plans] == [(0, "initial"), (1, "failure")]
    assert all("n1" not in p["nodes"] for p in plans[1]["pipelines"])
    assert job.events("resumed")[0]["step"] == 3
    assert [e["step"] for e in job.events("step")] == list(range(6))  # none lost, none repeated
    assert job.events("done")[0]["generation"] == 1
    assert job.coordinator.finished == set(survivors)


def test_survivors_one_step_apart_resume_at_the_largest_and_every_step_is_logged_once(
        make_job: Callable[..., Job]) -> None:
    # Rank 0 (n0) reached step 2's commit all-reduce and holds the step pending; its peers completed it.
    job = make_job(total_steps=5, scripts={"n0": WorkerScript(stall_at_commit=2)})
    job.start(step_limit=3)
    others = [n for n in NODES if n != "n0"]
    job.idle_at(others, 3)
    wait_until(lambda: job.cluster.workers["n0"].waiting_at == "the commit all-reduce of step 2", "n0 to stall")
    assert job.store.get(keys.progress(0)) == b"1"  # rank 0 logged steps 0 and 1 only

    job.backend.lose("n5")
    cfg1 = job.value(keys.config(1))
    n0_report = job.value(keys.report(0, "n0:0"))
    assert (n0_report["step"], n0_report["completable"]) == (2, True)
    assert {job.value(keys.report(0, keys.worker_id(n, 0)))["step"] for n in others if n != "n5"} == {3}
    assert cfg1["resume_step"] == 3

    job.run_to_end()
    # Step 2, which rank 0 never logged, is logged by the coordinator from a survivor's last_step.
    assert [e["step"] for e in job.events("step")] == list(range(5))
    assert job.events("step")[2]["generation"] == 0
    assert job.events("replan")[0]["resume_step"] == 3


def test_a_loss_while_the_reports_are_collected_joins_the_same_change(make_job: Callable[..., Job]) -> None:
    job = make_job(total_steps=5)
    job.cluster.held_reports.update({"n2", "n3"})
    job.start(step_limit=2)
    job.idle_at(NODES, 2)

    job.backend.lose("n1")
    wait_until(lambda: all(job.has(keys.report(0, keys.worker_id(n, 0))) for n in ["n0", "n4", "n5"]),
               "the reports of n0, n4, n5")
    assert job.coordinator.phase == "collecting" and not job.has(keys.config(1))
    job.backend.lose("n2")  # before it reported
    job.cluster.held_reports.clear()
    cfg1 = job.value(keys.config(1))

    assert sorted(cfg1["members"]) == ["n0", "n3", "n4", "n5"]
    assert job.value(keys.failed(0))["lost"] == ["n1"]  # the abort named the first loss only
    failures = [(e["nodes"], e["cause"], e["recovery"]) for e in job.events("failure")]
    assert failures == [(["n1"], "process_exit", 1), (["n2"], "process exit during recovery", 1)]
    job.run_to_end()
    assert [p["generation"] for p in job.events("plan")] == [0, 1]  # one change, not two
    assert in_order(job.recovery_kinds(1), RECOVERY_EVENTS)


def test_a_loss_during_the_rebuild_supersedes_the_unfinished_recovery(make_job: Callable[..., Job]) -> None:
    job = make_job(total_steps=5)
    job.cluster.held_rebuilds.add(1)  # generation 1's groups never form until the second loss
    job.start(step_limit=2)
    job.idle_at(NODES, 2)

    job.backend.lose("n1")
    cfg1 = job.value(keys.config(1))
    wait_until(lambda: job.coordinator.phase == "rebuilding", "the coordinator to wait for the rebuild")
    job.backend.lose("n2")
    cfg2 = job.value(keys.config(2))

    assert "n2" in cfg1["members"]
    assert job.value(keys.failed(1)) == {"lost": ["n2"], "joined": [], "cause": "process_exit"}
    members2 = sorted(cfg2["members"])
    assert members2 == ["n0", "n3", "n4", "n5"] and cfg2["resume_step"] == 2
    # The survivors left generation 1 before adopting its plan: they still hold generation 0's layers,
    # and generation 2's copies start from those.
    held = job.reported_layers(1, members2)
    assert held == job.reported_layers(0, members2)
    assert_copies_supply_what_each_stage_lacks(cfg2, held)

    job.run_to_end()
    second = [e for e in job.events() if e.get("recovery") == 2]
    assert second[0]["kind"] == "failure" and second[0]["supersedes"] == 1
    assert in_order([e["kind"] for e in second], RECOVERY_EVENTS)
    assert "resumed" not in job.recovery_kinds(1) and "group_rebuild" not in job.recovery_kinds(1)
    assert [e["generation"] for e in job.events("resumed")] == [2]


def test_a_replacement_node_joins_once_it_is_ready(make_job: Callable[..., Job]) -> None:
    job = make_job(total_steps=8, replacements=["r1"], replacement=True)
    job.start(step_limit=2)
    job.idle_at(NODES, 2)

    job.backend.lose("n1")
    job.value(keys.config(1))
    wait_until(lambda: job.has(keys.worker_ready("r1:0")), "the replacement's worker to be up")
    assert "r1" in job.backend.started and "r1" not in job.value(keys.config(1))["members"]
    assert not job.has(keys.failed(1))  # no join before generation 1 completed a step
    job.cluster.step_limit = 3  # generation 1 completes step 2: a join can be folded in at its boundary

    assert job.value(keys.failed(1)) == {"lost": [], "joined": ["r1"], "cause": "join"}
    cfg2 = job.value(keys.config(2))
    survivors = [n for n in NODES if n != "n1"]
    assert sorted(cfg2["members"]) == sorted([*survivors, "r1"]) and cfg2["resume_step"] == 3
    copies = assert_copies_supply_what_each_stage_lacks(cfg2, job.reported_layers(1, survivors))
    assert any(node == "r1" for _, node in copies), "the newcomer receives its stage's layers"

    job.run_to_end()
    plan2 = job.events("plan")[-1]
    assert (plan2["generation"], plan2["reason"], plan2["recovery"]) == (2, "join", 2)
    assert any("r1" in p["nodes"] for p in plan2["pipelines"])
    joined = job.events("node_joined")
    assert [(e["node"], e["generation"], e["recovery"]) for e in joined] == [("r1", 2, 2)]
    assert in_order([e["kind"] for e in job.events() if e.get("recovery") == 2],
                    ["plan", "group_rebuild", "state_copy", "replay", "resumed", "node_joined"])
    assert "r1" in job.coordinator.finished
    assert [e["step"] for e in job.events("step")] == list(range(8))


def test_losing_too_many_nodes_without_a_checkpoint_is_a_clear_error(make_job: Callable[..., Job]) -> None:
    job = make_job(total_steps=5)
    job.start(step_limit=2)
    job.idle_at(NODES, 2)

    job.backend.lose("n1", "n3", "n5")  # every replica of layers 3-5, and half the nodes
    # CannotContinue: the CoordinatorError that says a requeue would not help.
    with pytest.raises(CannotContinue, match=r"cannot continue: failure of node\(s\) \['n1', 'n3', 'n5'\] "
                       r"in generation 0: .*no complete checkpoint exists in \(no checkpoint directory\)") as raised:
        job.wait_done()
    assert isinstance(raised.value, CoordinatorError)
    assert not job.has(keys.config(1))
    assert job.backend.stopped == [["n0", "n2", "n4"]]  # the survivors are stopped, not left waiting
    assert [e["kind"] for e in job.events() if e.get("recovery") == 1] == ["failure", "detection",
                                                                           "checkpoint_fallback"]


def test_too_many_losses_with_a_checkpoint_restart_every_live_node_from_it(
        make_job: Callable[..., Job], tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    layer_keys = [f"layer{i}" for i in range(NUM_LAYERS)]
    for key in layer_keys:  # a complete checkpoint of step 1: every layer's file exists
        (root / "step1").mkdir(parents=True, exist_ok=True)
        (root / "step1" / f"{key}.safetensors").write_bytes(b"")
    job = make_job(total_steps=5, checkpoint_dir=str(root))
    job.start(step_limit=3)
    job.idle_at(NODES, 3)

    job.backend.lose("n1", "n3", "n5")
    # Generation 1 is skipped: no old worker, still waiting for a config, may join the restarted ones.
    cfg2 = job.value(keys.config(2))
    assert not job.has(keys.config(1))
    assert sorted(cfg2["members"]) == ["n0", "n2", "n4"]
    assert (cfg2["source"], cfg2["resume_step"], cfg2["transfers"]) == ("checkpoint", 1, [])
    assert cfg2["checkpoint"] == {"root": str(root), "step": 1}
    assert job.backend.stopped == [["n0", "n2", "n4"]]
    wait_until(lambda: job.backend.started == [*NODES, "n0", "n2", "n4"], "fresh processes for every live node")

    job.run_to_end()
    fallback = job.events("checkpoint_fallback")
    assert [(e["recovery"], e["generation"]) for e in fallback] == [(1, 1)]
    assert in_order(job.recovery_kinds(2), ["plan", "group_rebuild", "state_copy", "replay", "resumed"])
    assert [(e["generation"], e["reason"]) for e in job.events("plan")] == [(0, "initial"), (2, "failure")]
    # Steps 1 and 2 were trained, lost with the rollback to the checkpoint, and trained again.
    assert [(e["generation"], e["step"]) for e in job.events("step")] == [
        (0, 0), (0, 1), (0, 2), (2, 1), (2, 2), (2, 3), (2, 4)]
    assert job.events("done")[0]["generation"] == 2


def test_a_survivor_that_never_reports_is_lost_after_the_reconfiguration_timeout(
        make_job: Callable[..., Job]) -> None:
    timeout = 0.3
    job = make_job(total_steps=5, scripts={"n4": WorkerScript(hang_on_abort=True)}, reconfiguration_timeout=timeout)
    job.start(step_limit=2)
    job.idle_at(NODES, 2)

    job.backend.lose("n1")
    cfg1 = job.value(keys.config(1))

    assert sorted(cfg1["members"]) == ["n0", "n2", "n3", "n5"]
    assert job.backend.stopped == [["n4"]]  # fenced: a late report must not come back into play
    assert not job.has(keys.report(0, "n4:0"))
    failures = job.events("failure")
    assert [(e["nodes"], e["cause"]) for e in failures] == [
        (["n1"], "process_exit"), (["n4"], f"no report within the reconfiguration timeout ({timeout} s)")]
    # The abort (right after the first failure event) to the verdict: the timeout, not less.
    assert timeout <= failures[1]["t"] - failures[0]["t"] < timeout + DEADLINE_S / 2
    job.run_to_end()
    assert in_order(job.recovery_kinds(1), RECOVERY_EVENTS)


def test_collective_errors_with_no_loss_reform_the_same_members(make_job: Callable[..., Job]) -> None:
    # The grace for collective errors that no loss explains is the heartbeat lease.
    job = make_job(total_steps=5, scripts={"n2": WorkerScript(collective_error_at=2)}, heartbeat_lease=0.05)
    job.start(step_limit=2)
    job.idle_at([n for n in NODES if n != "n2"], 2)

    assert job.value(keys.failed(0)) == {"lost": [], "joined": [], "cause": "collective_error"}
    cfg1 = job.value(keys.config(1))
    assert cfg1["members"] == NODES and cfg1["plan"] == job.value(keys.config(0))["plan"]
    assert (cfg1["resume_step"], cfg1["transfers"]) == (2, [])
    assert job.store.get(keys.errors(0)) == b"1"
    job.run_to_end()
    assert in_order(job.recovery_kinds(1), ["collective_error", "reform", "replan", "plan", "resumed"])
    assert job.events("collective_error")[0]["nodes"] == ["n2:0"]
    assert [(p["generation"], p["reason"]) for p in job.events("plan")] == [(0, "initial"), (1, "reform")]
    assert job.events("failure") == [] and job.backend.stopped == []
    assert [e["step"] for e in job.events("step")] == list(range(5))
    assert job.events("done")[0]["generation"] == 1


def test_a_member_that_does_not_leave_a_reform_within_the_step_timeout_is_lost_as_hung(
        make_job: Callable[..., Job]) -> None:
    leave = 0.3  # the step timeout: no healthy rank computes longer than a step before its next collective
    job = make_job(total_steps=5, scripts={"n2": WorkerScript(collective_error_at=2),
                                           "n4": WorkerScript(hang_on_abort=True)},
                   heartbeat_lease=0.05, step_timeout=leave)
    job.start(step_limit=2)

    cfg1 = job.value(keys.config(1))

    assert job.value(keys.failed(0))["cause"] == "collective_error"
    assert sorted(cfg1["members"]) == ["n0", "n1", "n2", "n3", "n5"]
    assert job.backend.stopped == [["n4"]]
    lost = job.events("node_lost")
    assert [(e["node"], e["cause"], e["recovery"]) for e in lost] == [("n4", "hung", 1)]
    # The abort (right after the `reform` event) to the verdict: the step timeout, not less.
    assert leave <= lost[0]["t"] - job.events("reform")[0]["t"] < leave + DEADLINE_S / 2
    assert [(e["nodes"], e["cause"]) for e in job.events("failure")] == [(["n4"], "hung")]
    job.run_to_end()
    assert in_order(job.recovery_kinds(1), ["collective_error", "reform", "node_lost", "failure", "detection",
                                            "replan", "plan", "resumed"])
    assert job.events("plan")[-1]["reason"] == "failure"


# ---- regressions found while writing these tests ------------------------------------------------
def test_a_recovery_that_resumes_and_finishes_within_one_tick_keeps_its_events(make_job):
    # A slow tick (a loaded supervisor): the survivors rebuild, resume and finish within one sleep.
    job = make_job(total_steps=4, coordinator_poll=0.3)
    job.start(step_limit=2)
    job.idle_at(NODES, 2)
    job.backend.lose("n1")
    job.value(keys.config(1))
    job.cluster.step_limit = 4
    job.wait_done()
    assert job.value(keys.first_step(1))["step"] == 2  # generation 1 did resume and train to the end
    assert "resumed" in job.recovery_kinds(1)


def test_a_loss_reported_while_falling_back_is_not_restarted(make_job, tmp_path):
    root = tmp_path / "ckpt"
    (root / "step1").mkdir(parents=True)
    for i in range(NUM_LAYERS):
        (root / "step1" / f"layer{i}.safetensors").write_bytes(b"")
    job = make_job(total_steps=5, checkpoint_dir=str(root), mode="checkpoint")
    backend: FakeNodes = job.backend
    reported_lost: set[str] = set()
    real_stop, real_start, real_exited = backend.stop, backend.start, backend.exited

    def exited():  # as AgentNodes: a loss is reported once
        out = real_exited()
        reported_lost.update(n for n, loss in out.items() if loss is not None)
        return out

    def stop(nodes):  # n4's heartbeat lease expired while the coordinator decided: queued before the stop
        with backend._lock:
            backend._exits.setdefault("n4", Loss("n4", LossCause.HEARTBEAT, "no heartbeat", time.time()))
        real_stop(nodes)

    def start(node):  # as AgentNodes: a node reported lost is never started again (lost + start -> lost)
        if node not in reported_lost:
            real_start(node)

    backend.exited, backend.stop, backend.start = exited, stop, start
    job.start(step_limit=3)
    job.idle_at(NODES, 3)
    job.backend.lose("n1")
    cfg = job.value(keys.config(2))
    assert "n4" not in cfg["members"], "a node the backend reported lost is a member of the restart generation"


def test_rollbacks_made_before_a_takeover_or_requeue_count_against_the_limit(make_job: Callable[..., Job],
                                                                            tmp_path: Path) -> None:
    """A supervisor that takes over, or starts after Slurm requeued the job, goes on with the job's log:
    the loss-spike rollbacks logged there count against training.loss_spike.max_rollbacks (a count
    kept in memory only would give every requeue a fresh budget, and a run that spikes forever would
    roll back forever)."""
    log = EventLog(tmp_path / "job0" / "events.jsonl")
    log.emit("loss_spike_rollback", generation=3, step=6, spikes=[5, 6], checkpoint=4, data_step=7, skipped_samples=48,
             rollback=1, recovery=2, phase="restarting")
    log.close()
    job = make_job()
    assert job.coordinator.rollbacks == 1
    assert make_job().coordinator.rollbacks == 0  # another job's log: none
