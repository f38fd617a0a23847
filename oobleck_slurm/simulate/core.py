"""The bookkeeping every simulated system shares: where the wall time went, and samples over time.

Categories (seconds; they add up to the wall time):
- useful:        steps that were committed and stay committed (the effective training time)
- recovering:    detection, agreement, replanning, group rebuild, state copy, restarts after a failure,
                 and the re-formations that fold in a joining node
- replayed:      work of a step interrupted by a failure, thrown away and done again
- checkpointing: time the training stalls to write a checkpoint
- fallback:      restarting from a checkpoint because in-memory recovery was impossible
- lost:          committed work discarded by a roll-back to the last checkpoint
- redundant:     the share of training time spent on redundant computation (Bamboo-like)
- idle:          no plan fits the live nodes; waiting for nodes

useful_fraction = useful / wall time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

CATEGORIES = ("useful", "recovering", "replayed", "checkpointing", "fallback", "lost", "redundant", "idle")


class Ledger:
    """Time and samples of one simulated run. Training advances analytically (no per-step loop), so a
    month of 0.3 s steps costs the same as an hour; checkpoints every `checkpoint_every` steps stall
    for `checkpoint_s` and become the roll-back point when they complete."""

    def __init__(self, batch_samples: int, checkpoint_every: int = 0, checkpoint_s: float = 0.0,
                 curve_points: int = 2000) -> None:
        self.batch = batch_samples
        self.checkpoint_every = checkpoint_every
        self.checkpoint_s = checkpoint_s
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.t = 0.0
        self.step_s: float | None = None  # None: not training (no plan)
        self.useful_share = 1.0  # < 1: the rest of each step is redundant computation
        self.steps = 0
        self.partial = 0.0  # seconds into the current step (or checkpoint, when in_checkpoint)
        self.in_checkpoint = False
        self.steps_since_checkpoint = 0
        self.steps_at_checkpoint = 0
        self.useful_since_checkpoint = 0.0
        self.redundant_since_checkpoint = 0.0
        self.checkpoints = 0
        self.curve: list[tuple[float, float]] = [(0.0, 0.0)]
        self._curve_every = 0.0
        self._curve_points = curve_points

    @property
    def samples(self) -> int:
        return self.steps * self.batch

    def set_horizon(self, horizon_s: float) -> None:
        self._curve_every = horizon_s / max(1, self._curve_points)

    def _mark(self, force: bool = False) -> None:
        if force or self.t - self.curve[-1][0] >= self._curve_every:
            self.curve.append((self.t, float(self.samples)))

    def spend(self, category: str, seconds: float) -> None:
        """Wall time that trains nothing."""
        if seconds <= 0:
            return
        self.seconds[category] += seconds
        self.t += seconds
        self._mark()

    def train(self, seconds: float) -> None:
        """Train for `seconds` of wall time at `step_s` per step, checkpointing on schedule."""
        assert self.step_s is not None and self.step_s > 0
        S, K = self.step_s, self.checkpoint_every
        while seconds > 1e-12:
            if self.in_checkpoint:
                rest = self.checkpoint_s - self.partial
                use = min(seconds, rest)
                self.seconds["checkpointing"] += use
                self.t += use
                seconds -= use
                self.partial += use
                if self.partial >= self.checkpoint_s - 1e-12:
                    self._checkpoint_done()
                continue
            if K > 0 and self.steps_since_checkpoint >= K:  # due (e.g. one cut short by a failure)
                self.partial = 0.0
                self.in_checkpoint = True
                if self.checkpoint_s <= 0:
                    self._checkpoint_done()
                continue
            left = (K - self.steps_since_checkpoint) if K > 0 else math.inf
            run = min(seconds, left * S - self.partial)
            total = self.partial + run
            n = int(min(math.floor(total / S + 1e-9), left))  # left may be inf: no checkpoints
            self.partial = max(0.0, total - n * S)
            self.steps += n
            self.steps_since_checkpoint += n
            done = n * S
            self.seconds["useful"] += done * self.useful_share
            self.seconds["redundant"] += done * (1 - self.useful_share)
            self.useful_since_checkpoint += done * self.useful_share
            self.redundant_since_checkpoint += done * (1 - self.useful_share)
            self.t += run
            seconds -= run
            self._mark()

    def _checkpoint_done(self) -> None:
        self.in_checkpoint = False
        self.partial = 0.0
        self.steps_since_checkpoint = 0
        self.steps_at_checkpoint = self.steps
        self.useful_since_checkpoint = 0.0
        self.redundant_since_checkpoint = 0.0
        self.checkpoints += 1

    def finish_step(self) -> None:
        """Train until the current step (or checkpoint) is complete: a join waits for a step boundary."""
        if self.step_s is None:
            return
        if self.in_checkpoint:
            self.train(self.checkpoint_s - self.partial)
        elif self.partial > 0:
            self.train(self.step_s - self.partial)

    def interrupt(self, category: str = "replayed") -> None:
        """A failure: the step in progress is lost (a checkpoint being written is not saved)."""
        if self.in_checkpoint:
            self.in_checkpoint = False  # its seconds stay under checkpointing; it never completed
            self.steps_since_checkpoint = max(self.steps_since_checkpoint, self.checkpoint_every)
        elif self.partial > 0:
            self.seconds[category] += self.partial
        self.partial = 0.0

    def roll_back(self) -> None:
        """Return to the last completed checkpoint: committed work since then becomes lost."""
        self.interrupt("lost")
        self.seconds["useful"] -= self.useful_since_checkpoint
        self.seconds["redundant"] -= self.redundant_since_checkpoint
        self.seconds["lost"] += self.useful_since_checkpoint + self.redundant_since_checkpoint
        self.useful_since_checkpoint = self.redundant_since_checkpoint = 0.0
        self.steps = self.steps_at_checkpoint
        self.steps_since_checkpoint = 0
        self._mark(force=True)

    def close(self) -> None:
        """End of the run: a step in progress counts as useful time (the run goes on beyond)."""
        if self.partial > 0 and not self.in_checkpoint:
            self.seconds["useful"] += self.partial * self.useful_share
            self.seconds["redundant"] += self.partial * (1 - self.useful_share)
            self.partial = 0.0
        self._mark(force=True)


@dataclass
class SystemResult:
    """One system's simulated run."""

    system: str
    wall_s: float
    seconds: dict[str, float]
    samples: int
    steps: int
    failures: int
    joins: int
    fallbacks: int = 0
    checkpoints: int = 0
    samples_curve: list[tuple[float, float]] = field(default_factory=list)
    initial_samples_per_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def useful_fraction(self) -> float:
        return self.seconds["useful"] / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self, curve: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "system": self.system, "useful_fraction": self.useful_fraction, "samples": self.samples,
            "steps": self.steps, "wall_s": self.wall_s, "mean_samples_per_s": self.mean_samples_per_s,
            "initial_samples_per_s": self.initial_samples_per_s, "failures": self.failures, "joins": self.joins,
            "fallbacks": self.fallbacks, "checkpoints": self.checkpoints,
            "breakdown_s": dict(self.seconds),
            "breakdown_fraction": {k: (v / self.wall_s if self.wall_s > 0 else 0.0) for k, v in self.seconds.items()},
            "notes": list(self.notes), "details": dict(self.details),
        }
        if curve:
            out["samples_curve"] = [[round(t, 3), s] for t, s in self.samples_curve]
        return out


def ledger_result(system: str, ledger: Ledger, wall_s: float, failures: int, joins: int, **extra: Any) -> SystemResult:
    ledger.close()
    return SystemResult(system, wall_s, dict(ledger.seconds), ledger.samples, ledger.steps, failures, joins,
                        checkpoints=ledger.checkpoints, samples_curve=list(ledger.curve), **extra)
