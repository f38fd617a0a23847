"""Talking to a running job's supervisor from outside (commands, drills, tests): authenticated with the
job secret, addressed through `<job_dir>/supervisor.json`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from oobleck_slurm.supervisor.agent import SUPERVISOR_FILE
from oobleck_slurm.supervisor.secret import load_secret
from oobleck_slurm.supervisor.server import connect

CLIENT_TIMEOUT_S = 5.0


class SupervisorUnreachable(Exception):
    """The job has no running supervisor (not started yet, finished, or its node is gone)."""


def request(job_dir: str | os.PathLike[str], message: dict[str, Any], timeout: float = CLIENT_TIMEOUT_S) -> dict[str, Any]:
    """Send one message to the job's supervisor and return its reply."""
    path = Path(job_dir) / SUPERVISOR_FILE
    try:
        address = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        raise SupervisorUnreachable(f"{path}: no supervisor address (the job has not started yet?)") from None
    try:
        channel = connect(address["host"], int(address["port"]), load_secret(job_dir), {"role": "client"},
                          timeout=timeout)
    except (OSError, EOFError) as err:
        raise SupervisorUnreachable(f"supervisor at {address['host']}:{address['port']} does not answer: {err}") from None
    try:
        channel.sock.settimeout(timeout)
        channel.send(message)
        return channel.recv()
    except (OSError, EOFError) as err:
        raise SupervisorUnreachable(f"supervisor closed the connection: {err}") from None
    finally:
        channel.close()


def notify_fault(job_dir: str | os.PathLike[str], node: str, how: str, t: float | None = None,
                 worker: int = 0) -> dict[str, Any]:
    """Tell the supervisor a drill injects `how` into `node` now (it relays agent/worker/hang drills to
    the node's agent, for its worker `worker`, and measures detection times from `t`)."""
    return request(job_dir, {"type": "fault", "node": node, "how": how, "worker": worker,
                             "t": time.time() if t is None else t})


def live_status(job_dir: str | os.PathLike[str]) -> dict[str, Any]:
    return request(job_dir, {"type": "status"})
