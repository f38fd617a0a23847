"""Ranks of a test as threads of its process (real gloo groups need one thread per rank): run `fn(rank)`
on each, return what each returned, and re-raise the first error one raised."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

JOIN_S = 120.0  # a rank that has not returned by then hangs


def on_ranks(world: int, fn: Callable[[int], Any], join_s: float = JOIN_S) -> list[Any]:
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), f"a rank did not return within {join_s:g} s"
    return out


def worker_state(worker: Any) -> dict[str, Any]:
    """Copies of a worker's held parameters and optimizer state, by "<layer>/<name>" (bitwise checks)."""
    from oobleck_slurm.optim import optimizer_state_tensors

    out = {}
    for i in sorted(worker.layers):
        for name, p in worker.layers[i].named_parameters():
            out[f"{i}/{name}"] = p.detach().clone()
        for name, t in optimizer_state_tensors(worker.optimizers[i]).items():
            out[f"{i}/state/{name}"] = t.detach().clone()
    return out
