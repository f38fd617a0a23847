"""gloo groups that keep NCCL's ordering rules: a CPU mode in which a class of GPU deadlocks fails.

Two rules of NCCL that gloo does not have (docs/nccl.md, "Point-to-point"):

1. A communicator runs its operations one after the other, in the order they were posted (they are
   kernels on the communicator's one CUDA stream): an operation starts once the previous one is done.
2. A send larger than NCCL's internal buffers completes only once the peer has posted the matching
   receive (a rendezvous); gloo copies the data into a buffer and completes the send at once.

Operations posted together as one batch (`ncclGroupStart`/`ncclGroupEnd`, `Generation.exchange`)
start together, so a batch that both sends to and receives from a peer cannot block on itself.

With `OOBLECK_NCCL_ORDER=1` in a worker's environment, every gloo group of a generation is an
`OrderedGroup`: the real gloo group behind one executor thread (the stream) that runs the posted
operations in order, where a receive first sends its peer a one-element "ready" token and a send waits
for that token before it sends its data. A schedule that deadlocks on NCCL (two ranks that each send
before they receive on one communicator) then deadlocks on the CPU too, until the collective timeout
ends it. The test suite runs every job in this mode (tests/conftest.py).
"""

from __future__ import annotations

import datetime as dt
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

ENV = "OOBLECK_NCCL_ORDER"  # "1": every gloo group of a generation keeps NCCL's ordering rules


def enabled() -> bool:
    """True when this process emulates NCCL's ordering on its gloo groups."""
    return os.environ.get(ENV, "") == "1"


@dataclass(frozen=True)
class P2POp:
    """One point-to-point operation of a batch: `op` is "send" or "recv"; `peer` is a group rank."""

    op: str
    tensor: torch.Tensor
    peer: int
    tag: int


class UnitWork(dist.Work):
    """The handle of one posted unit: complete once the executor ran it (or failed it)."""

    def __init__(self) -> None:
        super().__init__()
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
            raise RuntimeError(f"operation of an ordered group timed out after {seconds:g} s")
        if self._error is not None:
            raise RuntimeError(f"operation of an ordered group failed: {self._error}") from self._error
        return True


def _done(work: dist.Work) -> None:
    work.wait()


class OrderedGroup:
    """A gloo group whose operations run in posting order, with rendezvous sends (module doc).

    It offers the operations the engine uses on a group: allreduce, allgather, reduce_scatter, barrier,
    send, recv, and `exchange` (a batch of sends and receives that start together). After a failed operation every
    later one fails with the same error, as on a broken NCCL communicator."""

    def __init__(self, pg: dist.ProcessGroup, name: str) -> None:
        self.pg = pg
        self.name = name
        self._units: queue.SimpleQueue[tuple[Callable[[], None], UnitWork] | None] = queue.SimpleQueue()
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"nccl-order:{name}")
        self._thread.start()

    # ---- the operations ------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work:
        return self._post(lambda: _done(self.pg.allreduce(tensors)))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> dist.Work:
        return self._post(lambda: _done(self.pg.allgather(outputs, inputs)))

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]]) -> dist.Work:
        return self._post(lambda: _done(self.pg.reduce_scatter(outputs, inputs)))

    def barrier(self) -> dist.Work:
        return self._post(lambda: _done(self.pg.barrier()))

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return self.exchange([P2POp("send", tensors[0], dst, tag)])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return self.exchange([P2POp("recv", tensors[0], src, tag)])

    def exchange(self, ops: Sequence[P2POp]) -> dist.Work:
        return self._post(lambda: self._p2p(list(ops)))

    def close(self) -> None:
        """Stop the executor once the posted units are done (it never blocks the caller)."""
        self._units.put(None)

    # ---- the executor (the stream) --------------------------------------------------------------

    def _post(self, run: Callable[[], None]) -> dist.Work:
        work = UnitWork()
        self._units.put((run, work))
        return work

    def _run(self) -> None:
        while (unit := self._units.get()) is not None:
            run, work = unit
            if self._broken is not None:
                work.finish(self._broken)
                continue
            try:
                run()
                work.finish()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter; the group is broken
                self._broken = e
                work.finish(e)
            # The unit's closure holds its tensors (a plan change's send and receive buffers): drop it
            # now, not when the next unit comes, or they outlive their use (as NCCL's would not).
            unit = run = work = None  # type: ignore[assignment]

    def _p2p(self, ops: list[P2POp]) -> None:
        """One batch: every receive announces itself first, then each send waits for its receiver's
        announcement before it sends (tags: data 2t, ready token 2t + 1)."""
        posted: list[tuple[dist.Work, torch.Tensor]] = []
        for op in ops:
            if op.op == "recv":
                token = torch.ones(1)
                posted.append((self.pg.send([token], op.peer, 2 * op.tag + 1), token))
                posted.append((self.pg.recv([op.tensor], op.peer, 2 * op.tag), op.tensor))
        for op in ops:
            if op.op == "send":
                token = torch.zeros(1)
                self.pg.recv([token], op.peer, 2 * op.tag + 1).wait()  # the peer has posted its receive
                posted.append((self.pg.send([op.tensor], op.peer, 2 * op.tag), op.tensor))
            elif op.op != "recv":
                raise ValueError(f"a point-to-point operation is 'send' or 'recv', got {op.op!r}")
        for work, _ in posted:
            work.wait()
