"""Control-plane wire format: small JSON messages in authenticated frames. Never pickle.

A connection starts with a handshake: each side sends a random nonce, and both derive a session key
`HMAC(secret, server_nonce + client_nonce)`. Every frame after that is

    length (4 bytes, big endian) | tag (32 bytes) | payload (UTF-8 JSON object)
    tag = HMAC-SHA256(session_key, direction + sequence number (8 bytes) + payload)

so a peer without the job secret cannot send anything that is accepted, a frame cannot be replayed
or reordered (the sequence number is implicit), and a garbled frame is detected before it is
parsed. A frame over `max_bytes` is refused before it is read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
from typing import Any

from oobleck_slurm.errors import InfrastructureError
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS

NONCE_BYTES = 16
TAG_BYTES = 32
DEFAULT_MAX_BYTES = 1 << 20  # plans and metrics are kilobytes; a megabyte is already a wrong peer
HANDSHAKE_MAGIC = b"OOBLECK1"


class ProtocolError(InfrastructureError):
    """The peer sent something that is not a valid, authenticated message; drop the connection."""


class Channel:
    """One authenticated, ordered message stream over a connected socket."""

    def __init__(self, sock: socket.socket, session_key: bytes, is_server: bool, max_bytes: int) -> None:
        self.sock = sock
        self._key = session_key
        self._send_dir, self._recv_dir = (b"S", b"C") if is_server else (b"C", b"S")
        self._send_seq = 0
        self._recv_seq = 0
        self.max_bytes = max_bytes
        self.peer: dict[str, Any] = {}  # the peer's hello message, once the handshake is done

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(self.encode(message))

    def encode(self, message: dict[str, Any]) -> bytes:
        """The next frame on the wire for `message` (advances the sequence number)."""
        payload = json.dumps(message, separators=(",", ":")).encode()
        if len(payload) > self.max_bytes:
            raise ProtocolError(f"message of {len(payload)} bytes exceeds the {self.max_bytes}-byte limit")
        tag = self._tag(self._send_dir, self._send_seq, payload)
        self._send_seq += 1
        return struct.pack(">I", len(payload)) + tag + payload

    def recv(self) -> dict[str, Any]:
        """The next message; raises ProtocolError on a bad frame, EOFError when the peer closed."""
        (length,) = struct.unpack(">I", _recv_exact(self.sock, 4))
        if length > self.max_bytes:
            raise ProtocolError(f"peer announced a {length}-byte message; limit is {self.max_bytes}")
        tag = _recv_exact(self.sock, TAG_BYTES)
        payload = _recv_exact(self.sock, length)
        if not hmac.compare_digest(tag, self._tag(self._recv_dir, self._recv_seq, payload)):
            raise ProtocolError("frame failed authentication (wrong secret, garbled or replayed)")
        self._recv_seq += 1
        try:
            message = json.loads(payload)
        except ValueError as err:  # not UTF-8, not JSON, or an integer over Python's 4300-digit limit
            raise ProtocolError(f"authenticated frame is not JSON: {str(err)[:200]}") from None
        except RecursionError:  # json's parser on deep nesting ("[[[[..."); no message nests deeply
            raise ProtocolError("authenticated frame nests JSON too deeply") from None
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise ProtocolError("message must be a JSON object with a string 'type'")
        return message

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def shutdown(self) -> None:
        """Close from another thread: a recv blocked on this socket returns (EOF) at once, which a
        plain close does not guarantee on Linux."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.close()

    def _tag(self, direction: bytes, seq: int, payload: bytes) -> bytes:
        return hmac.new(self._key, direction + struct.pack(">Q", seq) + payload, hashlib.sha256).digest()


def server_handshake(sock: socket.socket, secret: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> Channel:
    """Run the server side of the handshake; the client proves it knows `secret` with its first frame."""
    server_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(HANDSHAKE_MAGIC + server_nonce)
    magic_and_nonce = _recv_exact(sock, len(HANDSHAKE_MAGIC) + NONCE_BYTES)
    if not magic_and_nonce.startswith(HANDSHAKE_MAGIC):
        raise ProtocolError("peer does not speak the oobleck control protocol")
    client_nonce = magic_and_nonce[len(HANDSHAKE_MAGIC):]
    channel = Channel(sock, _session_key(secret, server_nonce, client_nonce), is_server=True, max_bytes=max_bytes)
    hello = channel.recv()  # authenticated: only a holder of the secret gets past this line
    if hello["type"] != "hello":
        raise ProtocolError(f"expected a hello message first, got {hello['type']!r}")
    channel.peer = hello
    return channel


def client_handshake(sock: socket.socket, secret: bytes, hello: dict[str, Any],
                     max_bytes: int = DEFAULT_MAX_BYTES) -> Channel:
    """Run the client side and send `hello` (e.g. {"type": "hello", "node": ...}) as the first frame."""
    magic_and_nonce = _recv_exact(sock, len(HANDSHAKE_MAGIC) + NONCE_BYTES)
    if not magic_and_nonce.startswith(HANDSHAKE_MAGIC):
        raise ProtocolError("server does not speak the oobleck control protocol")
    server_nonce = magic_and_nonce[len(HANDSHAKE_MAGIC):]
    client_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(HANDSHAKE_MAGIC + client_nonce)
    channel = Channel(sock, _session_key(secret, server_nonce, client_nonce), is_server=False, max_bytes=max_bytes)
    channel.send({**hello, "type": "hello"})
    return channel


def _session_key(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, server_nonce + client_nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    chunks = []
    while count:
        chunk = sock.recv(min(count, 1 << 16))
        if not chunk:
            raise EOFError("peer closed the connection")
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)


def connect(host: str, port: int, secret: bytes, hello: dict[str, Any],
            timeout: float = DEFAULT_TIMEOUTS.handshake_timeout,
            max_bytes: int = DEFAULT_MAX_BYTES) -> Channel:
    """Open an authenticated channel to a control server (supervisor/server.py `ControlServer`)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        channel = client_handshake(sock, secret, hello, max_bytes)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return channel
