"""The health check of a node before it joins: can a fresh process there run a collective with a peer?

A node that comes back (or a replacement Slurm just gave us) is not trusted blindly: its agent runs
`python -m oobleck_slurm.agent.preflight HOST PORT PREFIX TIMEOUT JOB_DIR` (imports torch, builds a
gloo group of two on the job's store, signed with the job folder's secret, and all-reduces) while the
supervisor is the other member (`health_peer`). Both check the sum; only then does the node's worker
start.
"""

from __future__ import annotations

import datetime as dt
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only where a check runs: the agent's module import stays light
    from torch.distributed import Store

HEALTH_VALUE = 1.0 + 2.0**-20  # not a round number: a garbled reduction does not pass by luck


def _allreduce(store: Store, prefix: str, rank: int, timeout_s: float) -> float:
    import torch

    from oobleck_slurm.engine.comm import make_group

    timeout = dt.timedelta(seconds=timeout_s)
    pg = make_group(store, prefix, rank, 2, timeout, "gloo", timeout)
    t = torch.full((1024,), HEALTH_VALUE, dtype=torch.float64)
    pg.allreduce([t]).wait(timeout)
    return float(t[0])


def health_peer(store: Store, prefix: str, timeout_s: float) -> bool:
    """The supervisor's side (rank 0); True when the sum is right."""
    return _allreduce(store, prefix, 0, timeout_s) == 2 * HEALTH_VALUE


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 5:
        print("usage: python -m oobleck_slurm.agent.preflight HOST PORT PREFIX TIMEOUT JOB_DIR", file=sys.stderr)
        return 2
    import torch

    from oobleck_slurm.cluster.jobdir import load_secret
    from oobleck_slurm.protocol.events import EventLog, events_path
    from oobleck_slurm.protocol.signed_store import connect

    torch.set_num_threads(1)
    host, port, prefix, timeout_s, job_dir = args[0], int(args[1]), args[2], float(args[3]), args[4]
    try:
        store = connect(host, port, dt.timedelta(seconds=timeout_s), load_secret(job_dir),
                        EventLog(events_path(job_dir)), f"health check {prefix}")
        value = _allreduce(store, prefix, 1, timeout_s)
    except Exception as err:  # noqa: BLE001 - the verdict is the exit code; the message is the detail
        print(f"health check failed: {type(err).__name__}: {err}")
        return 1
    if value != 2 * HEALTH_VALUE:
        print(f"health check failed: all-reduce gave {value!r}, expected {2 * HEALTH_VALUE!r}")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
