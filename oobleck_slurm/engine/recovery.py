"""The worker side of checkpoint-free recovery: transactional steps and adopting a new generation.

Transactions. A step changes a rank's state only in its optimizer step, after the last collective
of the step (the world all-reduce of step metrics). A failure can still strike between ranks'
optimizer steps: some survivors then finished step s, others aborted it. `StepUndo` keeps, per
layer, a copy of the parameters and optimizer state taken by an optimizer pre-hook right before the
layer's update, i.e. after every rank contributed to step s's all-reduce. Survivors therefore differ
by at most one step (finishing s+1's all-reduce proves everyone finished s), and one copy suffices:
the coordinator takes the smallest step the survivors report and ranks one step ahead restore the
copy. Every rank then replays that step with the same samples (the sampler depends on the step
only), so the optimizer step is applied everywhere or nowhere and no sample is skipped or repeated.

Adopting a generation. `adopt` gives a worker the layers of its new stage: from the seed (the
first generation), from a checkpoint (the fallback), or from surviving holders in memory, by the
coordinator's transfer list (the engine's `run_transfers`: parameters and optimizer state, all
copies posted at once so several senders work in parallel). If the copy is interrupted, the layers
being received are dropped again and only the layers that were valid before are reported.
The copy waits under the step timeout, not the collective one: it moves whole layers with their
optimizer state to a newcomer that may still be warming up, and the collective timeout (seconds, for
a step's all-reduce) made joins fail on a loaded machine; every rank then errored out of the
generation with nobody lost, waited for a `failed` key that never came, and the job died.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator

import torch

from oobleck_slurm.engine.checkpoint import load_layer
from oobleck_slurm.engine.comm import Generation
from oobleck_slurm.engine.layout import ExecPlan
from oobleck_slurm.engine.transfer import run_transfers
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.optim import load_optimizer_state_tensors, optimizer_state_tensors


class RollbackError(RuntimeError):
    """A rank cannot reach the agreed step (more than one step ahead, or no pre-step copy)."""


class StepUndo:
    """Pre-update copies of this worker's layers for rolling back the last optimizer step."""

    def __init__(self, worker: Worker, before_update: Callable[[int], None] | None = None) -> None:
        self.worker = worker
        self.before_update = before_update  # called with the layer index (fault injection)
        self.saved: dict[int, tuple[int, list[torch.Tensor], dict[str, torch.Tensor]]] = {}
        self._hooked: set[int] = set()

    def attach(self) -> None:
        """Hook every optimizer of the worker (new layers included); forget older copies."""
        for index, opt in self.worker.optimizers.items():
            if id(opt) not in self._hooked:
                opt.register_step_pre_hook(lambda o, args, kwargs, index=index: self._save(index, o))
                self._hooked.add(id(opt))
        self.saved.clear()

    def _save(self, index: int, opt: torch.optim.Optimizer) -> None:
        if self.before_update is not None:
            self.before_update(index)
        layer = self.worker.layers[index]
        self.saved[index] = (
            self.worker.step,
            [p.detach().clone() for p in layer.parameters()],
            {n: t.clone() for n, t in optimizer_state_tensors(opt).items()},
        )

    def rollback_to(self, target: int) -> bool:
        """Bring the worker to the start of step `target`; True if a step was undone."""
        w = self.worker
        if not w.layers:  # a newcomer (or a spare): it holds nothing, it just adopts the step
            w.step = target
            return False
        if w.step == target:
            return False
        stale = [i for i in w.layers if self.saved.get(i, (None,))[0] != target]
        if w.step != target + 1 or stale:
            raise RollbackError(f"rank at step {w.step} cannot return to step {target} "
                                f"(no pre-step copy of layer(s) {sorted(stale)})")
        with torch.no_grad():
            for i, layer in w.layers.items():
                _, params, state = self.saved[i]
                for p, saved in zip(layer.parameters(), params):
                    p.copy_(saved)
                load_optimizer_state_tensors(w.optimizers[i], state)
        w.step = target
        self.saved.clear()
        return True


def adopt(worker: Worker, plan: ExecPlan, gen: Generation, source: str,
          transfers: list[tuple[int, int, int]] = (), checkpoint: tuple[str, int] | None = None) -> int:
    """Give `worker` (rank `worker.rank` of `gen`) the layers of its stage in `plan`; returns bytes
    received (copied or read). `source`: "seed", "checkpoint" (root, step) or "memory" (transfers
    [(layer, src rank, dst rank)], every rank of `gen` passing the same list)."""
    role = plan.role(worker.rank)
    needed = set(role.layers) if role else set()
    received = 0
    if source == "seed":
        worker.layers.clear(), worker.optimizers.clear()
        for index in sorted(needed):
            worker._new_layer(index)
    elif source == "checkpoint":
        root, step = checkpoint
        worker.layers.clear(), worker.optimizers.clear()
        for index in sorted(needed):
            worker._new_layer(index)
            received += load_layer(root, step, worker.keys[index], worker.layers[index], worker.optimizers[index])
        worker.step = step
    elif source == "memory":
        incoming = [layer for layer, _, dst in transfers if dst == worker.rank]
        for index in incoming:
            worker._new_layer(index)
        try:
            with copy_timeouts(gen):
                received = run_transfers(gen, list(transfers), worker.layers, worker.optimizers)
        except BaseException:
            for index in incoming:  # half-received: not a valid copy, never report it as held
                del worker.layers[index], worker.optimizers[index]
            raise
        for index in list(worker.layers):
            if index not in needed:
                del worker.layers[index], worker.optimizers[index]
    else:
        raise ValueError(f"adopt: source must be 'seed', 'checkpoint' or 'memory', got {source!r}")
    missing = needed - set(worker.layers)
    if missing:
        raise RuntimeError(f"rank {worker.rank} lacks layer(s) {sorted(missing)} after adopting the plan")
    worker.plan, worker.gen, worker.role = plan, gen, role
    return received


@contextlib.contextmanager
def copy_timeouts(gen: Generation) -> Iterator[None]:
    """Waits of `gen` under the step timeout (if longer than the collective one) for a state copy."""
    saved = gen.timeouts
    gen.timeouts = dataclasses.replace(saved, collective=max(saved.collective, saved.step))
    try:
        yield
    finally:
        gen.timeouts = saved


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0
