"""Abortable generations: a worker blocked in a collective leaves it as soon as the generation fails.

gloo does not always fail fast (a large send whose receiver died hangs until the group timeout), and
`abort()`/`destroy_process_group()` from another thread do not unblock it. What works
(docs/nccl.md, "Aborting"): wait for the work in a helper thread while watching for `gen{g}/failed`,
which the coordinator sets when it sees a node die. On that key the worker raises `GenerationAborted`
and moves on; the helper thread stays blocked until the group's collective timeout and then ends.
The generation's groups are released once the next generation has formed (`Generation.release`), by
a reaper thread, so a destructor that waits for a stuck operation never holds up training.

NCCL: `Work.is_completed()` never blocks the CPU, so the main thread polls it together with the
failed key (no helper thread), enforcing the job's collective timeout itself; on a failed generation
every NCCL communicator of it is aborted at once, so no kernel of g stays queued on the GPU, and what
g's unfinished collectives produced is discarded (aborted work looks successful): the step is either
completed from what finished before the failure or replayed (recovery.py).
"""

from __future__ import annotations

import datetime as dt
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from oobleck_slurm.engine.comm import CollectiveError, Generation, abort_groups, step_timeout_waits
from oobleck_slurm.engine.layout import ExecPlan
from oobleck_slurm.engine.nccl_order import P2POp
from oobleck_slurm.errors import InfrastructureError
from oobleck_slurm.protocol import keys
from oobleck_slurm.protocol.signed_store import SignedStore, unsigned
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS, JobTimeouts


class GenerationAborted(InfrastructureError, RuntimeError):
    """The coordinator declared the generation failed (a node died, a node joins, or a timeout)."""


