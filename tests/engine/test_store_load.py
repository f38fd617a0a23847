"""Store load (issue 20, finding 7): a FailureWatch makes O(1) store requests however long its worker
waits, fires within milliseconds of `gen{g}/failed`, and leaves no thread or connection behind; and
benchmarks/bench_store.py's quick run (64 simulated workers) meets the two targets of the issue."""

from __future__ import annotations

import datetime as dt
import gc
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from oobleck_slurm.engine.abort import FailureWatch, clone_store
from oobleck_slurm.protocol import keys
from oobleck_slurm.timeouts import JobTimeouts

REPO = Path(__file__).resolve().parents[2]
PROMPT_S = 1.0  # a watch notices its key within this (milliseconds on an idle machine)


class Counting(dist.TCPStore):
    """A TCPStore client counting the requests of every instance (clones included: clone_store keeps the type)."""

    counts: Counter[str] = Counter()
    lock = threading.Lock()

    def _count(self, name: str) -> None:
        with Counting.lock:
            Counting.counts[name] += 1

    def set(self, *args: Any) -> Any:
        self._count("set")
        return super().set(*args)

    def get(self, *args: Any) -> Any:
        self._count("get")
        return super().get(*args)

    def check(self, *args: Any) -> Any:
        self._count("check")
        return super().check(*args)

    def wait(self, *args: Any) -> Any:
        self._count("wait")
        return super().wait(*args)


def requests() -> int:
    with Counting.lock:
        return sum(Counting.counts.values())


def eventually(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.005)


def watch_threads(generation: int) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"watch:{keys.failed(generation)}"]


@pytest.fixture
def server() -> Iterator[dist.TCPStore]:
    """The job's store, as the supervisor creates it. Every test ends its watches (their key set)
    before the server goes: a watch thread blocked on a server of this very process at interpreter
    exit would be woken during finalization."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))
    Counting.counts.clear()
    yield store


def client(server: dist.TCPStore) -> Counting:
    return Counting("127.0.0.1", server.port, is_master=False, timeout=dt.timedelta(seconds=30))


def test_a_watch_is_one_blocking_request_and_fires_promptly(server: dist.TCPStore) -> None:
    store = client(server)
    watch = FailureWatch(store, 5)
    eventually(lambda: Counting.counts["wait"] == 1, "the watch's thread waits on the key")
    for _ in range(10_000):  # a worker waiting for a long collective looks very often: no request
        assert not watch.failed()
    assert not watch.wait(0.05)  # a wait that times out costs nothing either
    assert requests() == 1
    t0 = time.monotonic()
    server.set(keys.failed(5), "{}")  # the coordinator declares generation 5 failed
    assert watch.wait(PROMPT_S * 10), "the watch did not fire"
    assert time.monotonic() - t0 < PROMPT_S
    assert watch.failed() and requests() == 1  # one blocking wait, nothing else
    eventually(lambda: not watch_threads(5), "the watch's thread ends with its key")


def test_the_watches_of_a_generation_share_one_thread(server: dist.TCPStore) -> None:
    """build_generation watches the worker's store, its AbortableGeneration a clone of it: one thread,
    one connection, one request for both; another generation gets its own."""
    store = client(server)
    build, gen = FailureWatch(store, 6), FailureWatch(clone_store(store), 6)
    nxt = FailureWatch(store, 7)
    eventually(lambda: Counting.counts["wait"] == 2, "both generations' threads wait")
    assert len(watch_threads(6)) == 1 and len(watch_threads(7)) == 1
    server.set(keys.failed(6), "{}")
    assert build.wait(PROMPT_S * 10) and gen.wait(PROMPT_S * 10)
    assert not nxt.failed()
    eventually(lambda: not watch_threads(6), "generation 6's thread ends")
    server.set(keys.failed(7), "{}")
    assert nxt.wait(PROMPT_S * 10)
    assert requests() == 2
    eventually(lambda: not watch_threads(7), "generation 7's thread ends")


def test_a_key_set_before_the_watch_exists_is_seen(server: dist.TCPStore) -> None:
    server.set(keys.failed(8), "{}")
    watch = FailureWatch(client(server), 8)
    assert watch.wait(PROMPT_S * 10)
    eventually(lambda: not watch_threads(8), "the thread ends")


def test_an_abandoned_watch_ends_at_its_renewal(server: dist.TCPStore) -> None:
    """A watch nobody holds any more (its key never set) closes its thread and connection at the next
    renewal; one that is held renews its wait (one request per renewal) and stays."""
    store = client(server)
    renew = JobTimeouts(watch_renew=0.3)
    kept, dropped = FailureWatch(store, 9, renew), FailureWatch(store, 10, renew)
    eventually(lambda: Counting.counts["wait"] == 2, "both threads wait")
    del dropped
    gc.collect()
    eventually(lambda: not watch_threads(10), "the abandoned watch's thread ends")
    eventually(lambda: Counting.counts["wait"] >= 3, "the kept watch renews its wait")
    assert watch_threads(9) and not kept.failed()
    server.set(keys.failed(9), "{}")
    assert kept.wait(PROMPT_S * 10)
    eventually(lambda: not watch_threads(9), "the kept watch's thread ends with its key")


def test_a_failed_store_raises_from_the_watch(server: dist.TCPStore) -> None:
    """The store going away surfaces as a DistNetworkError from failed(), as a look-up's would."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))
    watch = FailureWatch(Counting("127.0.0.1", master.port, is_master=False, timeout=dt.timedelta(seconds=30)), 11)
    eventually(lambda: Counting.counts["wait"] == 1, "the thread waits")
    del master
    gc.collect()
    with pytest.raises(dist.DistNetworkError, match="watching gen11/failed"):
        watch.wait(PROMPT_S * 10)
    eventually(lambda: not watch_threads(11), "the thread ends")


