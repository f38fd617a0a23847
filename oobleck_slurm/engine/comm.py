"""Generation: every process group of one membership generation, built straight on a shared store.

One seam for both backends: gloo on CPUs, NCCL on GPUs (one worker per GPU). Every group of
generation g is constructed directly on `PrefixStore("gen{g}/<name>", store)` by its members only: no
global `new_group` ordering, and a group without a dead rank keeps working. Dropping a Generation and
building the next one re-forms everything without restarting the process.

The TCPStore lives in the supervisor, which does no training, so a worker's death never takes the
store with it. Groups are built (and warmed up) in one global order, sorted by name, by every rank,
skipping those it is not in: each group's constructor waits for all its members, and a common order
rules out a cycle of ranks waiting on each other.

What differs between the backends stays here (docs/nccl.md): NCCL groups are connected eagerly on the
worker's device and warmed up, so no communicator connects in the middle of a step; stage-to-stage
traffic uses one 2-rank group per edge, its crossing send and receive posted as one batch (`batch`);
plan-change copies are one batch; a generation's communicators are aborted together. gloo groups cannot be aborted, so they are left to their timeouts
and dropped by a reaper thread. With OOBLECK_NCCL_ORDER=1 the gloo groups keep NCCL's ordering rules
(nccl_order.py), so that the CPU tests catch what would deadlock on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from oobleck_slurm.engine import nccl_order
from oobleck_slurm.engine.layout import ExecPlan, edge_pieces, reduce_groups
from oobleck_slurm.engine.nccl_order import OrderedGroup, P2POp
from oobleck_slurm.errors import InfrastructureError
from oobleck_slurm.protocol import keys, signed_store
from oobleck_slurm.protocol.events import EventLog
from oobleck_slurm.protocol.signed_store import SignedStore
from oobleck_slurm.timeouts import JobTimeouts

# NCCL's own per-operation timeout: far above the job's collective timeout, which the generation's
# abortable waits enforce; the watchdog acting first would kill the process instead of the generation.
NCCL_PG_TIMEOUT_S = 1800.0

# What a failed collective raises: torch's distributed errors, and gloo's RuntimeErrors, whose messages
# name gloo's transport (`[.../gloo/transport/tcp/pair.cc:534] Connection closed by peer`) or a timeout.
COLLECTIVE_ERROR_MARKERS = ("gloo/", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
                            "Timed out waiting", "timed out", "Application timeout", "pair closure", "NCCL",
                            "ncclCommAbort", "aborted")


class BuildCancelled(InfrastructureError, RuntimeError):
    """A generation's build that its worker abandoned (the generation failed while its groups formed)
    stopped at its next group, its groups aborted."""


class CollectiveError(InfrastructureError, RuntimeError):
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


def connect_store(host: str, port: int, timeouts: JobTimeouts, secret: bytes, log: EventLog | None,
                  reader: str) -> SignedStore:
    """A client connection to the job's store (hosted elsewhere), signed with the job secret; what it
    refuses is reported to `log` as seen by `reader` (protocol/signed_store.py)."""
    return signed_store.connect(host, port, timeouts.td("store_timeout"), secret, log, reader,
                                timeouts.forged_value_poll)


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


ABORT_JOIN_S = 30.0  # how long aborting a generation's NCCL communicators may take before we go on


def abort_groups(groups: list[Group]) -> None:
    """Abort the NCCL communicators of a generation all at once, one thread each: aborting them one by
    one can hang while kernels are still pending on the others (docs/nccl.md, "Aborting"). gloo groups
    have no abort that unblocks a waiter (#130345): they are left to their timeouts."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from CPU builds of torch
    threads = [threading.Thread(target=pg.abort, daemon=True, name="abort-communicator")
               for pg in groups if nccl is not None and isinstance(pg, nccl)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + ABORT_JOIN_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


# gloo's reduce-scatter costs about twice an all-reduce of its whole input on CPUs (4 ranks, 6.8 MB:
# 7.3 against 3.4 ms of CPU a call, 29 against 14 ms), and its flat form (reduce_scatter_tensor) is an
# all-reduce of a copy of the input: where the input may be overwritten (a stage's gradients, shard.py)
# gloo all-reduces it in place instead, the same bits without the copy. NCCL's is the cheaper one. The
# NCCL ordering mode takes NCCL's branch on gloo (`Generation.scatter_by_allreduce`), so that the CPU
# tests run it.
SCATTER_BY_ALLREDUCE = {"gloo": True, "nccl": False}
# NCCL groups are also warmed up with a message of this size (Generation._warm_up): twice NCCL's default
# buffer (NCCL_BUFFSIZE, 4 MiB), so that the algorithm and protocol of a layer-sized message connect then.
WARM_UP_LARGE_BYTES = 8 * 2**20
# A step's wait may take the collective timeout beyond this many times the generation's longest step
# (Generation.wait_timeout): a step's own waits never exceed its wall time; the factor absorbs jitter.
WAIT_STEP_FACTOR = 2.0


class Group(Protocol):
    """The operations the engine runs on a group: a torch ProcessGroup, or an OrderedGroup (gloo with
    NCCL's ordering rules, nccl_order.py)."""

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> dist.Work: ...
    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]]) -> dist.Work: ...
    # the flat forms (all_gather_into_tensor, reduce_scatter_tensor): no flat copy of the whole buffer
    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor) -> dist.Work: ...
    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: dist.ReduceScatterOptions) -> dist.Work: ...
    def barrier(self) -> dist.Work: ...
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work: ...
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work: ...


