"""Abortable generations: a worker blocked in a collective leaves it as soon as the generation fails.

gloo does not always fail fast (a large send whose receiver died hangs until the group timeout), and
`abort()`/`destroy_process_group()` from another thread do not unblock it. What works (see
shared/docs/torch-distributed-notes.md): wait for the work in a helper thread and, meanwhile, poll
the store for `gen{g}/failed`, which the coordinator sets when it sees a node die. On that key the
worker raises `GenerationAborted` and moves on; the helper thread stays blocked until the group's
collective timeout and then ends, and the old groups are kept referenced (`graveyard`) so that
their destructors never join a stuck thread on the training path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from oobleck_slurm.engine.comm import Generation, Timeouts
from oobleck_slurm.engine.layout import ExecPlan

POLL_S = 0.01  # how often a waiting worker looks at the store: bounds the abort latency


class GenerationAborted(RuntimeError):
    """The coordinator declared the generation failed (a node died, a node joins, or a timeout)."""


class FailureWatch:
    """`failed()` is True once `gen{g}/failed` exists; store look-ups at most every POLL_S."""

    def __init__(self, store: dist.Store, generation: int) -> None:
        self.store = store
        self.key = f"gen{generation}/failed"
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
                 timeouts: Timeouts, backend: str = "gloo", on_wait: Callable[[], None] | None = None) -> None:
        super().__init__(store, number, rank, world_size, plan, timeouts, backend)
        self.watch = FailureWatch(store, number)
        self.on_wait = on_wait
        graveyard.append(self.groups)  # keep every group alive past the generation (see module doc)

    def wait(self, work: dist.Work) -> None:
        if self.on_wait is not None:
            self.on_wait()
        if self.watch.failed():
            raise GenerationAborted(f"{self.watch.key}")
        if work.is_completed():  # async collectives that already finished: no thread
            work.wait(self.timeouts.td("collective"))
            return
        wait_abortable(lambda: work.wait(self.timeouts.td("collective")), self.watch, "collective")


def build_generation(store: dist.Store, number: int, rank: int, world_size: int, plan: ExecPlan,
                     timeouts: Timeouts, backend: str = "gloo",
                     on_wait: Callable[[], None] | None = None) -> AbortableGeneration:
    """Build generation `number`'s groups in a helper thread: a member dying while the groups form
    (a failure during recovery) aborts the build instead of blocking until the connect timeout."""
    watch = FailureWatch(store, number)
    return wait_abortable(
        lambda: AbortableGeneration(store, number, rank, world_size, plan, timeouts, backend, on_wait),
        watch, f"generation {number} groups")
