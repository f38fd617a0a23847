"""Generation: every process group of one membership generation, built straight on a shared store.

One seam for both backends: gloo on CPUs, NCCL on GPUs (one worker per GPU). What differs is kept
here: NCCL groups are connected eagerly on the worker's device (no communicator is ever created in
the middle of a step, where a dead peer would pin the thread in NCCL's bootstrap), stage-to-stage
traffic goes through one 2-rank group per pipeline edge (shared/docs/nccl-notes.md, section 5), and
an aborted generation's NCCL groups are aborted (`abort_groups`), while gloo groups, which cannot be
aborted, are left to time out in the background (see abort.py). The environment NCCL workers get from
their agent is `NCCL_WORKER_ENV` in supervisor/agent.py.

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
from typing import cast

import torch
import torch.distributed as dist

from oobleck_slurm.engine.layout import ExecPlan, layer_groups
from oobleck_slurm.protocol import keys

# NCCL's own per-operation timeout: far above the job's collective timeout, which the generation's
# abortable waits enforce; the watchdog acting first would kill the process instead of the generation.
NCCL_PG_TIMEOUT_S = 1800.0

# What a failed collective raises: torch's distributed errors, and gloo's RuntimeErrors, whose messages
# name gloo's transport (`[.../gloo/transport/tcp/pair.cc:534] Connection closed by peer`) or a timeout.
COLLECTIVE_ERROR_MARKERS = ("gloo/", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
                            "Timed out waiting", "timed out", "Application timeout", "pair closure", "NCCL",
                            "ncclCommAbort", "aborted")


class CollectiveError(RuntimeError):
    """A group operation of a generation failed: a peer died or stalled, or the network failed. Raised
    by the generation's waits and group builds (abort.py) around whatever the backend raised."""


def is_collective_error(error: BaseException) -> bool:
    """True for the errors that a peer's failure or a network fault raise in a collective; anything
    else (a logic error in the engine) is a bug that must fail the worker loudly, not re-form the job.
    Errors from a generation's waits and group builds are CollectiveErrors by construction; torch's
    distributed errors, and gloo's RuntimeErrors raised when an operation is posted, by type and text."""
    if isinstance(error, (CollectiveError, dist.DistError)):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in COLLECTIVE_ERROR_MARKERS)


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
               backend: str, connect_timeout: dt.timedelta, device: torch.device | None = None) -> dist.ProcessGroup:
    """A process group of `size` members on its own store prefix; only members call this.

    gloo: built under `connect_timeout` (members may still be starting), then every later operation
    runs under `timeout`. NCCL: connected eagerly on `device` (the worker's GPU), under NCCL's own long
    timeout; the job's collective timeout is enforced by the generation's waits (abort.py)."""
    pstore = dist.PrefixStore(prefix, store)
    pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(pstore, rank, size, connect_timeout)
        pg.set_timeout(timeout)
    elif backend == "nccl":
        if device is None or device.type != "cuda":
            raise ValueError(f"an NCCL group needs the worker's CUDA device, got {device}")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = dt.timedelta(seconds=NCCL_PG_TIMEOUT_S)
        pg = dist.ProcessGroupNCCL(pstore, rank, size, opts)
        pg.eager_connect_single_device(device)
    else:
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    # torch's stubs derive ProcessGroupGloo/NCCL from Backend, which declares none of the operations
    # (allreduce, send, recv, barrier) these classes have at run time: ProcessGroup's interface does.
    return cast(dist.ProcessGroup, pg)


def abort_groups(groups: list[dist.ProcessGroup]) -> None:
    """Abort NCCL groups of a failed generation (every communicator, so no kernel stays queued);
    gloo groups have no abort (#130345) and are left to their timeouts."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from CPU builds of torch
    for pg in groups:
        if nccl is not None and isinstance(pg, nccl):
            pg.abort()


class Generation:
    """The groups of generation `number` for worker `rank` of `world_size` under `plan`.

    world:      all workers (step metrics; with gloo also p2p between pipeline neighbours and state
                transfers)
    edges:      NCCL only: one 2-rank group per pipeline edge, for the stage-to-stage p2p
    pipeline:   this rank's pipeline, if it has more than one stage (gradient-norm sum)
    layers:     for each set of ranks holding the same layers, one group (gradient all-reduce);
                `layer_group[layer]` = (group, rank's index in it)
    """

    def __init__(self, store: dist.Store, number: int, rank: int, world_size: int, plan: ExecPlan,
                 timeouts: Timeouts, backend: str = "gloo", device: torch.device | None = None) -> None:
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
            if backend == "nccl":
                for a, b in zip(p.ranks, p.ranks[1:]):
                    wanted[edge_name(a, b)] = (a, b)
        by_members = layer_groups(plan)
        for members in by_members:
            wanted["layers/" + "-".join(map(str, members))] = members
        self.groups: dict[str, dist.ProcessGroup] = {}
        for name in sorted(wanted):
            members = wanted[name]
            if rank in members:
                self.groups[name] = make_group(
                    store, keys.group_prefix(number, name), members.index(rank), len(members), timeout,
                    backend, timeouts.td("connect"), device,
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
        group, peer = self._p2p(dst)
        return group.send([tensor], peer, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        group, peer = self._p2p(src)
        return group.recv([tensor], peer, tag)

    def _p2p(self, peer: int) -> tuple[dist.ProcessGroup, int]:
        """The group and the peer's rank in it: the edge's own group on NCCL when there is one (no
        communicator made mid-step), else the world group."""
        name = edge_name(min(self.rank, peer), max(self.rank, peer))
        if self.backend == "nccl" and name in self.groups:
            return self.groups[name], int(peer > self.rank)
        return self.world, peer


def edge_name(a: int, b: int) -> str:
    """The group of the pipeline edge between ranks a < b (NCCL)."""
    return f"edge/{a}-{b}"


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
