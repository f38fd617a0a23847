"""Reading ahead: one background thread that makes the next step's read while the current step trains.

A `Prefetcher` holds at most one read made ahead, known by its key. `ahead(key)` asks the thread for
`read(key)`; `take(key)` returns it once the thread has it, or, on a miss (nothing was asked for that
key: the first step, a plan changed since, reading ahead switched off), reads it in the caller's thread.
Either way `take` returns exactly `read(key)`: what was read ahead is used only for the very key it was
read for, and anything else it holds is dropped. The worker keys its reads by step, plan and slices
(engine/batches.py `Reads`), so a read made for another plan is never used.

An exception of the reader is raised by the `take` of that key, as itself (its message and traceback);
`take` never waits on a thread that has ended. `stop` ends the thread (it finishes the read it is in,
if any, and drops the result); a stopped prefetcher still serves `take` by reading in the caller's
thread, and a worker makes a new one for its next generation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Prefetcher(Generic[K, V]):
    def __init__(self, read: Callable[[K], V], name: str = "prefetch",
                 setup: Callable[[], None] | None = None) -> None:
        """`read(key)`: what `take(key)` returns; `setup`: run first in the thread (e.g. its CUDA device)."""
        self._read, self._name, self._setup = read, name, setup
        self._cv = threading.Condition()
        self._wanted: K | None = None  # asked for, not yet started
        self._reading: K | None = None  # being read by the thread
        self._ready: tuple[K, V | None, BaseException | None] | None = None  # (key, value, error)
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.hits = self.misses = 0  # takes served from a read made ahead, and read in the caller's thread

    def ahead(self, key: K) -> None:
        """Start reading `key` in the background (replacing any other read asked for and not started)."""
        with self._cv:
            if self._stopped or (self._thread is not None and not self._thread.is_alive()):
                return  # no thread to read ahead: the takes read for themselves
            if key == self._reading or (self._ready is not None and self._ready[0] == key):
                return
            self._ready = None  # made for another key: never to be used
            self._wanted = key
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def take(self, key: K) -> V:
        """`read(key)`: the read made ahead for `key` (waiting for it to finish), else read now."""
        with self._cv:
            while key == self._wanted or key == self._reading:
                self._cv.wait()  # the thread's `finally` wakes this even if it ends
            ready, self._ready = self._ready, None
        if ready is not None and ready[0] == key:
            self.hits += 1
            if ready[2] is not None:
                raise ready[2]
            return ready[1]  # type: ignore[return-value]
        self.misses += 1
        return self._read(key)

    def stop(self, wait: float) -> bool:
        """End the thread, dropping what it read or was asked to; True if it ended within `wait` seconds
        (else it ends on its own once its read returns, and nothing uses that read)."""
        with self._cv:
            self._stopped = True
            self._wanted = self._ready = None
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(wait)
            return not thread.is_alive()
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            if self._setup is not None:
                self._setup()
            while True:
                with self._cv:
                    while self._wanted is None and not self._stopped:
                        self._cv.wait()
                    key = self._wanted
                    if self._stopped or key is None:
                        return
                    self._wanted, self._reading = None, key
                value: V | None = None
                error: BaseException | None = None
                try:
                    value = self._read(key)
                except BaseException as e:  # noqa: BLE001 - handed to the `take` of this key, raised there
                    error = e
                with self._cv:
                    self._reading = None
                    if not self._stopped:
                        self._ready = (key, value, error)
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - the setup failed: raised by the take of the key asked for
            with self._cv:
                if self._wanted is not None and not self._stopped:
                    self._ready = (self._wanted, None, e)  # the failure is the read's: raised by its take
        finally:
            with self._cv:  # never leave a take waiting on a thread that has ended
                self._wanted = self._reading = None
                self._cv.notify_all()
