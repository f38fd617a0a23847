"""The job's store, authenticated with the job secret: `SignedStore` wraps the TCPStore client (or the
supervisor's server) of every process of the job, and torch.distributed's rendezvous goes through it
too (a `PrefixStore` over it: gloo and NCCL groups, the health check).

Three keys are derived from the job secret (cluster/jobdir.py), one per use: a name key, a check key
and a value key.

    hidden name  each logical key (protocol/keys.py, or a rendezvous key under `gen{g}/{group}/`) is
                 stored as `~` + base64url(HMAC(name key, key)[:16] + HMAC(check key, that)[:6]): a
                 process without the secret cannot address any of the job's keys by what it means
                 (it may list the names: TCPStore answers `list_keys` to any client), and the 6-byte
                 check lets a holder of the secret tell the job's names from any other without
                 knowing the key (`sweep`)
    signed value every value is stored as MAGIC + HMAC-SHA256(value key, key, nonce + value) + nonce +
                 value (an 8-byte random nonce) and verified on every read: a value moved from another
                 key, a value whose tag fails, or an unsigned value is not the job's. Counters too:
                 `add` is a compare-and-set loop on the sealed integer (the store's own `add` keeps a
                 bare integer, which cannot be signed)

A value that fails its check is as if its write had not happened: readers see the last good value
this process read under that key, else the key as absent (`check` is False, `wait` and `get` keep
waiting, polling every `forged_value_poll`, until a valid value replaces it or their timeout). Each
rejection is reported in the job's event log (`store_rejected`), at most once per key and reason a
minute and `REPORT_CAP` times a minute per process; never an exception. The last good value serves
the pollers (the supervisor's observer reads `current_gen` and `progress` every period: a forged
value must not stall its view until the next legitimate write); absence serves the waiters (a
forged `gen{g}/failed` must not abort a generation, a forged rendezvous value must not be used).

`sweep` (the supervisor's observer, every `store_sweep_poll`) lists the store's keys (torch's
`list_keys`; where torch lacks it, nothing is swept) and deletes every name that is not the job's:
writes under plain names and junk are removed and reported, since no process of the job reads them.

Not protected (docs/architecture.md, "The store"): a value replayed under its own key by someone who
captured the traffic (the store protocol is plain TCP, its values readable on the wire); overwriting a
listed or sniffed name (a denial of service: the forged value is refused, the legitimate one is lost
until rewritten); a flood of writes; connecting at all (the TCPStore server accepts any client that
reaches its port).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import os
import socket
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from oobleck_slurm.protocol.events import EventLog
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS

MAGIC = b"OSV1"  # a signed value
TAG_BYTES = 32
NONCE_BYTES = 8
NAME_PREFIX = "~"
_HASH_BYTES, _CHECK_BYTES = 16, 6  # 128 bits against collisions between the job's keys; 48 against guessing
LAST_GOOD_BYTES = 8 << 20  # the last good values kept per process (what a forged read falls back to)
NAMES_CACHED = 1 << 16  # hidden names kept per process: an HMAC per request is microseconds, a dict hit less
REPORT_EVERY_S = 60.0  # a key's rejections are reported at most this often (the event counts the others)
REPORT_CAP = 100  # events per minute per process at most: a flood of junk keys does not flood the log


class StoreSigner:
    """The names and seals of the job's store under one secret (pure: no I/O)."""

    def __init__(self, secret: bytes) -> None:
        def derive(use: bytes) -> bytes:
            return hmac.new(secret, b"oobleck store " + use, hashlib.sha256).digest()

        self._name_key, self._check_key, self._value_key = derive(b"name"), derive(b"name check"), derive(b"value")
        self._names: dict[str, str] = {}

    def name(self, key: str) -> str:
        """The hidden name of `key` in the store."""
        name = self._names.get(key)
        if name is None:
            digest = hmac.new(self._name_key, key.encode(), hashlib.sha256).digest()[:_HASH_BYTES]
            name = NAME_PREFIX + base64.urlsafe_b64encode(digest + self._check(digest)).decode().rstrip("=")
            if len(self._names) >= NAMES_CACHED:
                self._names.clear()
            self._names[key] = name
        return name

    def owns(self, name: str) -> bool:
        """True when `name` is the hidden name of some key under this secret (without knowing the key)."""
        if not name.startswith(NAME_PREFIX):
            return False
        try:
            raw = base64.urlsafe_b64decode(name[len(NAME_PREFIX):] + "==")
        except ValueError:
            return False
        return (len(raw) == _HASH_BYTES + _CHECK_BYTES
                and hmac.compare_digest(raw[_HASH_BYTES:], self._check(raw[:_HASH_BYTES])))

    def seal(self, key: str, value: bytes | str) -> bytes:
        """`value` as stored under `key`: never the same bytes twice (a nonce), so that a compare-and-set
        tells its own write from an equal value written by another process (`SignedStore.add`)."""
        data = os.urandom(NONCE_BYTES) + _as_bytes(value)
        return MAGIC + self._tag(key, data) + data

    def open(self, key: str, raw: bytes) -> bytes | None:
        """The value sealed under `key`, or None when `raw` is not one (no seal, a bad tag, another key's)."""
        head = len(MAGIC) + TAG_BYTES
        if len(raw) < head + NONCE_BYTES or not raw.startswith(MAGIC):
            return None
        data = raw[head:]
        return data[NONCE_BYTES:] if hmac.compare_digest(raw[len(MAGIC):head], self._tag(key, data)) else None

    def _check(self, digest: bytes) -> bytes:
        return hmac.new(self._check_key, digest, hashlib.sha256).digest()[:_CHECK_BYTES]

    def _tag(self, key: str, data: bytes) -> bytes:
        k = key.encode()  # length-prefixed: (key, value) pairs cannot be re-split
        return hmac.new(self._value_key, struct.pack(">I", len(k)) + k + data, hashlib.sha256).digest()


