"""The supervisor's health monitor (supervisor/health_monitor.py) on a real TCPStore and a real job
folder: metrics batches in, metrics.csv out, faulty machines and stragglers decided, recoveries and the
start not judged. Times are given, not waited for: each test runs in well under a second."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch.distributed as dist
from exec_plans import make_plan

from oobleck_slurm.agent.health import metrics_message
from oobleck_slurm.detection import read_metrics
from oobleck_slurm.detection.health import Evict, Rebalance
from oobleck_slurm.engine.checkpoint import layer_file
from oobleck_slurm.protocol import keys
from oobleck_slurm.protocol.events import EventLog, read_events
from oobleck_slurm.protocol.wire import ProtocolError
from oobleck_slurm.recipe.schema import DetectionConfig
from oobleck_slurm.supervisor.health_monitor import HealthMonitor, parse_metrics
from oobleck_slurm.supervisor.main import nodes_share_a_machine
from oobleck_slurm.supervisor.observer import StoreObserver, StoreView

NODES = ["node1", "node2", "node3", "node4"]
T0 = 1_800_000_000.0


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def publish(store: dist.TCPStore, gen: int, members: list[str], mb: list[int], first_step: int | None = 0) -> None:
    """What the coordinator and rank 0 write: a generation of 1-stage pipelines, its first step."""
    plan = make_plan(6, [[0, 6]] * len(members), mb)
    store.set(keys.config(gen), json.dumps({"generation": gen, "members": members, "plan": plan.to_json()}))
    store.set(keys.CURRENT_GEN, str(gen))
    if first_step is not None:
        store.set(keys.first_step(gen), json.dumps({"step": first_step, "t": 0.0}))


_observers: weakref.WeakKeyDictionary[dist.TCPStore, StoreObserver] = weakref.WeakKeyDictionary()


def look(store: dist.TCPStore) -> StoreView:
    """The store as the supervisor's store observer (one per store) reads it, now."""
    return _observers.setdefault(store, StoreObserver(store)).refresh()


def monitor(tmp_path: Path, checkpoint_interval: int = 0, **knobs) -> HealthMonitor:
    return HealthMonitor(DetectionConfig(**{"evict": True, **knobs}), tmp_path, EventLog(tmp_path / "events.jsonl"),
                         checkpoint_dir=str(tmp_path / "checkpoints"), checkpoint_interval=checkpoint_interval)


def sample(node: str, t: float, rss: float = 0.35, cpu: float = 50.0) -> list[tuple[float, str, float]]:
    return [(t, "procs.rss_gib", rss), (t, "procs.cpu_pct", cpu)]


def run_metrics(mon: HealthMonitor, store: dist.TCPStore, seconds: int, faulty: str | None = None,
                start: float = 0.0, leak_from: float = 20.0,
                levels: dict[str, float] | None = None) -> tuple[list[Evict], float | None]:
    """`seconds` of 1 s samples from every node (`faulty` leaks 50 MB/s from `leak_from`; `levels`:
    a node's memory and CPU relative to the others', its role's), polled as they would arrive;
    returns the evictions and when the first came."""
    evictions, first = [], None
    for i in range(int(start), int(start) + seconds):
        t = T0 + i
        for k, node in enumerate(NODES):
            rss = 0.35 + 0.002 * k + 0.0005 * ((i * 7 + k) % 3)
            level = (levels or {}).get(node, 1.0)
            rss *= level
            if node == faulty and i >= leak_from:
                rss += 0.05 * (i - leak_from + 1)
            batch = sample(node, t + 0.01 * k, rss, cpu=50.0 * level)
            mon.receive(node, parse_metrics(metrics_message(node, batch).samples))
        got = mon.poll(look(store), t + 0.5)
        if got and first is None:
            first = t + 0.5
        evictions += got
    return evictions, first


def test_batches_are_stored_as_detect_reads_them(tmp_path: Path, store: dist.TCPStore) -> None:
    publish(store, 0, NODES, [2, 2, 2, 2])
    mon = monitor(tmp_path)
    run_metrics(mon, store, 5)
    mon.close()
    trace = read_metrics(tmp_path / "metrics.csv")
    assert len(trace) == 5 * 4  # each node's own sample times
    assert all(set(s) <= set(NODES) and set(next(iter(s.values()))) == {"procs.rss_gib", "procs.cpu_pct"}
               for _, s in trace)


def test_the_stored_file_stays_readable_whatever_the_agents_send(tmp_path: Path, store: dist.TCPStore) -> None:
    # Two samples in one millisecond, and one from before the last (a clock stepped back): stored once.
    mon = monitor(tmp_path)
    for t in (T0 + 1.0, T0 + 1.0002, T0 + 0.5, T0 + 2.0):
        mon.receive("node1", sample("node1", t))
    mon.close()
    assert [t for t, _ in read_metrics(tmp_path / "metrics.csv")] == [T0 + 1.0, T0 + 2.0]


