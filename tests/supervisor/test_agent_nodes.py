"""`AgentNodes` over its real control server, with agents played by this test over real sockets in
protocol/messages.py's messages (no training): registration (refused when it must be), start, finish,
the losses a live agent reports, the fence, a spare's join through a real health check, and a peer
that sends what the supervisor does not take."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from oobleck_slurm.agent import preflight as health
from oobleck_slurm.cluster.jobdir import create_secret
from oobleck_slurm.protocol.events import EventLog, read_events
from oobleck_slurm.protocol.messages import (
    Health,
    HealthResult,
    Hello,
    Message,
    Register,
    Start,
    Stop,
    WorkerExit,
    parse,
)
from oobleck_slurm.protocol.wire import Channel, ProtocolError, connect
from oobleck_slurm.recipe.schema import PreflightConfig
from oobleck_slurm.supervisor.agent_nodes import AgentNodes, BackendConfig
from oobleck_slurm.supervisor.launchers import LocalLauncher
from oobleck_slurm.supervisor.membership import LossCause
from oobleck_slurm.supervisor.node_table import NodeState
from oobleck_slurm.supervisor.observer import StoreObserver
from oobleck_slurm.timeouts import JobTimeouts

IO_TIMEOUT_S = 10.0


def until(what: str, check: Callable[[], Any], timeout: float = IO_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not within {timeout} s")
        time.sleep(0.01)
    return found


class Backend:
    def __init__(self, tmp_path: Path, members: tuple[str, ...] | list[str] = ("node1", "node2"),
                 spares: tuple[str, ...] | list[str] = ("node3",), preflight: PreflightConfig | None = None,
                 requested: tuple[str, ...] = ()) -> None:
        self.job_dir, self.events = tmp_path, tmp_path / "events.jsonl"
        self.secret = create_secret(tmp_path)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.log = EventLog(self.events)
        (tmp_path / "logs").mkdir()
        timeouts = JobTimeouts(heartbeat_interval=1.0, heartbeat_lease=30.0, step_timeout=30.0)
        self.observer = StoreObserver(self.store, timeouts, workers_per_node=2)  # no training here: not started
        self.nodes = AgentNodes(self.secret, LocalLauncher(tmp_path), self.log, BackendConfig(
            replacement="spare", store_host="127.0.0.1", store_port=self.store.port, workers_per_node=2,
            threads_per_worker=3, timeouts=timeouts, preflight=preflight), members=list(members),
            observer=self.observer, spares=list(spares), requested=requested)
        self.nodes.server.start()

    def agent(self, node: str, message: Message | None = None) -> Channel:
        """An agent of `node` that sent `message` (default: its registration)."""
        channel = connect("127.0.0.1", self.nodes.port, self.secret, Hello(role="agent", node=node).to_dict())
        channel.sock.settimeout(IO_TIMEOUT_S)
        channel.send((message or Register(node=node, pid=1234)).to_dict())
        return channel

    def state(self, node: str) -> NodeState:
        return self.nodes.nodes[node].state

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return read_events(self.events, kind)


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[Backend]:
    b = Backend(tmp_path)
    yield b
    b.nodes.close()
    b.log.close()


def registered(b: Backend, node: str) -> Channel:
    channel = b.agent(node)
    until(f"{node} registered", lambda: b.nodes.nodes[node].agent is not None)
    return channel


def test_members_and_spares_register_then_a_member_starts_and_finishes(backend: Backend) -> None:
    agents = {n: registered(backend, n) for n in ("node1", "node2", "node3")}
    assert [backend.state(n) for n in ("node1", "node2", "node3")] == [NodeState.IDLE, NodeState.IDLE,
                                                                        NodeState.SPARE]
    status = backend.nodes.status()
    assert status.members == ("node1", "node2") and status.agents == ("node1", "node2", "node3")
    assert status.agent_pids == {"node1": 1234, "node2": 1234, "node3": 1234}
    assert status.states == {"node1": "idle", "node2": "idle", "node3": "spare"}

    backend.nodes.start("node1")  # a trusted member: its workers start at once
    assert parse(agents["node1"].recv()) == Start(node_id="node1", workers=2, threads=3, device="cpu")
    assert backend.state("node1") is NodeState.RUNNING and backend.nodes.status().watched == ("node1",)

    agents["node1"].send(WorkerExit(node="node1", node_id="node1", code=0).to_dict())
    assert until("the finish", backend.nodes.exited) == {"node1": None}
    assert backend.state("node1") is NodeState.FINISHED and backend.nodes.status().watched == ()


def test_a_failed_worker_loses_its_node_once_and_fences_it(backend: Backend) -> None:
    agent = registered(backend, "node2")
    backend.nodes.start("node2")
    assert isinstance(parse(agent.recv()), Start)
    backend.nodes.note_fault("node2", time.time(), "worker")
    agent.send(WorkerExit(node="node2", node_id="node2", code=9, worker=1).to_dict())
    (loss,) = until("the loss", backend.nodes.exited).values()
    assert (loss.node, loss.cause, loss.detail) == ("node2", LossCause.PROCESS_EXIT, "worker exited with code 9")
    assert parse(agent.recv()) == Stop()  # the fence
    (lost,) = backend.kinds("node_lost")
    assert lost["cause"] == "process_exit" and lost["detection_seconds"] >= 0
    # Lost is final: a late report, a start that raced with the report, a disconnect change nothing.
    agent.send(WorkerExit(node="node2", node_id="node2", code=0).to_dict())
    backend.nodes.start("node2")
    agent.close()
    until("the disconnect", lambda: backend.nodes.nodes["node2"].agent is None)
    assert backend.state("node2") is NodeState.LOST and backend.nodes.exited() == {}
    assert len(backend.kinds("node_lost")) == 1


def test_a_running_nodes_agent_going_away_is_agent_lost(backend: Backend) -> None:
    agent = registered(backend, "node1")
    backend.nodes.start("node1")
    assert isinstance(parse(agent.recv()), Start)
    agent.close()
    (loss,) = until("the loss", backend.nodes.exited).values()
    assert loss.cause is LossCause.AGENT_LOST and backend.state("node1") is NodeState.LOST


class AgentsSideOfCheck(threading.Thread):
    """The agent's side of a health check (agent.py runs it as a process): the real collective with the
    supervisor, on the store signed with the job folder's secret, in a thread; `code` is the check's exit
    code."""

    def __init__(self, check: Health, job_dir: Path) -> None:
        super().__init__()
        self.check, self.job_dir, self.code = check, job_dir, None
        self.start()

    def run(self) -> None:
        c = self.check
        self.code = health.main([c.host, str(c.port), c.prefix, str(c.timeout), str(self.job_dir)])


def answer_check(agent: Channel, node: str, job_dir: Path) -> None:
    """Play `node`'s agent through the health check it is sent next: the real collective, then its result."""
    check = parse(agent.recv())
    assert isinstance(check, Health)
    peer = AgentsSideOfCheck(check, job_dir)
    peer.join(IO_TIMEOUT_S)
    agent.send(HealthResult(node=node, prefix=check.prefix, ok=peer.code == 0, seconds=0.1).to_dict())


