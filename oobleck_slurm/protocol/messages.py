"""Control-plane messages, one frozen dataclass per type, validated where they enter a process.

Every message on the control plane (wire.py frames: supervisor <-> agents, commands -> supervisor)
is one of these. `parse(dict)` turns a received JSON object into its message and refuses anything
else with a ProtocolError naming the type and the field (unknown type, missing or unknown field,
wrong JSON type, a non-finite number); `to_dict()` is what is sent. A peer that sends an invalid
message is a broken peer: the receiver drops its connection (server.py), as for a bad frame.

    hello          any -> supervisor   the handshake's first frame (wire.py): who connects
    register       agent -> supervisor  an agent is up on `node` (a replacement names its token)
    heartbeat      agent -> supervisor  alive, with its workers' process states and the node's CPU use
    worker_exit    agent -> supervisor  a worker failed (its node's others are killed), or all finished (0)
    health_result  agent -> supervisor  the outcome of a health check
    preempt        agent -> supervisor  Slurm's preemption / time-limit signal reached the node
    fault          command -> supervisor  a drill injects a fault now; replied to with fault_result
    status         command -> supervisor  replied to with status_result (the backend's view of the nodes)
    start          supervisor -> agent  start the node's workers under a node id
    stop           supervisor -> agent  kill the workers
    health         supervisor -> agent  run a health check collective with the supervisor
    drill          supervisor -> agent  a fault that the agent carries out (kill itself, kill or stop a worker)
    shutdown       supervisor -> agent  stop the workers and exit

Fields are checked from their annotations (typed.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from oobleck_slurm.protocol.typed import decode, encode, json_name, short
from oobleck_slurm.protocol.wire import ProtocolError


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base of every message type; `TYPE` is its "type" on the wire."""

    TYPE: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, **encode(self)}


# ---- agent -> supervisor ---------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    TYPE: ClassVar[str] = "hello"
    role: str  # agent | client
    node: str | None = None


@dataclass(frozen=True, kw_only=True)
class Register(Message):
    TYPE: ClassVar[str] = "register"
    node: str  # the Slurm node (or local virtual node) the agent runs on
    replacement: str | None = None  # the token (r1, r2, ...) the supervisor asked Slurm for
    pid: int | None = None  # the agent's process id on its node (local drills find the node's processes by it)
    slurm_job_id: str | None = None
    # After a supervisor's takeover: the node id its workers run under, and their process states
    running: str | None = None
    workers: tuple[str, ...] = ()
    exited: int | None = None  # how they ended, if they did meanwhile: 0 all finished, else the first failure's code


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    TYPE: ClassVar[str] = "heartbeat"
    node: str
    workers: tuple[str, ...] = ()  # psutil's state of each worker process ("running", "stopped", "gone")
    cpu: float | None = None  # the node's CPU use, %
    t: float


@dataclass(frozen=True, kw_only=True)
class WorkerExit(Message):
    TYPE: ClassVar[str] = "worker_exit"
    node: str
    node_id: str  # the id the supervisor started the workers under
    code: int  # the first failed worker's exit code, or 0 once every worker finished
    worker: int | None = None  # which worker failed


@dataclass(frozen=True, kw_only=True)
class HealthResult(Message):
    TYPE: ClassVar[str] = "health_result"
    node: str
    prefix: str  # the check's, from its health message: a late result of an earlier check is told apart
    ok: bool
    seconds: float
    detail: str = ""
    figures: dict[str, float] = field(default_factory=dict)  # the pre-flight measurement (detection/preflight.py)


@dataclass(frozen=True, kw_only=True)
class Preempt(Message):
    TYPE: ClassVar[str] = "preempt"
    node: str
    signal: str
    t: float


@dataclass(frozen=True, kw_only=True)
class Metrics(Message):
    """A batch of the node's samples (agent/health.py); checked further where it is read
    (supervisor/health_monitor.py `parse_metrics`)."""

    TYPE: ClassVar[str] = "metrics"
    node: str
    samples: tuple[tuple[float, str, float], ...]  # (time, metric, value)

# ---- commands -> supervisor, and the replies --------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Fault(Message):
    TYPE: ClassVar[str] = "fault"
    node: str  # a node id or a Slurm node name
    how: str  # kill-node's --how
    worker: int = 0
    t: float  # when the fault is injected (detection times are measured from it)

    def __post_init__(self) -> None:
        _at_least(self, "worker", 0)


