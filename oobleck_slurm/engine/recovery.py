"""The worker side of checkpoint-free recovery: a step applied everywhere or nowhere, with no copy.

A step changes a rank's state only in its optimizer update, after the step's last collective, the
world all-reduce of its metrics (`Worker.train_step`). Before that all-reduce the rank records the
step as pending: its layers' gradients are reduced and the pipeline's gradient norm is known, so it
needs no peer to apply the update. A failure can still strike between ranks' updates: the all-reduce
may have completed on some ranks and not on others. Two cases, told apart by the survivors' reports:

- some survivor completed step s (it reports s + 1): the all-reduce completed somewhere, so every
  rank had contributed to it, so every survivor holds step s pending. Those at s complete it
  (`reach_step`): every survivor is at s + 1, and nothing is replayed;
- no survivor completed step s: nobody applied it; pending steps are dropped and s is replayed with
  the same samples (the sampler depends on the step only).

The coordinator resumes at the largest reported step (supervisor/decisions.py `resume_step`). The
rank's state is thus never copied for fault tolerance: the worker holds what a plain training loop
holds. (An earlier design kept a pre-update copy of every layer's parameters and optimizer state to
undo the step: +75% of the state's memory with AdamW.)

Adopting a generation: `Worker.adopt` gives a worker the layers of its new stage from the seed, a
checkpoint (the fallback), or surviving holders in memory by the coordinator's transfer list; an
interrupted copy drops the half-received layers, so only valid layers are reported.
"""

from __future__ import annotations

from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.errors import InternalError


class StepMismatchError(InternalError, RuntimeError):
    """A rank cannot reach the agreed step: it is ahead of it, or more than one step behind, or one
    step behind without the step pending (a coordinator bug, or state that is not what it reported)."""


def reach_step(worker: Worker, target: int) -> bool:
    """Bring the worker to the start of step `target`, completing its pending step if it is the one
    before; returns True if a step was completed. A worker that holds no layer just takes the step."""
    if not worker.layers:  # a newcomer (or a spare): it holds nothing, it just adopts the step
        worker.step, worker.pending = target, None
        return False
    if worker.step == target:
        worker.pending = None  # no survivor applied it: it is replayed
        return False
    if worker.step + 1 == target and worker.pending is not None and worker.pending.step == worker.step:
        worker.complete_step()
        return True
    raise StepMismatchError(f"rank at step {worker.step} (pending: {worker.pending}) cannot reach step {target}")


def can_complete(worker: Worker) -> bool:
    """True if the worker holds its current step pending (reported to the coordinator)."""
    return worker.pending is not None and worker.pending.step == worker.step