def test_a_spare_joins_through_a_real_health_check(backend: Backend) -> None:
    agent = registered(backend, "node3")
    assert backend.nodes.new_node() == "node3" and backend.state("node3") is NodeState.IDLE
    backend.nodes.start("node3")  # a spare is not trusted: checked first
    assert backend.state("node3") is NodeState.HEALTH_CHECK
    answer_check(agent, "node3", backend.job_dir)
    assert parse(agent.recv()) == Start(node_id="node3", workers=2, threads=3, device="cpu")
    assert backend.state("node3") is NodeState.RUNNING
    (checked,) = backend.kinds("health_check")
    assert checked["ok"] and checked["node"] == "node3"
    assert backend.nodes.new_node() is None  # no spare left
    assert backend.kinds("replacement_requested")[-1]["ok"] is False


@pytest.mark.parametrize("started_first", [True, False])
def test_a_replacement_started_before_a_takeover_is_checked_and_started_again(tmp_path: Path,
                                                                               started_first: bool) -> None:
    """After a takeover the join of r1 is pending (the durable state), but the lost supervisor had checked
    it and started its workers: its agent comes back saying they run under r1. This supervisor did not
    check it: its workers are stopped, it is checked, and started afresh, whether the coordinator's start
    of the pending join comes before its agent or after (in CI the agent was refused, and r1 never
    joined)."""
    b = Backend(tmp_path, spares=(), requested=("r1",))
    try:
        if started_first:
            b.nodes.start("r1")
            assert b.state("r1") is NodeState.AWAITING_AGENT
        agent = b.agent("r1-host", Register(node="r1-host", pid=4321, running="r1", workers=("sleeping",)))
        assert parse(agent.recv()) == Stop()  # the workers it started under the lost supervisor
        if not started_first:
            assert b.state("r1") is NodeState.IDLE
            b.nodes.start("r1")
        answer_check(agent, "r1-host", b.job_dir)
        assert parse(agent.recv()) == Start(node_id="r1", workers=2, threads=3, device="cpu")
        assert b.state("r1") is NodeState.RUNNING and not b.kinds("refused")
    finally:
        b.nodes.close()
        b.log.close()


