"""Fault injection for drills, tests and benchmarks: one hook object that a worker calls at named points.

The job folder's faults.json (copied into the job spec as `extra["faults"]` by the supervisor) is a
list of faults:

    {"node": N, "worker": i (default 0), "step": S, "generation": G, "at": POINT (default "start"),
     "do": "kill" (default) | "hang" | "pause" | "slow" | "hold" | "oom" | "spike" | "corrupt", "seconds": T
     (pause and slow), "factor": F (spike),
     "after": ["NODE" or "NODE:i", ...] (optional)}

POINT is where in step S (and, if given, generation G; one of the two is needed) the fault strikes
worker i of node N:

    start       before the step's first operation
    wait:K      before the step's K-th wait on a collective or p2p operation
    wait:last   before the step's last wait (as many waits as the previous step had)
    scatter     before the step's first wait for a kept wide stage's gradient reduce-scatter (posted,
                in flight; shard.py)
    optimizer   during the optimizer step, after one layer was updated (half applied)
    report      after leaving an aborted generation, before reporting its step and layers (the
                coordinator is collecting reports)
    groups      before building a new generation's process groups (the others are building theirs)
    adopt       while the worker adopts a new generation: groups built, layers not copied yet
    replay      before the first step of a generation after the first (a recovery's replay)

and what it does: "kill" sends this process SIGKILL, "hang" sleeps forever (a deadlocked worker that
stays runnable), "pause" sleeps T seconds and goes on (a transient stall that makes its peers'
collectives time out), "slow" sleeps T seconds at that point of step S and of every later step, in every
generation (a slow stage or straggler: its peers legitimately wait for it), "hold" blocks until the
worker's generation is declared failed and goes on (at `wait:last`, the commit point: the worker then
holds its step pending while peers that were not held applied it, engine/recovery.py), "oom" raises
torch.OutOfMemoryError there, as the CUDA caching allocator does when the device is full (the CPU has
no such error: this is how the worker's handling of one is tested without a GPU), "spike" multiplies
the worker's loss of step S by F, and so its gradients (on a last stage: the step's loss jumps, as with
a bad batch; for training.loss_spike), each time a step reads step S's samples, whatever `at` says (S
numbers the job's data stream: a loss-spike rollback, which skips samples, skips the spike with them,
as it would a bad batch), "corrupt" is silent
data corruption (engine/integrity.py): at "start", one bit of the first parameter of the worker's first
held layer is flipped in place (a mantissa bit: the value stays finite, training goes on, only the
replicas' checksums tell); at "adopt", every layer this worker sends in that adoption's recovery copies
arrives with one bit flipped (its own state stays right: the receiver's check against its checksum
re-fetches it from another holder). Each fault but "slow" and "spike" strikes once, even across
restarts (a store counter per fault), and a kill, hang or corrupt writes its
time to the store for the detection figures.

With "after", a fault that is due waits until every worker named there (a node's worker 0, or NODE:i)
has reached the fault's step: its progress key (`worker/<id>/step`, written when it reaches its step's
first wait) says so, and it has then applied every step before. So a kill can be placed after peers
finished a step, whatever the machine's speed. Both waits are bounded by the job's `fault_wait_max`.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from oobleck_slurm.engine.abort import FailureWatch
from oobleck_slurm.protocol import keys
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS, JobTimeouts

FAULT_POINTS = ("start", "wait:last", "scatter", "optimizer", "report", "groups", "adopt", "replay")  # and "wait:K"
FAULT_ACTIONS = ("kill", "hang", "pause", "slow", "hold", "oom", "spike", "corrupt")
CORRUPT_POINTS = ("start", "adopt")  # a held layer's parameter; the copies sent in a recovery
HANG_SLEEP_S = 3600.0  # a "hang" fault's sleep, repeated forever


def load_faults(path: Path) -> list[dict[str, Any]]:
    """A drill's fault list (see the module doc), checked: a bad entry names the file, the entry and the
    key, and every fault accepted is one a worker can carry out."""
    try:
        faults = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as err:  # deep nesting: RecursionError
        raise ValueError(f"{path}: not a JSON list of faults: {type(err).__name__}: {err}") from None
    if not isinstance(faults, list):
        raise ValueError(f"{path}: must be a JSON list of faults, got {type(faults).__name__}")
    for i, f in enumerate(faults):
        where = f"{path}: fault {i}"
        if not isinstance(f, dict) or "node" not in f or ("step" not in f and "generation" not in f):
            raise ValueError(f"{where}: needs 'node' and an integer 'step' or 'generation', got {f!r}")
        for key in ("step", "generation"):
            value = f.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: '{key}' must be an integer >= 0, got {value!r}")
        at = f.get("at", "start")
        if at not in FAULT_POINTS and not (isinstance(at, str) and re.fullmatch(r"wait:[0-9]+", at)):
            raise ValueError(f"{where}: 'at' must be one of {', '.join(FAULT_POINTS)} or wait:K, got {at!r}")
        if f.get("do", "kill") not in FAULT_ACTIONS:
            raise ValueError(f"{where}: 'do' must be one of {', '.join(FAULT_ACTIONS)}, got {f.get('do')!r}")
        if f.get("do") == "corrupt" and at not in CORRUPT_POINTS:
            raise ValueError(f"{where}: 'corrupt' strikes at {' or '.join(CORRUPT_POINTS)}, got 'at': {at!r}")
        worker = f.get("worker", 0)
        if isinstance(worker, bool) or not isinstance(worker, int) or worker < 0:
            raise ValueError(f"{where}: 'worker' must be a worker index >= 0, got {worker!r}")
        seconds = f.get("seconds")
        if f.get("do") in ("pause", "slow") and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                       or not math.isfinite(seconds) or seconds <= 0):
            raise ValueError(f"{where}: '{f['do']}' needs 'seconds' > 0, got {seconds!r} (a finite number)")
        if f.get("do") == "slow" and "step" not in f:
            raise ValueError(f"{where}: 'slow' needs the 'step' it starts at")
        factor = f.get("factor")
        if f.get("do") == "spike" and ("step" not in f or isinstance(factor, bool) or not isinstance(factor, (int, float))
                                       or not math.isfinite(factor)):
            raise ValueError(f"{where}: 'spike' needs the 'step' and a finite 'factor', got {factor!r}")
        after = f.get("after", [])
        if not isinstance(after, list) or not all(isinstance(w, str) and re.fullmatch(r"[^:\s]+(:[0-9]+)?", w)
                                                  for w in after):
            raise ValueError(f"{where}: 'after' must be a list of workers, NODE or NODE:i, got {after!r}")
    return faults


def worker_of(name: str) -> str:
    """The worker id (keys.worker_id) an "after" entry names: NODE is the node's worker 0."""
    node, _, local = name.partition(":")
    return keys.worker_id(node, int(local or 0))


