"""Abortable generations: a worker blocked in a collective leaves it as soon as the generation fails.

gloo does not always fail fast (a large send whose receiver died hangs until the group timeout), and
`abort()`/`destroy_process_group()` from another thread do not unblock it. What works (see
shared/docs/torch-distributed-notes.md): wait for the work in a helper thread and, meanwhile, poll
the store for `gen{g}/failed`, which the coordinator sets when it sees a node die. On that key the
worker raises `GenerationAborted` and moves on; the helper thread stays blocked until the group's
collective timeout and then ends, and the old groups are kept referenced (`graveyard`) so that
their destructors never join a stuck thread on the training path.

NCCL (shared/docs/nccl-notes.md): `Work.is_completed()` never blocks the CPU, so the main thread polls
it together with the failed key (no helper thread), enforcing the job's collective timeout itself;
on a failed generation every NCCL group of it is aborted, so no kernel of g stays queued on the GPU,
and what g's collectives produced is discarded (aborted work looks successful): the step is replayed
from the pre-step state (recovery.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from oobleck_slurm.engine.comm import CollectiveError, Generation, Timeouts, abort_groups
from oobleck_slurm.engine.layout import ExecPlan
from oobleck_slurm.protocol import keys

POLL_S = 0.01  # how often a waiting worker looks at the store: bounds the abort latency


class GenerationAborted(RuntimeError):
    """The coordinator declared the generation failed (a node died, a node joins, or a timeout)."""


class FailureWatch:
    """`failed()` is True once `gen{g}/failed` exists; store look-ups at most every POLL_S."""

    def __init__(self, store: dist.Store, generation: int) -> None:
        self.store = store
        self.key = keys.failed(generation)
        self._seen = False
        self._last = 0.0

    def failed(self) -> bool:
        now = time.monotonic()
        if not self._seen and now - self._last >= POLL_S:
            self._last = now
            self._seen = self.store.check([self.key])
        return self._seen


graveyard: list[Any] = []  # groups and threads of aborted generations: never destroyed on our path


def wait_abortable(fn: Callable[[], Any], watch: FailureWatch, what: str) -> Any:
    """Run `fn` in a helper thread; return its result, re-raise its error, or raise
    GenerationAborted as soon as the watch fires."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    thread = threading.Thread(target=target, daemon=True, name=f"wait:{what}")
    thread.start()
    while not done.wait(POLL_S):
        if watch.failed():
            graveyard.append(thread)
            raise GenerationAborted(f"{watch.key} while waiting for {what}")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class AbortableGeneration(Generation):
    """A Generation whose every wait gives up when the coordinator declares it failed.

    `on_wait()` runs before each wait (fault injection counts the waits of a step)."""

    def __init__(self, store: dist.Store, number: int, rank: int, world_size: int, plan: ExecPlan,
                 timeouts: Timeouts, backend: str = "gloo", on_wait: Callable[[], None] | None = None,
                 device: torch.device | None = None) -> None:
        super().__init__(store, number, rank, world_size, plan, timeouts, backend, device)
        self.watch = FailureWatch(store, number)
        self.on_wait = on_wait
        graveyard.append(self.groups)  # keep every group alive past the generation (see module doc)

    def wait(self, work: dist.Work) -> None:
        if self.on_wait is not None:
            self.on_wait()
        if self.watch.failed():
            raise self._aborted(self.watch.key)
        try:
            if self.backend == "nccl":
                return self._poll(work)
            if work.is_completed():  # async collectives that already finished: no thread
                work.wait(self.timeouts.td("collective"))
                return
            wait_abortable(lambda: work.wait(self.timeouts.td("collective")), self.watch, "collective")
        except GenerationAborted:
            raise
        except RuntimeError as err:  # whatever the backend raised: a failed collective (see comm.py)
            raise CollectiveError(f"{type(err).__name__}: {err}") from err

    def _poll(self, work: dist.Work) -> None:
        """NCCL: poll the work and the failed key from this thread; past the collective timeout the
        generation's groups are aborted and the error reported like gloo's (a collective error)."""
        deadline = time.monotonic() + self.timeouts.collective
        while not work.is_completed():
            if self.watch.failed():
                raise self._aborted(self.watch.key)
            if time.monotonic() > deadline:
                abort_groups(list(self.groups.values()))
                raise dist.DistBackendError(f"NCCL work of generation {self.number} timed out after "
                                            f"{self.timeouts.collective:g} s")
            time.sleep(NCCL_POLL_S)
        work.wait()  # completed: surfaces the work's error, if any

    def _aborted(self, why: str) -> GenerationAborted:
        if self.backend == "nccl":
            abort_groups(list(self.groups.values()))
        return GenerationAborted(why)


NCCL_POLL_S = 0.0005  # NCCL work is polled this often: a step's p2p waits are short


def build_generation(store: dist.Store, number: int, rank: int, world_size: int, plan: ExecPlan,
                     timeouts: Timeouts, backend: str = "gloo", on_wait: Callable[[], None] | None = None,
                     device: torch.device | None = None) -> AbortableGeneration:
    """Build generation `number`'s groups in a helper thread: a member dying while the groups form
    (a failure during recovery) aborts the build instead of blocking until the connect timeout.
    The helper thread gets its own store connection: a group's setup blocks in store calls, and a
    shared client would keep the failed key from this thread's watch (a second failure during the
    rebuild would then stall the survivors)."""
    watch = FailureWatch(store, number)
    group_store = clone_store(store)
    try:
        return wait_abortable(
            lambda: AbortableGeneration(group_store, number, rank, world_size, plan, timeouts, backend, on_wait,
                                        device),
            watch, f"generation {number} groups")
    except GenerationAborted:
        raise
    except RuntimeError as err:  # a member died or stalled while the groups formed
        raise CollectiveError(f"{type(err).__name__}: {err}") from err


def clone_store(store: dist.Store) -> dist.Store:
    """A second client connection to the same TCPStore (the same keys), for a thread that blocks in it."""
    if isinstance(store, dist.TCPStore):
        # Store.timeout exists at run time but not in torch's stubs.
        return dist.TCPStore(store.host, store.port, is_master=False, timeout=store.timeout)  # type: ignore[attr-defined]
    return store
