"""Talking to a running job's supervisor from outside (commands, drills, tests): authenticated with the
job secret, addressed through the job folder's supervisor.json, in protocol/messages.py's messages."""

from __future__ import annotations

import os
import time

from oobleck_slurm.cluster.jobdir import JobDir, SecretError, load_secret
from oobleck_slurm.errors import InfrastructureError
from oobleck_slurm.protocol.messages import Fault, FaultResult, Hello, M, Message, Status, StatusResult, expect
from oobleck_slurm.protocol.wire import ProtocolError, connect

CLIENT_TIMEOUT_S = 5.0


class SupervisorUnreachable(InfrastructureError):
    """The job has no running supervisor (not started yet, finished, or its node is gone), or it did
    not answer as a supervisor does."""


def request(job_dir: str | os.PathLike[str], message: Message, reply: type[M],
            timeout: float = CLIENT_TIMEOUT_S) -> M:
    """Send one message to the job's supervisor and return its reply, which must be a `reply`."""
    job = JobDir.at(job_dir)
    address = job.supervisor_address()
    if address is None:
        raise SupervisorUnreachable(f"{job.supervisor_file}: no supervisor address (the job has not started yet?)")
    try:
        secret = load_secret(job.path)
    except SecretError as err:
        raise SupervisorUnreachable(str(err)) from None
    try:
        channel = connect(address["host"], address["port"], secret, Hello(role="client").to_dict(), timeout=timeout)
    except (OSError, EOFError, ProtocolError) as err:
        raise SupervisorUnreachable(f"supervisor at {address['host']}:{address['port']} does not answer: {err}") from None
    try:
        channel.sock.settimeout(timeout)
        channel.send(message.to_dict())
        return expect(channel.recv(), reply)
    except (OSError, EOFError) as err:
        raise SupervisorUnreachable(f"supervisor closed the connection: {err}") from None
    except ProtocolError as err:
        raise SupervisorUnreachable(f"supervisor sent an invalid reply to {message.TYPE}: {err}") from None
    finally:
        channel.close()


def notify_fault(job_dir: str | os.PathLike[str], node: str, how: str, t: float | None = None,
                 worker: int = 0) -> FaultResult:
    """Tell the supervisor a drill injects `how` into `node` now (it relays agent/worker/hang drills to
    the node's agent, for its worker `worker`, and measures detection times from `t`)."""
    return request(job_dir, Fault(node=node, how=how, worker=worker, t=time.time() if t is None else t), FaultResult)


def live_status(job_dir: str | os.PathLike[str]) -> StatusResult:
    return request(job_dir, Status(), StatusResult)
