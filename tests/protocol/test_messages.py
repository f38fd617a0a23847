"""Control-plane messages: one type each, every type registered, validated at the boundary with an
error that names the type and the field (tests/fuzz/test_fuzz_protocol.py feeds random objects)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from oobleck_slurm.protocol import messages
from oobleck_slurm.protocol.messages import (
    MESSAGES,
    Fault,
    FaultResult,
    Health,
    Heartbeat,
    Message,
    Register,
    Start,
    Status,
    StatusResult,
    expect,
    parse,
)
from oobleck_slurm.protocol.wire import ProtocolError

EXAMPLES: list[Message] = [
    messages.Hello(role="agent", node="node1"),
    Register(node="node1", replacement="r2", pid=42, slurm_job_id="17"),
    Heartbeat(node="node1", workers=("running", "stopped"), cpu=12.5, t=1.5),
    messages.WorkerExit(node="node1", node_id="r2", code=-9, worker=1),
    messages.HealthResult(node="node1", prefix="health/r2/1", ok=True, seconds=4.2, detail="ok"),
    messages.Preempt(node="node1", signal="SIGUSR2", t=2.0),
    messages.Metrics(node="node1", samples=((1.0, "cpu.util", 12.5), (1.0, "mem.used_mb", 900.0))),
    Fault(node="node2", how="agent", worker=0, t=3.0),
    FaultResult(ok=False, detail="no agent on node9"),
    Status(),
    StatusResult(members=("node1", "r1"), agents=("node1",), watched=("node1",), node_of={"node1": "node1"},
                 requests={"r1": "99"}, agent_pids={"node1": 7}, states={"node1": "running", "r1": "requested"}),
    Start(node_id="node1", workers=4, threads=18, device="cuda"),
    messages.Stop(),
    Health(host="node1", port=29500, prefix="health/r2/1", timeout=60.0),
    messages.Drill(how="hang", worker=1),
    messages.Shutdown(),
]


def test_every_message_type_is_registered_once_and_has_an_example() -> None:
    classes = [c for c in vars(messages).values() if isinstance(c, type) and issubclass(c, Message) and c is not Message]
    assert sorted(MESSAGES) == sorted(c.TYPE for c in classes)
    assert all(MESSAGES[c.TYPE] is c for c in classes)
    assert sorted(type(m).TYPE for m in EXAMPLES) == sorted(MESSAGES)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.TYPE)
def test_round_trip_through_json(message: Message) -> None:
    wire = json.loads(json.dumps(message.to_dict()))
    assert wire["type"] == message.TYPE
    assert parse(wire) == message


def test_defaults_fill_optional_fields_and_ints_are_taken_as_floats() -> None:
    assert parse({"type": "fault", "node": "node2", "how": "agent", "t": 0}) == Fault(node="node2", how="agent", t=0.0)
    assert parse({"type": "start", "node_id": "n"}) == Start(node_id="n", workers=1, threads=1, device="cpu")
    assert parse({"type": "register", "node": "n", "replacement": None}).replacement is None


@pytest.mark.parametrize(("data", "error"), [
    ([], "a message must be a JSON object, got a list"),
    ({"node": "n"}, "a message needs a string 'type'"),
    ({"type": 3}, "a message needs a string 'type'"),
    ({"type": "reboot"}, "unknown message type 'reboot'"),
    ({"type": "heartbeat", "node": "n"}, "heartbeat message: missing field 't'"),
    ({"type": "heartbeat", "node": "n", "t": 1, "load": 2}, "heartbeat message: unknown field 'load'"),
    ({"type": "heartbeat", "node": 5, "t": 1}, "heartbeat message: field 'node' must be a string, got a number"),
    ({"type": "heartbeat", "node": "n", "t": "now"}, "heartbeat message: field 't' must be a number, got a string"),
    ({"type": "heartbeat", "node": "n", "t": float("nan")}, "heartbeat message: field 't' must be a finite number"),
    ({"type": "heartbeat", "node": "n", "t": 10**400}, "heartbeat message: field 't' must be a finite number"),
    ({"type": "heartbeat", "node": "n", "t": 1, "workers": "running"},
     "heartbeat message: field 'workers' must be a list, got a string"),
    ({"type": "heartbeat", "node": "n", "t": 1, "workers": ["running", 1]},
     "heartbeat message: field 'workers'[1] must be a string, got a number"),
    ({"type": "worker_exit", "node": "n", "node_id": "n", "code": True},
     "worker_exit message: field 'code' must be an integer, got a boolean"),
    ({"type": "health_result", "node": "n", "prefix": "p", "ok": 1, "seconds": 1},
     "health_result message: field 'ok' must be true or false, got a number"),
    ({"type": "start", "node_id": "n", "workers": 0}, "start message: field 'workers' must be at least 1, got 0"),
    ({"type": "health", "host": "h", "port": 70000, "prefix": "p", "timeout": 1},
     "health message: field 'port' must be at most 65535, got 70000"),
    ({"type": "drill", "how": "worker", "worker": -1}, "drill message: field 'worker' must be at least 0, got -1"),
    ({"type": "status_result", "members": [], "agents": [], "watched": [], "node_of": [], "requests": {},
      "agent_pids": {}, "states": {}}, "status_result message: field 'node_of' must be an object, got a list"),
    ({"type": "status_result", "members": [], "agents": [], "watched": [], "node_of": {}, "requests": {},
      "agent_pids": {"node1": "7"}, "states": {}},
     "status_result message: field 'agent_pids'['node1'] must be an integer, got a string"),
])
def test_invalid_messages_name_the_type_and_field(data: Any, error: str) -> None:
    with pytest.raises(ProtocolError) as err:
        parse(data)
    assert str(err.value).startswith(error), str(err.value)


def test_a_reply_must_be_the_expected_type() -> None:
    assert expect({"type": "fault_result", "ok": True}, FaultResult) == FaultResult(ok=True)
    with pytest.raises(ProtocolError, match="expected a status_result message, got fault_result"):
        expect({"type": "fault_result", "ok": True}, StatusResult)
