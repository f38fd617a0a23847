"""The loss-spike policy (`training.loss_spike`): pure decisions, no I/O, no torch.

A step whose loss exceeds the mean of the last `window` accepted losses by more than `sigma` of their
standard deviation, once at least `warmup` losses were accepted, is skipped by every rank (the engine's
non-finite guard's path: parameters and optimizer state unchanged, the step consumed); after
`max_consecutive` spikes in a row the job rolls back to the newest complete checkpoint at or before the
first of them and skips the data up to the last (`on_consecutive: rollback`, at most `max_rollbacks`
times: supervisor/decisions.py `loss_spike_action`), or stops naming the steps (`stop`; docs/engine.md,
numerical guards).

Every rank must decide identically, so the decision is a pure function of (`SpikeState`, the step's
loss) and the state is the same on every rank: the loss is the world sum of the step's last stages'
losses, reduced before the step's commit point (engine/worker.py), so every rank, a spare or one that
completes the step alone in a recovery included, holds it with the same bits; Python's float arithmetic
over the same values in the same order gives the same bits everywhere. A rank that joins later receives
the state from a rank that holds it (`Worker.adopt`), and a checkpoint carries it in its data record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

Verdict = Literal["accept", "skip", "stop", "non_finite"]


@dataclass(frozen=True)
class SpikePolicy:
    """`training.loss_spike` as the engine reads it (recipe/schema.py `LossSpikeConfig` documents it)."""

    sigma: float = 6.0
    window: int = 100
    warmup: int = 100
    max_consecutive: int = 5
    on_consecutive: Literal["rollback", "stop"] = "rollback"  # what `max_consecutive` spikes in a row do
    max_rollbacks: int = 3  # rollbacks a job makes before a further run of spikes stops it

    @property
    def rollbacks(self) -> int:
        """The rollbacks the coordinator may make (0: `stop`)."""
        return self.max_rollbacks if self.on_consecutive == "rollback" else 0

    def __post_init__(self) -> None:
        if not (self.sigma > 0 and math.isfinite(self.sigma)):
            raise ValueError(f"training.loss_spike.sigma must be a finite number > 0, got {self.sigma}")
        if self.window < 2:
            raise ValueError(f"training.loss_spike.window must be >= 2, got {self.window}")
        if not 2 <= self.warmup <= self.window:
            raise ValueError(f"training.loss_spike.warmup must be in [2, window={self.window}], got {self.warmup}")
        if self.max_consecutive < 1:
            raise ValueError(f"training.loss_spike.max_consecutive must be >= 1, got {self.max_consecutive}")
        if self.on_consecutive not in ("rollback", "stop"):
            raise ValueError(f"training.loss_spike.on_consecutive must be 'rollback' or 'stop', got {self.on_consecutive!r}")
        if self.max_rollbacks < 1:
            raise ValueError(f"training.loss_spike.max_rollbacks must be >= 1, got {self.max_rollbacks}")


@dataclass(frozen=True)
class SpikeState:
    """What the policy remembers: the next step it judges, the last accepted losses (oldest first, at
    most `window`), and the steps of the spikes in the current run of consecutive ones."""

    step: int = 0
    losses: tuple[float, ...] = ()
    spikes: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        # floats as JSON numbers: Python writes the shortest repr that reads back the same bits
        return {"step": self.step, "losses": list(self.losses), "spikes": list(self.spikes)}

    @staticmethod
    def from_json(d: Any) -> SpikeState:
        """The state written by `to_json`; raises ValueError naming what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"a loss-spike state is a mapping, got {type(d).__name__}")
        step, losses, spikes = d.get("step"), d.get("losses"), d.get("spikes")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"loss-spike state: 'step' must be an integer >= 0, got {step!r}")
        if not isinstance(losses, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                    and math.isfinite(v) for v in losses):
            raise ValueError("loss-spike state: 'losses' must be a list of finite numbers")
        if not isinstance(spikes, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in spikes):
            raise ValueError("loss-spike state: 'spikes' must be a list of step numbers")
        return SpikeState(step, tuple(float(v) for v in losses), tuple(spikes))

    def to_floats(self) -> list[float]:
        """The state as float64 values (exact: steps and counts stay below 2**53), for a collective."""
        return [float(self.step), float(len(self.losses)), float(len(self.spikes)), *self.losses,
                *map(float, self.spikes)]

    @staticmethod
    def from_floats(values: list[float]) -> SpikeState:
        n, k = int(values[1]), int(values[2])
        return SpikeState(int(values[0]), tuple(values[3 : 3 + n]), tuple(int(v) for v in values[3 + n : 3 + n + k]))

    @staticmethod
    def floats_len(policy: SpikePolicy) -> int:
        """The most values `to_floats` gives under `policy`."""
        return 3 + policy.window + policy.max_consecutive