def test_a_stopped_check_is_abandoned_and_a_failed_one_fails_the_join(backend: Backend) -> None:
    agent = registered(backend, "node3")
    backend.nodes.new_node()
    backend.nodes.start("node3")
    first = parse(agent.recv())
    assert isinstance(first, Health)
    first_peer = AgentsSideOfCheck(first, backend.job_dir)
    backend.nodes.stop(["node3"])  # a checkpoint fallback, say
    assert parse(agent.recv()) == Stop() and backend.state("node3") is NodeState.IDLE
    backend.nodes.start("node3")
    second = parse(agent.recv())
    assert isinstance(second, Health) and first.prefix != second.prefix
    first_peer.join(IO_TIMEOUT_S)
    # The first check passes, late: its result is ignored (the node was stopped meanwhile).
    agent.send(HealthResult(node="node3", prefix=first.prefix, ok=True, seconds=0.1).to_dict())
    until("the first check's end", lambda: backend.kinds("health_check"))
    assert backend.state("node3") is NodeState.HEALTH_CHECK
    second_peer = AgentsSideOfCheck(second, backend.job_dir)
    second_peer.join(IO_TIMEOUT_S)
    agent.send(HealthResult(node="node3", prefix=second.prefix, ok=False, seconds=0.1, detail="no GPU").to_dict())
    (loss,) = until("the failed join", backend.nodes.exited).values()
    assert (loss.cause, loss.detail) == (LossCause.JOIN_FAILED, "health check failed: no GPU")
    assert backend.state("node3") is NodeState.LOST
    assert [e["ok"] for e in backend.kinds("health_check")] == [True, False]


@pytest.mark.parametrize(("message", "reason"), [
    (Register(node="elsewhere"), "elsewhere is not a node of this job"),
    (Register(node="node5", replacement="r9"), "unknown or already bound replacement 'r9'"),
])
def test_registrations_that_are_refused(backend: Backend, message: Register, reason: str) -> None:
    channel = backend.agent(message.node, message)
    with pytest.raises((EOFError, OSError)):
        channel.recv()
    assert until("refused", lambda: [e for e in backend.kinds("refused") if e["reason"] == reason])


def test_a_second_agent_for_a_node_is_refused(backend: Backend) -> None:
    first = registered(backend, "node1")
    second = backend.agent("node1")
    with pytest.raises((EOFError, OSError)):
        second.recv()
    assert until("refused", lambda: [e for e in backend.kinds("refused") if "already has an agent" in e["reason"]])
    assert backend.nodes.nodes["node1"].agent is not None and backend.state("node1") is NodeState.IDLE
    first.send(WorkerExit(node="node1", node_id="node1", code=0).to_dict())  # the first one still talks


@pytest.mark.parametrize(("raw", "reason"), [
    ({"type": "start", "node_id": "node1"}, "the supervisor does not take start messages"),
    ({"type": "heartbeat", "node": "node1"}, "heartbeat message: missing field 't'"),
    ({"type": "register", "node": "node1", "pid": "12"}, "register message: field 'pid' must be an integer, got a string"),
])
def test_an_invalid_message_drops_the_peer(backend: Backend, raw: dict[str, Any], reason: str) -> None:
    channel = connect("127.0.0.1", backend.nodes.port, backend.secret, Hello(role="agent", node="node1").to_dict())
    channel.sock.settimeout(IO_TIMEOUT_S)
    channel.send(raw)
    with pytest.raises((EOFError, OSError, ProtocolError)):
        channel.recv()
    assert until("refused", lambda: [e for e in backend.kinds("refused") if reason in e["reason"]])


# ---- pre-flight (detection/preflight.py) ---------------------------------------------------------

