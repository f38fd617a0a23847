"""Which Slurm node states are a loss: only the hard ones (DOWN, FAIL, powered down). A drain and
NOT_RESPONDING are advisory: `scontrol reboot ASAP`, a maintenance drain and a rolling slurmd restart
must never evict a healthy node. Every form scontrol (and sinfo) prints a state in."""

from __future__ import annotations

import pytest

from oobleck_slurm.cluster.slurm import NodeHealth, node_health, parse_scontrol_records, state_flags
from oobleck_slurm.supervisor.membership import LossCause, Membership

# (State= as printed, lost, advisory states reported)
STATES = [
    ("IDLE", False, ()),
    ("ALLOCATED", False, ()),
    ("MIXED", False, ()),
    ("COMPLETING", False, ()),
    ("ALLOCATED+COMPLETING", False, ()),
    ("ALLOCATED+DRAIN", False, ("DRAIN",)),
    ("MIXED+DRAIN", False, ("DRAIN",)),
    ("IDLE+DRAIN", False, ("DRAIN",)),
    ("DRAINING", False, ("DRAINING",)),
    ("DRAINED", False, ("DRAINED",)),
    ("MIXED+DRAIN+REBOOT_REQUESTED", False, ("DRAIN", "REBOOT_REQUESTED")),  # scontrol reboot ASAP
    ("ALLOCATED+DRAIN+MAINTENANCE+RESERVED", False, ("DRAIN", "MAINTENANCE")),
    ("IDLE*", False, ("NOT_RESPONDING",)),
    ("ALLOCATED*", False, ("NOT_RESPONDING",)),
    ("ALLOCATED*+NOT_RESPONDING", False, ("NOT_RESPONDING",)),
    ("ALLOCATED+NOT_RESPONDING", False, ("NOT_RESPONDING",)),
    ("MIXED*+DRAIN", False, ("DRAIN", "NOT_RESPONDING")),
    ("UNKNOWN*", False, ("NOT_RESPONDING", "UNKNOWN")),  # slurmctld restarted, slurmd not heard yet
    ("IDLE+POWER_DOWN", False, ("POWER_DOWN",)),  # requested, not begun: the job runs on
    ("DOWN", True, ()),
    ("DOWN*", True, ()),
    ("DOWN*+NOT_RESPONDING", True, ()),
    ("DOWN+DRAIN", True, ()),
    ("DOWN*+DRAIN+NOT_RESPONDING", True, ()),
    ("FAIL", True, ()),
    ("ALLOCATED+FAIL", True, ()),
    ("FAILING", True, ()),
    ("MIXED+FAILING", True, ()),
    ("IDLE+CLOUD+POWERED_DOWN", True, ()),
    ("IDLE+POWERING_DOWN", True, ()),
    ("IDLE~", True, ()),  # sinfo's mark for powered down
    ("IDLE%", True, ()),  # sinfo's mark for powering down
    ("FUTURE", True, ()),
    ("allocated+drain", False, ("DRAIN",)),  # case: scontrol prints upper case; nothing depends on it
]


@pytest.mark.parametrize(("state", "lost", "advisory"), STATES, ids=[s for s, _, _ in STATES])
def test_only_hard_states_are_lost(state: str, lost: bool, advisory: tuple[str, ...]) -> None:
    health = NodeHealth("n1", state, "")
    assert (health.lost, health.usable, health.advisory) == (lost, not lost, advisory)


@pytest.mark.parametrize(("state", "lost", "advisory"), STATES, ids=[s for s, _, _ in STATES])
def test_an_advisory_state_never_evicts_and_a_lost_one_does(state: str, lost: bool, advisory: tuple[str, ...]) -> None:
    m = Membership(lease_s=3.0, step_timeout_s=60.0)
    m.watch("n1", 0.0)
    health = NodeHealth("n1", state, "")
    loss = m.slurm_state("n1", health.state, health.usable, 1.0)
    if lost:
        assert loss is not None and loss.cause is LossCause.SLURM_DOWN and state in loss.detail
    else:
        assert loss is None and not m.is_lost("n1")


def test_a_drained_node_that_dies_is_still_named_by_its_heartbeats() -> None:
    """The job's own evidence detects a dead node whatever Slurm's view says."""
    m = Membership(lease_s=2.0, step_timeout_s=60.0)
    m.watch("n1", 0.0)
    for t in (0.5, 1.0, 1.5, 2.0):
        assert m.slurm_state("n1", "ALLOCATED*+DRAIN", NodeHealth("n1", "ALLOCATED*+DRAIN", "").usable, t) is None
        assert m.check(t) == []
    (loss,) = m.check(2.1)  # no heartbeat since 0.0: more than the lease
    assert loss.cause is LossCause.HEARTBEAT


def test_state_flags_spell_out_the_marks() -> None:
    assert state_flags("DOWN*+NOT_RESPONDING") == {"DOWN", "NOT_RESPONDING"}
    assert state_flags("IDLE~") == {"IDLE", "POWERED_DOWN"}
    assert state_flags("MIXED-") == {"MIXED"}  # planned: nothing to report


def test_scontrol_records_of_a_rolling_slurmd_restart() -> None:
    text = ("NodeName=g1 State=ALLOCATED*+NOT_RESPONDING Reason=(null)\n"
            "NodeName=g2 State=MIXED+DRAIN Reason=reboot requested [root@2026-01-01T00:00:00]\n"
            "NodeName=g3 State=DOWN*+NOT_RESPONDING Reason=Not responding [slurm@2026-01-01T00:05:00]\n")
    health = node_health(parse_scontrol_records(text))
    assert [n for n, h in health.items() if h.lost] == ["g3"]
    assert health["g2"].reason.startswith("reboot requested")
