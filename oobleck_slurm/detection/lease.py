"""Heartbeat leases: each heartbeat renews a member's lease; an unrenewed lease expires."""

from __future__ import annotations

from collections.abc import Hashable


class LeaseTable:
    """Tracks when each member was last heard from. A member is lost once `now - last > lease_s`."""

    def __init__(self, lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._last: dict[Hashable, float] = {}

    def renew(self, member: Hashable, now: float) -> None:
        self._last[member] = max(now, self._last.get(member, now))

    def forget(self, member: Hashable) -> None:
        self._last.pop(member, None)

    def age(self, member: Hashable, now: float) -> float:
        return now - self._last[member]

    def expired(self, now: float) -> list[Hashable]:
        """Members whose lease ran out, oldest first."""
        late = [(last, m) for m, last in self._last.items() if now - last > self.lease_s]
        return [m for _, m in sorted(late, key=lambda item: item[0])]

    def members(self) -> list[Hashable]:
        return list(self._last)
