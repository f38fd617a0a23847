"""The supervisor's loss decisions (pure): first evidence wins, each loss once, hangs need a culprit."""

from __future__ import annotations

from oobleck_slurm.supervisor.membership import Membership


def test_each_path_reports_a_loss_once_with_its_cause() -> None:
    m = Membership(lease_s=2.0, step_timeout_s=5.0)
    for n in ("a", "b", "c", "d", "e"):
        m.watch(n, 0.0)
    assert m.agent_lost("a", 0.1).cause == "agent_lost"
    assert m.srun_exited("a", 0, 0.2) is None  # already lost: reported once
    assert m.srun_exited("b", 1, 0.3).cause == "srun_exit"
    assert m.slurm_state("c", "IDLE", True, 0.4) is None
    assert m.slurm_state("c", "DOWN*", False, 0.4).cause == "slurm_down"
    assert m.worker_exited("d", 0, 0.5) is None  # a clean exit is not a loss
    assert m.worker_exited("d", -9, 0.5).cause == "process_exit"
    m.heartbeat("e", 1.0)
    assert m.check(2.9) == []
    (loss,) = m.check(3.1)
    assert (loss.node, loss.cause) == ("e", "heartbeat")
    assert m.agent_lost("unknown", 1.0) is None  # never watched: not ours to lose


def test_a_stall_blames_only_a_stopped_worker_and_a_new_generation_restarts_the_clock() -> None:
    m = Membership(lease_s=100.0, step_timeout_s=5.0)
    for n in ("a", "b"):
        m.watch(n, 0.0)
    m.step(3, 0.0)
    m.heartbeat("a", 6.0, "sleeping")
    m.heartbeat("b", 6.0, "sleeping")
    assert m.progress.hung(6.0) and m.check(6.0) == []  # stalled, but nobody is to blame: no false eviction
    m.restart_progress(6.0)
    m.heartbeat("b", 10.0, "stopped")
    assert m.check(10.0) == []  # within the step timeout of the new generation
    (loss,) = m.check(11.5)
    assert (loss.node, loss.cause) == ("b", "hung")


def test_a_worker_stopped_longer_than_the_lease_is_hung_without_waiting_for_the_step_timeout() -> None:
    m = Membership(lease_s=2.0, step_timeout_s=60.0)
    for n in ("a", "b"):
        m.watch(n, 0.0)
    m.heartbeat("a", 1.0, "stopped")
    m.heartbeat("b", 1.0, "stopped")
    m.heartbeat("a", 2.0, "stopped")
    m.heartbeat("b", 2.0, "sleeping")  # SIGCONT before the lease: its clock starts again
    m.heartbeat("a", 2.9, "stopped")
    m.heartbeat("b", 2.9, "stopped")
    assert m.check(2.9) == []
    (loss,) = m.check(3.1)  # a: stopped since 1.0, more than the lease; no stall needed
    assert (loss.node, loss.cause) == ("a", "hung") and "stopped for 2.10 s" in loss.detail
    m.heartbeat("b", 4.0, "stopped")
    assert m.check(4.0) == []  # b: stopped since 2.9 only
    assert [(loss.node, loss.cause) for loss in m.check(5.0)] == [("b", "hung")]
    assert m.check(9.0) == []  # each loss once


def test_a_node_that_comes_back_is_watched_afresh() -> None:
    m = Membership(lease_s=1.0, step_timeout_s=5.0)
    m.watch("a", 0.0)
    assert m.agent_lost("a", 0.5)
    m.watch("a", 10.0)
    assert not m.is_lost("a") and m.check(10.5) == []


def test_a_supervisor_that_was_not_running_gives_every_node_a_fresh_lease() -> None:
    # A supervisor stopped or starved of CPU for longer than half a lease read no heartbeat meanwhile:
    # its leases ran out through its own silence. It judges nobody then, and each node gets a new lease.
    m = Membership(lease_s=2.0, step_timeout_s=60.0)
    for n in ("a", "b"):
        m.watch(n, 0.0)
    m.heartbeat("a", 0.4, "stopped")  # a's worker stopped at 0.4: hung after a lease, normally
    assert m.check(0.5) == []
    assert m.check(5.0) == []  # 4.5 s without a check: everyone's lease expired, and a's stop too
    losses = []
    t = 5.0
    while not losses:  # checked every 0.1 s from now on; b talks again, a stays silent
        t = round(t + 0.1, 1)
        m.heartbeat("b", t)
        losses = m.check(t)
    assert t == 7.1 and sorted((loss.node, loss.cause) for loss in losses) == [("a", "heartbeat")]
