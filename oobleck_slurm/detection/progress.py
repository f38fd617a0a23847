"""Step progress: a heartbeat proves a process lives, not that it trains (a SIGSTOPped or deadlocked
worker's agent still beats). A worker whose step has not advanced within `step_timeout_s` is hung."""

from __future__ import annotations

from collections.abc import Hashable


class ProgressWatch:
    def __init__(self, step_timeout_s: float) -> None:
        if step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be > 0, got {step_timeout_s}")
        self.step_timeout_s = step_timeout_s
        self._step: dict[Hashable, int] = {}
        self._since: dict[Hashable, float] = {}

    def report(self, worker: Hashable, step: int, now: float) -> None:
        """Record that `worker` is at `step`; only an advance resets its clock."""
        if step != self._step.get(worker):
            self._step[worker] = step
            self._since[worker] = now

    def restart(self, now: float) -> None:
        """After a reconfiguration every worker gets a fresh step timeout."""
        for worker in self._since:
            self._since[worker] = now

    def forget(self, worker: Hashable) -> None:
        self._step.pop(worker, None)
        self._since.pop(worker, None)

    def hung(self, now: float) -> list[Hashable]:
        return [w for w, since in self._since.items() if now - since > self.step_timeout_s]

    def step_of(self, worker: Hashable) -> int | None:
        return self._step.get(worker)

    def top(self) -> int | None:
        """The most advanced step any worker reported."""
        return max(self._step.values(), default=None)

    def behind(self, now: float) -> list[Hashable]:
        """Hung workers whose step is behind a peer's: when every rank waits for the slowest (an
        all-reduce), a stall alone names nobody, but the rank that never reached the step its peers
        reached is the one they wait for."""
        top = self.top()
        return [w for w in self.hung(now) if self._step[w] != top]