def test_a_leaking_node_is_evicted_with_its_evidence(tmp_path: Path, store: dist.TCPStore) -> None:
    publish(store, 0, NODES, [2, 2, 2, 2])
    mon = monitor(tmp_path)
    evictions, first = run_metrics(mon, store, 60, faulty="node3")
    (evict,) = evictions
    assert (evict.node, evict.cause) == ("node3", "faulty_metrics") and "procs.rss_gib" in evict.detail
    assert first is not None and first - (T0 + 20) <= 10  # 50 MB/s: flagged within seconds of the onset
    (event,) = read_events(tmp_path / "events.jsonl", "faulty_node")
    assert event["node"] == "node3" and event["action"] == "evict" and event["metrics"] == ["procs.rss_gib"]
    assert event["score"] >= 4.5
    health = read_events(tmp_path / "events.jsonl", "health")
    assert health and set(health[-1]["scores"]) == set(NODES) and health[-1]["metrics"]["node3"] == "procs.rss_gib"


def test_each_role_is_its_own_normal_under_every_plan(tmp_path: Path, store: dist.TCPStore) -> None:
    # Heterogeneous pipelines: node1 holds twice the layers of the others (twice the memory and CPU).
    publish(store, 0, NODES, [2, 2, 2, 2])
    mon = monitor(tmp_path)
    assert run_metrics(mon, store, 40, levels={"node1": 2.0})[0] == []
    # A new plan gives node2 that role instead (both nodes' microbatches change): both relearn, nobody
    # is flagged for the change.
    publish(store, 1, NODES, [1, 3, 2, 2])
    assert run_metrics(mon, store, 40, start=40, levels={"node2": 2.0})[0] == []
    # A leak that starts later is measured from the node's own role (relative to its level: 50 MB/s on
    # twice the memory counts as 25 MB/s would on one share, so it takes longer than the 10 s above).
    evictions, first = run_metrics(mon, store, 40, faulty="node2", start=80, leak_from=90, levels={"node2": 2.0})
    assert [e.node for e in evictions] == ["node2"] and first is not None and first - (T0 + 90) <= 20


def test_a_leak_under_way_is_not_learnt_as_normal_when_other_nodes_are_replanned(tmp_path: Path,
                                                                                 store: dist.TCPStore) -> None:
    # node3 leaks from t=20; at t=22 a rebalance moves microbatches between node1 and node2 only. node3's
    # work is the same, so its normal is the one learnt before the leak, and the leak is found as fast
    # as without the rebalance (node1 and node2 relearn, and are not flagged for their new share).
    publish(store, 0, NODES, [2, 2, 2, 2])
    mon = monitor(tmp_path)
    assert run_metrics(mon, store, 22, faulty="node3")[0] == []
    publish(store, 1, NODES, [3, 1, 2, 2])
    evictions, first = run_metrics(mon, store, 38, faulty="node3", start=22)
    assert [e.node for e in evictions] == ["node3"] and first is not None and first - (T0 + 20) <= 10


def test_report_only_when_eviction_is_off(tmp_path: Path, store: dist.TCPStore) -> None:
    publish(store, 0, NODES, [2, 2, 2, 2])
    mon = monitor(tmp_path, evict=False)
    evictions, _ = run_metrics(mon, store, 60, faulty="node3")
    assert evictions == []
    (event,) = read_events(tmp_path / "events.jsonl", "faulty_node")
    assert event["node"] == "node3" and event["action"] == "report"


@pytest.mark.parametrize("phase", ["starting", "recovering"])
def test_no_judgement_at_the_start_or_during_a_recovery(tmp_path: Path, store: dist.TCPStore, phase: str) -> None:
    # The leak begins at once and the job is starting (no first step yet) or recovering (gen 0 failed)
    # for 60 s: nothing is judged, however far node3 is from its peers.
    publish(store, 0, NODES, [2, 2, 2, 2], first_step=None if phase == "starting" else 0)
    if phase == "recovering":
        store.set(keys.failed(0), "{}")
    mon = monitor(tmp_path)
    assert run_metrics(mon, store, 60, faulty="node3", leak_from=0)[0] == []
    # Training again (a new generation, its first step done): judged again after one window.
    publish(store, 1, NODES, [2, 2, 2, 2])
    evictions, first = run_metrics(mon, store, 30, faulty="node3", start=60, leak_from=0)
    assert [e.node for e in evictions] == ["node3"] and first is not None and first >= T0 + 60 + 5


def test_no_judgement_while_a_checkpoint_is_written(tmp_path: Path, store: dist.TCPStore) -> None:
    # Only the first pipeline's nodes write a checkpoint: while they do, they differ from their peers.
    publish(store, 0, NODES, [2, 2, 2, 2])
    store.set(keys.progress(0), "49")  # step 49 done: the checkpoint of step 50 is being written
    mon = monitor(tmp_path, checkpoint_interval=50)
    assert run_metrics(mon, store, 60, faulty="node3", leak_from=0)[0] == []
    (tmp_path / "checkpoints" / "step50").mkdir(parents=True)
    for layer in range(6):  # every layer's file is there: the checkpoint is complete
        layer_file(tmp_path / "checkpoints", 50, f"layer{layer}").write_bytes(b"")
    evictions, first = run_metrics(mon, store, 30, faulty="node3", start=60, leak_from=0)
    assert [e.node for e in evictions] == ["node3"] and first is not None and first >= T0 + 60 + 5


