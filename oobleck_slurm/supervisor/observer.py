"""`StoreObserver`: the supervisor's one poller of the job's store. One thread, with its own client,
reads what the coordinator, the node backend (`AgentNodes`) and the health monitor need to know about
the current generation, every `store_poll`, and publishes it as an immutable `StoreView`; they read
the latest view (an attribute read: no lock, no store request) instead of polling the store each on
its own client at its own pace.

What a view holds, for generation g = `current_gen` (protocol/keys.py, protocol/records.py):

    generation     current_gen (-1 before the coordinator published one)
    config         gen{g}/config (GenerationConfig), read once per generation
    progress       gen{g}/progress: the last completed step (rank 0)
    first_step     gen{g}/first_step (FirstStep), read once it is there
    failed         gen{g}/failed is set
    compute        gen{g}/compute (StepCompute): the last step's compute seconds per rank
    errors         gen{g}/errors: the count of collective errors, None while there is none
    mismatch       gen{g}/mismatch (ReplicaMismatch): replicas disagreed at an integrity check
    rebuilt        every member's worker wrote gen{g}/rebuilt/{worker}
    worker_steps   worker/{w}/step of the members' workers, read every `rank_step_poll`; a node's
                   once every one of its workers has set its key

The keys are never deleted and a generation's one-off records are written once, so what was seen stays
seen: a key known to exist is read, not checked first, and the values read every period (current_gen,
progress, compute, errors) go in one `multi_get`; the config and the first step are read once, `failed`,
`rebuilt` and `mismatch` are checked until they are there. In a steady generation that is four requests a period
(the multi_get, and the checks of `failed`, `errors` and `mismatch`), and one multi_get of the members' steps
every `rank_step_poll`, whatever the number of nodes.

A view is at most one period old. What must be fresher is read by whoever acts on it, on its own
client: the coordinator reads the reports, the rebuilt records and a failed generation's progress
itself when it changes membership; `fresh()` waits for a view read after the call (the coordinator
takes its last look with it before it ends). Consumers compare `view.generation` with the generation
they are in: just after the coordinator publishes g+1 the view may still show g.

The observer runs on any `dist.Store`: on a TCPStore its thread connects a client of its own
(engine/abort.py `clone_store`), another store (the tests' HashStore) it shares. On the job's signed
store it also sweeps, every `store_sweep_poll`, the keys that are not the job's (one `list_keys`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch.distributed as dist

from oobleck_slurm.engine.abort import clone_store
from oobleck_slurm.protocol import keys, records
from oobleck_slurm.protocol.records import FirstStep, GenerationConfig, ReplicaMismatch, StepCompute
from oobleck_slurm.protocol.signed_store import SignedStore
from oobleck_slurm.protocol.wire import ProtocolError
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS, JobTimeouts

_NO_STEPS: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True)
class StoreView:
    """The job's store as the observer last read it (see the module's table); never changed once
    published. `seq` counts the views (0: nothing read yet), `t` is when its reads began, `steps_t`
    when `worker_steps` were read."""

    seq: int = 0
    t: float = 0.0
    generation: int = -1
    config: GenerationConfig | None = None
    progress: int | None = None
    first_step: FirstStep | None = None
    failed: bool = False
    compute: StepCompute | None = None
    errors: int | None = None
    mismatch: ReplicaMismatch | None = None
    rebuilt: bool = False
    worker_steps: Mapping[str, int] = field(default_factory=lambda: _NO_STEPS)
    steps_t: float = 0.0


class StoreObserver:
    """Reads the current generation's keys every `timeouts.store_poll` in a thread of its own and
    publishes a `StoreView` (`view`). `workers_per_node`: a member node's workers (rebuilt, steps)."""

    def __init__(self, store: dist.Store, timeouts: JobTimeouts = DEFAULT_TIMEOUTS, workers_per_node: int = 1) -> None:
        self.store, self.timeouts, self.workers_per_node = store, timeouts, workers_per_node
        self.view = StoreView()  # replaced whole by the observer's thread (a reference swap)
        self.last_error: str | None = None  # the last failed read (retried at the next period)
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._exists: set[str] = set()  # keys seen to exist (never deleted: not checked again)
        self._next_steps = 0.0
        self._next_sweep = 0.0

    # ---- life --------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="store-observer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(max(1.0, 10 * self.timeouts.store_poll))  # a daemon: not waited for longer

    def _run(self) -> None:
        client: dist.Store | None = None
        while not self._stop.is_set():
            try:
                if client is None:
                    client = clone_store(self.store)  # the thread's own connection (other stores: shared)
                self._publish(self._read(client))
                self._sweep(client)
            except (RuntimeError, OSError) as err:  # a store hiccup: a new connection, the next period
                self.last_error, client = f"{type(err).__name__}: {err}", None
            except (ValueError, ProtocolError) as err:  # a value that is not what its key holds: retried
                self.last_error = f"{type(err).__name__}: {err}"
            self._stop.wait(self.timeouts.store_poll)
        if client is not None:  # a last sweep: foreign keys written since the previous one are reported too
            self._next_sweep = 0.0
            try:
                self._sweep(client)
            except (RuntimeError, OSError):
                pass

    def _sweep(self, store: dist.Store) -> None:
        """Every `store_sweep_poll`, delete and report the keys of a signed store that are not the job's
        (written without the job secret: protocol/signed_store.py)."""
        now = time.monotonic()
        if isinstance(store, SignedStore) and now >= self._next_sweep:
            self._next_sweep = now + self.timeouts.store_sweep_poll
            store.sweep()

    def _publish(self, view: StoreView) -> None:
        with self._changed:
            self.view = view
            self._changed.notify_all()

    def fresh(self, timeout: float | None = None) -> StoreView:
        """A view whose reads began after this call (the next but one): what the store says now, at
        most two periods later. After `timeout` (default: a second, or ten periods), the latest one."""
        wait = timeout if timeout is not None else max(1.0, 10 * self.timeouts.store_poll)
        with self._changed:
            seq = self.view.seq
            self._changed.wait_for(lambda: self.view.seq >= seq + 2 or self._stop.is_set(), wait)
            return self.view

    def refresh(self) -> StoreView:
        """Read the store once now, in the calling thread, on the store given (for an observer whose
        thread is not started: a test that sets the keys and then looks)."""
        if self._thread is not None:
            raise RuntimeError("refresh() reads on the caller's store: not while the observer's thread runs")
        view = self._read(self.store)
        self._publish(view)
        return view

    # ---- one period's reads ------------------------------------------------------------------------

    def _read(self, store: dist.Store) -> StoreView:
        prev, t = self.view, time.time()
        g = prev.generation
        # The values read every period, with the previous generation's where they exist: one request.
        every = [keys.CURRENT_GEN, keys.progress(g), keys.step_compute(g), keys.errors(g)]
        known = [k for k in every if k in self._exists] if keys.CURRENT_GEN in self._exists else []
        values = dict(zip(known, store.multi_get(known))) if known else {}
        if keys.CURRENT_GEN not in values:
            values.update(self._get_new(store, [keys.CURRENT_GEN]))
        if keys.CURRENT_GEN not in values:
            return self._with_steps(t, StoreView(seq=prev.seq + 1, t=t), store)
        gen = _int(values[keys.CURRENT_GEN], keys.CURRENT_GEN)
        if gen != g:  # a new generation: none of its keys is known yet
            values = {keys.CURRENT_GEN: values[keys.CURRENT_GEN]}
            prev = StoreView(generation=gen, seq=prev.seq, worker_steps=prev.worker_steps, steps_t=prev.steps_t)
        values.update(self._get_new(store, [k for k in (keys.progress(gen), keys.step_compute(gen), keys.errors(gen))
                                            if k not in values]))
        config = prev.config
        if config is None and store.check([keys.config(gen)]):
            config = records.parse(GenerationConfig, store.get(keys.config(gen)), keys.config(gen))
        first = prev.first_step
        if first is None and store.check([keys.first_step(gen)]):
            first = records.parse(FirstStep, store.get(keys.first_step(gen)), keys.first_step(gen))
        mismatch = prev.mismatch  # written once, when a check fails: checked for until it is there or g failed
        if mismatch is None and not prev.failed and store.check([keys.replica_mismatch(gen)]):
            mismatch = records.parse(ReplicaMismatch, store.get(keys.replica_mismatch(gen)), keys.replica_mismatch(gen))
        workers = self._workers(config)
        raw_compute = values.get(keys.step_compute(gen))
        view = StoreView(
            seq=prev.seq + 1, t=t, generation=gen, config=config,
            progress=_int(values[keys.progress(gen)], keys.progress(gen)) if keys.progress(gen) in values else None,
            first_step=first,
            failed=prev.failed or store.check([keys.failed(gen)]),
            compute=records.parse(StepCompute, raw_compute, keys.step_compute(gen)) if raw_compute is not None else None,
            errors=_int(values[keys.errors(gen)], keys.errors(gen)) if keys.errors(gen) in values else None,
            mismatch=mismatch,
            rebuilt=prev.rebuilt or (bool(workers) and store.check([keys.rebuilt(gen, w) for w in workers])),
            worker_steps=prev.worker_steps, steps_t=prev.steps_t)
        return self._with_steps(t, view, store)

    def _with_steps(self, t: float, view: StoreView, store: dist.Store) -> StoreView:
        """`view` with the members' steps read again when `rank_step_poll` has passed."""
        if t < self._next_steps:
            return view
        self._next_steps = t + self.timeouts.rank_step_poll
        nodes = view.config.members if view.config is not None else ()
        names = {n: [keys.worker_step(w) for w in keys.node_workers(n, self.workers_per_node)] for n in nodes}
        unknown = {n: ks for n, ks in names.items() if not all(k in self._exists for k in ks)}
        if unknown and not store.check([k for ks in unknown.values() for k in ks]):
            # Some node has a worker that has not reached a collective yet: each node on its own (a node
            # counts once all its workers did, as the node backend reads them).
            unknown = {n: ks for n, ks in unknown.items() if store.check(ks)}
        self._exists.update(k for ks in unknown.values() for k in ks)
        present = [(w, k) for n, ks in names.items() for w, k in zip(keys.node_workers(n, self.workers_per_node), ks)
                   if k in self._exists]
        raw = store.multi_get([k for _, k in present]) if present else []
        steps = {w: _int(v, k) for (w, k), v in zip(present, raw)}
        return replace(view, worker_steps=MappingProxyType(steps), steps_t=t)

    def _get_new(self, store: dist.Store, names: list[str]) -> dict[str, Any]:
        """The values of those of `names` that exist now (each checked, then all read at once)."""
        found = [k for k in names if store.check([k])]
        self._exists.update(found)
        return dict(zip(found, store.multi_get(found))) if found else {}

    def _workers(self, config: GenerationConfig | None) -> list[str]:
        if config is None:
            return []
        return [w for n in config.members for w in keys.node_workers(n, self.workers_per_node)]


def _int(raw: Any, key: str) -> int:
    try:
        return int(raw)
    except ValueError as err:
        raise ProtocolError(f"store key {key!r}: expected an integer, got {bytes(raw)[:50]!r}") from err
