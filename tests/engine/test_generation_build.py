"""A generation's build order (engine/comm.py Generation): the world group first, then the previous
generation released, then the others; and an abandoned build stops at its next group. Real gloo groups,
two ranks in threads on one store.

Why: NCCL allocates each communicator's buffers outside torch's allocator, and a worker used to free
the old generation only after every group of the new one had formed (and warmed up), so a recovery
held two generations' communicators at once. Once the new world has formed every member has left the
old generation, so the old one can go first."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
import torch.distributed as dist
from exec_plans import make_plan
from rank_threads import on_ranks

from oobleck_slurm.engine.comm import BuildCancelled, Generation, communicators_per_rank, plan_groups
from oobleck_slurm.timeouts import JobTimeouts

TIMEOUTS = JobTimeouts(collective_timeout=30.0, step_timeout=60.0, connect_timeout=60.0)
PLAN = make_plan(6, [[0, 3, 6]], [2])  # one pipeline of 2 stages: world, pipe, the p2p edge, layers


def test_the_new_world_forms_first_then_the_previous_generation_is_released():
    store = dist.HashStore()
    store.set_timeout(dt.timedelta(seconds=60))
    old = on_ranks(2, lambda r: Generation(store, 0, r, 2, PLAN, TIMEOUTS))
    assert all(g.groups for g in old)
    new = on_ranks(2, lambda r: Generation(store, 1, r, 2, PLAN, TIMEOUTS, previous=old[r]))
    for g, previous in zip(new, old, strict=True):
        assert g.build_log[:2] == ["group world", "released generation 0"], g.build_log
        assert len(g.build_log) == 2 + len(g.groups) - 1  # every other group after the release
        assert previous.groups == {} and previous.pipeline is None  # released once, harmless twice
        previous.release()


def test_an_abandoned_build_stops_at_its_next_group_and_keeps_nothing():
    store = dist.HashStore()
    cancelled = threading.Event()
    cancelled.set()
    built: list = []
    with pytest.raises(BuildCancelled):
        Generation(store, 0, 0, 1, make_plan(6, [[0, 6]], [2]), TIMEOUTS, cancelled=cancelled, built=built)
    assert built == []


def test_a_batch_of_copies_is_posted_through_the_backends_own_coalescing_calls():
    # NCCL's batch (Generation.exchange) calls the backend's _start_coalescing/_end_coalescing, which
    # take no device (the ProcessGroup wrapper's do): the first multi-rank GPU run met a TypeError there.
    # gloo has the same Backend binding but no coalescing: reaching its "not implemented" proves the
    # call's arity is one the binding accepts.
    import torch

    from oobleck_slurm.engine.comm import coalesced
    from oobleck_slurm.engine.nccl_order import P2POp

    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, dt.timedelta(seconds=5))
    with pytest.raises(RuntimeError, match="does not implement startCoalescing"):
        coalesced(pg, [P2POp("send", torch.zeros(1), 0, 0)])


def test_plan_groups_name_one_p2p_group_per_edge_pair():
    """One communicator per pipeline edge pair, for both directions (was act/ and grad/ ones)."""
    assert plan_groups(PLAN, 2) == {"world": (0, 1), "pipe/0-1": (0, 1), "p2p/0-1": (0, 1)}
    assert communicators_per_rank(PLAN, 2) == [3, 3]
