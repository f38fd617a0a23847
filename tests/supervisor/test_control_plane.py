"""The control plane refuses every peer that lacks the job secret or sends a bad frame, and keeps serving."""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time
from pathlib import Path

import pytest

from oobleck_slurm.cluster.jobdir import SecretError, create_secret, load_secret
from oobleck_slurm.protocol.wire import HANDSHAKE_MAGIC, NONCE_BYTES, ProtocolError, connect
from oobleck_slurm.supervisor.server import ControlServer


class Recorder:
    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.refused: list[tuple[str, str]] = []
        self.changed = threading.Event()

    def handler(self, channel, message):
        self.messages.append(message)
        self.changed.set()
        return {"type": "ack", "n": len(self.messages), "node": channel.peer.get("node")}

    def on_refused(self, peer: str, reason: str) -> None:
        self.refused.append((peer, reason))
        self.changed.set()

    def wait_refused(self, count: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.refused) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.refused) >= count, self.refused


@pytest.fixture
def served(tmp_path: Path):
    secret = create_secret(tmp_path)
    recorder = Recorder()
    server = ControlServer(secret, recorder.handler, recorder.on_refused, host="127.0.0.1", handshake_timeout=1.0).start()
    yield secret, server, recorder
    server.stop()


def assert_still_serving(server: ControlServer, secret: bytes) -> None:
    channel = connect("127.0.0.1", server.port, secret, {"node": "good"})
    channel.send({"type": "ping"})
    assert channel.recv()["type"] == "ack"
    channel.close()


def test_authenticated_round_trip(served) -> None:
    secret, server, recorder = served
    channel = connect("127.0.0.1", server.port, secret, {"node": "node1"})
    for i in range(3):
        channel.send({"type": "heartbeat", "i": i})
        reply = channel.recv()
        assert reply == {"type": "ack", "n": i + 1, "node": "node1"}
    assert [m["i"] for m in recorder.messages] == [0, 1, 2]
    assert recorder.refused == []


def test_wrong_secret_is_refused_and_changes_nothing(served) -> None:
    secret, server, recorder = served
    channel = connect("127.0.0.1", server.port, os.urandom(32), {"node": "intruder"})
    channel.send({"type": "kill", "node": "node1"})
    with pytest.raises((EOFError, ConnectionError)):
        channel.recv()
    recorder.wait_refused(1)
    assert recorder.messages == []
    assert "authentication" in recorder.refused[0][1]
    assert_still_serving(server, secret)


def test_non_protocol_peer_is_refused(served) -> None:
    secret, server, recorder = served
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.recv(len(HANDSHAKE_MAGIC) + NONCE_BYTES)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        recorder.wait_refused(1)
    assert "does not speak" in recorder.refused[0][1]
    assert recorder.messages == []
    assert_still_serving(server, secret)


def test_silent_peer_is_dropped_after_handshake_timeout(served) -> None:
    secret, server, recorder = served
    with socket.create_connection(("127.0.0.1", server.port)):
        recorder.wait_refused(1, timeout=5)
    assert "timed out" in recorder.refused[0][1]
    assert_still_serving(server, secret)


def test_garbled_frame_after_handshake_is_refused(served) -> None:
    secret, server, recorder = served
    channel = connect("127.0.0.1", server.port, secret, {"node": "node1"})
    channel.send({"type": "heartbeat"})
    channel.recv()
    payload = b'{"type":"heartbeat"}'
    channel.sock.sendall(struct.pack(">I", len(payload)) + b"\x00" * 32 + payload)  # wrong tag
    recorder.wait_refused(1)
    assert len(recorder.messages) == 1
    assert_still_serving(server, secret)


def test_replayed_frame_is_refused(served) -> None:
    secret, server, recorder = served
    channel = connect("127.0.0.1", server.port, secret, {"node": "node1"})
    frame = channel.encode({"type": "step_done", "step": 7})
    channel.sock.sendall(frame)
    channel.recv()
    channel.sock.sendall(frame)  # the exact same bytes again
    recorder.wait_refused(1)
    assert [m.get("step") for m in recorder.messages] == [7]


def test_oversized_frame_is_refused_before_reading(served) -> None:
    secret, server, recorder = served
    channel = connect("127.0.0.1", server.port, secret, {"node": "node1"})
    channel.sock.sendall(struct.pack(">I", 1 << 30))
    recorder.wait_refused(1)
    assert "limit" in recorder.refused[0][1]
    with pytest.raises(ProtocolError):
        channel.send({"type": "x", "blob": "a" * (2 << 20)})
    assert_still_serving(server, secret)


def test_handler_error_drops_only_that_connection(tmp_path: Path) -> None:
    secret = create_secret(tmp_path)
    refused: list[str] = []

    def handler(channel, message):
        if message["type"] == "boom":
            raise KeyError("missing field")
        return {"type": "ok"}

    server = ControlServer(secret, handler, lambda peer, reason: refused.append(reason), host="127.0.0.1").start()
    try:
        bad = connect("127.0.0.1", server.port, secret, {"node": "a"})
        bad.send({"type": "boom"})
        with pytest.raises((EOFError, ConnectionError)):
            bad.recv()
        good = connect("127.0.0.1", server.port, secret, {"node": "b"})
        good.send({"type": "fine"})
        assert good.recv() == {"type": "ok"}
        assert any("handler error KeyError" in r for r in refused)
    finally:
        server.stop()


def test_secret_file_is_private_and_checked(tmp_path: Path) -> None:
    secret = create_secret(tmp_path)
    path = tmp_path / "secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_secret(tmp_path) == secret
    with pytest.raises(FileExistsError):
        create_secret(tmp_path)  # never overwrite a running job's secret
    path.chmod(0o644)
    with pytest.raises(SecretError, match="accessible by other users"):
        load_secret(tmp_path)
    path.chmod(0o600)
    path.write_text("zz\n")
    with pytest.raises(SecretError, match="not hex"):
        load_secret(tmp_path)
    with pytest.raises(SecretError, match="not found"):
        load_secret(tmp_path / "other")


def test_authenticated_peer_that_resets_is_not_a_refusal(served) -> None:
    secret, server, recorder = served
    channel = connect("127.0.0.1", server.port, secret, {"node": "status-cli"})
    channel.send({"type": "ping"})
    channel.recv()
    channel.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
    channel.close()
    time.sleep(0.3)
    assert recorder.refused == []
    assert_still_serving(server, secret)