class Rejections:
    """Reports refused values and foreign keys as `store_rejected` events, rate-limited; shared by a
    process's SignedStore and its clones. Without a log (a test, a benchmark) it only counts."""

    def __init__(self, log: EventLog | None, reader: str) -> None:
        self.log, self.reader = log, reader
        self.total = 0  # every rejection seen, reported or not
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}  # (key, reason) -> when it was last reported
        self._unreported: dict[tuple[str, str], int] = {}
        self._window, self._in_window, self._suppressed = 0.0, 0, 0

    def report(self, key: str, reason: str, op: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.total += 1
            what = (key, reason)
            count = self._unreported[what] = self._unreported.get(what, 0) + 1
            last = self._last.get(what)
            if last is not None and now - last < REPORT_EVERY_S:
                return
            if now - self._window >= 60.0:
                self._window, self._in_window = now, 0
            if self._in_window >= REPORT_CAP:
                self._suppressed += 1
                return
            if len(self._last) > 4 * REPORT_CAP:  # a flood of distinct keys: forget the old ones
                self._last.clear()
                self._unreported = {what: count}
            self._last[what] = now
            self._in_window += 1
            del self._unreported[what]
            suppressed, self._suppressed = self._suppressed, 0
        if self.log is not None:
            self.log.emit("store_rejected", key=key[:200], reason=reason, reader=self.reader, op=op, count=count,
                          suppressed=suppressed or None)


class SignedStore(dist.Store):
    """A `dist.Store` over `inner` whose every key is hidden and every value signed (module doc). Use it
    wherever the job's store is used; a PrefixStore over it signs torch's rendezvous. `over(other)`:
    the same signer, reports and last good values on another connection (engine/abort.py clone_store)."""

    def __init__(self, inner: dist.Store, signer: StoreSigner, rejections: Rejections | None = None,
                 poll: float = DEFAULT_TIMEOUTS.forged_value_poll) -> None:
        super().__init__()
        # Any: torch's stubs give str values only (bytes work: the seals), and no timeout, multi_set, clone
        self.inner: Any = inner
        self.signer, self.poll = signer, poll
        self.rejections = rejections if rejections is not None else Rejections(None, "")
        self._shared = _Shared()
        super().set_timeout(self._timeout())

    @classmethod
    def with_secret(cls, inner: dist.Store, secret: bytes, log: EventLog | None = None, reader: str = "",
                    poll: float = DEFAULT_TIMEOUTS.forged_value_poll) -> SignedStore:
        """`inner` signed with `secret`; refusals reported to `log` as seen by `reader`."""
        return cls(inner, StoreSigner(secret), Rejections(log, reader), poll)

    def over(self, inner: dist.Store) -> SignedStore:
        other = SignedStore(inner, self.signer, self.rejections, self.poll)
        other._shared = self._shared
        return other

    # a TCPStore's address, for whoever publishes it (supervisor/main.py) or clones the connection
    @property
    def host(self) -> str:
        return self.inner.host

    @property
    def port(self) -> int:
        return self.inner.port

    # ---- writes ------------------------------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        self.inner.set(self.signer.name(key), self.signer.seal(key, value))

    def multi_set(self, keys_: list[str], values: list[bytes | str]) -> None:
        self.inner.multi_set([self.signer.name(k) for k in keys_],
                             [self.signer.seal(k, v) for k, v in zip(keys_, values)])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set `desired` if the key's value is `expected` (empty: not set; a refused value counts as
        not written); the key's value after, as the store's compare_set returns it."""
        return self._swap(key, lambda current: _as_bytes(desired) if current == _as_bytes(expected) else None,
                          "compare_set")

    def add(self, key: str, value: int) -> int:
        """A signed counter (the store's own `add` keeps a bare integer, which cannot be signed, and drops
        the connection on a forged non-integer). One request for a new counter, two otherwise."""
        return int(self._swap(key, lambda current: str(int(current or b"0") + value).encode(), "add"))

    def _swap(self, key: str, update: Callable[[bytes], bytes | None], op: str) -> bytes:
        """Compare-and-set the key's sealed value to `update(current)` (b"" when not set) until it takes
        or `update` declines (None); the value after. A seal is never repeated, so the store's answer
        tells our write from another's. The first attempt assumes the key is not set."""
        name, seen, known = self.signer.name(key), b"", False  # known: `seen` is what the store answered
        while True:
            current = (self._open(key, seen, op) or b"") if seen else b""
            new = update(current)
            if new is None and known:
                return current
            if new is None:  # declined on the assumption: look (a compare-and-set that cannot match)
                probe = MAGIC + os.urandom(NONCE_BYTES)
                got = bytes(self.inner.compare_set(name, probe, probe))
                if got == probe:  # the store hands back `expected` for a key that is not set
                    return current
                seen, known = got, True
                continue
            desired = self.signer.seal(key, new)
            got = bytes(self.inner.compare_set(name, seen, desired))
            if got == desired:
                self._shared.keep(key, new)
                return new
            seen, known = (b"" if got == seen else got), True  # `seen` handed back: the key is gone

    def delete_key(self, key: str) -> bool:
        self._shared.forget(key)
        return self.inner.delete_key(self.signer.name(key))

    # ---- reads -------------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        return self._read([key], self._timeout(), "get", lambda names, _: [self.inner.get(names[0])])[0]

    def multi_get(self, keys_: list[str]) -> list[bytes]:
        return self._read(list(keys_), self._timeout(), "get", lambda names, _: self.inner.multi_get(names))

    def wait(self, keys_: list[str], timeout: dt.timedelta | None = None) -> None:
        """Until every key holds a valid value: the store's wait, then one read to verify them."""
        def wait_then_get(names: list[str], deadline: float) -> list[bytes]:
            self.inner.wait(names, dt.timedelta(seconds=max(0.001, deadline - time.monotonic())))
            return self.inner.multi_get(names)

        self._read(list(keys_), timeout if timeout is not None else self._timeout(), "wait", wait_then_get)

    def check(self, keys_: list[str]) -> bool:
        names = [self.signer.name(k) for k in keys_]
        if not self.inner.check(names):
            return False
        return all(self._open(k, bytes(raw), "check") is not None for k, raw in zip(keys_, self.inner.multi_get(names)))

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: dt.timedelta) -> None:
        super().set_timeout(timeout)
        self.inner.set_timeout(timeout)

    def _timeout(self) -> dt.timedelta:
        return self.inner.timeout  # the connection's own (set_timeout sets both)

    def has_extended_api(self) -> bool:
        return False  # no append (a sealed value cannot grow): torch keeps to set/get/wait/add

    def clone(self) -> SignedStore:
        return self.over(self.inner.clone())

    # ---- the job's names ---------------------------------------------------------------------------

    def sweep(self) -> int:
        """Delete and report every key of the store that is not one of the job's hidden names (writes
        by a process without the secret: plain key names, junk). The number deleted; 0 where the
        store cannot list its keys (torch before list_keys, or a store without it)."""
        try:
            names = self.inner.list_keys()
        except (AttributeError, NotImplementedError):
            return 0
        except UnicodeDecodeError:  # a name that is not UTF-8 (a raw socket's write): torch cannot list them
            self.rejections.report("(a key name that is not UTF-8)", "foreign key", "sweep")
            return 0
        foreign = [n for n in names if not self.signer.owns(n)]
        for name in foreign:
            self.inner.delete_key(name)
            self.rejections.report(name, "foreign key", "sweep")
        return len(foreign)

    # ---- verification ------------------------------------------------------------------------------

    def _read(self, keys_: list[str], timeout: dt.timedelta, op: str,
              fetch: Callable[[list[str], float], list[bytes]]) -> list[bytes]:
        """`fetch(names, deadline)` (it blocks until every name exists, up to the store's timeout), verified: a
        refused value reads as the last good one, else the fetch is repeated every `poll` until the
        writer's valid value replaces it, up to `timeout` (then torch's timeout error, DistStoreError)."""
        names = [self.signer.name(k) for k in keys_]
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            values = [self._open(k, bytes(raw), op) for k, raw in zip(keys_, fetch(names, deadline))]
            if all(v is not None for v in values):
                return values  # type: ignore[return-value]
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [k for k, v in zip(keys_, values) if v is None]
                raise dist.DistStoreError(f"{op} timeout after {timeout.total_seconds():g} s: no valid value under "
                                          f"{missing} (refused values: forged or unsigned)")
            time.sleep(min(self.poll, left))

    def _open(self, key: str, raw: bytes, op: str) -> bytes | None:
        """The value of `key` as the job wrote it, or the last good one, or None (module doc)."""
        value = self.signer.open(key, raw)
        if value is not None:
            self._shared.keep(key, value)
            return value
        self.rejections.report(key, "bad signature" if raw.startswith(MAGIC) else "unsigned value", op)
        return self._shared.last_good(key)


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class _Shared:
    """What a SignedStore shares with its clones: the last good value read under each key (bounded by
    LAST_GOOD_BYTES, oldest dropped first)."""

    def __init__(self) -> None:
        self._good: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def keep(self, key: str, value: bytes) -> None:
        with self._lock:
            old = self._good.pop(key, None)
            self._bytes += len(value) - (len(old) if old is not None else 0)
            self._good[key] = value
            while self._bytes > LAST_GOOD_BYTES and self._good:
                self._bytes -= len(self._good.popitem(last=False)[1])

    def last_good(self, key: str) -> bytes | None:
        with self._lock:
            return self._good.get(key)

    def forget(self, key: str) -> None:
        with self._lock:
            old = self._good.pop(key, None)
            if old is not None:
                self._bytes -= len(old)