class MeasuringAgent(threading.Thread):
    """The agent's side of a pre-flight check: the real child (collective, link rounds with the
    supervisor, matmul) in a thread; `result` is the HealthResult the agent would send, its figures
    scaled by `slowdown` where the test plays a slow node's agent."""

    def __init__(self, node: str, check: Health, job_dir: Path, slowdown: float = 1.0) -> None:
        super().__init__()
        self.node, self.check, self.job_dir, self.slowdown = node, check, job_dir, slowdown
        self.result: HealthResult | None = None
        self.start()

    def run(self) -> None:
        c = self.check
        assert c.measure and (c.threads, c.device, c.devices) == (3, "cpu", 2)
        out = io.StringIO()
        code = health.main([c.host, str(c.port), c.prefix, str(c.timeout), str(self.job_dir), "1", c.device,
                            str(c.devices)], out)
        figures, detail = health.parse_figures(out.getvalue())
        self.result = HealthResult(node=self.node, prefix=c.prefix, ok=code == 0, seconds=0.1, detail=detail,
                                   figures={k: v / self.slowdown for k, v in figures.items()})


@pytest.fixture
def preflight_backend(tmp_path: Path) -> Iterator[Backend]:
    b = Backend(tmp_path, members=["node1", "node2", "node3"], spares=["node4"],
                preflight=PreflightConfig())
    yield b
    b.nodes.close()
    b.log.close()


def test_at_the_start_a_slow_member_is_refused_and_the_others_start(preflight_backend: Backend) -> None:
    b = preflight_backend
    b.nodes._start_checks = {n: None for n in ("node1", "node2", "node3")}  # what launch_agents sets
    agents = {n: registered(b, n) for n in ("node1", "node2", "node3")}
    checks = {n: parse(a.recv()) for n, a in agents.items()}  # each measured from its registration
    for node in ("node1", "node2"):
        b.nodes.start(node)  # the coordinator's start may come before the verdicts: the workers wait
        assert b.state(node) is NodeState.HEALTH_CHECK
    peers = {n: MeasuringAgent(n, c, b.job_dir) for n, c in checks.items()}  # type: ignore[arg-type]
    for peer in peers.values():
        peer.join(IO_TIMEOUT_S * 3)
        assert peer.result is not None and peer.result.ok, peer.result
    # Three real checks ran (collective, link rounds, matmul) in threads of this one process, which share
    # its cores: each agent reports node1's figures (node3's a quarter of them), so the verdict is the
    # test's and not this machine's noise.
    base = peers["node1"].result.figures  # type: ignore[union-attr]
    for node, peer in peers.items():
        scale = 4.0 if node == "node3" else 1.0
        assert peer.result is not None and set(peer.result.figures) == set(base)
        agents[node].send(replace(peer.result, figures={k: v / scale for k, v in base.items()}).to_dict())
    for node in ("node1", "node2"):
        assert parse(agents[node].recv()) == Start(node_id=node, workers=2, threads=3, device="cpu")
    verdicts = {e["node"]: e for e in until("three verdicts", lambda: len(b.kinds("preflight")) == 3 and b.kinds("preflight"))}
    assert {n: e["admitted"] for n, e in verdicts.items()} == {"node1": True, "node2": True, "node3": False}
    assert all(e["at"] == "start" and set(e["figures"]) == {"matmul_gflops", "link_mib_s"} for e in verdicts.values())
    assert "matmul" in verdicts["node3"]["reason"] and "fleet's median" in verdicts["node3"]["reason"]
    assert b.state("node3") is NodeState.IDLE  # decided; its start uses the verdict
    b.nodes.start("node3")
    (loss,) = until("the refused member's loss", b.nodes.exited).values()
    assert loss.cause is LossCause.JOIN_FAILED and loss.detail.startswith("pre-flight check: ") and "matmul" in loss.detail
    assert b.state("node3") is NodeState.LOST
    assert set(b.nodes.fleet) == {"node1", "node2"}  # the admitted: the fleet a join is judged against


def answer_checks(b: Backend, agents: dict[str, Channel]) -> None:
    """Play the agents of `agents` through their start checks, each reporting this machine's figures."""
    checks = {n: parse(a.recv()) for n, a in agents.items()}
    peers = {n: MeasuringAgent(n, c, b.job_dir) for n, c in checks.items()}  # type: ignore[arg-type]
    for node, peer in peers.items():
        peer.join(IO_TIMEOUT_S * 3)
        assert peer.result is not None and peer.result.ok, peer.result
        agents[node].send(peer.result.to_dict())


