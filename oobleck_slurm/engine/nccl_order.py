"""gloo groups that keep NCCL's ordering rules: a CPU mode in which a class of GPU deadlocks fails.

Rules of NCCL that gloo does not have (docs/nccl.md, "Point-to-point" and "Several communicators"):

1. A communicator runs its operations one after the other, in the order they were posted (they are
   kernels on the communicator's one CUDA stream): an operation starts once the previous one is done.
2. A send larger than NCCL's internal buffers completes only once the peer has posted the matching
   receive (a rendezvous); gloo copies the data into a buffer and completes the send at once.
3. Sends and receives are matched per pair of ranks by the order in which they were posted on the
   communicator, not by tag: NCCL has no tags. gloo matches by tag, so a pair posted in different
   orders at its two ends works on gloo and delivers the wrong tensor (or hangs) on NCCL.
4. A device runs a limited number of kernels at once. NCCL's kernels spin until their peers join, so
   operations of several communicators posted in rank-dependent orders can fill a device with kernels
   that wait for peers whose own kernels cannot start: a deadlock that unlimited threads never show.

Operations posted together as one batch (`ncclGroupStart`/`ncclGroupEnd`, `Generation.exchange` and
`Generation.batch`) start together, as one kernel, so a batch that both sends to and receives from a
peer cannot block on itself.

With `OOBLECK_NCCL_ORDER=1` in a worker's environment, every gloo group of a generation is an
`OrderedGroup`: the real gloo group behind one executor thread (the stream) that runs the posted
operations in order. Point-to-point: a receive first sends its peer a "ready" token carrying its tag
and size; a send waits for that token, answers with its own tag and size, and sends its data only if
they agree, so a pair posted in different orders fails at both ends with a message that says so. The
k-th send to a peer meets the peer's k-th receive from this rank whatever the tags (rule 3).
`OOBLECK_NCCL_ORDER_SLOTS=N` bounds the operations that run at once on a rank (rule 4): an operation
takes one of the rank's N slots when it starts (its group's previous operation done) and holds it
until it completes, the rank's waiting operations taking free slots in the order they were posted,
as the device dispatches kernels. The slots are a generation's (`Slots`, one per Generation): an
aborted generation's kernels leave the device, and so do a released one's.

A schedule that deadlocks on NCCL then deadlocks on the CPU too, until the group's timeout ends it,
and the error names the operations that held and waited for the rank's slots. The test suite runs
every job in this mode with one slot (tests/conftest.py): a rank's operations then run one at a time in
posting order, which only a schedule consistent with one global order of operations survives.
"""

from __future__ import annotations

import collections
import datetime as dt
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

ENV = "OOBLECK_NCCL_ORDER"  # "1": every gloo group of a generation keeps NCCL's ordering rules
SLOTS_ENV = "OOBLECK_NCCL_ORDER_SLOTS"  # operations that may run at once on a rank; unset or "0": no bound


def enabled() -> bool:
    """True when this process emulates NCCL's ordering on its gloo groups."""
    return os.environ.get(ENV, "") == "1"