def test_a_forgotten_node_is_not_judged(tmp_path: Path, store: dist.TCPStore) -> None:
    publish(store, 0, NODES, [2, 2, 2, 2])
    mon = monitor(tmp_path)
    run_metrics(mon, store, 15)
    mon.forget("node3")
    for i in range(15, 60):  # node3 stopped reporting (lost): the others are fine
        for k, node in enumerate(n for n in NODES if n != "node3"):
            mon.receive(node, sample(node, T0 + i, 0.35 + 0.001 * k))
        assert mon.poll(look(store), T0 + i + 0.5) == []


def step(store: dist.TCPStore, gen: int, s: int, compute: list[float]) -> None:
    store.set(keys.step_compute(gen), json.dumps({"step": s, "compute_seconds": compute}))


def run_steps(mon: HealthMonitor, store: dist.TCPStore, gen: int, steps: range, slow_rank: int | None,
              factor: float = 2.0, t0: float = T0, mb: tuple[int, ...] = (2, 2, 2, 2)) -> list[Evict]:
    """Steps whose compute seconds per rank (20 ms per microbatch, a little noise) rank 0 publishes."""
    out = []
    for s in steps:
        compute = [0.02 * mb[r] * (1 + 0.02 * ((s + r) % 3)) * (factor if r == slow_rank else 1.0) for r in range(4)]
        step(store, gen, s, compute)
        out += mon.poll(look(store), t0 + 0.1 * s)
    return out


def test_a_straggler_pipeline_is_rebalanced_by_default(tmp_path: Path, store: dist.TCPStore) -> None:
    publish(store, 0, NODES, [2, 2, 2, 2])
    mon = monitor(tmp_path, straggler_window=10)
    assert run_steps(mon, store, 0, range(1, 40), slow_rank=None) == [] and mon.rebalances() == []
    assert run_steps(mon, store, 0, range(40, 60), slow_rank=2, t0=T0) == []
    (decision,) = mon.rebalances()
    assert isinstance(decision, Rebalance) and set(decision.slowdown) == {"node3"}
    assert decision.slowdown["node3"] == pytest.approx(2.0, rel=0.1)
    (event,) = read_events(tmp_path / "events.jsonl", "straggler")
    assert event["action"] == "rebalance" and set(event["nodes"]) == {"node3"}
    # The first step of a generation is not timed; the first window of the rebalanced plan says it again
    # (the coordinator ignores a decision that does not change its plan).
    publish(store, 1, NODES, [3, 3, 1, 1], first_step=60)
    run_steps(mon, store, 1, range(60, 75), slow_rank=2, t0=T0 + 10, mb=(3, 3, 1, 1))
    assert [set(d.slowdown) for d in mon.rebalances()] == [{"node3"}]


def test_a_straggler_is_evicted_when_asked(tmp_path: Path, store: dist.TCPStore) -> None:
    publish(store, 0, NODES, [2, 2, 2, 2])
    mon = monitor(tmp_path, stragglers="evict", straggler_window=10)
    evictions = run_steps(mon, store, 0, range(1, 40), slow_rank=1, factor=1.6)
    assert [(e.node, e.cause) for e in evictions] == [("node2", "straggler")]
    assert mon.rebalances() == []


def test_stragglers_off_watches_nothing(tmp_path: Path, store: dist.TCPStore) -> None:
    publish(store, 0, NODES, [2, 2, 2, 2])
    mon = monitor(tmp_path, stragglers="off", straggler_window=10)
    assert run_steps(mon, store, 0, range(1, 40), slow_rank=1, factor=3.0) == []
    assert mon.rebalances() == [] and read_events(tmp_path / "events.jsonl", "straggler") == []


@pytest.mark.parametrize("message, field", [
    ({"samples": "x"}, "'samples'"),
    ({"samples": [[1.0, "m"]]}, "samples[0]"),
    ({"samples": [[1.0, "", 2.0]]}, "metric"),
    ({"samples": [[1.0, "m" * 101, 2.0]]}, "metric"),
    ({"samples": [["t", "m", 2.0]]}, "time"),
    ({"samples": [[1.0, "m", float("nan")]]}, "value"),
    ({"samples": [[1.0, "m", True]]}, "value"),
])
def test_a_bad_metrics_message_names_what_is_wrong(message: dict, field: str) -> None:
    with pytest.raises(ProtocolError, match="metrics") as err:
        parse_metrics(message.get("samples"))
    assert field in str(err.value)


def test_virtual_nodes_of_one_machine_send_no_machine_counters() -> None:
    assert nodes_share_a_machine("local", ["node1", "node2"])
    assert nodes_share_a_machine("slurm", ["localhost", "127.0.0.1"])  # the lab: every node is 127.0.0.1
    assert not nodes_share_a_machine("slurm", ["localhost"])
    assert not nodes_share_a_machine("slurm", ["no-such-node.invalid", "localhost"])  # unresolvable: no evidence
