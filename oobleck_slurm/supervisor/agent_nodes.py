"""`AgentNodes`: the coordinator's NodeBackend when workers run under node agents (Slurm or local).

It owns the control server the agents connect to, and one watcher thread that turns every kind of
evidence into node losses (see membership.py): srun step exit, control connection loss, heartbeat
lease expiry, Slurm node state, hung worker, worker exit, and the health monitor's evictions (metrics,
stragglers: health_monitor.py, fed with the agents' `metrics` messages). A loss is handed to the coordinator as an
exit of the node (`exited()`), recorded with its real cause and detection time (`node_lost` event),
and the node is fenced: its agent, if it still answers, kills the worker.

Node ids: the coordinator's ids are Slurm node names, except requested replacements, which get a
token ("r1", "r2", ...) when asked for (the coordinator needs an id at once) and are bound to the
Slurm node whose agent registers with that token. Joining nodes are health-checked first.
"""

from __future__ import annotations

import datetime as dt
import itertools
import queue
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from oobleck_slurm.detection.health import Rebalance
from oobleck_slurm.protocol import keys
from oobleck_slurm.protocol.events import EventLog
from oobleck_slurm.protocol.wire import Channel, ProtocolError
from oobleck_slurm.supervisor.health import health_peer
from oobleck_slurm.supervisor.health_monitor import HealthMonitor, parse_metrics
from oobleck_slurm.supervisor.launchers import AgentLauncher
from oobleck_slurm.supervisor.membership import STOPPED_STATES, Loss, LossCause, Membership
from oobleck_slurm.supervisor.server import ControlServer

WATCH_S = 0.02  # the watcher's period: bounds the detection latency of srun exits and leases
SLURM_POLL_S = 1.0  # scontrol is asked at most this often (slurmctld is shared with other users)
RANK_STEP_POLL_S = 0.25  # per-worker steps (`worker/{node}:{i}/step`) are read this often: a hang takes step_timeout anyway
NODE_EVENT_S = 5.0  # a `node` snapshot per node this often (the dashboard's node table)
HEALTH_TIMEOUT_S = 60.0  # a joining node's collective with the supervisor (includes its torch import)
RELAYED_DRILLS = ("agent", "worker", "hang", "slow", "leak")  # faults that the node's agent injects (see agent.py)


def node_worker_state(states: Any) -> str:
    """One state for a node's workers: "stopped" if any is stopped (a SIGSTOPped worker stalls the
    whole node), else the first worker's, "none" before any started."""
    if not isinstance(states, list) or not states:
        return "none"
    stopped = [s for s in states if s in STOPPED_STATES]
    return str(stopped[0] if stopped else states[0])


@dataclass
class AgentConn:
    node: str  # Slurm node name
    channel: Channel
    lock: threading.Lock = field(default_factory=threading.Lock)
    replacement: str | None = None
    health: queue.Queue = field(default_factory=queue.Queue)
    pid: int | None = None  # the agent's process id on its node (local drills find the node's processes by it)

    def send(self, message: dict[str, Any]) -> bool:
        try:
            with self.lock:
                self.channel.send(message)
            return True
        except OSError:
            return False


@dataclass(frozen=True)
class BackendConfig:
    heartbeat_interval: float
    heartbeat_lease: float
    step_timeout: float
    replacement: str  # spare | request | none
    store_host: str
    store_port: int
    workers_per_node: int = 1  # one per device
    threads_per_worker: int = 1  # CPU threads of each worker
    device: str = "cpu"  # cpu | cuda