def test_a_clone_has_its_origins_timeout_and_keys(server: dist.TCPStore) -> None:
    origin = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=dt.timedelta(seconds=45))
    clone = clone_store(origin, attempt_s=0.5)
    assert clone.timeout == dt.timedelta(seconds=45)  # type: ignore[attr-defined]  # connected in 0.5 s attempts
    origin.set("k", "v")
    assert clone.get("k") == b"v"


def test_a_clone_of_a_store_whose_server_died_fails_within_an_attempt_or_two() -> None:
    """torch retries a refused connect until the store's timeout (here 60 s, three times over): a
    worker's thread cloning the store of a supervisor killed a moment before was stuck for minutes and
    missed the standby's takeover (its node was declared lost after the reconfiguration timeout)."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
    origin = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=dt.timedelta(seconds=60))
    del master
    gc.collect()
    t0 = time.monotonic()
    with pytest.raises(dist.DistNetworkError):
        clone_store(origin, attempt_s=1.0)
    assert time.monotonic() - t0 < 15.0  # one attempt with torch's own retries (~3.3 s), then the probe


def test_other_stores_are_looked_up_at_most_every_poll() -> None:
    """A HashStore (no second connection possible) is polled by failed() itself, rate-limited."""
    store = dist.HashStore()
    watch = FailureWatch(store, 12)
    assert not watch.failed() and not watch.wait(0.02)
    store.set(keys.failed(12), "{}")
    assert watch.wait(PROMPT_S * 10)


@pytest.mark.slow
def test_bench_store_quick_meets_the_targets(tmp_path: Path) -> None:
    """The benchmark's quick run (64 simulated workers over 2 processes, gloo's wait path) through its
    command: at most 2 store requests per worker-step in steady state, every worker out of the failed
    generation within 1 s."""
    out = tmp_path / "bench_store.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_store.py"), "--quick", "--wait", "abortable",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())["result"]
    assert r["workers"] == 64 and r["steady"]["worker_steps"] > 0
    assert r["steady"]["requests_per_worker_step"] <= 2.0, r["steady"]
    assert set(r["steady"]["by_kind"]) == {"set"}, r["steady"]  # the watches' waits were issued before
    assert r["whole_run"]["by_kind"]["wait"] == 64, r["whole_run"]  # one blocking wait per worker, in all
    assert r["leave"]["still_running"] == 0
    assert r["leave"]["reported_max_s"] <= 1.0 and r["leave"]["all_reports_at_coordinator_s"] <= 1.0, r["leave"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
