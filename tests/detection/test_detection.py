"""Heartbeat leases and step progress (the metrics detector and stragglers: test_minder.py, test_straggler.py)."""

from __future__ import annotations

import pytest

from oobleck_slurm.detection import LeaseTable, ProgressWatch


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