def slot_limit() -> int | None:
    """How many operations may run at once on one rank under the ordering mode (None: no bound)."""
    value = os.environ.get(SLOTS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{SLOTS_ENV} must be a number of operations (0: no bound), got {value!r}")
    return int(value) or None


@dataclass(frozen=True)
class P2POp:
    """One point-to-point operation of a batch: `op` is "send" or "recv"; `peer` is a group rank."""

    op: str
    tensor: torch.Tensor
    peer: int
    tag: int


class Slots:
    """The operations one rank's device runs at once: at most `limit` (None: no bound). Each group is a
    stream: its operations are registered in posting order (`post`), and one is ready once the one before
    it on its group is done. A ready operation takes a free slot only when no ready operation posted
    before it (on any group) is still waiting, as a device dispatches kernels in launch order; it holds
    the slot until it completes (`done`). `close()` fails those still waiting (a released generation)."""

    def __init__(self, limit: int | None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"a rank runs at least one operation at a time, got a bound of {limit}")
        self.limit = limit
        self._cond = threading.Condition()
        self._tickets = 0
        self._streams: dict[int, collections.deque[int]] = {}  # group -> its posted, unfinished tickets
        self._stream_of: dict[int, int] = {}  # ticket -> its group
        self._what: dict[int, str] = {}
        self._running: set[int] = set()
        self._closed = False

    def post(self, stream: object, what: str) -> int:
        """Register an operation of `stream` (its group), posted now; its ticket."""
        with self._cond:
            self._tickets += 1
            ticket, key = self._tickets, id(stream)
            self._streams.setdefault(key, collections.deque()).append(ticket)
            self._stream_of[ticket] = key
            self._what[ticket] = what
            return ticket

    def _ready(self) -> list[int]:
        """The operations that could start now: the first unfinished one of each group, if not running."""
        return [q[0] for q in self._streams.values() if q and q[0] not in self._running]

    def acquire(self, ticket: int) -> None:
        """Wait until operation `ticket` (ready: its group's previous one is done) may take a slot."""
        with self._cond:
            while not self._closed and (min(self._ready()) != ticket or
                                        (self.limit is not None and len(self._running) >= self.limit)):
                self._cond.wait()
            if self._closed:
                raise RuntimeError(f"{self._what[ticket]}: its generation was released before it could start")
            self._running.add(ticket)
            self._cond.notify_all()  # the next ready operation may fit too

    def done(self, ticket: int) -> None:
        """Operation `ticket` completed, failed, or was skipped: its slot and its group's turn pass on."""
        with self._cond:
            self._running.discard(ticket)
            stream = self._streams[self._stream_of.pop(ticket)]
            if stream and stream[0] == ticket:
                stream.popleft()
            else:  # never: a group's operations end in order
                stream.remove(ticket)
            del self._what[ticket]
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def describe(self) -> str:
        """What holds and what waits for this rank's slots, for an error message."""
        with self._cond:
            bound = "no bound" if self.limit is None else f"{self.limit}"
            running = ", ".join(f"#{t} {self._what[t]}" for t in sorted(self._running)) or "none"
            waiting = ", ".join(f"#{t} {self._what[t]}" for t in sorted(self._ready())) or "none"
        return f"this rank's operation slots ({bound}): running {running}; ready to start {waiting}"


class UnitWork(dist.Work):
    """The handle of one posted unit: complete once the executor ran it (or failed it)."""

    def __init__(self, what: str, slots: Slots) -> None:
        super().__init__()
        self.what = what
        self._slots = slots
        self._done = threading.Event()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: dt.timedelta = dt.timedelta(0)) -> bool:
        seconds = timeout.total_seconds() or None  # 0: no limit, as for torch's Work
        if not self._done.wait(seconds):
            raise RuntimeError(f"operation of an ordered group timed out after {seconds:g} s: {self.what}; "
                               f"{self._slots.describe()}")
        if self._error is not None:
            raise RuntimeError(f"operation of an ordered group failed: {self.what}: {self._error}") from self._error
        return True


def _done(work: dist.Work) -> None:
    work.wait()