class FaultHooks:
    """The faults of one worker (worker `local` of `node`), struck at the hook points the worker calls.

    Every hook takes the worker's current step. With no fault for this worker every hook returns at
    once: production runs carry the object but nothing happens.
    """

    def __init__(self, faults: Sequence[Mapping[str, Any]], store: dist.Store, node: str, local: int,
                 timeouts: JobTimeouts = DEFAULT_TIMEOUTS) -> None:
        # (index in the job's list: the store's once-only counter is per index, fault) for this worker
        self._mine = [(i, f) for i, f in enumerate(faults)
                      if (str(f["node"]), int(f.get("worker", 0))) == (node, local)]
        self.store = store  # the job's store (replaced when a new supervisor takes over)
        self._fired: set[int] = set()  # struck in this process (a new store does not know of them)
        self._node = node
        self.generation = 0  # the generation the worker is in (or leaving): set by the worker
        self._waits = 0  # waits so far in the current step
        self._last_waits = 0  # waits of the last finished step: where "wait:last" strikes
        self._updates = 0  # layers updated so far in the current step's optimizer step
        self._scatters = 0  # reduce-scatter waits so far in the current step
        self.timeouts = timeouts
        # "spike": step -> the factor of this worker's loss (not struck at a point: the step scales its loss)
        self.spikes = {int(f["step"]): float(f["factor"]) for _, f in self._mine if f.get("do") == "spike"}
        self._mine = [(i, f) for i, f in self._mine if f.get("do") != "spike"]

    def loss_factor(self, step: int) -> float:
        """What this worker's loss of `step` is multiplied by (1.0 but for a "spike" fault)."""
        return self.spikes.get(step, 1.0)
        # "corrupt": what the worker process does to its state (point "start") or to its sends ("adopt")
        self.on_corrupt: Callable[[str], None] | None = None

    def at_step_start(self, step: int) -> None:
        if not self._mine:
            return
        self._strike("start", step)
        self._waits, self._updates, self._scatters = 0, 0, 0

    def at_step_end(self) -> None:
        self._last_waits = self._waits

    def before_wait(self, step: int) -> None:
        if not self._mine:
            return
        self._waits += 1
        self._strike(f"wait:{self._waits}", step)

    def before_update(self, step: int) -> None:
        """Called before each layer's optimizer update; the fault strikes before the second one."""
        if not self._mine:
            return
        self._updates += 1
        if self._updates == 2:
            self._strike("optimizer", step)

    def before_scatter(self, step: int) -> None:
        """Called before each wait for a kept stage's reduce-scatter; the fault strikes before the first."""
        if not self._mine:
            return
        self._scatters += 1
        if self._scatters == 1:
            self._strike("scatter", step)

    def before_report(self, step: int) -> None:
        if self._mine:
            self._strike("report", step)

    def before_groups(self, step: int) -> None:
        if self._mine:
            self._strike("groups", step)

    def at_adopt(self, step: int) -> None:
        if self._mine:
            self._strike("adopt", step)

    def before_replay(self, step: int) -> None:
        if self._mine:
            self._strike("replay", step)

    def _strike(self, point: str, step: int) -> None:
        for i, f in self._mine:
            at = f.get("at", "start")
            hit = at == point or (at == "wait:last" and point == f"wait:{self._last_waits}")
            if f.get("do") == "slow":  # every step from its step on: no once-only counter
                if hit and step >= f["step"]:
                    time.sleep(float(f["seconds"]))
                continue
            if f.get("step", step) != step or f.get("generation", self.generation) != self.generation:
                continue
            if not hit or i in self._fired or self.store.add(keys.fault_fired(i), 1) != 1:
                continue
            self._fired.add(i)
            self._await_workers(f.get("after", []), step)
            if f.get("do") == "pause":  # no loss follows: no fault time for a detection figure
                time.sleep(float(f["seconds"]))
                return
            if f.get("do") == "hold":
                self._hold()
                return
            if f.get("do") == "corrupt":  # silent: the worker goes on; the fault time dates the detection
                if self.on_corrupt is None:
                    raise RuntimeError(f"fault {i}: 'corrupt' needs the worker's hook (FaultHooks.on_corrupt)")
                self.store.set(keys.fault_time(self._node), repr(time.time()))
                self.on_corrupt(point)
                return
            if f.get("do") == "oom":  # the worker's own handling follows (elastic_process)
                self.store.set(keys.fault_time(self._node), repr(time.time()))
                raise torch.OutOfMemoryError(f"emulated out of memory (fault {i}: at {point} of step {step}, "
                                             f"generation {self.generation})")
            self.store.set(keys.fault_time(self._node), repr(time.time()))
            if f.get("do", "kill") == "hang":
                while True:  # not stopped: its agent sees a live, sleeping process
                    time.sleep(HANG_SLEEP_S)
            os.kill(os.getpid(), signal.SIGKILL)

    def _await_workers(self, names: Sequence[str], step: int) -> None:
        """Return once every named worker has reached `step` (module doc, "after")."""
        deadline = time.monotonic() + self.timeouts.fault_wait_max
        waiting = [worker_of(name) for name in names]
        while waiting := [w for w in waiting if not self._reached(w, step)]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fault of {self._node} at step {step}: {', '.join(waiting)} did not reach "
                                   f"step {step} within {self.timeouts.fault_wait_max:g} s")
            time.sleep(self.timeouts.fault_poll)

    def _reached(self, worker: str, step: int) -> bool:
        key = keys.worker_step(worker)
        return self.store.check([key]) and int(self.store.get(key)) >= step

    def _hold(self) -> None:
        """Block until the worker's generation is declared failed. Through a FailureWatch of the
        generation, which shares its flag with the generation's own watch (abort.py): the wait that
        follows then raises GenerationAborted, even where its operation has completed meanwhile."""
        watch = FailureWatch(self.store, self.generation, self.timeouts)
        if not watch.wait(self.timeouts.fault_wait_max):
            raise TimeoutError(f"fault of {self._node}: generation {self.generation} was not declared failed "
                               f"within {self.timeouts.fault_wait_max:g} s of a hold")
