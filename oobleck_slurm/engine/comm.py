"""Generation: every process group of one membership generation, built straight on a shared store.

The TCPStore lives in a process that does no training (the launcher, later the supervisor), so a
worker's death never takes the store with it. Every group of generation g is a ProcessGroupGloo (or
NCCL) constructed directly on `PrefixStore(f"gen{g}/<name>", store)` by its members only: no global
`new_group` ordering, and a group that does not contain a dead rank keeps working. Dropping a
Generation and building the next one re-forms everything without restarting the process.

Groups are built in one global order (sorted by name) by every rank, skipping those it is not in:
each group's constructor waits for all its members, and a common order rules out a cycle of ranks
waiting on each other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from oobleck_slurm.engine.layout import ExecPlan, layer_groups


@dataclass(frozen=True)
class Timeouts:
    """Every timeout of the engine, in seconds. Ordered: collective < step < reconfiguration."""

    store: float = 60.0  # store connect / get
    connect: float = 120.0  # building a group: waits until every member has started (imports, builds)
    collective: float = 60.0  # any group operation afterwards: all-reduce, send/recv, barrier
    step: float = 300.0  # one training step (the supervisor's watchdog, not enforced by workers)
    run: float = 3600.0  # whole local run (the launcher)

    def td(self, name: str) -> dt.timedelta:
        return dt.timedelta(seconds=getattr(self, name))


def connect_store(host: str, port: int, timeouts: Timeouts) -> dist.TCPStore:
    """A client connection to the job's store (hosted elsewhere)."""
    return dist.TCPStore(host, port, is_master=False, timeout=timeouts.td("store"))


def make_group(store: dist.Store, prefix: str, rank: int, size: int, timeout: dt.timedelta,
               backend: str, connect_timeout: dt.timedelta) -> dist.ProcessGroup:
    """A process group of `size` members on its own store prefix; only members call this.

    Built under `connect_timeout` (members may still be starting), then every later operation
    runs under `timeout`."""
    pstore = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(pstore, rank, size, connect_timeout)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout  # NCCL connects lazily, on the first operation
        return dist.ProcessGroupNCCL(pstore, rank, size, opts)
    else:
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    pg.set_timeout(timeout)
    return pg


class Generation:
    """The groups of generation `number` for worker `rank` of `world_size` under `plan`.

    world:      all workers (p2p between pipeline neighbours, step metrics, state transfers)
    pipeline:   this rank's pipeline, if it has more than one stage (gradient-norm sum)
    layers:     for each set of ranks holding the same layers, one group (gradient all-reduce);
                `layer_group[layer]` = (group, rank's index in it)
    """

    def __init__(self, store: dist.Store, number: int, rank: int, world_size: int, plan: ExecPlan,
                 timeouts: Timeouts, backend: str = "gloo") -> None:
        self.number = number
        self.rank = rank
        self.world_size = world_size
        self.plan = plan
        self.timeouts = timeouts
        self.backend = backend
        timeout = timeouts.td("collective")
        wanted: dict[str, tuple[int, ...]] = {"world": tuple(range(world_size))}
        for p in plan.pipelines:
            if p.num_stages > 1:
                wanted["pipe/" + "-".join(map(str, p.ranks))] = tuple(p.ranks)
        by_members = layer_groups(plan)
        for members in by_members:
            wanted["layers/" + "-".join(map(str, members))] = members
        self.groups: dict[str, dist.ProcessGroup] = {}
        for name in sorted(wanted):
            members = wanted[name]
            if rank in members:
                self.groups[name] = make_group(
                    store, f"gen{number}/{name}", members.index(rank), len(members), timeout, backend,
                    timeouts.td("connect"),
                )
        self.world = self.groups["world"]
        role = plan.role(rank)
        self.pipeline = None
        if role is not None and role.num_stages > 1:
            self.pipeline = self.groups["pipe/" + "-".join(map(str, role.pipeline_ranks))]
        self.layer_group: dict[int, dist.ProcessGroup] = {}
        for members, layers in by_members.items():
            if rank in members:
                for layer in layers:
                    self.layer_group[layer] = self.groups["layers/" + "-".join(map(str, members))]

    def wait(self, work: dist.Work) -> None:
        """Wait for `work` at most the collective timeout (after which the group is dead)."""
        work.wait(self.timeouts.td("collective"))

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        return self.world.send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        return self.world.recv([tensor], src, tag)


@contextlib.contextmanager
def step_timeout_waits(gen: Generation) -> Iterator[None]:
    """Waits of `gen` under the step timeout (if longer than the collective one), for a state copy: it
    moves whole layers with their optimizer state to a newcomer that may still be warming up, and the
    collective timeout (seconds, sized for a step's all-reduce) made joins fail on a loaded machine."""
    saved = gen.timeouts
    gen.timeouts = dataclasses.replace(saved, collective=max(saved.collective, saved.step))
    try:
        yield
    finally:
        gen.timeouts = saved