@dataclass(frozen=True, kw_only=True)
class FaultResult(Message):
    TYPE: ClassVar[str] = "fault_result"
    ok: bool
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class Status(Message):
    TYPE: ClassVar[str] = "status"


@dataclass(frozen=True, kw_only=True)
class StatusResult(Message):
    TYPE: ClassVar[str] = "status_result"
    members: tuple[str, ...]  # node ids handed to the coordinator, in order
    agents: tuple[str, ...]  # Slurm nodes with a connected agent
    watched: tuple[str, ...]  # node ids every detection path watches
    node_of: dict[str, str]  # node id -> Slurm node
    requests: dict[str, str]  # replacement token -> Slurm job id
    agent_pids: dict[str, int | None]  # Slurm node -> its agent's process id
    states: dict[str, str]  # node id -> its NodeState (agent_nodes.py)


DEVICES = ("cpu", "cuda")  # what a node's workers compute on


# ---- supervisor -> agent ------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Start(Message):
    TYPE: ClassVar[str] = "start"
    node_id: str
    workers: int = 1  # one per device
    threads: int = 1  # CPU threads of each worker
    device: str = "cpu"  # cpu | cuda

    def __post_init__(self) -> None:
        _at_least(self, "workers", 1)
        _at_least(self, "threads", 1)
        _one_of(self, "device", DEVICES)


@dataclass(frozen=True, kw_only=True)
class Stop(Message):
    TYPE: ClassVar[str] = "stop"


@dataclass(frozen=True, kw_only=True)
class Health(Message):
    TYPE: ClassVar[str] = "health"
    host: str  # the job store's address
    port: int
    prefix: str  # the store prefix of the check's group (keys.health_prefix)
    timeout: float
    measure: bool = False  # also the pre-flight measurement (agent/preflight.py), of:
    threads: int = 1  # a worker's CPU threads
    device: str = "cpu"  # cpu | cuda
    devices: int = 1  # the node's devices (its workers)

    def __post_init__(self) -> None:
        _at_least(self, "port", 1)
        _at_most(self, "port", 65535)
        _at_least(self, "timeout", 0.001)
        _at_least(self, "threads", 1)
        _at_least(self, "devices", 1)
        _one_of(self, "device", DEVICES)


@dataclass(frozen=True, kw_only=True)
class Drill(Message):
    TYPE: ClassVar[str] = "drill"
    how: str  # agent | worker | hang
    worker: int = 0

    def __post_init__(self) -> None:
        _at_least(self, "worker", 0)


@dataclass(frozen=True, kw_only=True)
class Shutdown(Message):
    TYPE: ClassVar[str] = "shutdown"


M = TypeVar("M", bound=Message)

MESSAGES: dict[str, type[Message]] = {cls.TYPE: cls for cls in (
    Hello, Register, Heartbeat, WorkerExit, HealthResult, Preempt, Metrics, Fault, FaultResult, Status, StatusResult,
    Start, Stop, Health, Drill, Shutdown)}


# ---- validation -------------------------------------------------------------------------------------

def parse(data: Any) -> Message:
    """The message `data` (a received JSON object) is; ProtocolError naming the type and field if it
    is none."""
    if not isinstance(data, dict):
        raise ProtocolError(f"a message must be a JSON object, got {json_name(data)}")
    kind = data.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("a message needs a string 'type'")
    cls = MESSAGES.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message type {kind[:50]!r}")
    return decode(cls, {k: v for k, v in data.items() if k != "type"}, f"{kind} message")


def expect(data: Any, cls: type[M]) -> M:
    """`parse(data)`, which must be a `cls` (a reply to a request)."""
    message = parse(data)
    if not isinstance(message, cls):
        raise ProtocolError(f"expected a {cls.TYPE} message, got {message.TYPE}")
    return message


def _at_least(message: Message, name: str, low: float) -> None:
    if getattr(message, name) < low:
        raise ProtocolError(f"{message.TYPE} message: field {name!r} must be at least {low:g}, "
                            f"got {short(getattr(message, name))}")


def _one_of(message: Message, name: str, choices: tuple[str, ...]) -> None:
    if getattr(message, name) not in choices:
        raise ProtocolError(f"{message.TYPE} message: field {name!r} must be one of {', '.join(choices)}, "
                            f"got {short(getattr(message, name))}")


def _at_most(message: Message, name: str, high: float) -> None:
    if getattr(message, name) > high:
        raise ProtocolError(f"{message.TYPE} message: field {name!r} must be at most {high:g}, "
                            f"got {short(getattr(message, name))}")
