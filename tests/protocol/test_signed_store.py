"""The job's signed store (protocol/signed_store.py) on a real TCPStore: values signed and verified, keys
hidden, counters, what a forged or unsigned value does to each read, the sweep of foreign keys, the
rate-limited events, and real gloo groups of two processes formed over it."""

from __future__ import annotations

import datetime as dt
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from oobleck_slurm.engine.abort import FailureWatch, clone_store
from oobleck_slurm.protocol import keys, signed_store
from oobleck_slurm.protocol.events import EventLog, read_events
from oobleck_slurm.protocol.signed_store import MAGIC, REPORT_CAP, SignedStore, StoreSigner
from oobleck_slurm.timeouts import JobTimeouts

SECRET, OTHER = bytes(range(32)), bytes(range(1, 33))
TIMEOUT = dt.timedelta(seconds=20)


@pytest.fixture
def server() -> Iterator[dist.TCPStore]:
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def raw_client(server: dist.TCPStore) -> dist.TCPStore:
    """A client without the secret: the hostile process's view of the store."""
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=dt.timedelta(seconds=2))


def signed(server: dist.TCPStore, tmp_path: Path | None = None, reader: str = "test", secret: bytes = SECRET,
           poll: float = 0.01) -> SignedStore:
    log = EventLog(tmp_path / "events.jsonl") if tmp_path is not None else None
    return signed_store.connect("127.0.0.1", server.port, TIMEOUT, secret, log, reader, poll)


def rejected(tmp_path: Path) -> list[dict]:
    return read_events(tmp_path / "events.jsonl", "store_rejected")


# ---- the signer ------------------------------------------------------------------------------------

def test_a_sealed_value_opens_under_its_key_and_secret_only() -> None:
    signer = StoreSigner(SECRET)
    sealed = signer.seal("gen3/config", b'{"members": []}')
    assert signer.open("gen3/config", sealed) == b'{"members": []}'
    assert signer.open("gen3/config", signer.seal("gen3/config", "text")) == b"text"
    assert signer.open("gen4/config", sealed) is None  # moved to another key
    assert StoreSigner(OTHER).open("gen3/config", sealed) is None  # another job's secret
    for i in range(len(sealed)):  # any byte changed: tag, magic or value
        tampered = bytearray(sealed)
        tampered[i] ^= 1
        assert signer.open("gen3/config", bytes(tampered)) is None
    assert signer.open("gen3/config", b'{"members": []}') is None  # unsigned
    assert signer.open("gen3/config", sealed + b"x") is None and signer.open("gen3/config", MAGIC) is None


def test_names_are_hidden_and_recognised_without_the_key() -> None:
    signer, other = StoreSigner(SECRET), StoreSigner(OTHER)
    name = signer.name("gen0/failed")
    assert name == signer.name("gen0/failed") != other.name("gen0/failed")
    assert "gen0" not in name and "failed" not in name
    assert signer.owns(name) and not other.owns(name)
    assert not signer.owns("gen0/failed") and not signer.owns("~junk") and not signer.owns("~" + "A" * 30)
    forged = name[:-1] + ("A" if name[-1] != "A" else "B")  # a valid-looking name with a wrong check
    assert not signer.owns(forged)


# ---- the store on a real TCPStore --------------------------------------------------------------------

def test_every_request_round_trips_and_nothing_is_stored_in_the_clear(server: dist.TCPStore) -> None:
    a, b = signed(server), signed(server)
    a.set(keys.CURRENT_GEN, "3")
    a.multi_set([keys.progress(3), keys.first_step(3)], [b"7", '{"step": 7}'])
    assert b.get(keys.CURRENT_GEN) == b"3"
    assert b.multi_get([keys.progress(3), keys.first_step(3)]) == [b"7", b'{"step": 7}']
    assert b.check([keys.CURRENT_GEN, keys.progress(3)]) and not b.check([keys.failed(3)])
    b.wait([keys.CURRENT_GEN], dt.timedelta(seconds=2))
    assert b.add(keys.errors(3), 1) == 1 and a.add(keys.errors(3), 2) == 3
    assert a.get(keys.errors(3)) == b"3"  # a counter reads as its integer, signed like any value
    assert b.compare_set("lock", "", "mine") == b"mine"  # "" expected: not set yet
    assert a.compare_set("lock", "yours", "theirs") == b"mine"  # wrong expectation: unchanged
    assert a.compare_set("lock", "mine", "theirs") == b"theirs"
    assert a.delete_key("lock") and not b.check(["lock"])
    stored = raw_client(server).list_keys()
    assert len(stored) == 4 and all(a.signer.owns(n) for n in stored)
    assert not {keys.CURRENT_GEN, keys.progress(3), keys.errors(3)} & set(stored)
    with pytest.raises(dist.DistStoreError):
        b.wait([keys.failed(3)], dt.timedelta(seconds=0.2))


