"""Fuzzing the control plane's frame reader over real sockets: whatever a peer sends (random bytes,
truncated, oversized, replayed or wrongly authenticated frames, hostile JSON inside a valid tag), the
reader raises only ProtocolError, or EOFError when the peer closed, and never hangs. And the messages
inside (protocol/messages.py): whatever object a frame holds, `parse` returns a message, which sends
and parses back to itself, or raises ProtocolError.

Every socket has a timeout: a reader that waited for bytes that never come would raise
socket.timeout (TimeoutError), which fails the property instead of hanging the suite.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import threading
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING, fields
from typing import Any

from fuzzlib import fuzz_settings, json_values
from hypothesis import given
from hypothesis import strategies as st

from oobleck_slurm.protocol.messages import MESSAGES, Message, parse
from oobleck_slurm.protocol.wire import (
    HANDSHAKE_MAGIC,
    NONCE_BYTES,
    TAG_BYTES,
    Channel,
    ProtocolError,
    client_handshake,
    server_handshake,
)

IO_TIMEOUT_S = 5.0  # far above any local round trip; only a reader waiting for nothing reaches it
MAX_BYTES = 4096  # a small limit, so that "oversized" is cheap to reach
KEY = bytes(range(32))


@contextmanager
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    for s in (a, b):
        s.settimeout(IO_TIMEOUT_S)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def tag(key: bytes, direction: bytes, seq: int, payload: bytes) -> bytes:
    """The documented frame tag (protocol.py's docstring), computed independently of Channel."""
    return hmac.new(key, direction + struct.pack(">Q", seq) + payload, hashlib.sha256).digest()


def frame(key: bytes, seq: int, payload: bytes, direction: bytes = b"C", length: int | None = None) -> bytes:
    return struct.pack(">I", len(payload) if length is None else length) + tag(key, direction, seq, payload) + payload


def read_all(wire: bytes, close: bool = True) -> list[dict]:
    """Send `wire` to a server-side Channel and read until it refuses: the messages read before that.
    The refusal must be ProtocolError or EOFError (raised to the caller as `Refused`)."""
    with pair() as (client, server):
        channel = Channel(server, KEY, is_server=True, max_bytes=MAX_BYTES)
        # A writer thread: the reader may refuse before the whole wire is written.
        writer = threading.Thread(target=_write, args=(client, wire, close), daemon=True)
        writer.start()
        messages = []
        try:
            while True:
                messages.append(channel.recv())
        except (ProtocolError, EOFError) as refused:
            return messages + [{"refused": type(refused).__name__, "why": str(refused)}]
        finally:
            server.close()
            writer.join(IO_TIMEOUT_S)


def _write(sock: socket.socket, data: bytes, close: bool) -> None:
    try:
        sock.sendall(data)
        if close:
            sock.shutdown(socket.SHUT_WR)
    except OSError:  # the reader closed first: fine
        pass


def ending(result: list[dict]) -> str:
    return result[-1]["refused"]


@fuzz_settings()
@given(wire=st.binary(max_size=2048))
def test_random_bytes_are_refused(wire: bytes) -> None:
    result = read_all(wire)
    assert ending(result) in ("ProtocolError", "EOFError")
    assert len(result) == 1  # random bytes never authenticate


messages = st.dictionaries(st.text(max_size=10), json_values(10), max_size=5).map(
    lambda d: {**d, "type": "x"})


@fuzz_settings()
@given(batch=st.lists(messages, min_size=1, max_size=4))
def test_valid_frames_round_trip_then_eof(batch: list[dict]) -> None:
    payloads = [json.dumps(m).encode() for m in batch]
    wire = b"".join(frame(KEY, i, p) for i, p in enumerate(payloads) if len(p) <= MAX_BYTES)
    sent = [m for m, p in zip(batch, payloads) if len(p) <= MAX_BYTES]
    result = read_all(wire)
    assert ending(result) == "EOFError"
    # NaN != NaN: compare the JSON texts
    assert [json.dumps(m, sort_keys=True) for m in result[:-1]] == [json.dumps(m, sort_keys=True) for m in sent]


@fuzz_settings()
@given(message=messages, cut=st.integers(min_value=0))
def test_truncated_frame_is_eof(message: dict, cut: int) -> None:
    wire = frame(KEY, 0, json.dumps(message).encode())
    result = read_all(wire[: cut % len(wire)])
    assert ending(result) == "EOFError"


@fuzz_settings()
@given(length=st.integers(MAX_BYTES + 1, 2**32 - 1))
def test_oversized_length_is_refused_before_reading(length: int) -> None:
    # Only the header is sent and the socket stays open: a reader that tried to read `length` bytes
    # would time out instead of refusing.
    result = read_all(struct.pack(">I", length), close=False)
    assert ending(result) == "ProtocolError" and "limit" in result[-1]["why"]


@fuzz_settings()
@given(message=messages, flip=st.integers(min_value=0), bit=st.integers(0, 7))
def test_any_flipped_bit_is_refused(message: dict, flip: int, bit: int) -> None:
    wire = bytearray(frame(KEY, 0, json.dumps(message).encode()))
    i = 4 + flip % (len(wire) - 4)  # in the tag or the payload (a flipped length is another test)
    wire[i] ^= 1 << bit
    result = read_all(bytes(wire))
    assert ending(result) == "ProtocolError" and len(result) == 1


@fuzz_settings(0.5)
@given(message=messages, key=st.binary(min_size=1, max_size=64), direction=st.sampled_from([b"C", b"S"]))
def test_wrong_key_or_direction_is_refused(message: dict, key: bytes, direction: bytes) -> None:
    if key == KEY and direction == b"C":
        key = KEY[::-1]
    result = read_all(frame(key, 0, json.dumps(message).encode(), direction))
    assert ending(result) == "ProtocolError" and "authentication" in result[-1]["why"]


@fuzz_settings(0.5)
@given(batch=st.lists(messages, min_size=1, max_size=3), replay=st.integers(min_value=0))
def test_replayed_or_reordered_frame_is_refused(batch: list[dict], replay: int) -> None:
    frames = [frame(KEY, i, json.dumps(m).encode()) for i, m in enumerate(batch)]
    again = replay % len(frames)
    result = read_all(b"".join(frames) + frames[again])
    assert len(result) == len(batch) + 1 and ending(result) == "ProtocolError"


# Authenticated payloads that are not acceptable messages: a holder of the secret with a bug, or a
# compromised node. They must still be refused as ProtocolError, not crash the server's thread.
HOSTILE_PAYLOADS = [
    b"[" * 100_000,  # RecursionError inside json.loads
    b'{"type": "x", "n": ' + b"9" * 5000 + b"}",  # ValueError: int of more than 4300 digits
    b"\xff\xfe",  # not UTF-8
    b"[]", b"null", b'"hello"', b'{"type": 1}', b'{"no": "type"}', b"",
]


@fuzz_settings(0.5)
@given(payload=st.sampled_from(HOSTILE_PAYLOADS) | st.binary(max_size=64)
       | json_values().map(lambda v: json.dumps(v).encode()))
def test_authenticated_garbage_is_protocol_error(payload: bytes) -> None:
    big = MAX_BYTES if len(payload) <= MAX_BYTES else len(payload)
    with pair() as (client, server):
        channel = Channel(server, KEY, is_server=True, max_bytes=big)
        writer = threading.Thread(target=_write, args=(client, frame(KEY, 0, payload), True), daemon=True)
        writer.start()
        try:
            message = channel.recv()
        except ProtocolError:
            return
        finally:
            writer.join(IO_TIMEOUT_S)
        assert isinstance(message, dict) and isinstance(message.get("type"), str)


@fuzz_settings(0.5)
@given(wire=st.binary(max_size=128), prefix=st.booleans())
def test_server_handshake_refuses_garbage(wire: bytes, prefix: bool) -> None:
    if prefix:  # get past the magic check, then garbage where the hello frame belongs
        wire = HANDSHAKE_MAGIC + os.urandom(NONCE_BYTES) + wire
    with pair() as (client, server):
        writer = threading.Thread(target=_write, args=(client, wire, True), daemon=True)
        writer.start()
        try:
            server_handshake(server, KEY)
            raise AssertionError("a handshake without the secret was accepted")
        except (ProtocolError, EOFError):
            pass
        finally:
            writer.join(IO_TIMEOUT_S)


@fuzz_settings(0.5)
@given(wire=st.binary(max_size=64))
def test_client_handshake_refuses_garbage(wire: bytes) -> None:
    with pair() as (client, server):
        writer = threading.Thread(target=_write, args=(server, wire, True), daemon=True)
        writer.start()
        try:
            # The client cannot authenticate the server's nonce; its first read of a frame does.
            client_handshake(client, KEY, {"node": "n"}).recv()
            raise AssertionError("garbage from a server was accepted as a message")
        except (ProtocolError, EOFError):
            pass
        except (BrokenPipeError, ConnectionResetError):  # the hello met a closed peer: the socket's own error
            pass
        finally:
            writer.join(IO_TIMEOUT_S)


def test_handshake_then_messages_both_ways() -> None:
    """The property's baseline: the real handshake works over the same kind of socket."""
    with pair() as (client_sock, server_sock):
        box: dict = {}
        thread = threading.Thread(target=lambda: box.update(server=server_handshake(server_sock, KEY)), daemon=True)
        thread.start()
        client = client_handshake(client_sock, KEY, {"node": "n1"})
        thread.join(IO_TIMEOUT_S)
        server = box["server"]
        assert server.peer["node"] == "n1"
        client.send({"type": "ping"})
        assert server.recv() == {"type": "ping"}
        server.send({"type": "pong"})
        assert client.recv() == {"type": "pong"}
        assert TAG_BYTES == 32


# ---- messages ---------------------------------------------------------------------------------------

FIELD_NAMES = sorted({f.name for cls in MESSAGES.values() for f in fields(cls)})


def values_for(annotation: Any) -> st.SearchStrategy[Any]:
    """JSON values of the kind a message field is annotated with (some out of the field's range)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([st.none() if a is type(None) else values_for(a) for a in args])
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(values_for(args[0]), max_size=3)
        return st.tuples(*[values_for(a) for a in args]).map(list)
    if origin is dict:
        return st.dictionaries(st.text(max_size=5), values_for(args[1]), max_size=3)
    return {str: st.text(max_size=10), int: st.integers(-3, 70000), bool: st.booleans(),
            float: st.floats(allow_nan=False, allow_infinity=False) | st.integers(-5, 5)}[annotation]


@st.composite
def well_typed(draw: st.DrawFn) -> dict[str, Any]:
    """A message of a random type with every field of the right JSON type (optional ones maybe left out)."""
    cls = draw(st.sampled_from(sorted(MESSAGES.values(), key=lambda c: c.TYPE)))
    hints = typing.get_type_hints(cls)
    data: dict[str, Any] = {"type": cls.TYPE}
    for f in fields(cls):
        optional = f.default is not MISSING or f.default_factory is not MISSING
        if not optional or draw(st.booleans()):
            data[f.name] = draw(values_for(hints[f.name]))
    return data


# Keys of real fields, others, and non-string ones (a caller's dict, not JSON); values of any JSON type.
hostile_dicts = st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=8) | st.integers(),
                                json_values(8), max_size=6)
random_messages = (
    hostile_dicts
    | st.tuples(st.sampled_from(sorted(MESSAGES)) | st.text(max_size=8) | json_values(2), hostile_dicts).map(
        lambda kd: {**kd[1], "type": kd[0]})
    | well_typed()
)


def assert_round_trips(message: Message) -> None:
    wire = message.to_dict()
    assert wire["type"] == message.TYPE
    assert parse(json.loads(json.dumps(wire))) == message  # what a peer receives is what was sent


@fuzz_settings()
@given(data=random_messages | json_values(8))
def test_parse_returns_a_message_or_raises_protocol_error(data: Any) -> None:
    try:
        message = parse(data)
    except ProtocolError as err:
        assert str(err)  # says what is wrong
        return
    assert isinstance(message, MESSAGES[data["type"]])
    assert_round_trips(message)


@fuzz_settings()
@given(data=well_typed())
def test_well_typed_messages_parse_unless_out_of_range(data: dict[str, Any]) -> None:
    try:
        message = parse(data)
    except ProtocolError as err:
        # only a range (port, worker, ...) or a choice (device) refuses a well-typed message
        assert "must be at" in str(err) or "must be one of" in str(err), err
        return
    assert_round_trips(message)
