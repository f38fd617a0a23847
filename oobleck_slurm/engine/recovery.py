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

Adopting a generation: `Worker.adopt` gives a worker the layers of its new stage from the seed,
a checkpoint (the fallback), or surviving holders in memory by the coordinator's transfer list; an
interrupted copy drops the half-received layers, so only valid layers are reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from oobleck_slurm.engine.faults import FaultHooks
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.optim import load_optimizer_state_tensors, optimizer_state_tensors


class RollbackError(RuntimeError):
    """A rank cannot reach the agreed step (more than one step ahead, or no pre-step copy)."""


class StepUndo:
    """Pre-update copies of this worker's layers for rolling back the last optimizer step."""

    def __init__(self, worker: Worker, faults: FaultHooks | None = None) -> None:
        self.worker = worker
        self.faults = faults  # its `before_update` hook runs before each layer's update
        self.saved: dict[int, tuple[int, list[torch.Tensor], dict[str, torch.Tensor]]] = {}
        self._hooked: set[int] = set()

    def attach(self) -> None:
        """Hook every optimizer of the worker (new layers included); forget older copies."""
        for index, opt in self.worker.optimizers.items():
            if id(opt) not in self._hooked:
                opt.register_step_pre_hook(self._pre_step_hook(index))
                self._hooked.add(id(opt))
        self.saved.clear()

    def _pre_step_hook(self, index: int) -> Callable[[torch.optim.Optimizer, Any, Any], None]:
        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self._save(index, opt)
        return hook

    def _save(self, index: int, opt: torch.optim.Optimizer) -> None:
        if self.faults is not None:
            self.faults.before_update(self.worker.step)
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
