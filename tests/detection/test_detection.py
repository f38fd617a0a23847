"""Detection logic on synthetic but realistic observations: it must find faults and stay quiet otherwise."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_slurm.detection import LeaseTable, MinderDetector, ProgressWatch, find_stragglers


def test_lease_expires_only_unrenewed_members() -> None:
    leases = LeaseTable(lease_s=3.0)
    for node in ("a", "b", "c"):
        leases.renew(node, now=0.0)
    leases.renew("a", now=2.5)
    leases.renew("b", now=2.9)
    assert leases.expired(now=3.0) == []
    assert leases.expired(now=3.5) == ["c"]
    assert leases.expired(now=6.0) == ["c", "a", "b"]  # oldest first
    leases.forget("c")
    assert leases.age("a", now=4.0) == pytest.approx(1.5)
    assert "c" not in leases.members()


def test_lease_ignores_out_of_order_renewals() -> None:
    leases = LeaseTable(lease_s=1.0)
    leases.renew("a", now=5.0)
    leases.renew("a", now=4.0)  # a late-delivered older heartbeat must not shorten the lease
    assert leases.expired(now=5.5) == []


def test_progress_watch_finds_the_stuck_worker() -> None:
    watch = ProgressWatch(step_timeout_s=10.0)
    for t in range(0, 30, 2):
        watch.report("w0", step=t // 2, now=float(t))
        watch.report("w1", step=min(t // 2, 4), now=float(t))  # stops advancing at step 4 (t=8)
    assert watch.hung(now=17.0) == []
    assert watch.hung(now=18.5) == ["w1"]
    watch.restart(now=20.0)
    assert watch.hung(now=25.0) == []


def test_straggler_is_found_from_compute_times_not_step_times() -> None:
    rng = np.random.default_rng(0)
    compute = {rank: list(0.10 + rng.normal(0, 0.003, 8)) for rank in range(8)}
    compute[5] = list(0.16 + rng.normal(0, 0.003, 8))
    assert find_stragglers(compute) == [5]
    assert find_stragglers({r: compute[r] for r in range(8) if r != 5}) == []


def cluster_samples(rng: np.random.Generator, nodes: int, steps: int, faulty: int | None, fault_from: int):
    """CPU %, network MB/s and step compute seconds, moving together like one job's nodes do."""
    for t in range(steps):
        phase = np.sin(t / 3.0)
        sample = {}
        for n in range(nodes):
            cpu = 80 + 10 * phase + rng.normal(0, 1.5)
            net = 900 + 100 * phase + rng.normal(0, 15)
            step = 0.5 + 0.05 * phase + rng.normal(0, 0.01)
            if n == faulty and t >= fault_from:  # e.g. a throttled GPU: less traffic, slower compute
                cpu, net, step = cpu - 25, net * 0.6, step * 1.4
            sample[f"node{n}"] = {"cpu": cpu, "net": net, "compute_s": step}
        yield t, sample


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), nodes=st.integers(4, 16))
def test_minder_stays_quiet_on_a_healthy_cluster(seed: int, nodes: int) -> None:
    detector = MinderDetector()
    rng = np.random.default_rng(seed)
    alarms = [detector.observe(sample) for _, sample in cluster_samples(rng, nodes, 60, None, 0)]
    assert alarms == [None] * 60


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), nodes=st.integers(4, 16), data=st.data())
def test_minder_finds_the_faulty_node_within_a_few_samples(seed: int, nodes: int, data) -> None:
    faulty = data.draw(st.integers(0, nodes - 1))
    detector = MinderDetector(window=8, continuity=4)
    rng = np.random.default_rng(seed)
    first_alarm = None
    for t, sample in cluster_samples(rng, nodes, 60, faulty, fault_from=20):
        alarm = detector.observe(sample)
        if alarm is not None:
            first_alarm = (t, alarm)
            break
    assert first_alarm is not None
    t, node = first_alarm
    assert node == f"node{faulty}"
    assert 20 <= t <= 20 + detector.window + detector.continuity


def test_minder_needs_continuity_not_a_single_spike() -> None:
    detector = MinderDetector(window=4, continuity=3)
    rng = np.random.default_rng(1)
    for t, sample in cluster_samples(rng, 6, 30, None, 0):
        if t == 15:
            sample["node2"] = {k: v * 3 for k, v in sample["node2"].items()}  # one glitchy reading
        assert detector.observe(sample) is None


def test_minder_forgets_evicted_nodes() -> None:
    detector = MinderDetector(window=4, continuity=2)
    rng = np.random.default_rng(2)
    found = None
    for _, sample in cluster_samples(rng, 5, 40, 3, fault_from=5):
        found = found or detector.observe(sample)
    assert found == "node3"
    detector.forget("node3")
    for _, sample in cluster_samples(rng, 5, 20, None, 0):
        sample.pop("node3")
        assert detector.observe(sample) is None