class AgentNodes:
    def __init__(self, secret: bytes, launcher: AgentLauncher, log: EventLog, config: BackendConfig,
                 members: Sequence[str], spares: Sequence[str] = (), on_preempt: Any = None,
                 drills: Sequence[Any] = (), health: HealthMonitor | None = None) -> None:
        self.launcher, self.log, self.cfg = launcher, log, config
        self.health = health  # metrics and stragglers (None: detection.enabled is false)
        self.on_preempt = on_preempt  # called when an agent relays Slurm's preemption / time-limit signal
        self.drills = sorted(drills, key=lambda d: d.step)  # recipe DrillConfigs not yet run
        self.members, self.spares = list(members), list(spares)
        self.membership = Membership(config.heartbeat_lease, config.step_timeout)
        self.agents: dict[str, AgentConn] = {}  # Slurm node -> live connection
        self.node_of: dict[str, str] = {n: n for n in [*members, *spares]}  # coordinator id -> Slurm node
        self.id_of: dict[str, str] = dict(self.node_of)  # Slurm node -> coordinator id
        self.sruns: dict[str, subprocess.Popen] = {}  # Slurm node -> its agent's step
        self.starting: set[str] = set()  # ids to start once their agent is up and healthy
        self.requests: dict[str, str] = {}  # token -> Slurm job id
        self.fault_at: dict[str, float] = {}  # id -> time a drill injected a fault (for detection times)
        self._exits: queue.Queue[tuple[str, Loss | None]] = queue.Queue()  # (id, None) once its workers finished
        self._lock = threading.RLock()
        self._tokens = itertools.count(1)
        self._stop = threading.Event()
        self._registered = threading.Condition(self._lock)
        self.server = ControlServer(secret, self._on_message, self._on_refused, on_disconnect=self._on_disconnect)
        self._last_metrics: dict[str, dict[str, Any]] = {}  # id -> its agent's last heartbeat
        self.trusted: set[str] = set(members)  # ids whose worker may start without a health check
        self._store: dist.TCPStore | None = None  # the watcher's own client (a store object per thread)
        self._watcher = threading.Thread(target=self._watch, name="agent-nodes-watch", daemon=True)

    # ---- setting up ------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self.server.port

    def launch_agents(self, timeout: float) -> None:
        """Start an agent on every node of the allocation and wait until all have registered
        (the server must be started, and its address published, before)."""
        for node in [*self.members, *self.spares]:
            self.sruns[node] = self.launcher.launch(node)
        deadline = time.time() + timeout
        with self._lock:
            while missing := [n for n in self.sruns if n not in self.agents]:
                ended = {n: self.sruns[n].poll() for n in missing if self.sruns[n].poll() is not None}
                if ended:
                    raise RuntimeError(f"agent step(s) ended before registering: {ended}; see logs/agent-*.log")
                if time.time() > deadline:
                    raise RuntimeError(f"agents of {missing} did not register within {timeout:g} s; "
                                       "see logs/agent-*.log")
                self._registered.wait(0.2)
        self._watcher.start()

    def close(self) -> None:
        """Tell every agent to stop its worker and exit; then end what is left."""
        self._stop.set()
        with self._lock:
            agents = list(self.agents.values())
        for agent in agents:
            agent.send({"type": "shutdown"})
        deadline = time.time() + 10
        for proc in self.sruns.values():
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
            slurm = self.node_of.get(node)
            if slurm is not None and slurm in self.agents and node in self.trusted:
                self._start_worker(node)  # an initial member, or a restart (checkpoint fallback)
            else:  # a replacement or spare: started once registered and health-checked
                self.starting.add(node)
                if slurm is not None and slurm in self.agents:
                    self._health_then_start(node)

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
                self.membership.unwatch(node)
                self.starting.discard(node)
                if self.health is not None:
                    self.health.forget(node)
                agent = self.agents.get(self.node_of.get(node, ""))
                if agent is not None:
                    agent.send({"type": "stop"})

    def new_node(self) -> str | None:
        with self._lock:
            if self.cfg.replacement == "spare":
                used = set(self.members) | self.starting
                free = [s for s in self.spares if s not in used and s in self.agents]
                if not free:
                    self.log.emit("replacement_requested", node=None, how="spare", ok=False,
                                  detail="no spare node left in the allocation")
                    return None
                node = free[0]
                self.members.append(node)
                self.log.emit("replacement_requested", node=node, how="spare", ok=True)
                return node
            if self.cfg.replacement != "request":
                return None
            token = f"r{next(self._tokens)}"
        handle = self.launcher.request(token)
        with self._lock:
            self.log.emit("replacement_requested", node=token, how="request", ok=handle is not None,
                          slurm_job=handle)
            if handle is None:
                return None
            self.requests[token] = handle
            self.members.append(token)
            return token

    # ---- fault drills ------------------------------------------------------------------------------

    def note_fault(self, node: str, t: float, how: str) -> None:
        """A drill says it injects a fault into `node` at `t`: detection times are measured from it."""
        ident = self.id_of.get(node, node)
        self.fault_at[ident] = t
        self.log.emit("fault_injected", node=ident, slurm_node=self.node_of.get(ident, node), how=how, at=t)
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
            agent = self.agents.get(self.node_of.get(node, node))
        if agent is None:
            return False, f"no agent on {node}"
        agent.send({"type": "drill", "how": how, "worker": worker if isinstance(worker, int) else 0})
        return True, ""

    def _run_drills(self, step: int) -> None:
        """The recipe's scripted drills (`drills:`), each once, when training reaches its step."""
        for drill in [d for d in self.drills if step >= d.step]:
            self.drills.remove(drill)
            ok, detail = self.inject(drill.node, drill.how, drill.worker, time.time())
            self.log.emit("drill", node=drill.node, how=drill.how, worker=drill.worker, step=step, ok=ok,
                          detail=detail)

    # ---- control messages (server threads) ---------------------------------------------------------

    def _on_message(self, channel: Channel, message: dict[str, Any]) -> None:
        kind = message["type"]
        now = time.time()
        if kind == "register":
            self._register(channel, message, now)
        elif kind == "heartbeat":
            with self._lock:
                ident = self.id_of.get(str(message.get("node")))
                if ident is not None:
                    self.membership.heartbeat(ident, now, node_worker_state(message.get("workers")))
                    self._last_metrics[ident] = message
        elif kind == "metrics":
            self._on_metrics(message)
        elif kind == "worker_exit":
            with self._lock:
                ident = str(message.get("node_id"))
                if ident in self.membership.watched:
                    code = int(message["code"])
                    loss = self.membership.worker_exited(ident, code, now)
                    if loss is not None:
                        self._lost(loss)
                    elif code == 0:
                        self.membership.unwatch(ident)
                        self._exits.put((ident, None))
        elif kind == "health_result":
            agent = self.agents.get(str(message.get("node")))
            if agent is not None:
                agent.health.put(message)
        elif kind == "fault":
            ok, detail = self.inject(str(message["node"]), str(message.get("how", "")), message.get("worker"),
                                     float(message["t"]))
            return {"type": "fault_result", "ok": ok, "detail": detail}
        elif kind == "preempt":
            self.log.emit("preempt_notice", node=self.id_of.get(str(message.get("node")), message.get("node")),
                          signal=message.get("signal"))
            if self.on_preempt is not None:
                self.on_preempt()
        elif kind == "status":
            return self.status()  # type: ignore[return-value]
        return None

    def _on_metrics(self, message: dict[str, Any]) -> None:
        """An agent's batch of metrics: to the health monitor while its node is a live member (a spare,
        a node not started yet or a lost one is not compared with the members)."""
        if self.health is None:
            return
        with self._lock:
            ident = self.id_of.get(str(message.get("node")))
            judged = ident is not None and ident in self.membership.watched and not self.membership.is_lost(ident)
        if ident is None or not judged:
            return
        try:
            samples = parse_metrics(message)
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
        node = str(channel.peer.get("node"))
        with self._lock:
            agent = self.agents.get(node)
            if agent is None or agent.channel is not channel:
                return  # a drill or status client, or an agent that was already replaced
            del self.agents[node]
            ident = self.id_of.get(node)
            if ident is not None and not self._stop.is_set():
                loss = self.membership.agent_lost(ident, time.time())
                if loss is not None:
                    self._lost(loss)

    def _register(self, channel: Channel, message: dict[str, Any], now: float) -> None:
        node = str(message["node"])
        token = message.get("replacement")
        with self._lock:
            if token:
                if token not in self.requests or token in self.node_of:
                    self.log.emit("refused", peer=node, reason=f"unknown or already bound replacement {token!r}")
                    channel.close()
                    return
                self.node_of[token], self.id_of[node] = node, token
            pid = message.get("pid")
            self.agents[node] = AgentConn(node, channel, replacement=token, pid=pid if isinstance(pid, int) else None)
            self.log.emit("node", node=self.id_of.get(node, node), slurm_node=node,
                          state="joining" if token else ("spare" if node in self.spares else "healthy"),
                          agent_pid=message.get("pid"))
            self._registered.notify_all()
            ident = self.id_of.get(node)
            if ident is not None and ident in self.starting:
                self._health_then_start(ident)

    # ---- starting workers --------------------------------------------------------------------------

    def _start_worker(self, ident: str) -> None:
        agent = self.agents[self.node_of[ident]]
        self.starting.discard(ident)
        self.trusted.add(ident)
        self.membership.watch(ident, time.time())
        agent.send({"type": "start", "node_id": ident, "workers": self.cfg.workers_per_node,
                    "threads": self.cfg.threads_per_worker, "device": self.cfg.device})

    def _health_then_start(self, ident: str) -> None:
        threading.Thread(target=self._health_check, args=(ident,), name=f"health-{ident}", daemon=True).start()

    def _health_check(self, ident: str) -> None:
        """A node that joins proves it can run a collective (here: with the supervisor) first."""
        node = self.node_of[ident]
        agent = self.agents.get(node)
        if agent is None:
            return
        prefix = keys.health_prefix(ident, time.time_ns())
        t0 = time.time()
        agent.send({"type": "health", "host": self.cfg.store_host, "port": self.cfg.store_port,
                    "prefix": prefix, "timeout": HEALTH_TIMEOUT_S})
        try:
            store = dist.TCPStore(self.cfg.store_host, self.cfg.store_port, is_master=False,
                                  timeout=dt.timedelta(seconds=HEALTH_TIMEOUT_S))
            ok_here = health_peer(store, prefix, HEALTH_TIMEOUT_S)
            result = agent.health.get(timeout=HEALTH_TIMEOUT_S)
            ok, detail = ok_here and bool(result.get("ok")), str(result.get("detail", ""))
        except Exception as err:  # noqa: BLE001 - any failure means "not healthy"
            ok, detail = False, f"{type(err).__name__}: {err}"
        self.log.emit("health_check", node=ident, slurm_node=node, ok=ok, seconds=time.time() - t0, detail=detail)
        with self._lock:
            if ident not in self.starting:
                return
            if ok:
                self._start_worker(ident)
            else:
                self.starting.discard(ident)
                self._exits.put((ident, Loss(ident, LossCause.JOIN_FAILED, f"health check failed: {detail}",
                                             time.time())))

    # ---- detection ---------------------------------------------------------------------------------

    def _lost(self, loss: Loss) -> None:
        """Report a loss once: to the coordinator as an exit, to the log with cause and timing."""
        fault = self.fault_at.get(loss.node)
        slurm = self.node_of.get(loss.node, loss.node)
        self.log.emit("node_lost", node=loss.node, slurm_node=slurm, cause=loss.cause, detail=loss.detail,
                      detection_seconds=(loss.t - fault) if fault else None, t=loss.t)
        self.log.emit("node", node=loss.node, slurm_node=slurm, state="lost", cause=loss.cause)
        agent = self.agents.get(slurm)
        if agent is not None:
            agent.send({"type": "stop"})  # fence: a stopped or stray worker must not come back into play
        if self.health is not None:
            self.health.forget(loss.node)
        self._exits.put((loss.node, loss))

    def _watch(self) -> None:
        self._store = dist.TCPStore(self.cfg.store_host, self.cfg.store_port, is_master=False,
                                    timeout=dt.timedelta(seconds=30))
        for ident, t in self.fault_at.items():
            self._store.set(keys.fault_time(ident), repr(t))
        next_slurm = next_nodes = next_ranks = 0.0
        gen = -1
        while not self._stop.wait(WATCH_S):
            now = time.time()
            with self._lock:
                for node, proc in list(self.sruns.items()):
                    code = proc.poll()
                    if code is not None:
                        del self.sruns[node]
                        loss = self.membership.srun_exited(self.id_of.get(node, node), code, now)
                        if loss:
                            self._lost(loss)
                for loss in self.membership.check(now):
                    self._lost(loss)
            gen = self._read_progress(gen, now)
            if self.health is not None:
                for evict in self.health.poll(self._store, now):
                    with self._lock:
                        loss = self.membership.evict(str(evict.node), LossCause(evict.cause), evict.detail, now)
                        if loss:
                            self._lost(loss)
            if now >= next_ranks:
                next_ranks = now + RANK_STEP_POLL_S
                self._read_rank_steps(now)
            if now >= next_slurm:
                next_slurm = now + SLURM_POLL_S
                self._poll_slurm(now)
            if now >= next_nodes:
                next_nodes = now + NODE_EVENT_S
                self._node_snapshot(now)

    def _read_progress(self, gen: int, now: float) -> int:
        assert self._store is not None
        try:
            current = int(self._store.get(keys.CURRENT_GEN)) if self._store.check([keys.CURRENT_GEN]) else 0
            key = keys.progress(current)
            step = int(self._store.get(key)) if self._store.check([key]) else -1
        except Exception:  # noqa: BLE001 - the store belongs to this process; a hiccup is retried
            return gen
        with self._lock:
            if current != gen:
                self.membership.restart_progress(now)
            self.membership.step(step, now)
        if self.drills and step >= 0:
            self._run_drills(step)
        return current

    def _read_rank_steps(self, now: float) -> None:
        """Each watched node's step: the smallest over its workers of the last step each reached a
        collective in (a node with one hung worker is behind its peers): names a hung rank's node."""
        assert self._store is not None
        with self._lock:
            watched = sorted(self.membership.watched)
        steps = {}
        for ident in watched:
            names = [keys.worker_step(w) for w in keys.node_workers(ident, self.cfg.workers_per_node)]
            try:
                if self._store.check(names):
                    steps[ident] = min(int(self._store.get(k)) for k in names)
            except Exception:  # noqa: BLE001 - retried at the next poll
                return
        with self._lock:
            for ident, step in steps.items():
                self.membership.node_step(ident, step, now)

    def _poll_slurm(self, now: float) -> None:
        with self._lock:
            watched = {self.node_of[i]: i for i in self.membership.watched if i in self.node_of}
        try:
            states = self.launcher.node_states(sorted(watched))
        except Exception as err:  # noqa: BLE001 - slurmctld unreachable: other paths still detect
            self.log.emit("slurm_unreachable", error=str(err))
            return
        if not states:
            return
        with self._lock:
            for node, health in states.items():
                if node in watched:
                    loss = self.membership.slurm_state(watched[node], health.state, health.usable, now)
                    if loss:
                        self._lost(loss)

    def _node_snapshot(self, now: float) -> None:
        with self._lock:
            for ident in sorted(self.membership.watched):
                if self.membership.is_lost(ident):
                    continue
                m = self._last_metrics.get(ident, {})
                age = self.membership.leases.age(ident, now) if ident in self.membership.leases.members() else None
                self.log.emit("node", node=ident, slurm_node=self.node_of.get(ident, ident), state="healthy",
                              heartbeat_age=age, cpu=m.get("cpu"), worker=node_worker_state(m.get("workers")),
                              workers=m.get("workers"))

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"type": "status", "members": list(self.members), "agents": sorted(self.agents),
                    "watched": sorted(self.membership.watched), "node_of": dict(self.node_of),
                    "requests": dict(self.requests), "agent_pids": {n: a.pid for n, a in self.agents.items()}}
