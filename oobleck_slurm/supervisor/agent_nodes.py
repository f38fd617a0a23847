"""`AgentNodes`: the coordinator's NodeBackend when workers run under node agents (Slurm or local).

It owns the control server the agents connect to, and one watcher thread that turns every kind of
evidence into node losses (see membership.py): srun step exit, control connection loss, heartbeat
lease expiry, Slurm node state, hung worker, worker exit, and the health monitor's evictions (metrics,
stragglers: health_monitor.py, fed with the agents' `metrics` messages). A loss is handed to the coordinator as an
exit of the node (`exited()`), recorded with its real cause and detection time (`node_lost` event),
and the node is fenced: its agent, if it still answers, kills the worker.

Node ids: the coordinator's ids are Slurm node names, except requested replacements, which get a
token ("r1", "r2", ...) when asked for (the coordinator needs an id at once) and are bound to the
Slurm node whose agent registers with that token. Joining nodes are health-checked first; with the
pre-flight check on (detection.preflight), every initial member is measured from its registration and
starts once the start's verdicts are in, and a joining node is judged against the fleet's median
(detection/preflight.py; a refused node is lost as a failed join).

Each node id has one `NodeRecord` and a `NodeState` changed only by the pure `transition(state, event)`
(node_table.py, which shows the table).
A registration that the table refuses (a second agent for a node, a node that is running or lost) is
refused on the control plane (`refused` event) and changes nothing.
"""

from __future__ import annotations

import datetime as dt
import faulthandler
import itertools
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from oobleck_slurm.agent.preflight import health_peer
from oobleck_slurm.detection.health import Rebalance
from oobleck_slurm.detection.preflight import LINK, Verdict, decide, decide_fleet
from oobleck_slurm.errors import InfrastructureError, JobTimeoutError
from oobleck_slurm.protocol import keys, signed_store
from oobleck_slurm.protocol.events import EventLog
from oobleck_slurm.protocol.messages import (
    Drill,
    Fault,
    FaultResult,
    Health,
    HealthResult,
    Heartbeat,
    Message,
    Metrics,
    Preempt,
    Register,
    Shutdown,
    Start,
    Status,
    StatusResult,
    Stop,
    WorkerExit,
    parse,
)
from oobleck_slurm.protocol.records import ReplicaMismatch
from oobleck_slurm.protocol.wire import Channel, ProtocolError
from oobleck_slurm.recipe.schema import PreflightConfig
from oobleck_slurm.supervisor.hang_dumps import HangDumps
from oobleck_slurm.supervisor.health_monitor import HealthMonitor, parse_metrics
from oobleck_slurm.supervisor.launchers import AgentLauncher
from oobleck_slurm.supervisor.membership import STOPPED_STATES, Loss, LossCause, Membership
from oobleck_slurm.supervisor.node_table import (
    AgentConn,
    IllegalTransition,
    NodeEvent,
    NodeRecord,
    NodeState,
    node_worker_state,
    transition,
)
from oobleck_slurm.supervisor.observer import StoreObserver, StoreView
from oobleck_slurm.supervisor.server import ControlServer
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS, JobTimeouts

# Its timeouts and polls (the watcher's period, scontrol's, a joining node's health check) are the job's:
# BackendConfig.timeouts (timeouts.py). The job's progress and the per-worker steps come from the
# store observer's view (supervisor/observer.py), which reads them every store_poll and rank_step_poll.
# A start check's waits (the store, the group with the node's check process, its result): each is
# bounded by health_check_timeout; the start decides without a check still out after all of them.
START_CHECK_WAITS = 3
NODE_EVENT_S = 5.0  # a `node` snapshot per node this often (the dashboard's node table)
RELAYED_DRILLS = ("agent", "worker", "hang", "slow", "leak")  # faults that the node's agent injects (see agent.py)


@dataclass(frozen=True)
class BackendConfig:
    replacement: str  # spare | request | none
    store_host: str
    store_port: int
    workers_per_node: int = 1  # one per device
    threads_per_worker: int = 1  # CPU threads of each worker
    device: str = "cpu"  # cpu | cuda
    # heartbeat_lease, step_timeout, health_check_timeout, the watcher's polls (timeouts.py)
    timeouts: JobTimeouts = DEFAULT_TIMEOUTS
    # The pre-flight check (detection/preflight.py; None: off). Where the nodes share one machine (the
    # local backend's virtual nodes), the start's verdicts do not refuse (they would compare the machine
    # with itself), and the link figure (loopback there) is reported, not judged.
    preflight: PreflightConfig | None = None
    shared_machine: bool = False