def test_a_process_without_the_secret_sees_neither_keys_nor_values(server: dist.TCPStore) -> None:
    a = signed(server)
    a.set(keys.config(0), '{"secret plan": 1}')
    hostile = raw_client(server)
    assert not hostile.check([keys.config(0)])
    other_job = signed(server, secret=OTHER, poll=0.05)
    assert not other_job.check([keys.config(0)])
    with pytest.raises(dist.DistStoreError):
        other_job.wait([keys.config(0)], dt.timedelta(seconds=0.3))


def test_a_forged_value_reads_as_the_last_good_one_or_as_absent(server: dist.TCPStore, tmp_path: Path) -> None:
    job, reader = signed(server), signed(server, tmp_path, "node0:0")
    hostile = raw_client(server)
    name = job.signer.name
    # read once, then forged: the last good value
    job.set(keys.progress(0), "4")
    assert reader.get(keys.progress(0)) == b"4"
    hostile.set(name(keys.progress(0)), MAGIC + bytes(32) + b"99")
    assert reader.get(keys.progress(0)) == b"4" and reader.multi_get([keys.progress(0)]) == [b"4"]
    assert reader.check([keys.progress(0)])
    # never read, forged: absent to check, and wait keeps waiting until the writer's valid value
    hostile.set(name(keys.failed(0)), b'{"lost": ["node1"]}')
    assert not reader.check([keys.failed(0)])
    with pytest.raises(dist.DistStoreError):
        reader.wait([keys.failed(0)], dt.timedelta(seconds=0.3))
    threading.Timer(0.3, lambda: job.set(keys.failed(0), '{"lost": []}')).start()
    t0 = time.monotonic()
    reader.wait([keys.failed(0)], dt.timedelta(seconds=10))
    assert 0.2 < time.monotonic() - t0 < 5 and reader.get(keys.failed(0)) == b'{"lost": []}'
    events = rejected(tmp_path)
    assert {(e["key"], e["reason"]) for e in events} == {
        (keys.progress(0), "bad signature"), (keys.failed(0), "unsigned value")}
    assert {e["reader"] for e in events} == {"node0:0"}
    assert len(events) == 2  # once per key and reason, however often it was met