@dataclass(frozen=True)
class Judgement:
    """A step's verdict, with the figures it was judged on (mean, std and threshold are None while
    warming up): accept (update), skip (a spike), stop (the `max_consecutive`th spike in a row: also
    skipped, and the job stops), non_finite (the loss is not finite: the non-finite guard's case)."""

    verdict: Verdict
    loss: float
    mean: float | None = None
    std: float | None = None
    threshold: float | None = None

    @property
    def skips(self) -> bool:
        return self.verdict != "accept"


def statistics(losses: tuple[float, ...]) -> tuple[float, float]:
    """Mean and population standard deviation, summed in order (the same bits on every rank)."""
    n = len(losses)
    mean = sum(losses) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in losses) / n)


def judge(policy: SpikePolicy, state: SpikeState, step: int, loss: float) -> tuple[Judgement, SpikeState]:
    """The verdict on step `step`'s loss and the state after it. Pure.

    A non-finite loss changes nothing but the step (the non-finite guard skips the step). An accepted
    loss joins the window (the oldest leaves past `window`) and ends a run of spikes; a spike is kept
    out of the window, so a run of spikes does not raise the bar for the next. While fewer than
    `warmup` losses were accepted every finite loss is accepted. `state.step` must be `step`: a
    state that is not the step's is a bug (raised, never silently judged)."""
    if state.step != step:
        raise ValueError(f"loss-spike state is for step {state.step}, asked to judge step {step}")
    nxt = replace(state, step=step + 1)
    if not math.isfinite(loss):
        return Judgement("non_finite", loss), nxt
    if len(state.losses) < policy.warmup:
        return Judgement("accept", loss), replace(nxt, losses=(*state.losses, loss)[-policy.window:], spikes=())
    mean, std = statistics(state.losses)
    threshold = mean + policy.sigma * std
    if loss > threshold:
        spikes = (*state.spikes, step)[-policy.max_consecutive:]  # bounded: a collective carries the state
        verdict: Verdict = "stop" if len(spikes) >= policy.max_consecutive else "skip"
        return Judgement(verdict, loss, mean, std, threshold), replace(nxt, spikes=spikes)
    return (Judgement("accept", loss, mean, std, threshold),
            replace(nxt, losses=(*state.losses, loss)[-policy.window:], spikes=()))


def stop_message(policy: SpikePolicy, spikes: tuple[int, ...], judgement: Judgement, checkpoint: int | None) -> str:
    """Why the workers stop after `max_consecutive` spikes in a row, and what happens next: the job
    stops (`on_consecutive: stop`; what the user can do), or the coordinator rolls back."""
    head = (f"training.loss_spike: {len(spikes)} loss spikes in a row (steps {', '.join(map(str, spikes))}; "
            f"the last loss {judgement.loss:.6g} against a mean of {judgement.mean:.6g} + {policy.sigma:g} sigma "
            f"= {judgement.threshold:.6g}): max_consecutive is {policy.max_consecutive}")
    if policy.on_consecutive == "rollback":
        return (f"{head}, so the job rolls back to the newest complete checkpoint at or before step {spikes[0]} "
                f"and skips the samples up to step {spikes[-1]} (on_consecutive: rollback)")
    where = (f"the newest complete checkpoint is step {checkpoint}" if checkpoint is not None
             else "the job has no complete checkpoint")
    return (f"{head}, so the job stops; {where}. "
            f"The engine is deterministic: resuming from that checkpoint with the same data and settings "
            f"reproduces these spikes exactly, so change what caused them (the learning rate, the samples of "
            f"those steps) before resuming, or raise sigma or max_consecutive, or set on_consecutive: rollback")