def connect(host: str, port: int, timeout: dt.timedelta, secret: bytes, log: EventLog | None, reader: str,
            poll: float = DEFAULT_TIMEOUTS.forged_value_poll) -> SignedStore:
    """A client of the job's store at host:port, signed with the job secret; rejections go to `log`
    as seen by `reader` (a worker's name, "supervisor", ...)."""
    inner = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return SignedStore.with_secret(inner, secret, log, reader, poll)


def serve(host: str, timeout: dt.timedelta, secret: bytes, log: EventLog | None, reader: str,
          poll: float = DEFAULT_TIMEOUTS.forged_value_poll) -> SignedStore:
    """The job's store, hosted here and listening only on the address that `host` (the name every
    client connects to) resolves to: torch's server binds every interface unless it is handed a
    listening socket (`master_listen_fd`; TCPStoreLibUvBackend.cpp `makeWithSocket`). An address this
    machine cannot bind falls back to every interface, as before."""
    inner = None
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((address, 0))
            listener.listen(socket.SOMAXCONN)
        except OSError:
            listener.close()
            raise
        port = listener.getsockname()[1]
        # Detached: the server owns the descriptor (closed from Python, the older backend aborted).
        inner = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout,
                              master_listen_fd=listener.detach())
    except OSError as err:
        print(f"store: cannot listen on {host} only ({err}); listening on every interface", file=sys.stderr)
    if inner is None:
        inner = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    return SignedStore.with_secret(inner, secret, log, reader, poll)


def unsigned(store: dist.Store) -> dist.Store:
    """The store under a SignedStore (the connection itself), or `store`."""
    return store.inner if isinstance(store, SignedStore) else store