def test_a_counter_is_signed_and_a_forged_count_is_replaced(server: dist.TCPStore) -> None:
    job, hostile = signed(server), raw_client(server)
    name = job.signer.name(keys.errors(0))
    assert [job.add(keys.errors(0), 1) for _ in range(3)] == [1, 2, 3]
    hostile.set(name, b"100")  # an unsigned count: refused, and the next add counts on from the last good one
    assert job.get(keys.errors(0)) == b"3" and job.add(keys.errors(0), 1) == 4
    with pytest.raises(dist.DistNetworkError):  # the store's own add on a sealed value: the server drops
        hostile.add(name, 1)                    # the hostile's connection, and the count is unchanged
    assert signed(server).get(keys.errors(0)) == b"4"
    # concurrent adds from several connections all count
    stores = [signed(server) for _ in range(4)]
    threads = [threading.Thread(target=lambda s=s: [s.add("c", 1) for _ in range(25)]) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert job.get("c") == b"100"


def test_a_forged_failed_key_does_not_fire_a_failure_watch(server: dist.TCPStore) -> None:
    job, worker = signed(server), signed(server)
    raw_client(server).set(job.signer.name(keys.failed(5)), b"forged")
    watch = FailureWatch(worker, 5, JobTimeouts(abort_poll=0.01, watch_renew=30.0))
    assert not watch.wait(0.5)
    job.set(keys.failed(5), "{}")
    assert watch.wait(5.0)
    assert worker.rejections.total >= 1


def test_a_clone_is_signed_the_same_way_and_shares_the_reports(server: dist.TCPStore) -> None:
    store = signed(server)
    clone = clone_store(store)
    assert isinstance(clone, SignedStore) and clone.inner is not store.inner
    assert clone.rejections is store.rejections and clone.timeout == store.timeout
    store.set("k", "v")
    assert clone.get("k") == b"v"


def test_the_sweep_deletes_and_reports_every_foreign_key(server: dist.TCPStore, tmp_path: Path) -> None:
    store = signed(server, tmp_path, "supervisor")
    store.set(keys.CURRENT_GEN, "0")
    store.add(keys.errors(0), 1)
    hostile = raw_client(server)
    foreign = [keys.CURRENT_GEN, keys.failed(0), keys.worker_step("node0:0"), "gen1/world/0/0", "junk/\x01", "~x"]
    for k in foreign:
        hostile.set(k, b"1")
    hostile.add(keys.errors(1), 5)
    assert store.sweep() == len(foreign) + 1
    assert sorted(hostile.list_keys()) == sorted([store.signer.name(keys.CURRENT_GEN), store.signer.name(keys.errors(0))])
    assert store.get(keys.CURRENT_GEN) == b"0" and store.sweep() == 0
    assert {e["key"] for e in rejected(tmp_path)} == {*foreign, keys.errors(1)}
    assert {e["reason"] for e in rejected(tmp_path)} == {"foreign key"}


def test_a_flood_is_reported_within_the_cap(server: dist.TCPStore, tmp_path: Path) -> None:
    store = signed(server, tmp_path, "supervisor")
    hostile = raw_client(server)
    hostile.multi_set([f"junk/{i}" for i in range(REPORT_CAP + 50)], [b"x"] * (REPORT_CAP + 50))
    assert store.sweep() == REPORT_CAP + 50
    events = rejected(tmp_path)
    assert len(events) == REPORT_CAP and store.rejections.total == REPORT_CAP + 50


# ---- process groups over it --------------------------------------------------------------------------

def _rank(port: int, rank: int, secret: bytes, out: multiprocessing.Queue, met: Any) -> None:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    try:
        store = signed_store.connect("127.0.0.1", port, TIMEOUT, secret, None, f"rank {rank}", 0.01)
        if met is None:
            pass
        elif rank == 0:  # tell rank 1 once this rank refused a forged value (rank 1's address, as gloo reads it)
            def watch() -> None:
                while store.rejections.total < 1:
                    time.sleep(0.01)
                met.set()
            threading.Thread(target=watch, daemon=True).start()
        else:  # rank 0 waits for this rank's address while only the forged one is there
            met.wait(60)
        pg = dist.ProcessGroupGloo(dist.PrefixStore("gen1/world", store), rank, 2, dt.timedelta(seconds=30))
        t = torch.full((4,), float(rank + 1), dtype=torch.float64)
        pg.allreduce([t]).wait()
        out.put((rank, t.tolist(), store.rejections.total))
    except Exception as err:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(err).__name__}: {err}", -1))


def run_ranks(port: int, secrets: list[bytes], forged: bool = False) -> dict[int, tuple]:
    """Two ranks form a gloo group over the signed store; with `forged`, rank 1 writes its address only
    once rank 0 refused the forged one there."""
    ctx = multiprocessing.get_context("spawn")
    out, met = ctx.Queue(), ctx.Event() if forged else None
    procs = [ctx.Process(target=_rank, args=(port, r, s, out, met)) for r, s in enumerate(secrets)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, value, rejects = out.get(timeout=120)
        results[rank] = (value, rejects)
    for p in procs:
        p.join(30)
    return results


def test_a_gloo_group_forms_over_it_with_forged_rendezvous_keys_in_the_way(server: dist.TCPStore) -> None:
    # The hostile wrote the rendezvous keys first (raw names, and the hidden names as if sniffed): the
    # ranks refuse the forged values, wait for each other's and all-reduce.
    hostile, signer = raw_client(server), StoreSigner(SECRET)
    for rank in range(2):
        hostile.set(f"gen1/world/0/{rank}", os.urandom(170))
        hostile.set(signer.name(f"gen1/world/0/{rank}"), MAGIC + os.urandom(200))
    results = run_ranks(server.port, [SECRET, SECRET], forged=True)
    assert {r: v for r, (v, _) in results.items()} == {0: [3.0] * 4, 1: [3.0] * 4}
    assert results[0][1] >= 1  # rank 0 met the forged value of rank 1's address, and waited


def test_a_rank_without_the_secret_cannot_join_a_group(server: dist.TCPStore) -> None:
    results = run_ranks(server.port, [SECRET, OTHER])
    assert all(isinstance(v, str) for v, _ in results.values()), results  # neither forms the group


def _listening_addresses(port: int) -> set[str]:
    import psutil

    return {c.laddr.ip for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_the_job_store_listens_only_where_its_clients_connect() -> None:
    from oobleck_slurm.protocol.signed_store import connect, serve

    secret = b"s" * 32
    store = serve("127.0.0.1", dt.timedelta(seconds=5), secret, None, "supervisor")
    port = store.inner.port
    assert _listening_addresses(port) == {"127.0.0.1"}
    client = connect("127.0.0.1", port, dt.timedelta(seconds=5), secret, None, "worker")
    client.set("k", "v")
    assert store.get("k") == b"v"

