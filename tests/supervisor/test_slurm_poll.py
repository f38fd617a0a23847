"""The supervisor's steady-state Slurm query (`AgentNodes`' Slurm poller) against a real fake `scontrol`
(tests/fake_slurm.py): one RPC per slurm_node_poll, counted in `slurm_calls` events; a drain or
NOT_RESPONDING reported in `node` events and never a loss; DOWN a loss; a slurmctld that does not answer
reported (`slurm_unreachable`) and no loss either."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch.distributed as dist
from fake_slurm import FakeSlurm

from oobleck_slurm.cluster import slurm
from oobleck_slurm.cluster.jobdir import create_secret
from oobleck_slurm.cluster.slurm import NodeHealth
from oobleck_slurm.protocol.events import EventLog, read_events
from oobleck_slurm.supervisor.agent_nodes import AgentNodes, BackendConfig
from oobleck_slurm.supervisor.observer import StoreObserver
from oobleck_slurm.timeouts import JobTimeouts

# The real proportions, scaled down 50 times: a poll every 0.2 s (10 s), a report every 1.2 s (60 s).
TIMEOUTS = JobTimeouts(heartbeat_interval=1.0, heartbeat_lease=60.0, step_timeout=120.0,
                       reconfiguration_timeout=240.0, slurm_node_poll=0.2, slurm_calls_report=1.2,
                       slurm_command=0.5, slurm_retry_backoff=0.05)


class SlurmView:
    """A launcher whose agents start by themselves (as NodeJobLauncher's) and whose node states are
    the real client's answer."""

    def launch(self, node: str) -> None:
        return None

    def request(self, token: str) -> str | None:
        return None

    def lost(self, node: str) -> None:
        pass

    def node_states(self, nodes: Sequence[str]) -> dict[str, NodeHealth] | None:
        return slurm.query_nodes(list(nodes), timeouts=TIMEOUTS) if nodes else {}

    def close(self) -> None:
        pass


def records(states: dict[str, str]) -> str:
    return "".join(f"NodeName={n} State={s} Reason=(null)\n" for n, s in states.items())


@pytest.fixture
def watched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    fake = FakeSlurm(tmp_path / "bin", monkeypatch)
    fake.client("scontrol", records({f"node{i}": "ALLOCATED" for i in range(1, 5)}))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    events = tmp_path / "events.jsonl"
    (tmp_path / "logs").mkdir()
    members = [f"node{i}" for i in range(1, 5)]
    nodes = AgentNodes(create_secret(tmp_path), SlurmView(), EventLog(events), BackendConfig(  # type: ignore[arg-type]
        replacement="none", store_host="127.0.0.1", store_port=store.port, timeouts=TIMEOUTS),
        members=members, observer=StoreObserver(store, TIMEOUTS, workers_per_node=1))
    nodes.server.start()
    now = time.time()
    for node in members:
        nodes.membership.watch(node, now)
    nodes._watcher.start()  # watching the members, as once their workers started
    yield fake, nodes, events
    nodes._stop.set()
    nodes.server.stop()


def test_steady_state_costs_one_rpc_per_poll_and_reports_the_count(watched) -> None:
    from oobleck_slurm.cluster.slurm import client_calls

    fake, nodes, events = watched
    before = client_calls()  # the count is this process's: other tests of this pytest worker add to it
    t0 = time.monotonic()
    while len(reports := read_events(events, "slurm_calls")) < 2:  # two windows
        assert time.monotonic() - t0 < 30, "no slurm_calls events"
        time.sleep(0.05)
    elapsed = time.monotonic() - t0
    for report in reports:
        # One `scontrol show node` per slurm_node_poll (the query names all 4 nodes).
        assert report["window_calls"] <= report["window_s"] / TIMEOUTS.slurm_node_poll + 1, report
        added = {k: v - before.get(k, 0) for k, v in report["commands"].items() if v != before.get(k, 0)}
        assert set(added) == {"scontrol show"} and report["failed"] == before["failed"], (added, report)
    # Never faster than the poll period (slower only when this machine is loaded).
    assert 3 <= fake.calls("scontrol") <= elapsed / TIMEOUTS.slurm_node_poll + 2
    assert all(line == "show node -o node1,node2,node3,node4" for line in fake.log("scontrol"))


def test_drain_and_not_responding_are_reported_and_down_is_a_loss(watched) -> None:
    fake, nodes, events = watched
    fake.answer("scontrol", records({"node1": "MIXED+DRAIN+REBOOT_REQUESTED", "node2": "ALLOCATED*+NOT_RESPONDING",
                                     "node3": "DOWN*+NOT_RESPONDING", "node4": "ALLOCATED"}))
    deadline = time.monotonic() + 10
    while not read_events(events, "node_lost") and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(3 * TIMEOUTS.slurm_node_poll)
    lost = read_events(events, "node_lost")
    assert [(e["node"], e["cause"]) for e in lost] == [("node3", "slurm_down")]
    reported = {e["node"]: e["slurm_state"] for e in read_events(events, "node") if e.get("slurm_state")}
    assert reported["node1"] == "MIXED+DRAIN+REBOOT_REQUESTED" and reported["node2"] == "ALLOCATED*+NOT_RESPONDING"
    assert not nodes.membership.is_lost("node1") and not nodes.membership.is_lost("node2")


def test_a_controller_that_does_not_answer_is_reported_and_evicts_nobody(watched) -> None:
    fake, nodes, events = watched
    fake.client("scontrol", records({"node1": "DOWN"}), fail=10**6, how="sleep")
    t0 = time.monotonic()
    while not (unreachable := read_events(events, "slurm_unreachable")):
        assert time.monotonic() - t0 < 30, "no slurm_unreachable event"
        time.sleep(0.05)
    assert "answer is unknown" in unreachable[0]["error"]
    assert time.monotonic() - t0 >= 3 * TIMEOUTS.slurm_command  # every attempt waited its timeout
    assert read_events(events, "node_lost") == []