class AgentNodes:
    def __init__(self, secret: bytes, launcher: AgentLauncher, log: EventLog, config: BackendConfig,
                 members: Sequence[str], observer: StoreObserver, spares: Sequence[str] = (), on_preempt: Any = None,
                 drills: Sequence[Any] = (), health: HealthMonitor | None = None, requested: Sequence[str] = ()) -> None:
        self.launcher, self.log, self.cfg = launcher, log, config
        self.observer = observer  # the job's store, as its one poller last read it (the watcher follows it)
        self.health = health  # metrics and stragglers (None: detection.enabled is false)
        self.on_preempt = on_preempt  # called with the signal's name when an agent relays Slurm's notice
        self.hang_dumps: HangDumps | None = None  # every worker's stacks and flight recorder on a hang verdict
        self.drills = sorted(drills, key=lambda d: d.step)  # recipe DrillConfigs not yet run
        self.membership = Membership(config.timeouts.heartbeat_lease, config.timeouts.step_timeout)
        self.nodes: dict[str, NodeRecord] = {  # node id -> record; members first, then spares, then replacements
            **{n: NodeRecord(n, NodeState.LAUNCHING, n, trusted=True) for n in members},
            **{n: NodeRecord(n, NodeState.SPARE, n) for n in spares}}
        self._ids: dict[str, str] = {n: n for n in self.nodes}  # index: Slurm node -> node id
        # After a takeover: replacements the lost supervisor asked for (their agents register with the token)
        self.nodes.update({t: NodeRecord(t, NodeState.REQUESTED, None, replacement=True) for t in requested})
        self._exits: queue.Queue[tuple[str, Loss | None]] = queue.Queue()  # (id, None) once its workers finished
        self._lock = threading.RLock()
        used = [int(n[1:]) for n in self.nodes if n.startswith("r") and n[1:].isdigit()]
        self._tokens = itertools.count(max(used, default=0) + 1)  # replacement tokens r1, r2, ... never reused
        self._stop = threading.Event()
        self._registered = threading.Condition(self._lock)
        self.server = ControlServer(secret, self._on_message, self._on_refused, on_disconnect=self._on_disconnect,
                                    handshake_timeout=config.timeouts.handshake_timeout)
        self._store: dist.Store | None = None  # the watcher's own client, for the drills' fault times
        self._secret = secret  # its store clients are signed (protocol/signed_store.py)
        self._slurm_states: dict[str, str] = {}  # node id -> its Slurm state last seen (the Slurm poller's)
        self._watcher = threading.Thread(target=self._watch, name="agent-nodes-watch", daemon=True)
        # Pre-flight (detection/preflight.py): the start's checks, one per initial member, run from its
        # registration while the others register; their verdicts wait for them all (the start's median).
        self._start_checks: dict[str, tuple[bool, str, dict[str, float], float] | None] = {}
        self._verdicts: dict[str, Verdict] = {}  # an initial member's start verdict, until its start uses it
        self._start_deadline = math.inf  # the start's verdicts are decided by then, with or without every check
        self.fleet: dict[str, dict[str, float]] = {}  # the admitted nodes' figures: the median's fleet

    # ---- setting up ------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def members(self) -> list[str]:
        """The node ids handed to the coordinator, in order."""
        with self._lock:
            return [i for i, r in self.nodes.items() if r.state is not NodeState.SPARE]

    def launch_agents(self, timeout: float) -> None:
        """Start an agent on every node of the allocation and wait until all have registered
        (the server must be started, and its address published, before)."""
        launched = list(self.nodes.values())
        if self.cfg.preflight is not None:  # every initial member is measured once its agent registers
            self._start_checks = {r.node_id: None for r in launched if r.trusted}
        for record in launched:
            assert record.slurm_node is not None  # allocation nodes are named
            record.step = self.launcher.launch(record.slurm_node)
        deadline = time.time() + timeout
        with self._lock:
            while missing := [r for r in launched if r.agent is None]:
                ended = {r.slurm_node: code for r in missing if r.step is not None and (code := r.step.poll()) is not None}
                if ended:
                    raise InfrastructureError(f"agent step(s) ended before registering: {ended}; see logs/agent-*.log")
                if time.time() > deadline:
                    raise JobTimeoutError(f"agents of {[r.slurm_node for r in missing]} did not register within "
                                          f"{timeout:g} s; see logs/agent-*.log")
                self._registered.wait(0.2)
            if self._start_checks:
                # Each of a check's waits is bounded by health_check_timeout, but nothing in C++ (a gloo
                # connect, a peer that stopped) is trusted to honour it: a check not in by then fails
                self._start_deadline = time.time() + START_CHECK_WAITS * self.cfg.timeouts.health_check_timeout
        self._watcher.start()

    def adopt_agents(self, timeout: float) -> list[str]:
        """After a takeover (this supervisor did not launch them): wait up to `timeout` for the members'
        agents to register again with the workers they kept running; a member whose agent did not is
        lost (reported through `exited()`). Returns those members."""
        now = time.time()
        with self._lock:
            for record in self.nodes.values():
                if record.state is NodeState.LAUNCHING:
                    self.membership.watch(record.node_id, now)
            deadline = now + timeout
            while (missing := [r for r in self.nodes.values() if r.state is NodeState.LAUNCHING]) \
                    and time.time() < deadline:
                self._registered.wait(0.05)
            for record in missing:
                loss = self.membership.agent_lost(record.node_id, time.time(),
                                                  detail=f"its agent did not come back within {timeout:g} s of the "
                                                         f"supervisor's takeover")
                if loss is not None:
                    self._lost(loss)
        self._watcher.start()
        return [r.node_id for r in missing]

    def close(self) -> None:
        """Tell every agent to stop its worker and exit; then end what is left."""
        self._stop.set()
        with self._lock:
            agents = [r.agent for r in self.nodes.values() if r.agent is not None]
            steps = [r.step for r in self.nodes.values() if r.step is not None]
        for agent in agents:
            agent.send(Shutdown())
        deadline = time.time() + 10
        for proc in steps:
            try:
                proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.launcher.close()
        self.server.stop()
        if self.health is not None:
            self.health.close()

    # ---- NodeBackend -------------------------------------------------------------------------------

    def start(self, node: str) -> None:
        with self._lock:
            record = self.nodes[node]
            if record.agent is None:  # a replacement before its job runs: checked once its agent registers
                self._fire(record, NodeEvent.AWAIT_AGENT)
            elif record.node_id in self._start_checks or record.node_id in self._verdicts:  # after its pre-flight verdict
                self._fire(record, NodeEvent.CHECK_HEALTH)
                self._start_after_preflight(record)
            elif record.trusted:  # an initial member, or a restart (checkpoint fallback)
                self._start_worker(record)
            elif self._fire(record, NodeEvent.CHECK_HEALTH) is NodeState.HEALTH_CHECK:  # a spare or replacement
                self._begin_health_check(record)

    def exited(self) -> dict[str, Loss | None]:
        out: dict[str, Loss | None] = {}
        while True:
            try:
                node, loss = self._exits.get_nowait()
            except queue.Empty:
                return out
            out.setdefault(node, loss)

    def stop(self, nodes: Sequence[str]) -> None:
        with self._lock:
            for node in nodes:
                record = self.nodes.get(node)
                if record is None:
                    continue
                self.membership.unwatch(node)
                self._fire(record, NodeEvent.STOP)
                if record.agent is not None:
                    record.agent.send(Stop())
                if self.health is not None:
                    self.health.forget(node)

    def new_node(self) -> str | None:
        with self._lock:
            if self.cfg.replacement == "spare":
                free = [r for r in self.nodes.values() if r.state is NodeState.SPARE and r.agent is not None]
                if not free:
                    self.log.emit("replacement_requested", node=None, how="spare", ok=False,
                                  detail="no spare node left in the allocation")
                    return None
                self._fire(free[0], NodeEvent.ASSIGN)
                self.log.emit("replacement_requested", node=free[0].node_id, how="spare", ok=True)
                return free[0].node_id
            if self.cfg.replacement != "request":
                return None
            token = f"r{next(self._tokens)}"
            # Known before the request: its agent may register before the request returns.
            self.nodes[token] = NodeRecord(token, NodeState.REQUESTED, None, replacement=True)
        handle = self.launcher.request(token)  # outside the lock: sbatch may take seconds
        with self._lock:
            self.log.emit("replacement_requested", node=token, how="request", ok=handle is not None,
                          slurm_job=handle)
            if handle is None:
                del self.nodes[token]  # never handed out; an agent that registers with it is refused
                return None
            self.nodes[token].request = handle
            return token

    # ---- fault drills ------------------------------------------------------------------------------

    def _lookup(self, name: str) -> NodeRecord | None:
        """The record of a Slurm node or of a node id (commands name either)."""
        return self.nodes.get(self._ids.get(name, name))

    def note_fault(self, node: str, t: float, how: str) -> None:
        """A drill says it injects a fault into `node` at `t`: detection times are measured from it."""
        with self._lock:
            record = self._lookup(node)
            ident = record.node_id if record is not None else node
            if record is not None:
                record.fault_at = t
            slurm = record.slurm_node if record is not None and record.slurm_node is not None else node
        self.log.emit("fault_injected", node=ident, slurm_node=slurm, how=how, at=t)
        if self._store is not None:
            try:
                self._store.set(keys.fault_time(ident), repr(t))
            except Exception:  # noqa: BLE001 - only a measurement is lost
                pass

    def inject(self, node: str, how: str, worker: Any, t: float) -> tuple[bool, str]:
        """A drill: note the fault time, and for the kinds a node's agent carries out (a killed worker
        or agent, a SIGSTOPped worker) tell that agent. Returns (ok, detail)."""
        self.note_fault(node, t, how)
        if how not in RELAYED_DRILLS:
            return True, ""  # kill-node does it itself (down, freeze, node)
        with self._lock:
            record = self._lookup(node)
            agent = record.agent if record is not None else None
        if agent is None:
            return False, f"no agent on {node}"
        agent.send(Drill(how=how, worker=worker if isinstance(worker, int) and worker >= 0 else 0))
        return True, ""

    def _run_drills(self, step: int) -> None:
        """The recipe's scripted drills (`drills:`), each once, when training reaches its step."""
        for drill in [d for d in self.drills if step >= d.step]:
            self.drills.remove(drill)
            if drill.how == "supervisor":  # this process: its standby takes over (docs/failover.md)
                self.log.emit("drill", node="supervisor", how=drill.how, worker=0, step=step, ok=True, detail="")
                os.kill(os.getpid(), signal.SIGKILL)
            ok, detail = self.inject(drill.node, drill.how, drill.worker, time.time())
            self.log.emit("drill", node=drill.node, how=drill.how, worker=drill.worker, step=step, ok=ok,
                          detail=detail)

    # ---- control messages (server threads) ---------------------------------------------------------

    def _on_message(self, channel: Channel, raw: dict[str, Any]) -> dict[str, Any] | None:
        """Validate a received message (a bad one drops the peer: ProtocolError) and act on it."""
        message = parse(raw)
        reply = self._handle(channel, message, time.time())
        return reply.to_dict() if reply is not None else None

    def _handle(self, channel: Channel, message: Message, now: float) -> Message | None:
        if isinstance(message, Register):
            self._register(channel, message)
        elif isinstance(message, Heartbeat):
            with self._lock:
                record = self._lookup(message.node)
                if record is not None:
                    self.membership.heartbeat(record.node_id, now, node_worker_state(message.workers))
                    record.last_beat = message
        elif isinstance(message, Metrics):
            self._on_metrics(message)
        elif isinstance(message, WorkerExit):
            self._worker_exit(message, now)
        elif isinstance(message, HealthResult):
            with self._lock:
                record = self._lookup(message.node)
                waiting = record.agent.checks.get(message.prefix) if record is not None and record.agent else None
            if waiting is not None:  # else a check that was given up
                waiting.put(message)
        elif isinstance(message, Fault):
            ok, detail = self.inject(message.node, message.how, message.worker, message.t)
            return FaultResult(ok=ok, detail=detail)
        elif isinstance(message, Preempt):
            with self._lock:
                record = self._lookup(message.node)
            self.log.emit("preempt_notice", node=record.node_id if record is not None else message.node,
                          signal=message.signal)
            if self.on_preempt is not None:
                self.on_preempt(message.signal)
        elif isinstance(message, Status):
            return self.status()
        else:
            raise ProtocolError(f"the supervisor does not take {message.TYPE} messages")
        return None

    def _worker_exit(self, message: WorkerExit, now: float) -> None:
        with self._lock:
            record = self.nodes.get(message.node_id)
            if record is None or record.state is not NodeState.RUNNING:
                return  # stopped or lost meanwhile: the coordinator knows already
            self._workers_ended(record, message.code, now)

    def _workers_ended(self, record: NodeRecord, code: int, now: float) -> None:
        """A running node's workers ended (lock held): finished (0) or the node lost."""
        loss = self.membership.worker_exited(record.node_id, code, now)
        if loss is not None:
            self._lost(loss)
        elif code == 0:
            self._fire(record, NodeEvent.FINISH)
            self.membership.unwatch(record.node_id)
            self._exits.put((record.node_id, None))

    def _on_metrics(self, message: Metrics) -> None:
        """An agent's batch of metrics: to the health monitor while its node is a live member (a spare,
        a node not started yet or a lost one is not compared with the members)."""
        if self.health is None:
            return
        with self._lock:
            record = self._lookup(message.node)
            ident = record.node_id if record is not None else None
            judged = ident is not None and ident in self.membership.watched and not self.membership.is_lost(ident)
        if ident is None or not judged:
            return
        try:
            samples = parse_metrics(message.samples)
        except ProtocolError as err:  # advisory data: dropped and logged, the agent stays connected
            self.log.emit("refused", peer=ident, reason=str(err))
            return
        self.health.receive(ident, samples)

    def rebalances(self) -> list[Rebalance]:
        """Straggler decisions for the coordinator (detection/health.py `Rebalance`: node -> slowdown,
        a node not named at full speed); empty without detection."""
        return self.health.rebalances() if self.health is not None else []

    def _on_refused(self, peer: str, reason: str) -> None:
        self.log.emit("refused", peer=peer, reason=reason)

    def _on_disconnect(self, channel: Channel) -> None:
        with self._lock:
            record = self._lookup(str(channel.peer.get("node")))
            if record is None or record.agent is None or record.agent.channel is not channel:
                return  # a drill or status client, or a connection that never registered
            record.agent = None
            if self._start_checks.get(record.node_id, ()) is None:  # an unwatched member: the others go on
                self._start_check_done(record.node_id, (False, "its agent went away during the check", {}, 0.0))
            if not self._stop.is_set():
                loss = self.membership.agent_lost(record.node_id, time.time())
                if loss is not None:
                    self._lost(loss)

    def _register(self, channel: Channel, message: Register) -> None:
        if message.running is not None:
            return self._readopt(channel, message, message.running)
        node, token = message.node, message.replacement
        with self._lock:
            record = self.nodes.get(token) if token else self._lookup(node)
            if token and (record is None or not record.replacement or record.slurm_node is not None):
                return self._refuse(channel, node, f"unknown or already bound replacement {token!r}")
            if record is None:
                return self._refuse(channel, node, f"{node} is not a node of this job")
            if record.agent is not None:
                return self._refuse(channel, node, f"{record.node_id} already has an agent")
            try:
                self._fire(record, NodeEvent.REGISTER)
            except IllegalTransition:
                return self._refuse(channel, node, f"{record.node_id} is {record.state}: no agent may register")
            if token:
                record.slurm_node = node
                self._ids[node] = token
            record.agent = AgentConn(channel, pid=message.pid)
            self.log.emit("node", node=record.node_id, slurm_node=node,
                          state="joining" if token else ("spare" if record.state is NodeState.SPARE else "healthy"),
                          agent_pid=message.pid)
            self._registered.notify_all()
            if record.node_id in self._start_checks and self._start_checks[record.node_id] is None:
                threading.Thread(target=self._start_check, args=(record, record.agent),
                                 name=f"preflight-{record.node_id}", daemon=True).start()
            if record.state is NodeState.HEALTH_CHECK:  # the coordinator is waiting for it
                self._begin_health_check(record)

    def _readopt(self, channel: Channel, message: Register, node_id: str) -> None:
        """An agent of a member, whose workers run under `node_id`, registers with the supervisor that
        took over: the node is running, as it was (adopt_agents)."""
        with self._lock:
            record = self.nodes.get(node_id)
            if record is None or record.agent is not None:
                return self._refuse(channel, message.node, f"{node_id} is not a member waiting for its agent")
            if record.replacement and record.state in (NodeState.REQUESTED, NodeState.AWAITING_AGENT):
                return self._rejoin(channel, message, record)
            try:
                self._fire(record, NodeEvent.ADOPT)
            except IllegalTransition:
                return self._refuse(channel, message.node, f"{node_id} is {record.state}: it cannot be adopted")
            record.slurm_node, record.trusted = message.node, True
            self._ids[message.node] = node_id
            record.agent = AgentConn(channel, pid=message.pid)
            now = time.time()
            self.membership.watch(node_id, now)
            self.log.emit("node", node=node_id, slurm_node=message.node, state="healthy", agent_pid=message.pid)
            self._registered.notify_all()
            if message.exited is not None:  # they ended while no supervisor listened
                self._workers_ended(record, message.exited, now)
            elif not message.workers or "gone" in message.workers:  # killed, and the agent did not see it yet
                loss = self.membership.worker_exited(node_id, -1, now)
                if loss is not None:
                    self._lost(loss)
            else:
                self.membership.heartbeat(node_id, now, node_worker_state(message.workers))

    def _rejoin(self, channel: Channel, message: Register, record: NodeRecord) -> None:
        """A replacement whose workers the lost supervisor started after its check, before they joined
        a generation (lock held): its join is pending in the durable state, but this supervisor neither
        checked it nor started them. Its workers are stopped and it joins as a replacement whose agent
        just registered does: checked first, then started afresh (the coordinator starts it, or already
        did: `start` of a pending join)."""
        self._fire(record, NodeEvent.REGISTER)
        record.slurm_node = message.node
        self._ids[message.node] = record.node_id
        record.agent = AgentConn(channel, pid=message.pid)
        record.agent.send(Stop())
        self.log.emit("node", node=record.node_id, slurm_node=message.node, state="joining", agent_pid=message.pid)
        self._registered.notify_all()
        if record.state is NodeState.HEALTH_CHECK:  # the coordinator is waiting for it
            self._begin_health_check(record)

    def _refuse(self, channel: Channel, peer: str, reason: str) -> None:
        self.log.emit("refused", peer=peer, reason=reason)
        channel.close()

    # ---- starting workers --------------------------------------------------------------------------

    def _fire(self, record: NodeRecord, event: NodeEvent) -> NodeState:
        record.state = transition(record.state, event)
        return record.state

    def _start_worker(self, record: NodeRecord) -> None:
        if self._fire(record, NodeEvent.START_WORKER) is not NodeState.RUNNING:
            return  # lost meanwhile: the coordinator learns it from exited()
        assert record.agent is not None  # the caller checked
        record.trusted = True
        self.membership.watch(record.node_id, time.time())
        record.agent.send(Start(node_id=record.node_id, workers=self.cfg.workers_per_node,
                                threads=self.cfg.threads_per_worker, device=self.cfg.device))

    def _begin_health_check(self, record: NodeRecord) -> None:
        assert record.agent is not None and record.state is NodeState.HEALTH_CHECK
        record.health_check = keys.health_prefix(record.node_id, time.time_ns())
        threading.Thread(target=self._health_check, args=(record, record.agent, record.health_check),
                         name=f"health-{record.node_id}", daemon=True).start()

    def _run_check(self, agent: AgentConn, prefix: str) -> tuple[bool, str, dict[str, float]]:
        """One check with the node's agent (agent/preflight.py): (passed, detail, pre-flight figures)."""
        results: queue.Queue[HealthResult] = queue.Queue()
        with self._lock:
            agent.checks[prefix] = results
        timeout = self.cfg.timeouts.health_check_timeout
        measure = self.cfg.preflight is not None
        agent.send(Health(host=self.cfg.store_host, port=self.cfg.store_port, prefix=prefix, timeout=timeout,
                          measure=measure, threads=self.cfg.threads_per_worker, device=self.cfg.device,
                          devices=self.cfg.workers_per_node))
        try:
            store = signed_store.connect(self.cfg.store_host, self.cfg.store_port, dt.timedelta(seconds=timeout),
                                         self._secret, self.log, "supervisor", self.cfg.timeouts.forged_value_poll)
            ok_here = health_peer(store, prefix, timeout, link=measure)
            result = results.get(timeout=timeout)
            return ok_here and result.ok, result.detail, dict(result.figures)
        except Exception as err:  # noqa: BLE001 - any failure means "not healthy"
            return False, f"{type(err).__name__}: {err}", {}
        finally:
            with self._lock:
                del agent.checks[prefix]

    def _judge_join(self, record: NodeRecord, figures: dict[str, float], seconds: float) -> Verdict:
        """A joining node's pre-flight verdict against the fleet (the admitted nodes' figures)."""
        assert self.cfg.preflight is not None
        with self._lock:
            fleet = list(self.fleet.values())
        if not figures:
            verdict = Verdict(False, "it reported no pre-flight figures")
        else:
            verdict = decide([self._judged(f) for f in fleet], self._judged(figures), self.cfg.preflight.min_fraction,
                             self.cfg.preflight.min_nodes)
        self._log_verdict(record, "join", verdict, figures, seconds)
        if verdict.admit:
            with self._lock:
                self.fleet[record.node_id] = figures
        return verdict

    def _judged(self, figures: dict[str, float]) -> dict[str, float]:
        """The figures a verdict weighs: on a shared machine, not the link (its loopback)."""
        return {k: v for k, v in figures.items() if not (self.cfg.shared_machine and k == LINK)}

    def _log_verdict(self, record: NodeRecord, at: str, verdict: Verdict, figures: dict[str, float],
                     seconds: float) -> None:
        self.log.emit("preflight", node=record.node_id, slurm_node=record.slurm_node, at=at, admitted=verdict.admit,
                      reason=verdict.reason or None, figures={k: round(v, 3) for k, v in figures.items()},
                      medians={k: round(v, 3) for k, v in verdict.medians.items()}, seconds=round(seconds, 3))

    def _start_check(self, record: NodeRecord, agent: AgentConn) -> None:
        """An initial member's pre-flight check, from its registration; the last one in decides all."""
        t0 = time.time()
        ok, detail, figures = self._run_check(agent, keys.health_prefix(record.node_id, time.time_ns()))
        with self._lock:
            self._start_check_done(record.node_id, (ok, detail, figures, time.time() - t0))

    def _start_check_done(self, node: str, result: tuple[bool, str, dict[str, float], float]) -> None:
        """An initial member's check is in (lock held): its result, a failure (lost meanwhile), or no
        result by the start's deadline; the last one in decides all. Once decided, later ones are moot."""
        if self._start_checks.get(node, ()) is not None:
            return  # decided already (a late check after the deadline), or not an initial member's check
        self._start_checks[node] = result
        if all(v is not None for v in self._start_checks.values()):
            self._decide_start()

    def _start_checks_overdue(self, now: float) -> None:
        """The start's deadline passed with checks still out: they fail (lock held), and the start is
        decided without them (a member whose check hangs must not hold every other one back)."""
        if now < self._start_deadline or not self._start_checks:
            return
        late = sorted(n for n, v in self._start_checks.items() if v is None)
        waited = START_CHECK_WAITS * self.cfg.timeouts.health_check_timeout
        # Every wait of a check is bounded: one still out is a bug or a stuck call, and where its thread
        # waits is what explains it (the supervisor's log)
        print(f"supervisor: the start checks of {late} are still out after {waited:g} s; every thread's stack:",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for node in late:
            self._start_check_done(node, (False, f"no result within {waited:g} s of the start", {}, waited))

    def _decide_start(self) -> None:
        """Every initial member measured (lock held): their verdicts against the start's median; a member
        that is waiting (`start` came first) starts now, or fails as a join would."""
        assert self.cfg.preflight is not None
        done = {n: v for n, v in self._start_checks.items() if v is not None}
        measured = {n: self._judged(figures) for n, (ok, _, figures, _) in done.items() if ok and figures}
        verdicts = decide_fleet(measured, self.cfg.preflight.min_fraction, self.cfg.preflight.min_nodes)
        for node, (ok, detail, figures, seconds) in done.items():
            verdict = verdicts.get(node) or Verdict(False, f"its check failed: {detail}" if not ok else
                                                    "it reported no pre-flight figures")
            if not verdict.admit and self.cfg.shared_machine:
                verdict = Verdict(True, f"not refused (the nodes share a machine): {verdict.reason}", verdict.medians)
            self._log_verdict(self.nodes[node], "start", verdict, figures, seconds)
            if verdict.admit and figures:
                self.fleet[node] = figures
            self._verdicts[node] = verdict
        self._start_checks = {}
        for node in list(self._verdicts):
            record = self.nodes[node]
            if record.state is NodeState.HEALTH_CHECK and record.health_check is None:
                self._start_after_preflight(record)

    def _start_after_preflight(self, record: NodeRecord) -> None:
        """An initial member that the coordinator started (lock held): once its start verdict is in,
        its workers start, or it is lost as a failed join (the coordinator recovers without it)."""
        verdict = self._verdicts.pop(record.node_id, None)
        if verdict is None:
            return  # decided with the others (_decide_start), which comes back here
        if record.state is not NodeState.HEALTH_CHECK:
            return
        if verdict.admit and record.agent is not None:
            self._start_worker(record)
        else:
            self._join_failed(record, f"pre-flight check: {verdict.reason}" if not verdict.admit else
                              "its agent went away")

    def _join_failed(self, record: NodeRecord, why: str) -> None:
        loss = Loss(record.node_id, LossCause.JOIN_FAILED, why, time.time())
        self._fire(record, NodeEvent.LOSE)
        record.loss = loss
        self._exits.put((record.node_id, loss))

    def _health_check(self, record: NodeRecord, agent: AgentConn, prefix: str) -> None:
        """A node that joins proves it can run a collective (here: with the supervisor) first, and
        (pre-flight) that it is not slower than the fleet."""
        t0 = time.time()
        ok, detail, figures = self._run_check(agent, prefix)
        if ok and self.cfg.preflight is not None:
            verdict = self._judge_join(record, figures, time.time() - t0)
            ok, detail = verdict.admit, (detail if verdict.admit else f"pre-flight check: {verdict.reason}")
        self.log.emit("health_check", node=record.node_id, slurm_node=record.slurm_node, ok=ok,
                      seconds=time.time() - t0, detail=detail)
        with self._lock:
            if record.state is not NodeState.HEALTH_CHECK or record.health_check != prefix:
                return  # stopped meanwhile (and maybe started again: a newer check decides)
            record.health_check = None
            if ok and record.agent is agent:
                self._start_worker(record)
            else:
                self._join_failed(record, f"health check failed: {detail if not ok else 'its agent went away'}")

    # ---- detection ---------------------------------------------------------------------------------

    def _lost(self, loss: Loss) -> None:
        """Report a loss once: to the coordinator as an exit, to the log with cause and timing."""
        record = self.nodes[loss.node]
        if loss.cause is LossCause.HUNG and self.hang_dumps is not None:  # before its stop and the abort
            watched = sorted(self.membership.watched)
            self.hang_dumps.collect([loss.node], watched, [n for n in watched if self.membership.worker_state.get(n)
                                                           in STOPPED_STATES])
        self._fire(record, NodeEvent.LOSE)
        record.loss = loss
        fault = record.fault_at
        slurm = record.slurm_node or loss.node
        self.log.emit("node_lost", node=loss.node, slurm_node=slurm, cause=loss.cause, detail=loss.detail,
                      detection_seconds=(loss.t - fault) if fault else None, t=loss.t)
        self.log.emit("node", node=loss.node, slurm_node=slurm, state="lost", cause=loss.cause)
        if record.agent is not None:
            record.agent.send(Stop())  # fence: a stopped or stray worker must not come back into play
        if self.health is not None:
            self.health.forget(loss.node)
        self._exits.put((loss.node, loss))
        if record.slurm_node:  # a replacement's token is no machine
            self.launcher.lost(record.slurm_node)

    def _watch(self) -> None:
        self._store = signed_store.connect(self.cfg.store_host, self.cfg.store_port,
                                           self.cfg.timeouts.td("store_timeout"), self._secret, self.log,
                                           "supervisor", self.cfg.timeouts.forged_value_poll)
        with self._lock:
            faults = {i: r.fault_at for i, r in self.nodes.items() if r.fault_at is not None}
        for ident, t in faults.items():
            self._store.set(keys.fault_time(ident), repr(t))
        next_nodes = 0.0
        gen, seen, steps_seen = -1, 0, 0.0
        mismatch_gen = -1  # the last generation whose integrity verdict was acted on
        timeouts = self.cfg.timeouts
        # Slurm's view in its own thread: a query may take retries (tens of seconds) while slurmctld
        # restarts, and this loop bounds the detection latency of every other path.
        threading.Thread(target=self._watch_slurm, name="agent-nodes-slurm", daemon=True).start()
        while not self._stop.wait(timeouts.backend_poll):
            now = time.time()
            with self._lock:
                self._start_checks_overdue(now)
                for record in self.nodes.values():
                    code = record.step.poll() if record.step is not None else None
                    if code is not None:
                        record.step = None
                        loss = self.membership.srun_exited(record.node_id, code, now)
                        if loss:
                            self._lost(loss)
                for loss in self.membership.check(now):
                    self._lost(loss)
            view = self.observer.view
            if view.seq != seen:
                seen = view.seq
                gen = self._follow_progress(view, gen, now)
            if self.health is not None:
                for evict in self.health.poll(view, now):
                    with self._lock:
                        loss = self.membership.evict(str(evict.node), LossCause(evict.cause), evict.detail, now)
                        if loss:
                            self._lost(loss)
            if view.mismatch is not None and view.generation != mismatch_gen:
                mismatch_gen = view.generation
                self._evict_mismatched(view.mismatch, now)
            if view.steps_t != steps_seen:
                steps_seen = view.steps_t
                self._follow_rank_steps(view, now)
            if now >= next_nodes:
                next_nodes = now + NODE_EVENT_S
                self._node_snapshot(now)

    def _evict_mismatched(self, verdict: ReplicaMismatch, now: float) -> None:
        """The workers' integrity verdict (engine/integrity.py): each node named is lost like a dead one;
        the recovery copies its layers from the replicas that agree."""
        detail = f"step {verdict.step}: {verdict.detail}"
        with self._lock:
            for node in verdict.nodes:
                if loss := self.membership.evict(node, LossCause.REPLICA_MISMATCH, detail, now):
                    self._lost(loss)

    def _follow_progress(self, view: StoreView, gen: int, now: float) -> int:
        """The job's step (-1 before a generation's first) from a new view; a new generation restarts
        the step clock."""
        current = max(view.generation, 0)
        step = view.progress if view.progress is not None else -1
        with self._lock:
            if current != gen:
                self.membership.restart_progress(now)
            self.membership.step(step, now)
        if self.drills and step >= 0:
            self._run_drills(step)
        return current

    def _follow_rank_steps(self, view: StoreView, now: float) -> None:
        """Each watched node's step, from the view's worker steps (read every rank_step_poll): the
        smallest over its workers of the last step each reached a collective in (a node with one hung
        worker is behind its peers): names a hung rank's node. A node counts once all its workers did."""
        with self._lock:
            for ident in sorted(self.membership.watched):
                workers = keys.node_workers(ident, self.cfg.workers_per_node)
                if all(w in view.worker_steps for w in workers):
                    self.membership.node_step(ident, min(view.worker_steps[w] for w in workers), now)

    def _watch_slurm(self) -> None:
        """The steady state's one Slurm query, every slurm_node_poll (one controller RPC per period when
        slurmctld answers), and the count of the client commands this process ran (`slurm_calls`), every
        slurm_calls_report. A launcher with no Slurm view (local) makes it report nothing."""
        from oobleck_slurm.cluster.slurm import client_calls

        timeouts = self.cfg.timeouts
        reported, last = time.time(), client_calls()
        while not self._stop.wait(timeouts.slurm_node_poll):
            has_view = self._poll_slurm(time.time())
            now = time.time()
            if has_view and now - reported >= timeouts.slurm_calls_report:
                calls = client_calls()
                self.log.emit("slurm_calls", calls=calls["total"], failed=calls["failed"],
                              window_calls=calls["total"] - last["total"], window_s=round(now - reported, 3),
                              commands={k: v for k, v in calls.items() if k not in ("total", "failed")})
                reported, last = now, calls

    def _poll_slurm(self, now: float) -> bool:
        """Slurm's state of the watched nodes: a lost state (DOWN, FAIL, powered down) is a loss; an
        advisory one (DRAIN, NOT_RESPONDING: cluster/slurm.py) is only reported, in a `node` event when it
        changes and in every node snapshot. False when the launcher has no Slurm view."""
        with self._lock:
            watched = {r.slurm_node: i for i in self.membership.watched
                       if (r := self.nodes.get(i)) is not None and r.slurm_node is not None}
        try:
            states = self.launcher.node_states(sorted(watched))
        except Exception as err:  # noqa: BLE001 - slurmctld unreachable: other paths still detect
            self.log.emit("slurm_unreachable", error=str(err))
            return True
        if states is None:
            return False
        with self._lock:
            for node, health in states.items():
                if node not in watched:
                    continue
                ident = watched[node]
                if self._slurm_states.get(ident) != health.state:
                    self._slurm_states[ident] = health.state
                    if health.usable and not self.membership.is_lost(ident):
                        self.log.emit("node", node=ident, slurm_node=node, slurm_state=health.state)
                loss = self.membership.slurm_state(ident, health.state, health.usable, now)
                if loss:
                    self._lost(loss)
        return True

    def _node_snapshot(self, now: float) -> None:
        with self._lock:
            for ident in sorted(self.membership.watched):
                if self.membership.is_lost(ident):
                    continue
                record = self.nodes[ident]
                beat = record.last_beat
                workers = list(beat.workers) if beat is not None else None
                age = self.membership.leases.age(ident, now) if ident in self.membership.leases.members() else None
                self.log.emit("node", node=ident, slurm_node=record.slurm_node or ident, state="healthy",
                              heartbeat_age=age, cpu=beat.cpu if beat is not None else None,
                              worker=node_worker_state(workers or ()), workers=workers,
                              slurm_state=self._slurm_states.get(ident))

    def status(self) -> StatusResult:
        with self._lock:
            records = self.nodes.values()
            return StatusResult(
                members=tuple(self.members),
                agents=tuple(sorted(r.slurm_node for r in records if r.agent is not None and r.slurm_node)),
                watched=tuple(sorted(self.membership.watched)),
                node_of={r.node_id: r.slurm_node for r in records if r.slurm_node is not None},
                requests={r.node_id: r.request for r in records if r.request is not None},
                agent_pids={r.slurm_node: r.agent.pid for r in records if r.agent is not None and r.slurm_node},
                states={r.node_id: str(r.state) for r in records})