class Generation:
    """The groups of generation `number` for worker `rank` of `world_size` under `plan`.

    world:      all workers: step metrics, and the batched state copies of a plan change (`exchange`)
    p2p/a-b:    per pipeline edge, stage a's activations to stage b and b's gradients back to a, on one
                communicator. 1F1B's crossing transfers (a sends activation m+k and then receives
                gradient m, while b sends gradient m and then receives activation m+k) are posted as
                one batch at each end (`batch`), one kernel that progresses both: on NCCL, where a
                communicator runs its operations in order, a large send completes only once the peer
                has posted its receive, and a device runs a limited number of kernels at once, two
                sends waiting for receives posted behind them (on one communicator, or on two that
                hold the device) would deadlock (docs/nccl.md). Between wide stages: one pair per
                overlap of the two stages' sample ranges (layout.edge_pieces).
    stage:      this rank's stage, if wider than one rank (parameter all-gathers, gradient
                reduce-scatters, checkpoint gathers)
    pipeline:   every rank of this rank's pipeline, if more than one (gradient-norm sum)
    layers:     for each set of ranks all-reducing the same layer pieces, one group (gradient
                all-reduce); `piece_group[(layer, piece)]` = that group, `layer_group[layer]` the
                group of the layer's piece this rank holds first

    Every group is warmed up with one small operation (an edge's: one in each direction) when it is
    built, in the build's common order:
    NCCL connects its transports at a communicator's first operation, and that must not happen in the
    middle of a step, where a dead peer would block it in a call nothing can interrupt.
    """

    def __init__(self, store: dist.Store, number: int, rank: int, world_size: int, plan: ExecPlan,
                 timeouts: JobTimeouts, backend: str = "gloo", device: torch.device | None = None,
                 previous: Generation | None = None, cancelled: threading.Event | None = None,
                 built: list[Group] | None = None) -> None:
        self.number = number
        self.build_log: list[str] = []  # the build's order of events (groups formed, previous released)
        self.rank = rank
        self.world_size = world_size
        self.plan = plan
        self.timeouts = timeouts
        # The longest step of this generation so far (None before its first): bounds a step's waits.
        self.longest_step_s: float | None = None
        self._unbounded_next = False  # the next step follows extra work on some rank (evaluation, checkpoint)
        self.backend = backend
        self.device = device or torch.device("cpu")
        # Kept while the groups live: a store written in Python (SignedStore) answers the C++ groups' calls
        # only while its Python object exists (pybind11), and NCCL may connect a communicator lazily.
        self.store = store
        # A gloo group's own operation timeout is the longer step timeout: the generation's waits enforce
        # the collective timeout themselves (`wait`), and the waits that may take longer (a state copy
        # to a newcomer, `AbortableGeneration.align`) raise theirs. gloo bounds a collective by the
        # group's timeout whatever its waiter allows.
        timeout = dt.timedelta(seconds=max(timeouts.collective_timeout, timeouts.step_timeout))
        wanted = plan_groups(plan, world_size)
        by_members = reduce_groups(plan)
        ordered = backend == "gloo" and nccl_order.enabled()
        # the ordering mode's device: one per rank and generation (an aborted generation's kernels leave it)
        self.slots = nccl_order.Slots(nccl_order.slot_limit()) if ordered else None
        # how a stage's gradients are reduce-scattered (shard.py): NCCL's way in the mode that imitates it
        self.scatter_by_allreduce = SCATTER_BY_ALLREDUCE[backend] and not ordered
        self.groups: dict[str, Group] = {}
        self._members: dict[str, tuple[int, ...]] = {}
        built = built if built is not None else []  # shared with build_generation: aborted if abandoned
        # The world first, in every member: once it has formed, every member has left the previous
        # generation, so its communicators are freed before this one's others allocate theirs (a
        # recovery never holds two generations' NCCL buffers, which are outside torch's allocator).
        for name in ["world", *sorted(n for n in wanted if n != "world")]:
            members = wanted[name]
            if cancelled is not None and cancelled.is_set():
                abort_groups(built)
                raise BuildCancelled(f"generation {number}: the build was abandoned (its generation failed)")
            if rank in members:
                pg = make_group(store, keys.group_prefix(number, name), members.index(rank), len(members),
                                timeout, backend, timeouts.td("connect_timeout"), device)
                built.append(cast(Group, pg))
                self.groups[name] = OrderedGroup(pg, name, self.slots) if ordered else cast(Group, pg)
                self._members[name] = members
                self.build_log.append(f"group {name}")
            if name == "world" and previous is not None:
                previous.release(wait=True)
                self.build_log.append(f"released generation {previous.number}")
        self.world = self.groups["world"]
        role = plan.role(rank)
        self.pipeline: Group | None = None
        if role is not None and len(role.pipeline_all_ranks) > 1:
            self.pipeline = self.groups["pipe/" + "-".join(map(str, role.pipeline_all_ranks))]
        self.stage: Group | None = None
        if role is not None and role.width > 1:
            self.stage = self.groups["stage/" + "-".join(map(str, role.stage_ranks))]
        self.layer_group: dict[int, Group] = {}
        self.piece_group: dict[tuple[int, int], Group] = {}
        for members, entries in by_members.items():
            if rank in members:
                for layer, piece, _ in entries:
                    group = self.groups["layers/" + "-".join(map(str, members))]
                    self.piece_group[(layer, piece)] = group
                    self.layer_group.setdefault(layer, group)
        self._warm_up()

    def _warm_up(self) -> None:
        """One small operation on every group, in the build order (module doc of the class); on NCCL
        also one of WARM_UP_LARGE_BYTES: NCCL connects each algorithm at its first use
        (NCCL_RUNTIME_CONNECT), and a small message picks other algorithms and protocols than a
        layer's gradient, which would otherwise connect inside a step, beyond the failed key's reach."""
        sizes = [1] + ([WARM_UP_LARGE_BYTES // 4] if self.backend == "nccl" else [])
        for name in sorted(self.groups):
            for numel in sizes:
                self._warm_up_one(name, torch.zeros(numel, device=self.device))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the large probes' blocks: back to the device for NCCL's buffers

    def _warm_up_one(self, name: str, probe: torch.Tensor) -> None:
        group, members = self.groups[name], self._members[name]
        if name.startswith("p2p/"):
            # what the edge carries, one direction after the other (each completes before the next is
            # posted, in the same order at both ends): its first member's activations to the second,
            # then the second's gradients back (NCCL connects each direction of a pair by itself)
            for src, dst in (members, members[::-1]):
                peer = dst if self.rank == src else src
                post = group.send if self.rank == src else group.recv
                self._warm_up_wait(name, post([probe], members.index(peer), 0))
        else:
            self._warm_up_wait(name, group.allreduce([probe]))

    def _warm_up_wait(self, name: str, work: dist.Work) -> None:
        if self.backend != "nccl":  # gloo's p2p work only completes through wait()
            work.wait(self.timeouts.td("connect_timeout"))
            return
        deadline = time.monotonic() + self.timeouts.connect_timeout
        while not work.is_completed():  # NCCL's wait() would only order the streams
            if time.monotonic() > deadline:
                raise CollectiveError(f"generation {self.number}: warming up group {name} took more than "
                                      f"{self.timeouts.connect_timeout:g} s")
            time.sleep(self.timeouts.warm_up_poll)
        work.wait()

    def wait_timeout(self) -> float:
        """How long one of a step's waits may take before the group is taken for dead.

        A wait includes its peers' compute, legitimately: stage 0 waits (S-1) stages' backward for its
        first gradient, pipelines of different lengths meet at the all-reduce, and a generation's first
        step connects NCCL's large-message paths and runs first kernels. So the bound is the collective
        timeout *beyond* the longest step this generation has completed (WAIT_STEP_FACTOR of it), and
        the step timeout (a hung rank's bound) for a generation's first step and for a step after
        extra work on some rank (`expect_long_step`): a fixed collective timeout re-formed healthy
        generations, and the same timeout then struck the re-formed one."""
        if self.longest_step_s is None or self._unbounded_next:
            return self.timeouts.step_timeout
        return min(self.timeouts.step_timeout,
                   self.timeouts.collective_timeout + WAIT_STEP_FACTOR * self.longest_step_s)

    def step_completed(self, seconds: float) -> None:
        """A step of this generation took `seconds` (its wall time, waits included)."""
        if not self._unbounded_next:
            self.longest_step_s = max(self.longest_step_s or 0.0, seconds)
        self._unbounded_next = False

    def expect_long_step(self) -> None:
        """The next step's waits may include a peer's extra work (an evaluation or a checkpoint's
        clones between steps): bounded by the step timeout, and not counted as a typical step."""
        self._unbounded_next = True

    def wait(self, work: dist.Work) -> None:
        """Wait for `work` at most `wait_timeout()` (after which the group is dead)."""
        work.wait(dt.timedelta(seconds=self.wait_timeout()))

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        """Send to a pipeline neighbour: activations forward, gradients backward."""
        group, peer = self._p2p(self.rank, dst)
        return group.send([tensor], peer, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        group, peer = self._p2p(src, self.rank)
        return group.recv([tensor], peer, tag)

    def _p2p(self, src: int, dst: int) -> tuple[Group, int]:
        """The group carrying traffic from `src` to `dst` (pipeline neighbours), and the peer's rank in it."""
        for name in (edge_name(src, dst), edge_name(dst, src)):
            if name in self.groups:
                peer = dst if src == self.rank else src
                return self.groups[name], self._members[name].index(peer)
        raise RuntimeError(f"ranks {src} and {dst} are not neighbours in a pipeline of generation {self.number}")

    def batch(self, peer: int, ops: Sequence[P2POp]) -> list[dist.Work]:
        """Post sends to and receives from pipeline neighbour `peer` (world ranks in `ops`) on their edge's
        group as one batch whose operations start together (NCCL: one kernel): 1F1B's crossing transfers."""
        group, index = self._p2p(self.rank, peer)
        return self._batch(group, [dataclasses.replace(op, peer=index) for op in ops])

    def exchange(self, ops: Sequence[P2POp]) -> list[dist.Work]:
        """Post sends and receives between any ranks (world ranks) as one batch whose operations start
        together, on NCCL one `ncclGroupStart`/`ncclGroupEnd` on the world's eagerly connected
        communicator: no order between the batch's operations can deadlock it."""
        return self._batch(self.world, ops)

    def _batch(self, group: Group, ops: Sequence[P2POp]) -> list[dist.Work]:
        if isinstance(group, OrderedGroup):
            return [group.exchange(ops)]
        if self.backend == "nccl":
            return [coalesced(group, ops)]
        return [(group.send if op.op == "send" else group.recv)([op.tensor], op.peer, op.tag) for op in ops]

    def release(self, wait: bool = False) -> None:
        """Free this generation's groups once no member needs them any more (the next generation's
        world has formed, so every member has left this one). A reaper thread drops them: a gloo group's
        destructor waits for its stuck operations (a failed generation's) to time out, and that must
        not hold up training. NCCL communicators are aborted, all at once, which frees their buffers on
        the device whether the generation failed or ended cleanly; with `wait` that happens before this
        returns, and torch's cached blocks go back to the device too, so that the next generation's
        communicators find the memory free. Releasing twice is harmless."""
        groups = list(self.groups.values())
        if wait and self.backend == "nccl":
            self.groups.clear()
            self.layer_group.clear()
            self.piece_group.clear()
            self.pipeline = self.stage = None
            abort_groups(groups)
            torch.cuda.empty_cache()
            return
        self.groups.clear()
        self.layer_group.clear()
        self.piece_group.clear()
        self.pipeline = self.stage = None

        slots = self.slots

        def reap() -> None:
            abort_groups(groups)
            for group in groups:
                if isinstance(group, OrderedGroup):
                    group.close()
            if slots is not None:
                slots.close()  # operations still waiting for a slot fail, and their executors end
            groups.clear()

        threading.Thread(target=reap, daemon=True, name=f"release:gen{self.number}").start()


def coalesced(pg: Group, ops: Sequence[P2POp]) -> dist.Work:
    """Post `ops` as one batch on a backend group (ProcessGroupNCCL: one ncclGroupStart/ncclGroupEnd),
    what batch_isend_irecv does through a ProcessGroup. A backend's own `_start_coalescing` and
    `_end_coalescing` take no device (the ProcessGroup wrapper's do): passing one was a TypeError on
    torch 2.11, found on the first multi-rank H200 run."""
    backend = cast(Any, pg)
    backend._start_coalescing()
    for op in ops:
        (pg.send if op.op == "send" else pg.recv)([op.tensor], op.peer, op.tag)
    return cast(dist.Work, backend._end_coalescing())


def plan_groups(plan: ExecPlan, world_size: int) -> dict[str, tuple[int, ...]]:
    """Every group a generation of `plan` builds, by name, with its members (the class doc of
    Generation): on NCCL one communicator each, whose buffers are outside torch's allocator."""
    wanted: dict[str, tuple[int, ...]] = {"world": tuple(range(world_size))}
    for p in plan.pipelines:
        if len(p.all_ranks) > 1:
            wanted["pipe/" + "-".join(map(str, p.all_ranks))] = p.all_ranks
        for s in range(p.num_stages):
            if p.widths[s] > 1:
                wanted["stage/" + "-".join(map(str, p.stage_ranks(s)))] = p.stage_ranks(s)
            if s + 1 < p.num_stages:
                sender, receiver = p.stage_ranks(s), p.stage_ranks(s + 1)
                # which ranks' sample ranges overlap is the same for every microbatch size both
                # widths divide, the largest width included
                for a, b, _, _ in edge_pieces(max(len(sender), len(receiver)), sender, receiver):
                    wanted[edge_name(a, b)] = (a, b)
    for members in reduce_groups(plan):
        wanted["layers/" + "-".join(map(str, members))] = members
    return wanted


def communicators_per_rank(plan: ExecPlan, world_size: int) -> list[int]:
    """How many groups (NCCL communicators) each rank of a generation of `plan` is a member of."""
    counts = [0] * world_size
    for members in plan_groups(plan, world_size).values():
        for r in members:
            counts[r] += 1
    return counts


def edge_name(a: int, b: int) -> str:
    """The group of the pipeline edge from stage rank a to its next stage's rank b (both directions)."""
    return f"p2p/{a}-{b}"


@contextlib.contextmanager
def step_timeout_waits(gen: Generation) -> Iterator[None]:
    """Waits of `gen` under the step timeout (if longer than the collective one), for a state copy: it
    moves whole layers with their optimizer state to a newcomer that may still be warming up, and the
    collective timeout (seconds, sized for a step's all-reduce) made joins fail on a loaded machine."""
    saved = gen.timeouts
    gen.timeouts = dataclasses.replace(saved, collective_timeout=max(saved.collective_timeout, saved.step_timeout))
    try:
        yield
    finally:
        gen.timeouts = saved
