"""A small threaded TCP server for the control plane: authenticate, then dispatch messages.

Every failure of a peer (wrong secret, garbage, an oversized or replayed frame, a handler error) ends
that one connection and is reported through `on_refused`; the server itself keeps serving.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

from oobleck_slurm.protocol.wire import (
    DEFAULT_MAX_BYTES,
    Channel,
    ProtocolError,
    server_handshake,
)
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS

Handler = Callable[[Channel, dict[str, Any]], "dict[str, Any] | None"]
RefusedCallback = Callable[[str, str], None]


class ControlServer:
    """Accepts authenticated connections; `handler(channel, message)` may return a reply."""

    def __init__(self, secret: bytes, handler: Handler, on_refused: RefusedCallback | None = None,
                 host: str = "0.0.0.0", port: int = 0,
                 handshake_timeout: float = DEFAULT_TIMEOUTS.handshake_timeout,
                 max_bytes: int = DEFAULT_MAX_BYTES, on_disconnect: Callable[[Channel], None] | None = None) -> None:
        self._secret = secret
        self._handler = handler
        self._on_refused = on_refused or (lambda peer, reason: None)
        self._on_disconnect = on_disconnect or (lambda channel: None)
        self._handshake_timeout = handshake_timeout
        self._max_bytes = max_bytes
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="control-accept", daemon=True)

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, address = self._listener.accept()
            except OSError:
                return
            peer = f"{address[0]}:{address[1]}"
            threading.Thread(target=self._serve, args=(sock, peer), name=f"control-{peer}", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        channel: Channel | None = None
        try:
            sock.settimeout(self._handshake_timeout)
            channel = server_handshake(sock, self._secret, self._max_bytes)
            sock.settimeout(None)
            while not self._stopping.is_set():
                message = channel.recv()
                reply = self._handler(channel, message)
                if reply is not None:
                    channel.send(reply)
        except EOFError:
            pass  # a clean close by the peer
        except (ConnectionResetError, BrokenPipeError) as err:
            if channel is None:  # vanished before proving it knows the secret
                self._on_refused(peer, f"{type(err).__name__}: {err}")
            # else: an authenticated peer went away (a `status` call, a killed node): not a refusal
        except (ProtocolError, OSError, ValueError) as err:
            self._on_refused(peer, f"{type(err).__name__}: {err}")
        except Exception as err:  # noqa: BLE001 - a handler bug must not take the server down
            self._on_refused(peer, f"handler error {type(err).__name__}: {err}")
        finally:
            if channel is not None:
                self._on_disconnect(channel)
            sock.close()