class OrderedGroup:
    """A gloo group whose operations run in posting order, with rendezvous sends matched per pair in
    posting order, each taking one of the rank's `slots` while it runs (module doc).

    It offers the operations the engine uses on a group: allreduce, allgather, _allgather_base,
    reduce_scatter, _reduce_scatter_base, barrier, send, recv, and `exchange` (a batch of sends and
    receives that start together). After a failed operation every later one fails with the same error,
    as on a broken NCCL communicator."""

    def __init__(self, pg: dist.ProcessGroup, name: str, slots: Slots | None = None) -> None:
        self.pg = pg
        self.name = name
        self.slots = slots if slots is not None else Slots(slot_limit())
        self._units: queue.SimpleQueue[tuple[Callable[[], None], UnitWork, int] | None] = queue.SimpleQueue()
        self._broken: BaseException | None = None
        self._sent: dict[int, int] = {}  # peer -> sends to it run so far (NCCL's per-pair order)
        self._received: dict[int, int] = {}  # peer -> receives from it run so far
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"nccl-order:{name}")
        self._thread.start()

    # ---- the operations ------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work:
        return self._post("allreduce", lambda: _done(self.pg.allreduce(tensors)))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> dist.Work:
        return self._post("allgather", lambda: _done(self.pg.allgather(outputs, inputs)))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor) -> dist.Work:
        return self._post("all_gather_into_tensor", lambda: _done(self.pg._allgather_base(output, input)))

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]]) -> dist.Work:
        return self._post("reduce_scatter", lambda: _done(self.pg.reduce_scatter(outputs, inputs)))

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: dist.ReduceScatterOptions | None = None) -> dist.Work:
        options = opts if opts is not None else dist.ReduceScatterOptions()
        return self._post("reduce_scatter_tensor", lambda: _done(self.pg._reduce_scatter_base(output, input, options)))

    def barrier(self) -> dist.Work:
        return self._post("barrier", lambda: _done(self.pg.barrier()))

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return self.exchange([P2POp("send", tensors[0], dst, tag)])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return self.exchange([P2POp("recv", tensors[0], src, tag)])

    def exchange(self, ops: Sequence[P2POp]) -> dist.Work:
        ops = list(ops)
        for op in ops:
            if op.op not in ("send", "recv"):
                raise ValueError(f"a point-to-point operation is 'send' or 'recv', got {op.op!r}")
        return self._post(_describe(ops), lambda: self._p2p(ops))

    def close(self) -> None:
        """Stop the executor once the posted units are done (it never blocks the caller)."""
        self._units.put(None)

    # ---- the executor (the stream) --------------------------------------------------------------

    def _post(self, what: str, run: Callable[[], None]) -> dist.Work:
        work = UnitWork(f"{what} on group {self.name}", self.slots)
        self._units.put((run, work, self.slots.post(self, work.what)))
        return work

    def _run(self) -> None:
        while (unit := self._units.get()) is not None:
            run, work, ticket = unit
            try:
                if self._broken is not None:
                    work.finish(self._broken)
                    continue
                try:
                    self.slots.acquire(ticket)
                except RuntimeError as e:
                    self._broken = e
                    work.finish(e)
                    continue
                try:
                    run()
                    work.finish()
                except BaseException as e:  # noqa: BLE001 - handed to the waiter; the group is broken
                    # what held the rank's slots when it failed: a timeout here may be a slot deadlock
                    self._broken = RuntimeError(f"{e}; {self.slots.describe()}")
                    work.finish(self._broken)
            finally:
                self.slots.done(ticket)
                # The unit's closure holds its tensors (a plan change's send and receive buffers): drop
                # it now, not when the next unit comes, or they outlive their use (as NCCL's would not).
                unit = run = work = None  # type: ignore[assignment]

    def _p2p(self, ops: list[P2POp]) -> None:
        """One batch. The k-th send to a peer meets the peer's k-th receive from this rank (gloo tags
        3k, 3k + 1, 3k + 2: data, the receiver's ready token, the sender's answer). Every receive
        announces itself (tag, size) first; each send waits for its receiver's announcement, answers
        with its own, and sends the data if both agree; each receive then reads the answer and takes
        the data if they agree. A disagreement fails both ends (NCCL would pair these two)."""
        posted: list[tuple[dist.Work, torch.Tensor]] = []  # waited at the end; holds their buffers
        answers: list[tuple[P2POp, int, torch.Tensor, dist.Work]] = []
        errors: list[str] = []
        for op in ops:
            if op.op == "recv":
                k = self._received.get(op.peer, 0)
                self._received[op.peer] = k + 1
                ready = _header(op)
                posted.append((self.pg.send([ready], op.peer, 3 * k + 1), ready))
                answer = torch.empty(2, dtype=torch.float64)
                answers.append((op, k, answer, self.pg.recv([answer], op.peer, 3 * k + 2)))
        for op in ops:
            if op.op == "send":
                k = self._sent.get(op.peer, 0)
                self._sent[op.peer] = k + 1
                ready = torch.empty(2, dtype=torch.float64)
                self.pg.recv([ready], op.peer, 3 * k + 1).wait()  # the peer has posted its receive
                mine = _header(op)
                posted.append((self.pg.send([mine], op.peer, 3 * k + 2), mine))
                if not torch.equal(mine, ready):
                    errors.append(_mismatch(self.name, "send", op, k, ready))
                    continue
                posted.append((self.pg.send([op.tensor], op.peer, 3 * k), op.tensor))
        for op, k, answer, work in answers:
            work.wait()
            if not torch.equal(answer, _header(op)):
                errors.append(_mismatch(self.name, "recv", op, k, answer))
                continue
            posted.append((self.pg.recv([op.tensor], op.peer, 3 * k), op.tensor))
        for work, _ in posted:
            work.wait()
        if errors:
            raise RuntimeError("; ".join(errors))


def _describe(ops: list[P2POp]) -> str:
    """A batch for an error message: its operations, or their count when there are many (a state copy)."""
    if len(ops) > 4:
        sends = sum(op.op == "send" for op in ops)
        return f"batch of {sends} sends and {len(ops) - sends} receives"
    return " + ".join(f"{op.op} {'to' if op.op == 'send' else 'from'} {op.peer} (tag {op.tag})" for op in ops)


def _header(op: P2POp) -> torch.Tensor:
    return torch.tensor([float(op.tag), float(op.tensor.numel())], dtype=torch.float64)


def _mismatch(group: str, side: str, op: P2POp, k: int, other: torch.Tensor) -> str:
    peer_op = "receive" if side == "send" else "send"
    ordinal = f"{side} #{k + 1} {'to' if side == 'send' else 'from'} rank {op.peer}"
    return (f"point-to-point order differs at the two ends of group {group}: this rank's {ordinal} has tag "
            f"{op.tag} ({op.tensor.numel()} elements), the peer's {peer_op} #{k + 1} tag {int(other[0])} "
            f"({int(other[1])} elements). NCCL pairs a pair's sends and receives by posting order, not by "
            f"tag: it would deliver the wrong tensor here")