class FailureWatch:
    """`failed()` is True once `gen{g}/failed` exists, and costs no store request.

    On a TCPStore (signed or not) one daemon thread per generation (shared by every FailureWatch of that
    generation on the worker's store or its clones, see clone_store) blocks in `wait([key])` on a
    connection of its own (a signed store's wait returns on a valid value only) and sets a flag that
    `failed()` and `wait()` read: a worker's watch makes one store request per generation (one more per
    `watch_renew` it lasts) instead of a look-up every `abort_poll` while it waits, ~50,000 requests/s on
    one store at 512 workers (benchmarks/bench_store.py). The thread ends when the
    key appears (the coordinator sets it at every generation change, so at most one is left per worker),
    when the store fails (`failed()` then raises a DistNetworkError, as a look-up would), or at a renewal
    once no FailureWatch of it is left; a worker process ends with os._exit. Any other store (a HashStore
    in tests) gets no second connection: `failed()` looks the key up itself, at most every `abort_poll`.
    Both periods come from the job's timeouts (timeouts.py)."""

    def __init__(self, store: dist.Store, generation: int, timeouts: JobTimeouts = DEFAULT_TIMEOUTS,
                 superseded: threading.Event | None = None) -> None:
        self.store = store
        # Set when the worker's supervisor was replaced (a standby took over a frozen one): the
        # generation is over as if it had failed; its store may never answer again.
        self.superseded = superseded
        self.key = keys.failed(generation)
        self.poll = timeouts.abort_poll
        self._watcher = (_Watcher.of(store, self.key, timeouts.watch_renew)
                         if isinstance(unsigned(store), dist.TCPStore) else None)
        self._seen = False
        self._last = 0.0

    def failed(self) -> bool:
        if self.superseded is not None and self.superseded.is_set():
            return True
        w = self._watcher
        if w is not None:
            if w.error is not None:
                first = (str(w.error).splitlines() or [""])[0]  # torch appends its C++ stack
                raise dist.DistNetworkError(f"watching {self.key}: {type(w.error).__name__}: {first}")
            return w.done.is_set()
        now = time.monotonic()
        if not self._seen and now - self._last >= self.poll:
            self._last = now
            self._seen = self.store.check([self.key])
        return self._seen

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` s until the generation fails; return failed() (no store request on a TCPStore)."""
        if self._watcher is not None:
            deadline = time.monotonic() + timeout
            while not self._watcher.done.wait(max(0.0, min(self.poll * 10, deadline - time.monotonic()))):
                if self.failed() or time.monotonic() >= deadline:
                    break
            return self.failed()
        deadline = time.monotonic() + timeout
        while not self.failed() and time.monotonic() < deadline:
            time.sleep(max(0.0, min(self.poll, deadline - time.monotonic())))
        return self.failed()


class _Watcher:
    """The thread behind the FailureWatches of one key on one store (see FailureWatch): it holds its
    FailureWatches' handle weakly, so that it can end once none is left."""

    _lock = threading.Lock()
    _live: weakref.WeakValueDictionary[tuple[int, str], _Watcher] = weakref.WeakValueDictionary()

    @classmethod
    def of(cls, store: dist.Store, key: str, renew: float) -> _Watcher:
        root = _clone_of.get(store, store)
        with cls._lock:
            w = cls._live.get((id(root), key))
            if w is None:
                w = cls._live[(id(root), key)] = cls(root, key, renew)
            return w

    def __init__(self, store: dist.Store, key: str, renew: float) -> None:
        self.store = store  # keeps id(store) from being reused while this watcher is registered
        self.done = threading.Event()  # the key exists, or the store failed (error)
        self.error: BaseException | None = None
        threading.Thread(target=_watch, args=(weakref.ref(self), store, key, self.done, renew),
                         daemon=True, name=f"watch:{key}").start()


def _watch(handle: weakref.ref[_Watcher], store: dist.Store, key: str, done: threading.Event, renew: float) -> None:
    """The watcher thread: block until `key` exists or the store fails (then the handle's error is set),
    and set `done`; or end at a renewal (every `renew` s) where no FailureWatch holds the handle any more."""
    try:
        while True:
            # Its own connection: a blocking wait would hold up every other request on a shared client.
            # A fresh one at each renewal: no torch version leaves a timed-out wait's answer on it.
            conn = clone_store(store)
            t0 = time.monotonic()
            try:
                conn.wait([key], dt.timedelta(seconds=renew))
                break
            except Exception:  # noqa: BLE001 - a timeout's error type varies between torch versions
                if time.monotonic() - t0 < renew / 2:
                    raise  # not a timeout: the store failed
            del conn
            if handle() is None:
                return
    except Exception as err:  # noqa: BLE001 - handed to failed()
        w = handle()
        if w is not None:
            w.error = err
    done.set()


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
    while not done.wait(watch.poll):
        if watch.failed():  # the helper thread ends with the operation's timeout
            raise GenerationAborted(f"{watch.key} while waiting for {what}")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def poll_pauses(first: float, most: float) -> Iterator[float]:
    """The pauses between a polled wait's checks: none (a yield), then `first`, doubling up to `most`."""
    pause = 0.0
    while True:
        yield pause
        pause = min(most, max(first, 2 * pause))


def poll_work(work: dist.Work, watch: FailureWatch, timeout_s: float, timeouts: JobTimeouts,
              abort: Callable[[], None], what: str = "a collective") -> None:
    """Wait for `work` by polling `is_completed()` (it never blocks) and the watch from this thread, with
    `poll_pauses` between checks (never longer than timeouts.nccl_poll, so the failed key is seen within
    it). On the failed key or past `timeout_s`, `abort()` runs, then GenerationAborted or a
    DistBackendError is raised; so is a DistBackendError, after `abort()`, for a work that completed with
    an error. A work that completed successfully is waited on (orders the current stream after it)."""
    deadline = time.monotonic() + timeout_s
    pauses = poll_pauses(timeouts.nccl_poll_first, timeouts.nccl_poll)
    while not work.is_completed():
        if watch.failed():
            abort()
            raise GenerationAborted(f"{watch.key} while waiting for {what}")
        if time.monotonic() > deadline:
            abort()
            raise dist.DistBackendError(f"{what} timed out after {timeout_s:g} s")
        time.sleep(next(pauses))
    try:
        work.wait()  # completed: raises the work's error, if any (Work.exception() has no Python
    except Exception as err:  # binding for NCCL's work in torch 2.11: "Unable to convert std::exception_ptr")
        # Failed: every communicator of the generation is aborted at once before anything else touches
        # one (aborting one at a time while kernels are queued on the others can hang, docs/nccl.md).
        abort()
        raise dist.DistBackendError(f"{what} failed: {type(err).__name__}: {err}") from err


class AbortableGeneration(Generation):
    """A Generation whose every wait gives up when the coordinator declares it failed.

    `on_wait()` runs before each wait (fault injection counts the waits of a step)."""

    def __init__(self, store: dist.Store, number: int, rank: int, world_size: int, plan: ExecPlan,
                 timeouts: JobTimeouts, backend: str = "gloo", on_wait: Callable[[], None] | None = None,
                 device: torch.device | None = None, superseded: threading.Event | None = None,
                 previous: Generation | None = None, cancelled: threading.Event | None = None,
                 built: list[Any] | None = None) -> None:
        super().__init__(store, number, rank, world_size, plan, timeouts, backend, device, previous, cancelled, built)
        self.watch = FailureWatch(store, number, timeouts, superseded)
        self.on_wait = on_wait

    def wait(self, work: dist.Work) -> None:
        if self.on_wait is not None:
            self.on_wait()
        if self.watch.failed():
            raise self._aborted(self.watch.key)
        try:
            if self.backend == "nccl":
                return self._poll(work)
            bound = dt.timedelta(seconds=self.wait_timeout())
            if work.is_completed():  # async collectives that already finished: no thread
                work.wait(bound)
                return
            wait_abortable(lambda: work.wait(bound), self.watch, "collective")
        except GenerationAborted:
            raise
        except RuntimeError as err:  # whatever the backend raised: a failed collective (see comm.py)
            raise CollectiveError(f"{type(err).__name__}: {err}") from err

    def exchange(self, ops: Sequence[P2POp]) -> list[dist.Work]:
        """On NCCL, posted from a helper thread: a batch's pairs of the world communicator connect at
        their first use (p2p connections are lazy whatever NCCL_RUNTIME_CONNECT says), a host-side
        handshake with the peer that a frozen peer blocks forever. The worker's thread keeps watching
        the failed key meanwhile, and on it aborts the generation, which ends the handshake."""
        if self.backend != "nccl":
            return super().exchange(ops)
        try:
            return wait_abortable(lambda: super(AbortableGeneration, self).exchange(ops), self.watch, "exchange")
        except GenerationAborted:
            abort_groups(list(self.groups.values()))
            raise

    def align(self) -> None:
        """Wait until every member has adopted the generation's plan, under the step timeout and
        outside any step's count of waits (fault points). Without it, the first step's collective
        timeout would have to cover the slowest member's adoption (building its layers from the seed,
        loading a checkpoint), and a send under NCCL's rules waits for its receiver from the moment
        it is posted: on a loaded machine that re-formed healthy generations."""
        on_wait, self.on_wait = self.on_wait, None
        try:
            with step_timeout_waits(self):
                self.wait(self.world.allreduce([torch.zeros(1, device=self.device)]))
        finally:
            self.on_wait = on_wait

    def _poll(self, work: dist.Work) -> None:
        """NCCL: poll the work and the failed key from this thread (`poll_work`); on the failed key or
        past `wait_timeout()` the generation's groups are aborted, and a timeout is reported like gloo's
        (a collective error); so is a work that completed with an error, after every communicator of the
        generation was aborted."""
        poll_work(work, self.watch, self.wait_timeout(), self.timeouts,
                  lambda: abort_groups(list(self.groups.values())), f"NCCL work of generation {self.number}")

    def _aborted(self, why: str) -> GenerationAborted:
        if self.backend == "nccl":
            abort_groups(list(self.groups.values()))
        return GenerationAborted(why)


def build_generation(store: dist.Store, number: int, rank: int, world_size: int, plan: ExecPlan,
                     timeouts: JobTimeouts, backend: str = "gloo", on_wait: Callable[[], None] | None = None,
                     device: torch.device | None = None, superseded: threading.Event | None = None,
                     previous: Generation | None = None) -> AbortableGeneration:
    """Build generation `number`'s groups in a helper thread: a member dying while the groups form
    (a failure during recovery) aborts the build instead of blocking until the connect timeout.
    The helper thread gets its own store connection: a group's setup blocks in store calls, and a
    shared client would keep the failed key from this thread's watch (a second failure during the
    rebuild would then stall the survivors). `previous` (this worker's last generation) is released
    as soon as the new world has formed (Generation's build order).

    An abandoned build is cancelled: its helper stops at its next group and aborts what it built, and
    the next build first aborts the groups every abandoned build has formed so far, so that no helper
    warms up communicators of a dead generation while the next one's form on the same device."""
    for _cancelled, built in _abandoned:
        abort_groups(built)  # those its helper formed so far; it aborts the rest itself, at its next group
    _abandoned.clear()
    watch = FailureWatch(store, number, timeouts, superseded)
    group_store = clone_store(store)
    cancelled, built = threading.Event(), []
    try:
        return wait_abortable(
            lambda: AbortableGeneration(group_store, number, rank, world_size, plan, timeouts, backend, on_wait,
                                        device, superseded, previous, cancelled, built),
            watch, f"generation {number} groups")
    except GenerationAborted:
        cancelled.set()
        _abandoned.append((cancelled, built))
        raise
    except RuntimeError as err:  # a member died or stalled while the groups formed
        cancelled.set()
        _abandoned.append((cancelled, built))
        raise CollectiveError(f"{type(err).__name__}: {err}") from err


# Builds whose worker gave up on them (build_generation): (their cancel flag, the groups formed so far).
_abandoned: list[tuple[threading.Event, list[Any]]] = []


def clone_store(store: dist.Store, attempt_s: float = DEFAULT_TIMEOUTS.store_clone_attempt) -> dist.Store:
    """A second client connection to the same TCPStore (the same keys), for a thread that blocks in it.
    Of the same type (a benchmark's counting client stays one); FailureWatch finds a clone's origin.

    Connected in attempts of `attempt_s`, up to the store's own timeout, and given up at once when the
    store's port refuses connections: torch retries a refused connect until its timeout (60 s, three
    times over), so a thread cloning the store of a supervisor that had just died was stuck for minutes,
    deaf to a standby's takeover. A live store that is slow to answer (thousands of clients connecting
    at a generation change) still has the whole timeout. A SignedStore's clone is signed the same way."""
    if isinstance(store, SignedStore):
        signed = store.over(clone_store(store.inner, attempt_s))
        _clone_of[signed] = _clone_of.get(store, store)
        return signed
    if not isinstance(store, dist.TCPStore):
        return store
    timeout: dt.timedelta = store.timeout  # type: ignore[attr-defined]  # exists at run time, not in torch's stubs
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        try:
            clone = type(store)(store.host, store.port, is_master=False,
                                timeout=dt.timedelta(seconds=max(0.1, min(attempt_s, left))))
            break
        except dist.DistNetworkError:
            if left <= attempt_s or _refuses_connections(store.host, store.port, attempt_s):
                raise
    clone.set_timeout(timeout)
    _clone_of[clone] = _clone_of.get(store, store)
    return clone


def _refuses_connections(host: str, port: int, timeout_s: float) -> bool:
    """True when nothing listens at host:port any more (its process died); a slow or busy server
    still accepts the connection, which is closed at once."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True
    except OSError:  # unreachable or slow: not known to be gone
        return False
    return False


_clone_of: weakref.WeakKeyDictionary[dist.Store, dist.Store] = weakref.WeakKeyDictionary()  # clone -> origin
