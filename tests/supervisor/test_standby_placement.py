"""Where the standby supervisor runs under Slurm (supervisor/main.py): pure decisions, no Slurm."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from oobleck_slurm.supervisor.main import failover_enabled, standby_in_allocation, standby_node


def recipe(nodes: int = 4, spares: int = 0, standby: bool = True, failover: bool = False) -> SimpleNamespace:
    supervisor = SimpleNamespace(standby=standby, failover=failover)
    return SimpleNamespace(cluster=SimpleNamespace(nodes=nodes, spare_nodes=spares, supervisor=supervisor))


@pytest.mark.parametrize(("nodes", "spares", "standby", "failover", "inside"), [
    (4, 0, True, False, True),
    (1, 1, True, False, True),  # the spare hosts it
    (1, 0, True, False, False),  # no second node: the batch host's loss is the whole job's
    (4, 0, False, False, False),
    (4, 0, True, True, False),  # one job per node: the standby is a job of its own
])
def test_the_standby_is_a_step_of_the_allocation_by_default(nodes: int, spares: int, standby: bool, failover: bool,
                                                           inside: bool) -> None:
    r = recipe(nodes, spares, standby, failover)
    assert standby_in_allocation("slurm", r) is inside
    assert not standby_in_allocation("local", r)
    assert failover_enabled("slurm", r) is (inside or failover)
    assert failover_enabled("local", r)


def test_the_standby_avoids_the_supervisors_node_lost_ones_and_prefers_spares() -> None:
    nodes = ["node1", "node2", "node3", "node4", "spare1"]
    assert standby_node(nodes, ["node1"]) == "spare1"
    assert standby_node(nodes[:4], ["node1"]) == "node4"
    assert standby_node(nodes[:4], ["node2", "node4", "node1"]) == "node3"  # after a takeover on node2
    assert standby_node(["node1"], ["node1"]) is None