def test_a_member_whose_agent_goes_away_during_its_check_does_not_hold_the_start(preflight_backend: Backend) -> None:
    """node3's agent closes its connection on receiving its check: its check fails at once and the
    others start, not after its check's waits (health_check_timeout, a minute) run out."""
    b = preflight_backend
    b.nodes._start_checks = {n: None for n in ("node1", "node2", "node3")}  # what launch_agents sets
    agents = {n: registered(b, n) for n in ("node1", "node2", "node3")}
    for node in ("node1", "node2", "node3"):
        b.nodes.start(node)
    gone = agents.pop("node3")
    parse(gone.recv())
    gone.close()
    answer_checks(b, agents)
    for node in ("node1", "node2"):
        assert parse(agents[node].recv()) == Start(node_id=node, workers=2, threads=3, device="cpu")
    verdicts = {e["node"]: e for e in until("three verdicts", lambda: len(b.kinds("preflight")) == 3 and b.kinds("preflight"))}
    assert not verdicts["node3"]["admitted"] and "went away" in verdicts["node3"]["reason"], verdicts["node3"]
    (loss,) = until("node3's failed start", b.nodes.exited).values()
    assert loss.node == "node3" and loss.cause is LossCause.JOIN_FAILED


def test_a_start_check_still_out_at_the_deadline_fails_and_the_others_start(preflight_backend: Backend) -> None:
    """node3's agent takes its check and never answers: past the start's deadline (START_CHECK_WAITS x
    health_check_timeout after the agents registered; here passed by hand) its check fails and the
    others start, whatever holds node3's check."""
    b = preflight_backend
    b.nodes._start_checks = {n: None for n in ("node1", "node2", "node3")}  # what launch_agents sets
    agents = {n: registered(b, n) for n in ("node1", "node2", "node3")}
    silent = agents.pop("node3")
    parse(silent.recv())  # its check: never run
    answer_checks(b, agents)
    for node in ("node1", "node2", "node3"):
        b.nodes.start(node)
    time.sleep(0.5)  # the two results are in: nothing starts while node3's check is out
    assert [b.state(n) for n in ("node1", "node2")] == [NodeState.HEALTH_CHECK] * 2 and not b.kinds("preflight")
    with b.nodes._lock:  # what the watcher does every period once the deadline passed
        b.nodes._start_deadline = 0.0
        b.nodes._start_checks_overdue(time.time())
    for node in ("node1", "node2"):
        assert parse(agents[node].recv()) == Start(node_id=node, workers=2, threads=3, device="cpu")
    verdicts = {e["node"]: e for e in b.kinds("preflight")}
    assert not verdicts["node3"]["admitted"] and "no result within 180 s" in verdicts["node3"]["reason"]
    (loss,) = until("node3's failed start", b.nodes.exited).values()
    assert loss.node == "node3" and loss.cause is LossCause.JOIN_FAILED


@pytest.mark.parametrize("slowdown", [1.0, 4.0])
def test_a_joining_node_is_judged_against_the_fleet(preflight_backend: Backend, slowdown: float) -> None:
    b = preflight_backend
    agent = registered(b, "node4")
    # The fleet as the start measured it (CPU figures of this machine, from a first real measurement)
    assert b.nodes.new_node() == "node4"
    b.nodes.start("node4")
    check = parse(agent.recv())
    peer = MeasuringAgent("node4", check, b.job_dir, slowdown)  # type: ignore[arg-type]
    peer.join(IO_TIMEOUT_S * 3)
    assert peer.result is not None and peer.result.ok
    measured = {k: v * slowdown for k, v in peer.result.figures.items()}
    b.nodes.fleet = {f"node{i}": measured for i in (1, 2, 3)}
    agent.send(peer.result.to_dict())
    (verdict,) = until("the verdict", lambda: b.kinds("preflight"))
    (checked,) = until("the health check", lambda: b.kinds("health_check"))
    assert verdict["at"] == "join" and verdict["admitted"] == (slowdown == 1.0)
    assert verdict["figures"]["matmul_gflops"] > 0 and verdict["figures"]["link_mib_s"] > 0
    assert checked["ok"] == (slowdown == 1.0)
    if slowdown == 1.0:
        assert parse(agent.recv()) == Start(node_id="node4", workers=2, threads=3, device="cpu")
        assert b.state("node4") is NodeState.RUNNING and "node4" in b.nodes.fleet
    else:
        assert checked["detail"].startswith("pre-flight check: ") and "0.25 x the fleet's median" in checked["detail"]
        (loss,) = until("the refused join", b.nodes.exited).values()
        assert loss.cause is LossCause.JOIN_FAILED and b.state("node4") is NodeState.LOST
